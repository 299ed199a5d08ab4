"""Speculative decoding (tinyhet.engine.speculative): over a random tiny model, greedy and sampled tokens equal plain
decode's for random prompts, batches and k, and the pool ends as plain decode leaves it (lengths, table sizes, free blocks; each step
puts rejected drafts' blocks back in the free queue where they were); the verify step replays the plain decode step's
captures (no capture of its own once the batch buckets are captured)."""
import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st
from tinygrad import Tensor, dtypes
from tinyhet.engine.decode_engine import BATCH_BUCKETS, DecodeEngine
from tinyhet.engine.ngram_draft import NgramIndex, ngram_draft
from tinyhet.engine.speculative import SpeculativeStep, check_speculative, within_one_tile
from tinyhet.kernels.quant_matmul import DECODE_MAX_M
from tinyhet.kv.paged_cache import PagedKVCache
from tinyhet.model import llama as model
from tinyhet.model.layer_jit import Replay
from tinyhet.model.sampling import Sampler, sample_batch

CFG = model.small_config(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, hidden_dim=96, vocab_size=32, max_context=256)

@pytest.fixture(scope="module")
def llama(): return model.Llama(CFG, model.random_weights(CFG, seed=1))

@pytest.fixture(scope="module")
def shared_engine(llama):
  return DecodeEngine(llama, PagedKVCache(CFG.n_layers, CFG.n_kv_heads, CFG.head_dim, num_blocks=64, block_size=8, max_seq_len=256))

def run(llama, prompts, new, k, temperature=0.0, engine=None, adaptive=False, policy=None, capture=True, draft=None):
  """Tokens of each prompt (plain decode: k = 0), and the block manager after. engine: a DecodeEngine to decode with
  (default: a fresh one), whose pool holds no sequence 0..len(prompts)-1. adaptive: drafts cut by the policy (default: every
  n-gram draft verified whole, so drafts are made and checked). draft: a DraftModel every sequence drafts with (mode "draft")."""
  if engine is None:
    cache = PagedKVCache(CFG.n_layers, CFG.n_kv_heads, CFG.head_dim, num_blocks=64, block_size=8, max_seq_len=256)
    engine = DecodeEngine(llama, cache)
  cache, bm = engine.cache, engine.cache.block_manager
  spec = SpeculativeStep(engine, adaptive=adaptive or policy is not None, policy=policy, capture=capture, draft=draft)
  toks = [list(p) for p in prompts]
  samplers = [Sampler(temperature, 1.0, seed=7 + i) for i in range(len(prompts))]
  for i, p in enumerate(prompts):
    bm.allocate(i, len(p))
    logits = llama.forward(Tensor([p], dtype=dtypes.int32), Tensor(cache.begin_step([i], len(p))), cache).numpy()
    toks[i].append(sample_batch(logits, [samplers[i]], [len(p)], [p])[0].token)
  ids = list(range(len(prompts)))
  while any(len(t) - len(p) < new for t, p in zip(toks, prompts)):
    live = [i for i in ids if len(toks[i]) - len(prompts[i]) < new]
    for i in live: bm.append_slot(i)
    limits = [new - (len(toks[i]) - len(prompts[i])) for i in live]
    if k:
      before, held = list(bm.free_ids), held_blocks(bm)
      draws = spec.step(live, [toks[i] for i in live], [samplers[i] for i in live], k, limits, modes=["draft"] * len(live) if draft else None)
      taken = held_blocks(bm) - held        # rejected drafts' blocks are back in their places in the free queue
      assert list(bm.free_ids) == [b for b in before if b not in taken]
    else:
      logits = engine.step(live, [toks[i][-1] for i in live])
      draws = [[d] for d in sample_batch(logits, [samplers[i] for i in live], [len(toks[i]) for i in live], [toks[i] for i in live])]
    for i, ds in zip(live, draws):
      toks[i] += [d.token for d in ds]
      assert bm.length(i) == len(toks[i]) - 1
  bm.check()
  return [t[len(p):] for t, p in zip(toks, prompts)], bm, spec

def held_blocks(bm): return {b for t in bm.tables.values() for b in t}

def state(bm):
  """What speculative decoding leaves as plain decode does: each sequence's length and table size and the number of free
  blocks (bm.check: none leaked). Which blocks are held may differ: a step of several tokens a row crosses block boundaries
  in another order across the batch, and a block one row rejects stays free while the next row keeps its own."""
  return ({s: len(t) for s, t in bm.tables.items()}, dict(bm.lengths), len(bm.free_ids))

prompt = st.lists(st.integers(0, 5), min_size=3, max_size=30)     # a small alphabet: n-grams recur, drafts are made

@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompts=st.lists(prompt, min_size=1, max_size=3), k=st.integers(1, 8), new=st.integers(1, 20), adaptive=st.booleans())
@example(prompts=[[0, 2, 0, 0, 2, 2, 5, 1, 3], [2, 1, 0, 4, 0, 4, 1, 4, 3, 1, 5, 4, 4, 0, 3, 1, 2, 0, 1, 4, 5]], k=7, new=11, adaptive=False)
@example(prompts=[[2, 2, 0, 2, 2, 3, 1, 3, 3, 1], [4, 3, 0, 5, 4, 1, 0, 5, 0, 4, 2, 3, 1, 5, 0, 2, 5, 1, 2], [0, 1, 3, 3, 1, 2, 3, 0, 3, 5, 2]],
         k=7, new=10, adaptive=False)        # both rows roll a block back in one step; rows cross block boundaries out of order
def test_greedy_equals_plain_and_the_pool_ends_as_plain(llama, shared_engine, prompts, k, new, adaptive):
  # one engine for every example (its step captures made once), each run's sequences freed after its state is taken
  ends = {}
  for mode in (0, k):
    ends[mode] = run(llama, prompts, new, mode, engine=shared_engine, adaptive=adaptive)
    ends[mode] = (ends[mode][0], state(ends[mode][1]))
    for i in range(len(prompts)): shared_engine.cache.block_manager.deallocate(i)
  (plain, plain_state), (fast, fast_state) = ends[0], ends[k]
  assert fast == [t[:new] for t in plain] and all(len(t) == new for t in fast)
  assert fast_state == plain_state

def test_sampled_equals_plain_sampling_and_drafts_are_taken(llama):
  prompts = [[1, 2, 3, 4] * 6, [5, 1, 5, 2] * 4]
  plain, _, _ = run(llama, prompts, 24, 0, temperature=0.8)
  fast, _, spec = run(llama, prompts, 24, 4, temperature=0.8)
  assert fast == plain and spec.drafted > 0

def test_verify_replays_the_plain_decode_captures(llama):
  """Over a few shapes (batch, k), with one engine whose buckets up to 8 rows are captured: the speculative tokens equal
  plain decode's, drafts are verified, and every verify ran as the engine's captured plain step of its rows (no capture
  made, every engine step a replay, some of them verify steps)."""
  cache = PagedKVCache(CFG.n_layers, CFG.n_kv_heads, CFG.head_dim, num_blocks=64, block_size=8, max_seq_len=256)
  engine = DecodeEngine(llama, cache)
  engine.warm_up([b for b in BATCH_BUCKETS if b <= 8])
  captured, buckets = Replay.captures, set(engine.steps)
  assert all(r.jit.captured is not None for r in engine.steps.values())
  calls = {"step": 0, "verify": 0, "replay": 0}
  step = engine.step
  def counted_step(*args, counts=None, **kw):          # the engine's own step, counted
    calls["step"] += 1
    calls["verify"] += counts is not None
    return step(*args, counts=counts, **kw)
  def counted(replay):
    def call(*args, **kw):
      calls["replay"] += 1
      return replay(*args, **kw)
    return call
  engine.step, engine.steps = counted_step, {B: counted(r) for B, r in engine.steps.items()}
  loop, other = [3, 1, 4, 1, 5, 2, 6] * 3, [2, 7, 2, 7, 9] * 4 + [2]      # one prompt length: its prefill compiles once
  for prompts, k in (([loop], 1), ([loop], 4), ([loop, other], 3), ([loop[2:] + loop[:2], other, loop[5:] + loop[:5]], 1)):
    got = {}
    for mode in (0, k):
      got[mode], bm, spec = run(llama, prompts, 12, mode, engine=engine)
      for i in range(len(prompts)): bm.deallocate(i)
    assert got[k] == got[0] and spec.drafted > 0 and spec.accepted > 0, (prompts, k)
  assert Replay.captures == captured and set(engine.steps) == buckets
  assert calls["replay"] == calls["step"] and calls["verify"] > 0, calls

def test_a_node_verifies_only_at_buckets_it_captured(llama):
  """capture=False (the decode node's), the model warmed up (a node's WarmUp, over) with buckets 1 and 2 captured: a policy
  that would verify 8 drafts a step verifies one (bucket 2), builds no capture on the way, and the tokens are plain
  decode's. Without a warm-up (warm_up off) a bucket is captured when priced."""
  from tinyhet.engine.spec_policy import SpecPolicy
  from tinyhet.engine.warm_up import WarmUp
  engine = DecodeEngine(llama, PagedKVCache(CFG.n_layers, CFG.n_kv_heads, CFG.head_dim, num_blocks=64, block_size=8, max_seq_len=256))
  engine.warm_up([1, 2])
  captured, loop = Replay.captures, [3, 1, 4, 1, 5, 2, 6] * 3
  plain, bm, _ = run(llama, [loop], 16, 0, engine=engine)
  bm.deallocate(0)
  WarmUp(llama, [])                                   # sets llama.warm: a node's warm-up, nothing left to build
  try:
    fast, bm, spec = run(llama, [loop], 16, 8, engine=engine, policy=SpecPolicy(prior=0.99, probe_every=1), capture=False)
    assert fast == plain and spec.verifies > 0 and spec.drafted == spec.verifies     # one token a verify: a step of 2 rows
    assert Replay.captures == captured and set(engine.steps) == {1, 2}
    assert spec.costs(3) == float("inf") and spec.costs(2) < float("inf")
  finally: del llama.warm
  assert spec.costs(3) < float("inf") and 4 in engine.steps        # no warm-up: priced by capturing and timing it

@given(take=st.lists(st.integers(0, 8), min_size=1, max_size=20), tile=st.integers(1, 16))
def test_drafts_are_cut_to_one_tile_where_the_plain_step_fits_one(take, tile):
  # a batch of at most a tile of sequences verifies within one decode tile (the kernel plain decode runs), the longest
  # drafts cut first; a larger batch keeps its drafts
  cut = within_one_tile(take, tile)
  assert len(cut) == len(take) and all(0 <= c <= t for c, t in zip(cut, take))
  if len(take) > tile: assert cut == take
  else:
    assert len(cut) + sum(cut) == min(len(take) + sum(take), tile)
    assert all(c >= max(cut) - 1 for c, t in zip(cut, take) if c < t)     # the longest cut first: a cut one ends near the top

def test_a_batch_of_one_verifies_within_one_decode_tile(llama, monkeypatch):
  # k = 8 drafts at batch 1 would be a step of 9 rows, past the decode kernel plain decode runs: cut to 7 (8 rows)
  engine = DecodeEngine(llama, PagedKVCache(CFG.n_layers, CFG.n_kv_heads, CFG.head_dim, num_blocks=64, block_size=8, max_seq_len=256))
  rows, step = [], engine.step
  monkeypatch.setattr(engine, "step", lambda ids, toks, *a, **kw: rows.append(len(toks)) or step(ids, toks, *a, **kw))
  plain, _, _ = run(llama, [[1, 2, 3, 4] * 8], 40, 0)
  fast, _, spec = run(llama, [[1, 2, 3, 4] * 8], 40, 8, engine=engine)
  assert fast == plain and spec.drafted > 0 and max(rows) == DECODE_MAX_M

def test_ngram_draft():
  assert ngram_draft([1, 2, 3, 9, 9, 1, 2, 3], 3) == ([9, 9, 1], 3)
  assert ngram_draft([4, 5, 6, 7], 2) == ([], 0)
  assert ngram_draft([7, 1, 8, 1], 4) == ([8, 1, 8, 1], 1)     # the 1-gram when no longer tail recurs; past the end, its period
  assert ngram_draft([5, 1, 2, 1, 2], 8) == ([1, 2] * 4, 2)    # a loop drafts k tokens, not its period less one
  assert ngram_draft(list(range(20)) + list(range(17)), 2) == ([17, 18], 16)   # the longest of SIZES that recurs

@settings(max_examples=60, deadline=None)
@given(start=st.lists(st.integers(0, 3), max_size=40), chunks=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=9), max_size=12),
       ks=st.lists(st.integers(0, 9), min_size=13, max_size=13), other=st.lists(st.integers(0, 3), max_size=30))
def test_ngram_index_drafts_as_ngram_draft(start, chunks, ks, other):
  """The index a sequence keeps gives the stateless lookup's draft and n at every step, however many tokens each step
  adds; a list that is not the one indexed (another sequence) is indexed again."""
  ix, toks = NgramIndex(), list(start)
  for chunk, k in zip([[], *chunks], ks):
    toks += chunk
    assert ix.draft(toks, k) == ngram_draft(toks, k), (toks, k)
  other = [4, *other]                   # another sequence (its first token another), or the same one shortened
  assert ix.draft(other, 8) == ngram_draft(other, 8)
  assert ix.draft(toks[:len(toks) // 2], 8) == ngram_draft(toks[:len(toks) // 2], 8)

@pytest.mark.parametrize("bad", [{"mode": "eagle"}, {"k": 0}, {"k": 9}, {"k": True}, "ngram", {"mode": "ngram", "depth": 2}])
def test_bad_speculative_fields_are_refused(bad):
  with pytest.raises(ValueError, match="speculative"): check_speculative(bad)
  assert check_speculative({"mode": "ngram", "k": 8}) == {"mode": "ngram", "k": 8}
