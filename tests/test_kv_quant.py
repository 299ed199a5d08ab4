"""The KV cache's 8-bit and bfloat16 formats (kernels/kv_quant.py): quantize / dequantize against float64 references, the C scatter
against the numpy packer, the C attention kernels over 8-bit and bfloat16 pools against a float64 attention over the dequantized values."""
import subprocess
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from tinygrad import Tensor, dtypes
from tinyhet.config import ConfigError, load_config
from tinyhet.kernels.kv_pack import pack_kv, pack_kv_host, tensor_of_bytes, unpack_kv
from tinyhet.kernels.kv_quant import FP8, code_of, decode_bf16, decode_fp8, dequantize_q8_0, encode_bf16, encode_fp8, is_q8, np_storage, \
  quantize_q8_0, round_kv, tile_len
from tinyhet.kernels.paged_attention import kv_scatter, paged_attention

EIGHT = [dtypes.int8, dtypes.fp8e4m3, dtypes.fp8e5m2]
CODED = [*EIGHT, dtypes.uint16]   # and bfloat16, held as its bits
floats = st.floats(-1e4, 1e4, allow_nan=False, width=32) | st.sampled_from([0.0, -0.0, 1e-9, -1e-9, 448.0, 1e4])

@settings(max_examples=60, deadline=None)
@given(st.lists(floats, min_size=32, max_size=32))
def test_q8_0_error_bound(xs):
  x = np.zeros(64, np.float32)
  x[:len(xs)] = xs   # one shape: one kernel
  q, d = quantize_q8_0(x)
  y = dequantize_q8_0(q, d).astype(np.float64)
  amax = np.abs(x.astype(np.float64)).max()
  step = amax / 127
  assert np.abs(q.astype(int)).max() <= 127
  assert np.all(np.abs(y - x) <= step * (0.5 + 127 * 2 ** -11) + 127 * 2 ** -25 + amax * 1e-6)   # 2^-25: a float16 scale's smallest step

@settings(max_examples=60, deadline=None)
@given(st.lists(floats, min_size=1, max_size=64), st.sampled_from([dtypes.fp8e4m3, dtypes.fp8e5m2]))
def test_fp8_nearest_and_saturating(xs, fmt):
  x = np.array(xs, np.float64)
  y = decode_fp8(encode_fp8(x, fmt), fmt).astype(np.float64)
  grid = decode_fp8(np.arange(256, dtype=np.uint8), fmt).astype(np.float64)
  grid = grid[np.isfinite(grid) & (np.abs(grid) <= FP8[fmt][3])]
  best = np.abs(np.clip(x, -FP8[fmt][3], FP8[fmt][3])[:, None] - grid[None]).min(1)
  assert np.allclose(np.abs(np.clip(x, -FP8[fmt][3], FP8[fmt][3]) - y), best, rtol=0, atol=1e-12)

@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(-2.0 ** 127, 2.0 ** 127, allow_nan=False, width=32) | st.sampled_from([0.0, -0.0, 1e-40, -3e-39, 1.00390625, 1.01171875]),
                min_size=1, max_size=64))
def test_bfloat16_round_trip_is_nearest_even(xs):
  # float64 reference: x to the step of its binade (7 mantissa bits; float32's subnormal steps below 2^-126), half to even
  x = np.zeros(64, np.float32)
  x[:len(xs)] = xs   # one shape: one kernel
  a = np.abs(x.astype(np.float64))
  step = 2.0 ** (np.maximum(np.floor(np.log2(np.where(a > 0, a, 1.0))), -126) - 7)
  want = np.rint(x.astype(np.float64) / step) * step
  host = decode_bf16(encode_bf16(x))
  assert np.array_equal(host.astype(np.float64), want)
  assert np.array_equal(round_kv(Tensor(x), dtypes.uint16).numpy(), host)   # the tinygrad bit ops round as numpy does

@pytest.mark.parametrize("fmt", CODED)
def test_round_kv_is_what_the_pool_holds(fmt):
  x = (np.random.default_rng(1).standard_normal((20, 2, 64)) * np.exp(np.random.default_rng(2).uniform(-9, 5, (20, 2, 64)))).astype(np.float32)
  r = round_kv(Tensor(x), fmt).numpy()
  k, _ = unpack_kv(pack_kv(Tensor(r), Tensor(r), 16, fmt), 20, 64)
  assert np.array_equal(k.numpy(), r)   # the prefill attends to exactly the decode node's numbers

@pytest.mark.parametrize("fmt", CODED)
def test_scatter_matches_packer(fmt):
  rng, KV, D, BS = np.random.default_rng(3), 2, 64, 16
  pool = Tensor.zeros(3, 2, KV, tile_len(fmt, BS, D), dtype=fmt).contiguous().realize()
  pos, table = np.array([0, 5, 17], np.int32), np.array([[2, 1, 0]] * 3, np.int32)
  k = (rng.standard_normal((3, KV, D)) * np.exp(rng.uniform(-8, 6, (3, KV, D)))).astype(np.float32)
  got = np.frombuffer(bytes(kv_scatter(pool, Tensor(k), Tensor(-2 * k), Tensor(table), Tensor(pos)).realize().uop.buffer.as_memoryview()), np.uint8)
  got = got.reshape(*pool.shape[:3], -1)
  full, full_v = np.zeros((48, KV, D), np.float32), np.zeros((48, KV, D), np.float32)   # +0.0 in the empty slots (bfloat16 keeps -0.0's sign)
  full[pos], full_v[pos] = k, -2 * k
  want = np.zeros_like(got)
  pack_kv_host(full, full_v, want.view(np_storage(fmt)), q8=is_q8(fmt), code=code_of(fmt))
  assert np.array_equal(got, want[[2, 1, 0]])

@settings(max_examples=12, deadline=None)
@given(st.sampled_from(CODED), st.integers(1, 3), st.integers(1, 70), st.sampled_from([1, 3, 8]), st.integers(0, 10**6))
def test_attention_over_coded_blocks(fmt, rows, longest, G, seed):
  rng, KV, D, BS, NB = np.random.default_rng(seed), 2, 64, 16, 8
  nbytes = NB * 2 * KV * tile_len(fmt, BS, D) * fmt.itemsize
  pool = np.frombuffer(rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes(), np.uint8)  # stale bytes everywhere
  k = rng.standard_normal((NB * BS, KV, D)).astype(np.float32)
  v = rng.standard_normal((NB * BS, KV, D)).astype(np.float32)
  packed = np.frombuffer(bytes(pack_kv(Tensor(k), Tensor(v), BS, fmt).uop.buffer.as_memoryview()), np.uint8).reshape(NB, 2, KV, -1)
  order = rng.permutation(NB)                                                         # the table: any block ids
  pool = pool.reshape(NB, 2, KV, -1).copy()
  pool[order] = packed
  lens = rng.integers(1, longest + 1, rows).astype(np.int32)
  kd, vd = (x.float().numpy().astype(np.float64) for x in unpack_kv(pack_kv(Tensor(k), Tensor(v), BS, fmt), NB * BS, D))
  q = rng.standard_normal((rows, KV * G, D)).astype(np.float32)
  table = Tensor(np.tile(order.astype(np.int32), (rows, 1)))
  out = paged_attention(Tensor(q), tensor_of_bytes(pool.view(np_storage(fmt)), fmt, 'CPU'), table, Tensor(lens), NB, threads=1).numpy()
  for r in range(rows):
    n = lens[r]
    kk, vv = np.repeat(kd[:n], G, axis=1), np.repeat(vd[:n], G, axis=1)
    s = np.einsum("hd,thd->ht", q[r].astype(np.float64), kk) / np.sqrt(D)
    p = np.exp(s - s.max(-1, keepdims=True))
    ref = np.einsum("ht,thd->hd", p / p.sum(-1, keepdims=True), vv)
    assert np.abs(out[r] - ref).max() < 1e-4

def test_config_names_the_formats():
  with pytest.raises(ConfigError, match="kv_dtype"): load_config(env={}, kv_dtype="q4_0")
  assert load_config(env={}, kv_dtype="q8_0").kv_dtype == "q8_0"

@pytest.mark.parametrize("code", range(6))
def test_every_kv_kernel_links_without_libm(code):
  """Each format's C kernels (decode, split decode with its count fixed or read at run time, prefill tiles, the split merge,
  the scatter) compile without a warning (clang's default set) to objects that call
  nothing outside themselves: tinygrad's loader links a libm call by a 32-bit PC-relative offset, which fails once the image
  lies over 2 GiB from libm (clang left `ldexpf` a call: the fp8 kernels failed that way late in a long run). A warning is
  a defect too: the fp8 K tiles' load was once passed its exponent bias as a float (2^120, out of int's range: undefined,
  and right only because clang happened to fold it as the V load's 7)."""
  from tinygrad import Device
  from tinygrad.runtime.support.elf import elf_loader
  from tinyhet.kernels.cpu_attention import QR, _source
  D, BS, KV, G = 64, 16, 2, 2
  common = dict(D=D, BS=BS, KVH=KV, G=G, R=4, CAP=8, NBLK=16, PARTS=2, SHARED=1, KVB=code, TX=tile_len(
    [dtypes.float32, dtypes.float16, dtypes.uint16, dtypes.int8, dtypes.fp8e4m3, dtypes.fp8e5m2][code], BS, D), SCALE=0.125)
  common["RT"] = 0
  sources = [_source("decode", **{**common, "P": 1, "QR": 0, "NQ": KV * G}), _source("decode", **{**common, "P": 2, "QR": 0, "NQ": KV * G}),
             _source("decode", **{**common, "P": 2, "QR": 0, "NQ": KV * G, "RT": 1}),
             _source("prefill", **{**common, "P": 1, "QR": QR, "NQ": QR * G}), _source("merge", D=D, P=2, RH=8, PARTS=2, RT=0),
             _source("merge", D=D, P=2, RH=8, PARTS=2, RT=1),
             _source("scatter", KVB=code, R=4, KVH=KV, D=D, BS=BS, CAP=8, NBLK=16)]
  compiler = Device["CPU"].compiler
  for name, src in sources:
    elf_loader(compiler.compile(src))      # raises on a symbol it would have to link from a library
    out = subprocess.run(["clang", "-x", "c", "-fsyntax-only", "-Werror", "-march=native", "-"], input=src, capture_output=True, text=True)
    assert out.returncode == 0, f"{name}: {out.stderr[:2000]}"
