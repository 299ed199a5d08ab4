"""kernels/cpu_attention.py (the C paged attention of CPU devices) against a float64 reference: decode rows with splits, one
sequence's rows in prefill tiles, every KV dtype, stale NaN slots, and through paged_attention's dispatch."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from tinygrad import Tensor, dtypes
from tinyhet.kernels.cpu_attention import QR, cpu_paged_attention, supported
from tinyhet.kernels.paged_attention import max_blocks_var, paged_attention, uses_c
from test_paged_attention import D, dense_reference, put_token

def rows_pool(rng, lengths: list[int], bs: int, n_kv: int, cap: int, dtype=np.float16):
  """A NaN-filled pool holding one random sequence per length in scattered blocks: (pool, tables, ks, vs)."""
  num_blocks = len(lengths) * cap + 3
  pool = np.full((num_blocks, 2, n_kv, bs * D), np.nan, dtype=dtype)
  tables, ids, ks, vs = np.zeros((len(lengths), cap), np.int32), rng.permutation(num_blocks), [], []
  for r, n in enumerate(lengths):
    nb = -(-n // bs)
    tables[r, :nb], ids = ids[:nb], ids[nb:]
    ks.append(rng.standard_normal((n, n_kv, D)).astype(dtype)); vs.append(rng.standard_normal((n, n_kv, D)).astype(dtype))
    for p in range(n): put_token(pool, tables[r, p // bs], p % bs, ks[r][p], vs[r][p])
  return pool, tables, ks, vs

def test_supported_cases():
  assert supported("CPU", dtypes.float16, 64, 16) and supported("CPU", dtypes.uint16, 128, 32)
  assert not supported("CPU", dtypes.float16, 64, 8)        # block size not a multiple of 16: the tinygrad kernel
  assert not supported("CPU", dtypes.float16, 72, 16)       # head_dim not a multiple of 16
  assert supported("CPU", dtypes.int8, 64, 16) and not supported("CPU", dtypes.int8, 48, 16)   # q8_0: head_dim a multiple of 32
  assert not supported("CPU", dtypes.uint8, 64, 16)        # not a KV format
  assert not supported("PYTHON", dtypes.float16, 64, 16)    # not compiled C
  pool = Tensor.empty(2, 2, 1, 16 * D, dtype=dtypes.float16)
  assert uses_c("CPU", pool, D, 2) and uses_c("CPU", pool, D, 0) and not uses_c("CPU", pool, D, None)

@pytest.mark.parametrize("bs,group", [(16, 3), (32, 1), (16, 8)])
@settings(max_examples=3, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), lengths=st.lists(st.integers(1, 200), min_size=1, max_size=5),
       splits=st.integers(1, 5), threads=st.integers(1, 3))
def test_decode_matches_reference(bs, group, seed, lengths, splits, threads):
  # any lengths, any split count (parts past a short row's end hold no token), any part count: the reference's result
  rng, n_kv = np.random.default_rng(seed), 2 if group == 8 else 3
  cap = -(-200 // bs)
  pool, tables, ks, vs = rows_pool(rng, lengths, bs, n_kv, cap)
  q = rng.standard_normal((len(lengths), n_kv * group, D)).astype(np.float32)
  out = cpu_paged_attention(Tensor(q), Tensor(pool), Tensor(tables), Tensor(np.array(lengths, np.int32)), threads, min(splits, cap)).numpy()
  for r in range(len(lengths)): np.testing.assert_allclose(out[r], dense_reference(q[r], ks[r], vs[r]), atol=2e-5, rtol=1e-4)

@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), lengths=st.lists(st.integers(1, 200), min_size=1, max_size=5), most=st.integers(2, 5),
       count=st.integers(-1, 6), threads=st.integers(1, 3))
def test_a_run_time_part_count_gives_the_bits_of_that_count(seed, lengths, most, count, threads):
  # split_count: the kernel made for `most` parts, told `count` at run time (clamped to 1..most), gives each row the bits
  # of the kernel made for that count (one part: o / l, the unsplit kernel's output)
  rng, bs, n_kv = np.random.default_rng(seed), 16, 3
  cap = -(-200 // bs)
  pool, tables, _, _ = rows_pool(rng, lengths, bs, n_kv, cap)
  q = rng.standard_normal((len(lengths), n_kv * 3, D)).astype(np.float32)
  args = (Tensor(q), Tensor(pool), Tensor(tables), Tensor(np.array(lengths, np.int32)), threads)
  got = cpu_paged_attention(*args, most, split_count=Tensor(np.array([count], np.int32))).numpy()
  np.testing.assert_array_equal(got, cpu_paged_attention(*args, min(max(count, 1), most)).numpy())

@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), start=st.integers(0, 150), rows=st.integers(1, 3 * QR + 1), threads=st.integers(1, 3),
       group=st.sampled_from([1, 3]))
def test_prefill_tiles_match_reference(seed, start, rows, threads, group):
  # rows at positions start..start+rows-1 of one sequence (each row's context: its position + 1), every row reading the
  # sequence's one table; tiles of QR rows, the last one short; the slots past the sequence hold NaN
  rng, bs, n_kv = np.random.default_rng(seed), 16, 2
  n = start + rows
  cap = -(-n // bs) + 1
  pool, tables, ks, vs = rows_pool(rng, [n], bs, n_kv, cap)
  q = rng.standard_normal((rows, n_kv * group, D)).astype(np.float32)
  lens = np.arange(start + 1, n + 1, dtype=np.int32)
  out = cpu_paged_attention(Tensor(q), Tensor(pool), Tensor(np.repeat(tables, rows, 0)), Tensor(lens), threads, shared_table=True,
                            prefill=True).numpy()
  for i in range(rows): np.testing.assert_allclose(out[i], dense_reference(q[i], ks[0][:lens[i]], vs[0][:lens[i]]), atol=2e-5, rtol=1e-4)

def bf16_bits(a: np.ndarray) -> np.ndarray:
  # float32 -> bfloat16 bits, rounded to nearest even (NaN stays NaN)
  b = a.astype(np.float32).view(np.uint32)
  return np.where(np.isnan(a), 0x7fc0, (b + 0x7fff + ((b >> 16) & 1)) >> 16).astype(np.uint16)

@pytest.mark.parametrize("kv_dtype", [dtypes.float32, dtypes.uint16])
def test_other_kv_dtypes(kv_dtype):
  # float32 read as is; bfloat16, held as its bits (uint16: tinygrad's clang renderer would declare a bfloat16 buffer
  # __bf16, which clang < 17 rejects here), widened by a shift: the reference sees the values the pool holds
  rng, bs, n_kv, lengths = np.random.default_rng(1), 16, 3, [37, 64, 5]
  pool, tables, _, _ = rows_pool(rng, lengths, bs, n_kv, 4, np.float32)
  if kv_dtype == dtypes.uint16:
    bits = bf16_bits(pool)
    tp, held = Tensor(bits).realize(), (bits.astype(np.uint32) << 16).view(np.float32)
  else: tp, held = Tensor(pool).realize(), pool
  q = rng.standard_normal((3, n_kv * 2, D)).astype(np.float32)
  out = cpu_paged_attention(Tensor(q), tp, Tensor(tables), Tensor(np.array(lengths, np.int32)), 2, 2).numpy()
  for r, n in enumerate(lengths):
    k = np.stack([held[tables[r, p // bs], 0, :, (p % bs) + bs * np.arange(D)].T for p in range(n)])
    v = np.stack([held[tables[r, p // bs], 1, :, (p % bs) * D:(p % bs + 1) * D] for p in range(n)])
    np.testing.assert_allclose(out[r], dense_reference(q[r], k, v), atol=2e-5, rtol=1e-4)

def test_dispatch_matches_tinygrad_kernel():
  # paged_attention with threads runs the C kernels; without, the tinygrad kernel: the same result, splits included
  rng, bs, n_kv, lengths = np.random.default_rng(2), 16, 3, [1, 100, 255]
  cap = 16
  pool, tables, _, _ = rows_pool(rng, lengths, bs, n_kv, cap)
  q = rng.standard_normal((3, n_kv * 3, D)).astype(np.float32)
  args = (Tensor(q), Tensor(pool), Tensor(tables), Tensor(np.array(lengths, np.int32)), max_blocks_var(cap).bind(16))
  for splits in (1, 3):
    ref = paged_attention(*args, splits=splits).numpy()
    np.testing.assert_allclose(paged_attention(*args, splits=splits, threads=2).numpy(), ref, atol=1e-6, rtol=1e-5)

def test_bad_block_id_stays_in_the_pool():
  # a table entry past the pool reads block 0 instead of memory outside it (garbage in, no crash): finite output
  rng = np.random.default_rng(3)
  pool = rng.standard_normal((2, 2, 1, 16 * D)).astype(np.float16)
  out = cpu_paged_attention(Tensor(rng.standard_normal((1, 1, D)).astype(np.float32)), Tensor(pool), Tensor(np.array([[1, 10**6]], np.int32)),
                            Tensor(np.array([32], np.int32)), 1).numpy()
  assert np.isfinite(out).all()

def test_prefill_needs_a_shared_table():
  t = Tensor.empty(2, 1, D)
  with pytest.raises(ValueError, match="sharing"):
    cpu_paged_attention(t, Tensor.empty(2, 2, 1, 16 * D, dtype=dtypes.float16), Tensor.empty(2, 2, dtype=dtypes.int32),
                        Tensor.empty(2, dtype=dtypes.int32), 1, prefill=True)
