import random
import pytest
from hypothesis import given, settings, strategies as st
from tinyhet.kv.block_manager import BlockManager
from tinyhet.engine.scheduler import RequestTooLarge, Scheduler, Sequence, SequenceStatus

EOS = 2

def check_state(s: Scheduler) -> None:
  s.bm.check()
  for seq in s.running:
    assert seq.status is SequenceStatus.RUNNING and s.bm.length(seq.seq_id) in (seq.num_tokens - 1, seq.num_tokens)
  for seq in s.waiting: assert seq.status is SequenceStatus.WAITING and seq.seq_id not in s.bm
  for sid, seq in s.incoming.items(): assert seq.status is SequenceStatus.INCOMING and s.bm.is_reserved(sid)
  assert len(s.running) + len(s.incoming) <= s.max_num_seqs

def run(s: Scheduler, rng: random.Random, pending: list[Sequence], incoming: list[Sequence], max_steps: int) -> list[Sequence]:
  """Drive the scheduler like an engine: new requests arrive over time, transfers land or fail, the model samples tokens
  (EOS now and then). Returns the finished sequences."""
  done: list[Sequence] = []
  in_flight: list[Sequence] = []
  for _ in range(max_steps):
    if pending and rng.random() < 0.3: s.add(pending.pop())
    if incoming and rng.random() < 0.2 and s.reserve_incoming(incoming[-1], use_cache=rng.random() < 0.5): in_flight.append(incoming.pop())
    if in_flight and rng.random() < 0.3:
      seq = in_flight.pop(rng.randrange(len(in_flight)))
      if rng.random() < 0.25:
        s.abort_incoming(seq)
        s.add(seq)                                # prefilled here instead
      elif s.commit_incoming(seq, 7): done.append(seq)
    seqs, is_prefill = s.schedule()
    check_state(s)
    for seq in seqs: assert s.bm.length(seq.seq_id) == seq.num_tokens   # prefill: the whole sequence; decode: the slot of its last token
    done += s.postprocess(seqs, [EOS if rng.random() < 0.02 else 5 for _ in seqs])
    check_state(s)
    if s.is_finished() and not pending and not incoming and not in_flight: return done
  raise AssertionError(f"not finished after {max_steps} steps: {len(s.waiting)} waiting, {len(s.running)} running")

def random_request(rng: random.Random, i: int, capacity: int) -> Sequence:
  """A request whose prompt takes at most half of a pool of `capacity` tokens and whose answer fits the rest."""
  prompt = rng.randint(1, max(1, capacity // 2))
  return Sequence(i, [1] * prompt, max_new_tokens=rng.randint(1, max(1, capacity - prompt)))

@settings(max_examples=60, deadline=None)
@given(num_blocks=st.integers(4, 40), block_size=st.sampled_from([1, 4, 16]), max_num_seqs=st.integers(1, 8), seed=st.integers(0, 2**32),
       n_local=st.integers(0, 12), n_incoming=st.integers(0, 6), prefix_cache=st.booleans(), forks=st.integers(0, 2))
def test_random_workload_finishes_every_request_in_full(num_blocks, block_size, max_num_seqs, seed, n_local, n_incoming, prefix_cache, forks):
  rng = random.Random(seed)
  capacity = num_blocks * block_size
  request = lambda i: random_request(rng, i, capacity)
  local = [request(i) for i in range(n_local)]
  samples = []                          # n > 1: some local requests carry forks (their samples), when the pool and the batch hold them
  for q in local[:forks]:
    q.forks = [Sequence(1000 + 10 * q.seq_id + j, list(q.token_ids), q.max_new_tokens) for j in range(rng.randint(1, 2))]
    if 1 + len(q.forks) > max_num_seqs or q.num_tokens // block_size + (len(q.forks) + 1) * (q.num_tokens % block_size > 0) > num_blocks:
      q.forks = []
    samples += q.forks
  incoming = [request(100 + i) for i in range(n_incoming)]
  # with the prefix cache, prompts of 1s share their blocks, and cached blocks are evicted before anything is preempted
  s = Scheduler(BlockManager(num_blocks, block_size, prefix_cache), max_num_seqs=max_num_seqs, max_num_batched_tokens=capacity // 2 + 1, eos=EOS)
  done = run(s, rng, list(local), list(incoming), max_steps=20000)
  assert sorted(q.seq_id for q in done) == sorted(q.seq_id for q in local + incoming + samples)
  for q in done:   # never truncated: a sequence stops only at EOS or at max_new_tokens
    assert q.status is SequenceStatus.FINISHED and q.num_prompt_tokens + 1 <= q.num_tokens <= q.max_tokens
    assert q.token_ids[-1] == EOS or q.num_generated == q.max_new_tokens
  assert s.bm.num_free == num_blocks and not s.bm.tables

def test_admission_waits_for_blocks():
  s = Scheduler(BlockManager(4, 4))          # 16 token slots
  a, b = Sequence(0, [1] * 10, max_new_tokens=2), Sequence(1, [1] * 10, max_new_tokens=2)
  s.add(a); s.add(b)
  assert s.schedule() == ([a], True)          # b's 3 blocks do not fit next to a's 3
  assert list(s.waiting) == [b]
  s.postprocess([a], [5])
  assert s.schedule() == ([a], False)
  assert s.postprocess([a], [5]) == [a]       # a finishes, frees its blocks
  assert s.schedule() == ([b], True)

def test_full_pool_preempts_the_newest_and_recomputes_it():
  s = Scheduler(BlockManager(4, 4))
  old, new = Sequence(0, [1] * 4, max_new_tokens=8), Sequence(1, [1] * 4, max_new_tokens=8)
  s.add(old); s.add(new)
  assert s.schedule() == ([old, new], True)     # one block each
  s.postprocess([old, new], [5, 5])
  for _ in range(4):                             # both grow into a second block: 4 of 4 blocks used
    seqs, _ = s.schedule()
    s.postprocess(seqs, [5] * len(seqs))
  assert s.bm.num_free == 0 and old.num_tokens == new.num_tokens == 9
  assert s.schedule() == ([old], False)          # old needs a third block: the newest, new, gives its two back
  assert new.status is SequenceStatus.WAITING and new.num_preemptions == 1 and list(s.waiting) == [new] and new.seq_id not in s.bm
  assert new.num_tokens == 9                     # its generated tokens are kept, to be prefilled again
  finished = s.postprocess([old], [5])
  while not s.is_finished():
    seqs, is_prefill = s.schedule()
    if is_prefill: assert seqs == [new] and s.bm.length(new.seq_id) == 9 and old.status is SequenceStatus.FINISHED
    finished += s.postprocess(seqs, [5] * len(seqs))
  assert finished == [old, new] and old.num_generated == new.num_generated == 8 and s.bm.num_free == 4

def test_prompt_larger_than_the_pool_is_rejected_with_sizes_and_new_tokens_are_cut_to_the_pool():
  s = Scheduler(BlockManager(4, 16))
  msg = r"request 3: its prompt of 65 tokens needs 5 KV blocks of 16 tokens, but the pool has 4 blocks \(64 tokens\)"
  with pytest.raises(RequestTooLarge, match=msg): s.add(Sequence(3, [1] * 65, max_new_tokens=1))
  with pytest.raises(RequestTooLarge): s.reserve_incoming(Sequence(4, [1] * 65, max_new_tokens=1))
  assert s.is_finished() and s.bm.num_free == 4
  seq = Sequence(5, [1] * 60, max_new_tokens=100_000)       # admission by need: the prompt's blocks now, the rest as it grows
  s.add(seq)
  assert seq.max_new_tokens == 5                             # 60 prompt + 4 stored + the last one sampled
  while not s.is_finished():
    seqs, _ = s.schedule()
    assert seqs
    s.postprocess(seqs, [2] * len(seqs))
  assert seq.num_generated == 5 and s.bm.num_free == 4

def test_incoming_reservation_waits_when_full_and_commit_starts_decode():
  s = Scheduler(BlockManager(4, 4))
  a = Sequence(0, [1] * 12, max_new_tokens=3)
  s.add(a)
  s.schedule()
  b = Sequence(1, [1] * 8, max_new_tokens=2)
  assert not s.reserve_incoming(b) and b.seq_id not in s.bm    # 2 blocks needed, 1 free: the router tries later
  s.postprocess([a], [5])
  s.finish(a)
  assert s.reserve_incoming(b) and s.bm.is_reserved(1)
  assert not s.commit_incoming(b, 5)
  assert s.schedule() == ([b], False) and s.bm.length(1) == 9
  assert s.postprocess([b], [5]) == [b] and s.is_finished()

@pytest.mark.parametrize("kw", [dict(max_num_seqs=0), dict(max_num_seqs=-1), dict(max_num_batched_tokens=0)])
def test_a_scheduler_that_could_admit_nothing_is_refused(kw):
  with pytest.raises(ValueError, match="must be at least 1"): Scheduler(BlockManager(4, 4), **kw)

@settings(max_examples=60, deadline=None)
@given(prompt=st.integers(1, 60), n=st.integers(1, 6), block_size=st.sampled_from([1, 4, 16]), steps=st.integers(0, 20),
       prefix_cache=st.booleans())
def test_n_samples_fork_from_one_prefill_and_share_the_prompts_blocks(prompt, n, block_size, steps, prefix_cache):
  """n > 1: the forks are admitted with their sequence in one prefill batch, hold the prompt's full blocks by reference
  and a copy of its partial last block each; KV blocks used = one prompt's + the samples' own (n separate requests: n prompts')."""
  bm = BlockManager(200, block_size, prefix_cache=prefix_cache)
  s = Scheduler(bm, max_num_seqs=8)
  ids = list(range(3, 3 + prompt))
  seqs = [Sequence(i, list(ids), 40) for i in range(n)]
  seqs[0].forks = seqs[1:]
  s.add(seqs[0])
  batch, is_prefill = s.schedule()
  assert is_prefill and batch == seqs and all(f.fork_of is seqs[0] for f in seqs[1:])
  check_state(s)
  full, partial = prompt // block_size, prompt % block_size != 0
  assert bm.num_used == full + n * partial                       # the prompt's full blocks once, its partial block once per sample
  assert all(bm.block_table(f.seq_id)[:full] == bm.block_table(0)[:full] for f in seqs)
  assert all(f.fork_copy == ((bm.block_table(0)[-1], bm.block_table(f.seq_id)[-1]) if partial else None) for f in seqs[1:])
  s.postprocess(batch, [5] * n)
  for _ in range(steps):
    batch, is_prefill = s.schedule()
    assert not is_prefill and len(batch) == n
    s.postprocess(batch, [5] * n)
    check_state(s)
  own = n * (bm.blocks_needed(prompt + steps) - full)           # what each sample holds beyond the shared full blocks
  assert bm.num_used == full + own

def test_forks_wait_for_room_for_all_of_them():
  bm = BlockManager(20, 4)
  s = Scheduler(bm, max_num_seqs=3)
  s.add(Sequence(9, [1, 2], 4))
  s.schedule()
  seqs = [Sequence(i, [1, 2, 3], 4) for i in range(3)]
  seqs[0].forks = seqs[1:]
  s.add(seqs[0])
  assert s.schedule() == ([s.running[0]], False)                # three samples need three places: one is taken
  dropped = seqs[2]
  dropped.status = SequenceStatus.FINISHED                      # its client went away before the prefill
  s.finish(s.running[0])
  batch, is_prefill = s.schedule()
  assert is_prefill and batch == seqs[:2] and dropped not in s.running
  check_state(s)

def test_incoming_samples_are_reserved_with_their_sequence_and_committed_each():
  bm = BlockManager(10, 4)
  s = Scheduler(bm, max_num_seqs=3)
  seqs = [Sequence(i, [1] * 6, 4) for i in range(3)]
  seqs[0].forks = seqs[1:]
  assert s.reserve_incoming(seqs[0])
  assert bm.num_used == 1 + 3 and all(bm.is_reserved(q.seq_id) for q in seqs) and set(s.incoming) == {0, 1, 2}
  assert all(f.fork_copy == (bm.block_table(0)[1], bm.block_table(f.seq_id)[1]) for f in seqs[1:])
  check_state(s)
  s.abort_incoming(seqs[2])                       # a sample whose client left before the KV landed
  for q, tok in zip(seqs[:2], (5, 6)): assert not s.commit_incoming(q, tok)
  check_state(s)
  assert bm.num_used == 1 + 2 and [q.token_ids[-1] for q in s.running] == [5, 6]
  more = [Sequence(10 + i, [2] * 3, 4) for i in range(3)]
  more[0].forks = more[1:]
  assert not s.reserve_incoming(more[0]) and 10 not in bm     # three more places do not fit a batch of three

def run_stall_free(s: Scheduler, rng: random.Random, pending: list[Sequence], budget: int, max_steps: int) -> list[Sequence]:
  """Drive schedule_step like a node that prefills and decodes: each step's chunks advance their prompts, a prompt's last
  chunk samples its first token, and every decoding sequence gets a token each step."""
  done: list[Sequence] = []
  for _ in range(max_steps):
    if pending and rng.random() < 0.3: s.add(pending.pop())
    decoding = [(q, q.num_preemptions) for q in s.running if q.prefilled is None]
    decode, chunks = s.schedule_step(budget)
    check_state(s)
    assert all(q in decode or q.num_preemptions > n for q, n in decoding)   # every decoding sequence steps, or was preempted
    assert sum(end - first for _, first, end in chunks) <= (budget if decode else max(budget, s.max_num_batched_tokens))
    # with nothing decoding, a step ends at the first prompt it completes: no later chunk holds back that prompt's second token
    if not decode: assert all(end < q.num_tokens for q, _, end in chunks[:-1])
    assert all(q.prefilled is None for q in decode) and len({id(q) for q, _, _ in chunks}) == len(chunks)
    for q in decode: assert s.bm.length(q.seq_id) == q.num_tokens
    finished_prompts = []
    for q, first, end in chunks:
      assert first == q.prefilled and 0 <= first < end <= q.num_tokens == s.bm.length(q.seq_id)
      if end < q.num_tokens: q.prefilled = end
      else:
        q.prefilled = None
        finished_prompts.append(q)
    seqs = decode + finished_prompts
    done += s.postprocess(seqs, [EOS if rng.random() < 0.02 else 5 for _ in seqs])
    check_state(s)
    if s.is_finished() and not pending: return done
  raise AssertionError(f"not finished after {max_steps} steps: {len(s.waiting)} waiting, {len(s.running)} running")

@settings(max_examples=60, deadline=None)
@given(num_blocks=st.integers(4, 40), block_size=st.sampled_from([1, 4, 16]), max_num_seqs=st.integers(1, 8), seed=st.integers(0, 2**32),
       n_local=st.integers(0, 12), budget=st.integers(1, 64), prefix_cache=st.booleans())
def test_stall_free_steps_spread_prompts_within_the_budget_and_finish_every_request(num_blocks, block_size, max_num_seqs, seed, n_local,
                                                                                     budget, prefix_cache):
  rng = random.Random(seed)
  capacity = num_blocks * block_size
  request = lambda i: random_request(rng, i, capacity)
  local = [request(i) for i in range(n_local)]
  s = Scheduler(BlockManager(num_blocks, block_size, prefix_cache), max_num_seqs=max_num_seqs, eos=EOS)
  done = run_stall_free(s, rng, list(local), budget, max_steps=40000)
  assert sorted(q.seq_id for q in done) == sorted(q.seq_id for q in local)
  for q in done: assert q.token_ids[-1] == EOS or q.num_generated == q.max_new_tokens
  assert s.bm.num_free == num_blocks and not s.bm.tables

def test_a_long_prompt_is_spread_over_steps_while_decode_goes_on():
  s = Scheduler(BlockManager(64, 4), max_num_seqs=4)
  short, long = Sequence(1, [1] * 3, 20), Sequence(2, [2] * 50, 5)
  s.add(short)
  assert s.schedule_step(16) == ([], [(short, 0, 3)])
  short.prefilled = None
  s.postprocess([short], [9])
  s.add(long)
  for first in range(0, 48, 16):            # the long prompt in chunks of 16; the short one decodes every step meanwhile
    decode, chunks = s.schedule_step(16)
    assert decode == [short] and chunks == [(long, first, first + 16)]
    long.prefilled = first + 16
    s.postprocess(decode, [9])
  assert s.schedule_step(16) == ([short], [(long, 48, 50)])
  with pytest.raises(ValueError, match="budget"): s.schedule_step(0)
  idle = Scheduler(BlockManager(64, 4), max_num_seqs=4, max_num_batched_tokens=40)
  idle.add(Sequence(3, [3] * 50, 5))
  assert idle.schedule_step(16)[1] == [(idle.running[0], 0, 40)]     # nothing decodes: as much as a prefill batch takes
  two = Scheduler(BlockManager(64, 4), max_num_seqs=4)
  a, b = Sequence(4, [4] * 30, 5), Sequence(5, [5] * 30, 5)
  two.add(a)
  two.add(b)
  assert two.schedule_step(16) == ([], [(a, 0, 30)])     # a whole, and b waits: b's prefill would stall a's second token
  a.prefilled = None
  two.postprocess([a], [9])
  assert two.schedule_step(16) == ([a], [(b, 0, 16)])

def test_forks_of_a_prompt_spread_over_steps_wait_for_its_last_chunk():
  """n > 1 under stall-free steps: the forks hold their places and blocks from admission, decode only once their
  sequence's last chunk has run, and go back to be recomputed alone when it stops before its prompt's end."""
  bm = BlockManager(64, 4)
  s = Scheduler(bm, max_num_seqs=4)
  other = Sequence(9, [1] * 3, 30)
  s.add(other)
  s.schedule_step(16)
  other.prefilled = None
  s.postprocess([other], [5])
  seqs = [Sequence(i, [2] * 30, 5) for i in range(3)]
  seqs[0].forks = seqs[1:]
  s.add(seqs[0])
  decode, chunks = s.schedule_step(16)
  assert decode == [other] and chunks == [(seqs[0], 0, 16)] and all(f.fork_of is seqs[0] for f in seqs[1:])
  assert bm.num_used == 1 + 8 + 2                      # other's block, the prompt's 7 full + 1 partial, a partial copy per fork
  check_state(s)
  seqs[0].prefilled = 16
  s.postprocess(decode, [5])
  decode, chunks = s.schedule_step(16)
  assert decode == [other] and chunks == [(seqs[0], 16, 30)]          # the forks do not decode before their KV is in
  for f in seqs[1:]: f.fork_of = None                                  # the engine's copy after the last chunk (DecodeNode._prefill_group)
  seqs[0].prefilled = None
  s.postprocess(decode + seqs, [5] * 4)
  decode, _ = s.schedule_step(16)
  assert decode == [other, *seqs]
  check_state(s)
  # a sequence cancelled before its prompt's end: its forks are queued to be recomputed on their own
  more = [Sequence(10 + i, [3] * 20, 5) for i in range(2)]
  more[0].forks = more[1:]
  s2 = Scheduler(BlockManager(64, 4), max_num_seqs=4)
  s2.add(more[0])
  s2.add(Sequence(20, [4] * 2, 5))
  s2.schedule_step(8)
  assert more[1].fork_of is more[0] and more[1] in s2.running
  s2.finish(more[0])
  assert more[1] in s2.waiting and more[1].fork_of is None and more[1].fork_copy is None and more[1] not in s2.running
  check_state(s2)
