"""A speculative verify step's logits are plain decode's, bit for bit (docs/speculative.md): row j of a sequence's rows in a
verify step of several sequences equals the plain step of those sequences at that token, on the CPU C attention kernels
and GGUF-block weights (the decode node's kernels), over batch compositions and draft lengths. Greedy tokens then equal
plain decode's even at a near-tie."""
import numpy as np
import pytest
import tinyhet  # noqa: F401  (the MESH device)
from hypothesis import HealthCheck, example, given, settings, strategies as st
from tinygrad import Tensor, dtypes
from tinyhet.engine.decode_engine import DecodeEngine
from tinyhet.engine.speculative import within_one_tile
from tinyhet.kernels.quant_matmul import DECODE_MAX_M
from tinyhet.kv.paged_cache import PagedKVCache
from tinyhet.model import llama as model
from tinyhet.model.packed import Q4_1

CFG = model.small_config(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, hidden_dim=96, vocab_size=64, max_context=512)
BS = 16     # the C kernels' block size (a multiple of 16): a row's context in blocks is what its parts cut

@pytest.fixture(scope="module")
def engine():
  # MESH, the decode node's device: its kernels run on the worker pool's threads (CPU's C kernels take one); Q4_1 blocks,
  # whose decode kernel (kernels/gemv16.py) is the one every 32-weight block type runs
  llama = model.Llama(CFG, model.random_weights(CFG, device="MESH", seed=3, packed=Q4_1), "MESH")
  cache = PagedKVCache(CFG.n_layers, CFG.n_kv_heads, CFG.head_dim, num_blocks=200, block_size=BS, max_seq_len=512, device="MESH")
  assert cache.c_threads is not None, "the C attention kernels must run this cache"
  return DecodeEngine(llama, cache)

def prefill(engine, sid, prompt):
  bm = engine.cache.block_manager
  bm.allocate(sid, len(prompt))
  pos = engine.cache.begin_step([sid], len(prompt))
  engine.model.forward(Tensor([prompt], dtype=dtypes.int32, device="MESH"), Tensor(pos, device="MESH"), engine.cache).realize()

def check(engine, rng, lens, counts):
  """Sequences of these lengths, twice: one copy decodes counts[i] tokens plainly (every copy a token a step, so the batch
  stays the same), the other verifies the same tokens in one step; the rows' logits must be equal."""
  n = len(lens)
  prompts = [[int(x) for x in rng.integers(0, CFG.vocab_size, m)] for m in lens]
  drafts = [[int(x) for x in rng.integers(0, CFG.vocab_size, c)] for c in counts]    # the rows' tokens: the newest and its draft
  bm = engine.cache.block_manager
  plain, fast = list(range(100, 100 + n)), list(range(200, 200 + n))
  for sids in (plain, fast):
    for sid, p in zip(sids, prompts): prefill(engine, sid, p)
  try:
    want = [[] for _ in range(n)]
    for j in range(max(counts)):
      for sid in plain: bm.append_slot(sid)
      logits = engine.step(plain, [d[j] if j < len(d) else 0 for d in drafts])
      for i in range(n):
        if j < counts[i]: want[i].append(logits[i])
    for sid, c in zip(fast, counts):
      for _ in range(c): bm.append_slot(sid)
    got = engine.step(fast, [t for d in drafts for t in d], counts=counts)
    first = np.cumsum([0, *counts[:-1]])
    for i in range(n):
      np.testing.assert_array_equal(got[first[i]:first[i] + counts[i]], np.stack(want[i]), err_msg=f"sequence {i} of {counts}")
  finally:
    for sid in plain + fast: bm.deallocate(sid)

LENGTHS = (37, 150)     # 3 and 10 blocks; few lengths, so the test compiles few prefills

@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31), n_seqs=st.integers(1, 4))
@example(seed=-1, n_seqs=1)       # a batch of one at 150 tokens (10 blocks) drafting 7: its verify fills the tile
def test_verify_rows_are_the_plain_steps_bits(engine, seed, n_seqs):
  # sequences of 3 or 10 blocks (a row's context is cut in parts where the threads are several), drafts cut
  # as within_one_tile cuts them (the verify within one decode tile: the matrix kernel plain decode runs at these batches)
  rng = np.random.default_rng(max(seed, 0))
  lens = [int(rng.choice(LENGTHS)) for _ in range(n_seqs)] if seed >= 0 else [150]
  want = [int(x) for x in rng.integers(0, 8, n_seqs)] if seed >= 0 else [7]
  check(engine, rng, lens, [1 + c for c in within_one_tile(want)])

def test_verify_rows_past_a_tile_are_the_plain_steps_bits(engine):
  # more sequences than a tile: plain and verify steps both run the tiled kernel, whose row gets the same bits at any count
  rng = np.random.default_rng(5)
  check(engine, rng, [int(rng.choice(LENGTHS)) for _ in range(DECODE_MAX_M + 1)], [2, 1, 3, 1, 1, 2, 1, 1, 3])
