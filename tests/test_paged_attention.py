import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from tinygrad import GlobalCounters, Tensor, dtypes
from tinyhet.kernels.kv_pack import pack_kv, unpack_kv
from tinyhet.kernels.paged_attention import kv_scatter, max_blocks_var, paged_attention

D, ROWS, MAX_LEN = 64, 5, 300

def dense_reference(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
  """q (H, D); k, v (L, KV, D) -> (H, D): softmax(q.k / sqrt(D)) @ v per head, head h on kv head h // (H // KV), float64."""
  H, KV = q.shape[0], k.shape[1]
  out = np.zeros(q.shape)
  for h in range(H):
    s = k[:, h // (H // KV)].astype(np.float64) @ q[h] / np.sqrt(q.shape[1])
    p = np.exp(s - s.max())
    out[h] = (p / p.sum()) @ v[:, h // (H // KV)].astype(np.float64)
  return out

def nan_pool(num_blocks: int, n_kv: int, block_size: int, dtype=np.float16) -> np.ndarray:
  # stale bytes everywhere: a slot the kernel should not read as data holds NaN
  return np.full((num_blocks, 2, n_kv, block_size * D), np.nan, dtype=dtype)

def put_token(pool: np.ndarray, block: int, t: int, k: np.ndarray, v: np.ndarray) -> None:
  """Write one token's k, v (n_kv, D) at slot t of block, in the layout paged_attention.py documents."""
  bs = pool.shape[3] // D
  pool[block, 0, :, t + bs * np.arange(D)] = k.T     # K tile (d, t)
  pool[block, 1, :, t * D:(t + 1) * D] = v           # V tile (t, d)

@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("group", [1, 3, 8])
@settings(max_examples=3, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), lengths=st.lists(st.integers(1, MAX_LEN), min_size=ROWS, max_size=ROWS))
def test_paged_attention_matches_dense_reference(block_size, group, seed, lengths):
  rng = np.random.default_rng(seed)
  n_kv = 2 if group == 8 else 3
  cap = -(-MAX_LEN // block_size)
  num_blocks = ROWS * cap + 3
  pool, tables = nan_pool(num_blocks, n_kv, block_size), np.zeros((ROWS, cap), np.int32)   # padding entries: block 0
  ids = rng.permutation(num_blocks)
  ks, vs = [], []
  for r, n in enumerate(lengths):
    nb = -(-n // block_size)
    tables[r, :nb], ids = ids[:nb], ids[nb:]
    ks.append(rng.standard_normal((n, n_kv, D)).astype(np.float16)); vs.append(rng.standard_normal((n, n_kv, D)).astype(np.float16))
    for p in range(n): put_token(pool, tables[r, p // block_size], p % block_size, ks[r][p], vs[r][p])
  q = rng.standard_normal((ROWS, n_kv * group, D)).astype(np.float32)
  max_blocks = max_blocks_var(cap).bind(max(-(-n // block_size) for n in lengths))
  out = paged_attention(Tensor(q), Tensor(pool), Tensor(tables), Tensor(np.array(lengths, np.int32)), max_blocks).numpy()
  for r in range(ROWS): np.testing.assert_allclose(out[r], dense_reference(q[r], ks[r], vs[r]), atol=2e-5, rtol=1e-4)

def tinygrad_has(dtype) -> bool:
  try: return Tensor([1.5]).cast(dtype).realize().cast(dtypes.float32).item() == 1.5
  except Exception: return False   # e.g. clang 14 has no __bf16 for tinygrad's CPU target

@pytest.mark.parametrize("kv_dtype", [dtypes.float32, dtypes.bfloat16])
def test_paged_attention_other_kv_dtypes(kv_dtype):
  if not tinygrad_has(kv_dtype): pytest.skip(f"tinygrad on this machine cannot compute in {kv_dtype} (clang too old for __bf16?)")
  rng = np.random.default_rng(1)
  n, bs, n_kv, group = 37, 16, 2, 2
  k, v = rng.standard_normal((n, n_kv, D)).astype(np.float32), rng.standard_normal((n, n_kv, D)).astype(np.float32)
  pool = pack_kv(Tensor(k), Tensor(v), bs, kv_dtype).realize()       # blocks 0..2 hold the sequence in order
  kr, vr = (x.float().numpy() for x in unpack_kv(pool, n, D))          # what the pool holds, rounded to kv_dtype
  q = rng.standard_normal((1, n_kv * group, D)).astype(np.float32)
  out = paged_attention(Tensor(q), pool, Tensor(np.array([[0, 1, 2]], np.int32)), Tensor(np.array([n], np.int32)), 3).numpy()
  np.testing.assert_allclose(out[0], dense_reference(q[0], kr, vr), atol=2e-5, rtol=1e-4)

def test_kv_scatter_writes_only_its_slots():
  rng = np.random.default_rng(2)
  num_blocks, bs, n_kv, rows = 512, 16, 3, 4
  before = rng.standard_normal((num_blocks, 2, n_kv, bs * D)).astype(np.float16)
  pool = Tensor(before).realize()
  tables = np.stack([rng.permutation(num_blocks)[:8] for _ in range(rows)]).astype(np.int32)
  pos = np.array([0, 17, 63, 127], np.int32)
  k, v = rng.standard_normal((rows, n_kv, D)).astype(np.float32), rng.standard_normal((rows, n_kv, D)).astype(np.float32)
  args = [Tensor(x).realize() for x in (k, v, tables, pos)]
  GlobalCounters.reset()
  kv_scatter(pool, *args).realize()
  # it reads k, v, positions and table entries and writes 2 * rows * n_kv * D values: a few KB, not the 6 MB pool
  assert GlobalCounters.kernel_count == 1 and GlobalCounters.global_mem < 16 * rows * n_kv * D, GlobalCounters.global_mem
  expect = before.copy()
  for r in range(rows): put_token(expect, tables[r, pos[r] // bs], pos[r] % bs, k[r].astype(np.float16), v[r].astype(np.float16))
  np.testing.assert_array_equal(pool.numpy(), expect)

def test_pack_then_copy_spans_gives_dense_attention():
  from tinyhet.kv.paged_cache import PagedKVCache
  rng = np.random.default_rng(3)
  bs, n_kv, group, n_layers = 8, 2, 3, 2
  cache = PagedKVCache(n_layers, n_kv, D, num_blocks=40, block_size=bs, max_seq_len=256)
  bm = cache.block_manager
  bm.allocate(0, 5)                            # scatter the free list so a sequence's blocks are not one run
  bm.reserve(1, 50)                            # the sequence a prefill node sends: 7 blocks, the last one partial
  bm.allocate(2, 9)
  bm.deallocate(0)
  k, v = rng.standard_normal((n_layers, 50, n_kv, D)).astype(np.float32), rng.standard_normal((n_layers, 50, n_kv, D)).astype(np.float32)
  for layer in range(n_layers):
    packed = pack_kv(Tensor(k[layer]), Tensor(v[layer]), bs, cache.kv_dtype).numpy().tobytes()   # the bytes a prefill node sends
    pool_bytes = cache.pool_buffer(layer).as_memoryview(force_zero_copy=True)
    at = 0
    for off, n in cache.block_spans(1, layer):                         # a transport writes span by span; here numpy copies
      pool_bytes[off:off + n] = packed[at:at + n]
      at += n
    assert at == len(packed) == 7 * cache.block_nbytes
  bm.commit(1)
  assert cache.block_spans(1, 0)[0][0] == bm.block_table(1)[0] * cache.block_nbytes and len(cache.block_spans(1, 0)) < 7  # runs coalesce
  bm.append_slot(1)                            # decode token 50
  cache.begin_step([1])
  q = rng.standard_normal((1, 1, n_kv * group, D)).astype(np.float32)
  kn, vn = rng.standard_normal((n_layers, 1, 1, n_kv, D)).astype(np.float32), rng.standard_normal((n_layers, 1, 1, n_kv, D)).astype(np.float32)
  for layer in range(n_layers):
    out = cache.update_and_attend(layer, Tensor(q), Tensor(kn[layer]), Tensor(vn[layer]), Tensor(np.array([[50]], np.int32))).numpy()
    kk = np.concatenate([k[layer], kn[layer, 0]]).astype(np.float16)
    vv = np.concatenate([v[layer], vn[layer, 0]]).astype(np.float16)
    np.testing.assert_allclose(out[0, 0], dense_reference(q[0, 0], kk, vv), atol=2e-5, rtol=1e-4)

def test_unpack_inverts_pack():
  rng = np.random.default_rng(4)
  k, v = rng.standard_normal((21, 3, D)).astype(np.float32), rng.standard_normal((21, 3, D)).astype(np.float32)
  packed = pack_kv(Tensor(k), Tensor(v), 8)
  assert packed.shape == (3, 2, 3, 8 * D)
  assert not packed.numpy()[2, :, :].reshape(2, 3, -1)[0].reshape(3, D, 8)[:, :, 5:].any()   # tokens 21..23: zero padding
  k2, v2 = unpack_kv(packed, 21, D)
  np.testing.assert_array_equal(k2.numpy(), k)
  np.testing.assert_array_equal(v2.numpy(), v)
