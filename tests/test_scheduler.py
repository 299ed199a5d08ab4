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

@settings(max_examples=60, deadline=None)
@given(num_blocks=st.integers(4, 40), block_size=st.sampled_from([1, 4, 16]), max_num_seqs=st.integers(1, 8), seed=st.integers(0, 2**32),
       n_local=st.integers(0, 12), n_incoming=st.integers(0, 6), prefix_cache=st.booleans())
def test_random_workload_finishes_every_request_in_full(num_blocks, block_size, max_num_seqs, seed, n_local, n_incoming, prefix_cache):
  rng = random.Random(seed)
  capacity = num_blocks * block_size
  def request(i):
    prompt = rng.randint(1, max(1, capacity // 2))
    return Sequence(i, [1] * prompt, max_new_tokens=rng.randint(1, max(1, capacity - prompt)))
  local = [request(i) for i in range(n_local)]
  incoming = [request(100 + i) for i in range(n_incoming)]
  # with the prefix cache, prompts of 1s share their blocks, and cached blocks are evicted before anything is preempted
  s = Scheduler(BlockManager(num_blocks, block_size, prefix_cache), max_num_seqs=max_num_seqs, max_num_batched_tokens=capacity // 2 + 1, eos=EOS)
  done = run(s, rng, list(local), list(incoming), max_steps=20000)
  assert sorted(q.seq_id for q in done) == sorted(q.seq_id for q in local + incoming)
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
  def request(i):
    prompt = rng.randint(1, max(1, capacity // 2))
    return Sequence(i, [1] * prompt, max_new_tokens=rng.randint(1, max(1, capacity - prompt)))
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
