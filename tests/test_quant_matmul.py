"""The hand-written matmul kernels (kernels/quant_matmul.py) that HET on a CPU and MESH use for weights in their stored form:
for every GGML type they read, the decode and the tiled kernel against the gguf package's own dequantizer (an independent
implementation of the ggml-common.h layouts), the same bits whatever the part count, and the model's linear layer and a
whole Llama with a Q4_K_M-like mix of types routed to them."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
import tinyhet  # noqa: F401  (MESH)
from tinygrad import Tensor, dtypes
from tinyhet.kernels import gemv16, quant_matmul as qmm
from tinyhet.kernels.quant_blocks import (BF16, F16, LAYOUT, NAMES, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, dequantize_reference,
                                          random_blocks, supported)
from tinyhet.model.packed import PackedWeight

TYPES = [Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, F16, BF16]

def cols_for(t: int) -> int:
  """Columns with a last partial panel of the tiled kernel (past its 512-column panels): 768 = 3 super-blocks; 544 = 17
  blocks of 32, an odd count (the kernels' two-block steps end in a single block)."""
  return 768 if LAYOUT[t][0] == 256 else 544

def reference(blocks: np.ndarray, t: int, cols: int) -> np.ndarray:
  if t == BF16:   # gguf's BF16 dequantizer: float32 from the top 16 bits, as ggml does
    from gguf.quants import dequantize
    from gguf import GGMLQuantizationType
    return dequantize(blocks, GGMLQuantizationType.BF16).astype(np.float32).reshape(-1, cols)
  return dequantize_reference(blocks, t, cols)

def product(t: int, rows: int, out: int, cols: int, parts: int, seed: int, tiled=None):
  rng = np.random.default_rng(seed)
  b = random_blocks(out, cols, t, rng)
  x = rng.standard_normal((rows, cols), dtype=np.float32)
  want = x.astype(np.float64) @ reference(b, t, cols).astype(np.float64).T
  got = qmm.quant_matmul(Tensor(x, device="MESH"), Tensor(b, device="MESH"), t, (out, cols), parts, tiled).numpy()
  return got, want

@pytest.mark.parametrize("t", TYPES, ids=[NAMES[t] for t in TYPES])
@pytest.mark.parametrize("rows", [1, 5, 40])     # one row; a few (a decode tile and a tail); many (the tiled kernel)
def test_each_type_equals_the_independent_dequantizer(t, rows):
  got, want = product(t, rows, 70, cols_for(t), 2, seed=rows + t)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())

@pytest.mark.parametrize("t", [Q4_K, Q6_K, Q5_0, BF16], ids=["Q4_K", "Q6_K", "Q5_0", "BF16"])
def test_decode_and_tiled_kernels_agree_for_a_batch_either_could_take(t):
  got_decode, want = product(t, 20, 48, cols_for(t), 1, seed=3, tiled=False)
  got_tiled, _ = product(t, 20, 48, cols_for(t), 1, seed=3, tiled=True)
  for got in (got_decode, got_tiled): np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())

@settings(max_examples=8, deadline=None)
@given(t=st.sampled_from(TYPES), rows=st.integers(qmm.DECODE_MAX_M + 1, 39), out=st.sampled_from([17, 40, 70]))
def test_past_one_decode_tile_a_row_gets_the_same_bits_in_any_batch(t, rows, out):
  # the tiled kernel from DECODE_MAX_M + 1 rows on (its panel transposed in registers made it the faster one there): each
  # row's sums run in one order whatever the other rows, so a prompt's rows in a 16-token chunk of a stall-free step get
  # the bits they get in the whole prompt's 512-row product; and they are the dequantized product's
  got, want = product(t, 40, out, cols_for(t), 1, seed=rows)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
  rng = np.random.default_rng(rows)
  b = random_blocks(out, cols_for(t), t, rng)
  x = rng.standard_normal((40, cols_for(t)), dtype=np.float32)
  part = qmm.quant_matmul(Tensor(x[:rows], device="MESH"), Tensor(b, device="MESH"), t, (out, cols_for(t)), 1).numpy()
  np.testing.assert_array_equal(part, got[:rows])

@settings(max_examples=12, deadline=None)
@given(t=st.sampled_from(TYPES), rows=st.integers(1, 70), out=st.integers(1, 75), parts=st.sampled_from([1, 2, 3]),
       wide=st.booleans(), seed=st.integers(0, 2**16))
def test_the_dot_kernel_equals_the_dequantized_product_and_its_bits_hold_for_any_rows_and_parts(t, rows, out, parts, wide, seed):
  # kernels/dot_gemm.py (F16/BF16's float path past one decode tile; any type when asked): blocks of 4 weight rows and tails
  # of 1-3, tiles of 4 rows of x and tails, groups of rows (wide: 4096 columns of F16, 32 rows a group, so 75 rows are 3)
  cols = 4096 if wide else cols_for(t)
  got, want = product(t, rows, out, cols, parts, seed, tiled="dot")
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
  # every output is one accumulator summed in one order: the same bits for a row of x whatever the other rows and the split
  np.testing.assert_array_equal(product(t, rows + 5, out, cols, 1, seed, tiled="dot")[0][:rows], got)

def test_float_weights_past_one_decode_tile_take_the_dot_kernel_and_block_types_the_tiled_one():
  for t in TYPES:
    name, _ = qmm.kernel_source(t, qmm.DECODE_MAX_M + 1, 64, 512 if LAYOUT[t][0] == 32 else 768, 2)
    assert name.endswith("_dot" if t in (F16, BF16) else "_tiled"), name
  assert not qmm.kernel_source(F16, qmm.DECODE_MAX_M, 64, 512, 2)[0].endswith("_dot")   # one decode tile: the decode kernel

@settings(max_examples=10, deadline=None)
@given(t=st.sampled_from(TYPES), rows=st.sampled_from([1, 3, 8, 33]), out=st.sampled_from([1, 17, 50]), parts=st.sampled_from([1, 2, 3]),
       seed=st.integers(0, 2**16))
def test_equals_the_dequantized_float_product_for_any_part_count(t, rows, out, parts, seed):
  cols = LAYOUT[t][0] * (1 if LAYOUT[t][0] == 256 else 3)
  got, want = product(t, rows, out, cols, parts, seed)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
  # each output row is summed within one part, in one order: the split changes which core computes it, not its bits
  np.testing.assert_array_equal(product(t, rows, out, cols, 1, seed)[0], got)

GEMVF = gemv16.GEMVF_TYPES

@settings(max_examples=16, deadline=None)
@given(t=st.sampled_from(GEMVF), rows=st.integers(1, qmm.DECODE_MAX_M), out=st.integers(16, 70),
       parts=st.integers(1, 3), blocks=st.integers(1, 9), seed=st.integers(0, 2**16))
def test_the_16_row_float_decode_kernel_gives_a_row_the_same_bits_at_any_count_and_part(t, rows, out, parts, blocks, seed):
  # kernels/gemv16.py's float kernel, the block types' float path within one decode tile: a batch of one's step and its
  # speculative verify step (up to DECODE_MAX_M rows) give a row the same bits, whatever the part count; odd block counts,
  # weight rows past a multiple of its 16-row groups; and the dequantized product's values
  rng = np.random.default_rng(seed)
  cols = LAYOUT[t][0] * (blocks if LAYOUT[t][0] == 32 else 1 + blocks % 3)
  b, x = random_blocks(out, cols, t, rng), rng.standard_normal((qmm.DECODE_MAX_M, cols), dtype=np.float32)
  assert qmm.kernel_source(t, rows, out, cols, parts)[0].endswith("_r16")
  tile = qmm.quant_matmul(Tensor(x, device="MESH"), Tensor(b, device="MESH"), t, (out, cols), 1).numpy()
  got = qmm.quant_matmul(Tensor(x[:rows], device="MESH"), Tensor(b, device="MESH"), t, (out, cols), parts).numpy()
  np.testing.assert_array_equal(got, tile[:rows])
  want = x.astype(np.float64) @ reference(b, t, cols).astype(np.float64).T
  np.testing.assert_allclose(tile, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())

def test_leading_axes_are_kept():
  w = PackedWeight.random(48, 64, Q4_1, device="MESH")
  x = Tensor.randn(2, 3, 64, device="MESH")
  got = qmm.quant_matmul(x, w.blocks, Q4_1, w.shape, 2)
  assert got.shape == (2, 3, 48)
  np.testing.assert_allclose(got.numpy(), (x @ w.dequantize().T).numpy(), rtol=1e-4, atol=1e-4)

@given(rows=st.integers(1, 1 << 20), threads=st.integers(1, 1024))
def test_parts_leave_every_part_enough_rows(rows, threads):
  p = qmm.kernel_parts(rows, threads)
  assert 1 <= p <= threads and (p == 1 or rows // p >= qmm.MIN_ROWS_PER_PART)

def test_unsupported_blocks_are_refused_in_words():
  assert supported(Q4_K, 256) and not supported(Q4_K, 576) and not supported(Q4_1, 48) and not supported(10, 256)   # Q2_K: no kernel
  with pytest.raises(ValueError, match="no quantized matmul kernel"): qmm.kernel_source(Q4_K, 1, 32, 576, 1)
  with pytest.raises(ValueError, match="not whole blocks"): random_blocks(4, 100, Q8_0, np.random.default_rng(0))

def kernels_run(fn) -> list[str]:
  from tinygrad.engine.realize import runtime_cache
  before = len(runtime_cache)
  fn()
  return [getattr(rt, "name", "") for rt in list(runtime_cache.values())[before:]]

@pytest.mark.parametrize("rows", [1, 40])
def test_the_model_uses_it_for_k_quants_and_half_floats_on_the_pool_devices_only(rows):
  from tinyhet.model.layers import linear
  rng = np.random.default_rng(0)
  x = Tensor(rng.standard_normal((rows, 256), dtype=np.float32), device="MESH")
  kq = PackedWeight(Tensor(random_blocks(64, 256, Q6_K, rng), device="MESH"), (64, 256), Q6_K).realize()
  half = Tensor(rng.standard_normal((64, 256)).astype(np.float16), device="MESH").realize()
  for w, name in ((kq, "qmatmul_q6_k"), (half, "qmatmul_f16")):
    want = x.numpy() @ (w.dequantize() if isinstance(w, PackedWeight) else w.float()).numpy().T
    out = []
    assert any(name in n for n in kernels_run(lambda: out.append(linear(x, w).numpy())))
    np.testing.assert_allclose(out[0], want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
  w_cpu = PackedWeight(kq.blocks.to("CPU"), kq.shape, Q6_K)
  assert not any("qmatmul" in n for n in kernels_run(lambda: linear(x.to("CPU"), w_cpu).realize()))   # tinygrad's CPU: its own kernels

def mix_logits(device: str, packed: bool) -> tuple[list[np.ndarray], list[str]]:
  """A small Llama with each layer's matrices in the mix of types llama-quantize's Q4_K_M writes (Q4_K, Q6_K for some
  down projections and V, Q5_0 where columns are not whole super-blocks): the logits of a 40-token prefill and of a decode
  step after it, and the kernels that ran."""
  from tinyhet.model.llama import DenseKVCache, LayerWeights, Llama, LlamaWeights, small_config
  cfg = small_config(n_layers=2, dim=256, n_heads=4, n_kv_heads=2, hidden_dim=512, vocab_size=96, max_context=64)
  rng = np.random.default_rng(1)
  def mat(o, i, t): return random_blocks(o, i, t, rng), (o, i), t
  qd, kvd = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
  layers = [dict(wq=mat(qd, 256, Q4_K), wk=mat(kvd, 256, Q4_K), wv=mat(kvd, 256, Q6_K), wo=mat(256, qd, Q4_K), w_gate=mat(512, 256, Q5_K),
                 w_up=mat(512, 256, Q4_K), w_down=mat(256, 512, Q6_K if l == 0 else Q4_K)) for l in range(cfg.n_layers)]
  emb, norms = mat(96, 256, Q8_0), [rng.uniform(0.8, 1.2, 256).astype(np.float32) for _ in range(2 * cfg.n_layers + 1)]
  def m(spec):
    b, shape, t = spec
    if packed: return PackedWeight(Tensor(b, device=device), shape, t).realize()
    return Tensor(dequantize_reference(b, t, shape[1]), device=device).realize()
  ls = [LayerWeights(attn_norm=Tensor(norms[2 * l], device=device), ffn_norm=Tensor(norms[2 * l + 1], device=device),
                     **{k: m(v) for k, v in layers[l].items()}) for l in range(cfg.n_layers)]
  e = m(emb)
  model = Llama(cfg, LlamaWeights(tok_embeddings=e, layers=ls, norm=Tensor(norms[-1], device=device), output=e if cfg.tie_embeddings else m(emb)))
  tokens = rng.integers(0, 96, (1, 40)).astype(np.int32)
  logits = []
  cache = DenseKVCache(cfg, 1, 48, dtypes.float32, device)
  pos = Tensor(np.arange(40, dtype=np.int32).reshape(1, 40), device=device)
  names = kernels_run(lambda: logits.append(model.forward(Tensor(tokens, device=device), pos, cache).numpy()))
  logits.append(model.forward(Tensor([[5]], dtype=dtypes.int32, device=device), Tensor([[40]], dtype=dtypes.int32, device=device), cache).numpy())
  return logits, names

@pytest.fixture(scope="module")
def float32_mix_logits():
  return mix_logits("CPU", False)[0]

def test_a_q4_k_m_mix_runs_the_kernels_and_matches_the_float32_model(float32_mix_logits):
  """The mix on MESH: prefill (the tiled kernel) and a decode step give the logits of the same weights dequantized to float32
  and run by tinygrad's own kernels."""
  got, names = mix_logits("MESH", True)
  assert {"q4_k", "q5_k", "q6_k"} <= {n.split("_")[1] + "_" + n.split("_")[2] for n in names if n.startswith("qmatmul")}
  for g, want in zip(got, float32_mix_logits):
    np.testing.assert_allclose(g, want, rtol=1e-3, atol=1e-3 * np.abs(want).max())

def test_the_int8_mode_runs_the_int8_tiled_kernel_in_prefill_and_stays_near_the_float32_model(float32_mix_logits, monkeypatch):
  # x rounded to 8 bits: logits within a few percent, not the float path's 1e-3
  monkeypatch.setenv("TINYHET_INT8_ACTIVATIONS", "1")
  got, names = mix_logits("MESH", True)
  assert {"q4_k", "q5_k", "q6_k"} <= {n.split("_")[1] + "_" + n.split("_")[2] for n in names if n.endswith("_int8t")}
  for g, want in zip(got, float32_mix_logits):
    err = np.abs(g - want).max() / np.abs(want).max()
    assert 1e-5 < err < 5e-2, err

@pytest.mark.parametrize("t", [Q4_0, Q4_K, Q6_K, BF16], ids=["Q4_0", "Q4_K", "Q6_K", "BF16"])
def test_kernels_call_nothing_outside_themselves(t):
  # clang turned the accumulators' zero initializer into a call to memset for some shapes (one output row, a partial last
  # tile): tinygrad loads a kernel as a bare object, so the call's target was wherever the C library lay, and loading
  # failed whenever that was more than 2 GiB away (it depends on where the process's memory landed)
  from tinygrad import Device
  from tinygrad.runtime.support.elf import elf_loader
  for rows, out, cols, parts in [(5, 1, 256, 1), (9, 1, 256, 1), (40, 1, 256, 1), (1, 1536, 768, 2), (40, 48, 512, 3), (100, 70, 1536, 2)]:
    for int8 in ((False, True) if rows in (9, 1, 40) else (False,)):
      _, src = qmm.kernel_source(t, rows, out, cols, parts, int8=int8)
      elf_loader(Device["MESH"].compiler.compile(src))   # raises on a relocation against a symbol it does not define

def rounded_to_int8(x: np.ndarray, block: int = 32) -> np.ndarray:
  """x rounded as the int8 mode rounds it: per block of 32 (the K-quants: 256, llama.cpp's q8_K), scale max|x|/127, nearest even."""
  xb = x.reshape(x.shape[0], -1, block)
  amax = np.abs(xb).max(-1, keepdims=True)
  inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
  return (np.round(xb * inv) * (amax / np.float32(127))).reshape(x.shape)

INT8_TYPES = [Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K]

def rounded_to_bf16(x: np.ndarray) -> np.ndarray:
  """x rounded to bfloat16 as the int8 mode's BF16 kernel rounds it: to nearest, ties to an even last bit (no NaN here)."""
  b = x.astype(np.float32).view(np.uint32).astype(np.uint64)
  return ((b + 0x7fff + ((b >> 16) & 1)) >> 16 << 16).astype(np.uint32).view(np.float32)

@pytest.mark.parametrize("t", INT8_TYPES, ids=[NAMES[t] for t in INT8_TYPES])
def test_int8_mode_is_the_exact_product_with_x_rounded_per_block(t):
  # 9 rows: the K-quants' int8 decode kernel (a full tile and a tail), the 32-weight types' int8 tiled kernel
  from tinyhet.kernels.quant_blocks import supported_int8
  rng = np.random.default_rng(t)
  cols = 512
  b = random_blocks(50, cols, t, rng)
  x = rng.standard_normal((9, cols), dtype=np.float32) * rng.uniform(0.1, 10, (9, 1)).astype(np.float32)
  block = LAYOUT[t][0]
  x[0, :block] = 0                                               # an all-zero block: scale 0, no division by it
  want = rounded_to_int8(x, block).astype(np.float64) @ reference(b, t, cols).astype(np.float64).T
  assert supported_int8(t, cols) and "_int8" in qmm.kernel_source(t, 9, 50, cols, 2, int8=True)[0]
  got = qmm.quant_matmul(Tensor(x, device="MESH"), Tensor(b, device="MESH"), t, (50, cols), 2, int8=True).numpy()
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
  # the rounding per 32 would be a different product: the test tells the two apart
  if block == 256:
    per32 = rounded_to_int8(x).astype(np.float64) @ reference(b, t, cols).astype(np.float64).T
    assert np.abs(got - per32).max() > 1e-3 * np.abs(want).max()

@pytest.mark.parametrize("t", [Q4_K, Q5_K, Q6_K], ids=["Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("rows,parts", [(1, 1), (3, 3), (8, 2), (17, 2)])   # one row; a tail; a full tile; tiles and a tail
def test_kquant_int8_kernel_for_any_row_and_part_count(t, rows, parts):
  # the q8_K-style kernel (x per super-block of 256, integer sums over the super-block): every row of a tile, every part; 17
  # rows, past the int8 tiled kernel's crossover, asked for by tiled=False
  assert qmm.kernel_source(t, rows, 40, 768, parts, False, int8=True)[0].endswith("_int8k")
  rng = np.random.default_rng(rows * 7 + parts + t)
  b = random_blocks(40, 768, t, rng)
  x = rng.standard_normal((rows, 768), dtype=np.float32)
  want = rounded_to_int8(x, 256).astype(np.float64) @ reference(b, t, 768).astype(np.float64).T
  got = qmm.quant_matmul(Tensor(x, device="MESH"), Tensor(b, device="MESH"), t, (40, 768), parts, False, int8=True).numpy()
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())

def test_int8_mode_is_off_by_default_and_chosen_by_the_environment(monkeypatch):
  from tinyhet.model.layers import linear
  rng = np.random.default_rng(0)
  w = PackedWeight(Tensor(random_blocks(64, 256, Q4_K, rng), device="MESH"), (64, 256), Q4_K).realize()
  x = Tensor(rng.standard_normal((1, 256), dtype=np.float32), device="MESH")
  monkeypatch.delenv("TINYHET_INT8_ACTIVATIONS", raising=False)
  assert not any("_int8" in n for n in kernels_run(lambda: linear(x, w).realize()))
  monkeypatch.setenv("TINYHET_INT8_ACTIVATIONS", "1")
  assert any("_int8" in n for n in kernels_run(lambda: linear(x, w).realize()))
  # F16 and BF16 have no int8 kernel: the float one, named as such; the 32-weight types below the crossover the int8 decode one
  assert "_int8" not in qmm.kernel_source(F16, 1, 64, 256, 1, int8=True)[0]
  assert all(qmm.kernel_source(Q5_0, rows, 64, 256, 1, int8=True)[0].endswith("p1_int8v") for rows in (1, 3, 9, 16))
  # past the crossover, for any count of rows, the int8 tiled kernel, unless the (float) tiled kernel is asked for
  for t, rows in ((Q5_0, 17), (Q5_0, 5000), (Q4_K, 16), (Q4_K, 5000)): assert qmm.kernel_source(t, rows, 64, 256, 1, int8=True)[0].endswith("_int8t")
  assert "_int8k" in qmm.kernel_source(Q4_K, 15, 64, 256, 1, int8=True)[0] and "_int8" not in qmm.kernel_source(Q4_K, 64, 64, 256, 1, True, True)[0]

@pytest.mark.parametrize("march", ["native -mno-avx512vnni", "x86-64-v3", "x86-64"], ids=["avx512-no-vnni", "avx2", "x86-64"])
def test_each_cpu_path_the_source_has(march, tmp_path):
  # the kernels pick their path from what the compiler targets (tinygrad's CPU compiler: -march=native): AVX-512 with VNNI
  # on this machine; built here for the others (AVX-512 without VNNI: dot4's widening sum; AVX2 with F16C: 4-row tiles; plain
  # x86-64: the shift-and-scale half-float conversion) and run through ctypes on the same random blocks
  import ctypes, platform, subprocess
  if platform.machine() != "x86_64": pytest.skip("the -march names are x86's")
  rng = np.random.default_rng(len(march))
  def build(name: str, src: str):
    lib = tmp_path / f"{name}.so"
    subprocess.run(["clang", "-O2", "-shared", "-fPIC", "-ffreestanding", "-fno-math-errno", *f"-march={march}".split(), "-x", "c", "-",
                    "-o", str(lib)], input=src.encode(), check=True)
    return getattr(ctypes.CDLL(str(lib)), name)
  for t, rows, int8 in [(Q4_K, 9, True), (Q5_K, 1, True), (Q6_K, 3, True), (Q8_0, 9, True), (Q4_K, 5, False), (F16, 1, False), (BF16, 40, False),
                        (Q5_0, 1, False), (Q5_1, 2, False),   # the fifth bits' byte path (not AVX-512) and lane path
                        (Q4_K, 19, True), (Q6_K, 16, True), (Q5_0, 17, True), (BF16, 9, True),   # the tiled int8, bf16 kernels
                        (Q5_0, 5, True), (Q4_1, 1, True), (Q5_1, 16, True)]:   # the 32-weight types' int8 decode kernel (and Q8_0's 9)
    cols, out = cols_for(t) if not int8 else 512, 24
    name, src = qmm.kernel_source(t, rows, out, cols, 1, int8=int8)
    b = random_blocks(out, cols, t, rng)
    x = rng.standard_normal((rows, cols), dtype=np.float32)
    got, xin = np.zeros((rows, out), np.float32), x
    if (rounding := qmm.rounding_kernel(name, t, rows, cols, 1)) is not None:   # the tiled int8, bf16 kernels: x rounded first
      xin = np.zeros(rounding[2], np.uint8)
      build(*rounding[:2])(ctypes.c_void_p(xin.ctypes.data), ctypes.c_void_p(x.ctypes.data), 0)
    build(name, src)(*(ctypes.c_void_p(a.ctypes.data) for a in (got, b, xin)), 0)
    xr = (rounded_to_bf16(x) if t == BF16 else rounded_to_int8(x, 32 if rounding else LAYOUT[t][0])) if int8 else x
    want = xr.astype(np.float64) @ reference(b, t, cols).astype(np.float64).T
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max(), err_msg=f"{name} -march={march}")

@pytest.mark.parametrize("t", INT8_TYPES, ids=[NAMES[t] for t in INT8_TYPES])
def test_int8_tiled_kernel_is_the_exact_product_with_x_rounded_per_32(t):
  # the int8 mode past its crossover (kernels/int8_gemm.py): x rounded per 32 for every type, the K-quants too. Rows: one past
  # the crossover (odd: full 8-row tiles and a tail), a few hundred; weight rows not a multiple of the 16-row panel; columns
  # past a whole 512-column panel; 1-3 parts
  rng = np.random.default_rng(100 + t)
  cols = 768 if LAYOUT[t][0] == 256 else 576
  lo = qmm.INT8_TILED_MIN_M[LAYOUT[t][0]]
  for rows, out, parts in ((lo + 1, 37, 3), (203, 21, 2), (lo, 5, 1)):
    b = random_blocks(out, cols, t, rng)
    x = rng.standard_normal((rows, cols), dtype=np.float32) * rng.uniform(0.1, 10, (rows, 1)).astype(np.float32)
    x[0, 32:64] = 0                                               # an all-zero block: scale 0, no division by it
    assert qmm.kernel_source(t, rows, out, cols, parts, int8=True)[0].endswith("_int8t")
    want = rounded_to_int8(x, 32).astype(np.float64) @ reference(b, t, cols).astype(np.float64).T
    got = qmm.quant_matmul(Tensor(x, device="MESH"), Tensor(b, device="MESH"), t, (out, cols), parts, int8=True).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max(), err_msg=f"{rows} rows, {out} out, {parts} parts")
    if LAYOUT[t][0] == 256:   # not the rounding per 256 of the K-quants' int8 decode kernel: the test tells the two apart
      per256 = rounded_to_int8(x, 256).astype(np.float64) @ reference(b, t, cols).astype(np.float64).T
      assert np.abs(got - per256).max() > 1e-3 * np.abs(want).max()

@settings(max_examples=6, deadline=None)
@given(t=st.sampled_from(INT8_TYPES), rows=st.integers(17, 40), out=st.integers(48, 90), parts=st.sampled_from([2, 3]), seed=st.integers(0, 2**16))
def test_int8_tiled_kernel_gives_the_same_bits_for_any_part_count(t, rows, out, parts, seed):
  # x is rounded once, by its own kernel (a row the same way in any of its parts), and each part of the product sums each of
  # its output rows in one order: the split changes which core computes a row, not its bits
  rng = np.random.default_rng(seed)
  cols = LAYOUT[t][0] * (1 if LAYOUT[t][0] == 256 else 4)
  b, x = Tensor(random_blocks(out, cols, t, rng), device="MESH"), rng.standard_normal((rows, cols), dtype=np.float32)
  got = [qmm.quant_matmul(Tensor(x, device="MESH"), b, t, (out, cols), p, int8=True).numpy() for p in (1, parts)]
  assert qmm.kernel_parts(out, parts) == parts and qmm.kernel_source(t, rows, out, cols, parts, int8=True)[0].endswith("_int8t")
  np.testing.assert_array_equal(got[0], got[1])

GEMV8 = [Q4_0, Q4_1, Q5_0, Q5_1, Q8_0]

@pytest.mark.parametrize("t", GEMV8, ids=[NAMES[t] for t in GEMV8])
def test_int8_decode_kernel_is_the_exact_product_with_x_rounded_per_32(t):
  # kernels/gemv16.py's gemv8, the int8 mode's kernel for the 32-weight types below the tiled kernel's crossover: one row, a few,
  # the most it takes; weight rows not a multiple of its 16-row groups (a part's last group repeats its last row); 1-3 parts
  rng = np.random.default_rng(200 + t)
  for rows, out, parts in ((1, 37, 3), (5, 21, 2), (qmm.INT8_TILED_MIN_M[32] - 1, 50, 1), (2, 16, 1)):
    b = random_blocks(out, 576, t, rng)
    x = rng.standard_normal((rows, 576), dtype=np.float32) * rng.uniform(0.1, 10, (rows, 1)).astype(np.float32)
    x[0, 32:64] = 0                                               # an all-zero block: scale 0, no division by it
    assert qmm.kernel_source(t, rows, out, 576, parts, int8=True)[0].endswith("_int8v")
    want = rounded_to_int8(x, 32).astype(np.float64) @ reference(b, t, 576).astype(np.float64).T
    got = qmm.quant_matmul(Tensor(x, device="MESH"), Tensor(b, device="MESH"), t, (out, 576), parts, int8=True).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max(), err_msg=f"{rows} rows, {out} out, {parts} parts")

@settings(max_examples=10, deadline=None)
@given(t=st.sampled_from(GEMV8), rows=st.integers(1, 16), out=st.integers(16, 70), parts=st.integers(1, 3), blocks=st.integers(1, 10),
       seed=st.integers(0, 2**16))
def test_int8_decode_kernel_gives_the_tiled_kernels_bits_for_any_rows_and_parts(t, rows, out, parts, blocks, seed):
  # a row of x gets the same bits from the decode kernel (a decode step, a short chunk) as from the tiled one (the whole
  # prompt, past the crossover), whatever the part count of either: a stall-free step's chunk gives the unchunked tokens
  rng = np.random.default_rng(seed)
  cols, many = 64 * blocks, qmm.INT8_TILED_MIN_M[32] + int(rng.integers(0, 9))
  b, x = Tensor(random_blocks(out, cols, t, rng), device="MESH"), rng.standard_normal((many, cols), dtype=np.float32)
  assert qmm.kernel_source(t, many, out, cols, 1, int8=True)[0].endswith("_int8t")
  whole = qmm.quant_matmul(Tensor(x, device="MESH"), b, t, (out, cols), 1, int8=True).numpy()
  part = qmm.quant_matmul(Tensor(x[-rows:], device="MESH"), b, t, (out, cols), parts, int8=True).numpy()
  np.testing.assert_array_equal(part, whole[-rows:])

def test_products_of_one_x_share_one_rounding_of_it(monkeypatch):
  # a layer's q, k, v (gate and up) multiply the same x: one rounding kernel in the graph for all of them, the same bits as
  # each product with its own
  rng = np.random.default_rng(7)
  x = rng.standard_normal((5, 256), dtype=np.float32)
  bs = [Tensor(random_blocks(48, 256, t, rng), device="MESH") for t in (Q4_1, Q4_1, Q4_1)]
  alone = [qmm.quant_matmul(Tensor(x, device="MESH"), b, Q4_1, (48, 256), 2, int8=True).numpy() for b in bs]
  from tinyhet.kernels.c_program import c_program
  built = []
  monkeypatch.setattr(qmm, "c_program", lambda name, *a, **k: built.append(name) or c_program(name, *a, **k))
  xt = Tensor(x, device="MESH")
  outs = [qmm.quant_matmul(xt, b, Q4_1, (48, 256), 2, int8=True) for b in bs]
  Tensor.realize(*outs)
  assert sum(n.startswith("round_x") for n in built) == 1 and sum(n.startswith("qmatmul") for n in built) == 3
  for got, want in zip(outs, alone): np.testing.assert_array_equal(got.numpy(), want)

def test_the_int8_mode_rounds_x_to_bf16_for_bf16_weights_in_batches_and_prefill():
  # kernels/bf16_gemm.py (vdpbf16ps): the exact product with x rounded to bfloat16, told apart from the float32 product;
  # below BF16_TILED_MIN_M rows, and in the float path, x stays float32
  rng = np.random.default_rng(7)
  lo = qmm.BF16_TILED_MIN_M
  assert "_bf16t" not in qmm.kernel_source(BF16, lo - 1, 64, 544, 1, int8=True)[0] and "_bf16t" not in qmm.kernel_source(BF16, 512, 64, 544, 1)[0]
  for rows, out, parts in ((lo + 1, 37, 3), (203, 21, 2), (lo, 5, 1)):
    b = random_blocks(out, 544, BF16, rng)
    x = rng.standard_normal((rows, 544), dtype=np.float32)
    assert qmm.kernel_source(BF16, rows, out, 544, parts, int8=True)[0].endswith("_bf16t")
    w = reference(b, BF16, 544).astype(np.float64)
    want = rounded_to_bf16(x).astype(np.float64) @ w.T
    got = qmm.quant_matmul(Tensor(x, device="MESH"), Tensor(b, device="MESH"), BF16, (out, 544), parts, int8=True).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max(), err_msg=f"{rows} rows, {out} out, {parts} parts")
    assert np.abs(got - x.astype(np.float64) @ w.T).max() > 1e-4 * np.abs(want).max()

def rounded_buffer(x: np.ndarray, t: int) -> np.ndarray:
  """The bytes the rounding kernel writes for x (int8_gemm.round_source, bf16_gemm.round_source), from numpy: for BF16 x as
  bfloat16, a row K + 32 values apart; else x's int8 quants a row K + 64 apart, then per block of 32 the scale max|x|/127, then
  per group (Q6_K 16, else 32) the sum of the rounded x (the symmetric types: -OFF times the sum of the quants, an int32)."""
  from tinyhet.kernels.int8_gemm import OFFSET, group
  M, K = x.shape
  if t == BF16: return np.pad(rounded_to_bf16(x).view(np.uint32) >> 16, ((0, 0), (0, 32))).astype(np.uint16).view(np.uint8).ravel()
  xb = x.reshape(M, -1, 32)
  amax = np.abs(xb).max(-1, keepdims=True)
  inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
  q, d = np.rint(xb * inv).astype(np.int32), (amax / np.float32(127)).astype(np.float32)
  qsum = q.reshape(M, K // group(t), group(t)).sum(-1)
  off = OFFSET.get(t, 0)
  xs = (-off * qsum).astype(np.int32).view(np.uint8) if off else \
    (qsum.astype(np.float32) * np.repeat(d[..., 0], 32 // group(t), 1)).astype(np.float32).view(np.uint8)
  return np.concatenate([np.pad(q.reshape(M, K).astype(np.int8), ((0, 0), (0, 64))).view(np.uint8).ravel(), d.view(np.uint8).ravel(), xs.ravel()])

@settings(max_examples=8, deadline=None)
@given(t=st.sampled_from([*INT8_TYPES, BF16]), rows=st.integers(4, 40), parts=st.integers(1, 9), seed=st.integers(0, 2**16))
def test_x_is_rounded_once_by_its_own_kernel_the_same_bits_for_any_part_count(t, rows, parts, seed, tmp_path_factory):
  # the int8 and bf16 tiled kernels read x rounded by a kernel launched before them, its rows split in parts (more parts than
  # rows too): its output, run part by part, is numpy's rounding bit for bit, and the product through tinygrad (both kernels,
  # the pool's parts) has the same bits for any count of threads
  import ctypes, subprocess
  rng = np.random.default_rng(seed)
  cols, out = 256 if LAYOUT[t][0] == 256 else 96 if t == BF16 else 128, 40
  rows = max(rows, qmm.BF16_TILED_MIN_M if t == BF16 else qmm.INT8_TILED_MIN_M[LAYOUT[t][0]])   # the tiled kernel's rows
  x = rng.standard_normal((rows, cols), dtype=np.float32) * rng.uniform(0.01, 100, (rows, 1)).astype(np.float32)
  x[rows // 2, :32] = 0                                       # an all-zero block: scale 0
  name = qmm.kernel_source(t, rows, out, cols, 1, int8=True)[0]
  rname, src, nbytes = qmm.rounding_kernel(name, t, rows, cols, parts)
  lib = tmp_path_factory.mktemp("round") / f"{rname}.so"
  subprocess.run(["clang", "-O2", "-shared", "-fPIC", "-ffreestanding", "-fno-math-errno", "-march=native", "-x", "c", "-", "-o", str(lib)],
                 input=src.encode(), check=True)
  got = np.zeros(nbytes, np.uint8)
  for p in range(parts): getattr(ctypes.CDLL(str(lib)), rname)(ctypes.c_void_p(got.ctypes.data), ctypes.c_void_p(x.ctypes.data), p)
  np.testing.assert_array_equal(got, rounded_buffer(x, t))
  b = Tensor(random_blocks(out, cols, t, rng), device="MESH")
  one, split = (qmm.quant_matmul(Tensor(x, device="MESH"), b, t, (out, cols), p, int8=True).numpy() for p in (1, min(parts, 2)))
  np.testing.assert_array_equal(one, split)

def native_kernel(name: str, src: str, tmp: str):
  """The C function `name` of `src`, built by clang for this CPU as tinygrad's CPU compiler targets it, called via ctypes."""
  import ctypes, os, subprocess
  lib = os.path.join(tmp, f"{name}_{abs(hash(src))}.so")
  subprocess.run(["clang", "-O2", "-shared", "-fPIC", "-ffreestanding", "-fno-math-errno", "-march=native", "-x", "c", "-", "-o", lib],
                 input=src.encode(), check=True)
  fn = getattr(ctypes.CDLL(lib), name)
  return lambda *arrays, core_id: fn(*(ctypes.c_void_p(a.ctypes.data) for a in arrays), core_id)

@settings(max_examples=8, deadline=None)
@given(t=st.sampled_from([Q5_0, Q5_1]), rows=st.sampled_from([1, 2, 3, 9, 40]), out=st.sampled_from([1, 17, 50]),
       blocks=st.integers(1, 20), parts=st.sampled_from([1, 2, 3]), seed=st.integers(0, 2**16))
def test_q5_fifth_bits_spread_in_lanes_give_the_byte_paths_bits(t, rows, out, blocks, parts, seed):
  # Q5_0/Q5_1's fifth bits expanded in 32-bit lanes (AVX-512; quant_blocks._Q5_32) are the same 5-bit quants as the byte path
  # (_QH5) and meet the same fma: the kernels' products are the same bits, for any count of blocks (odd: a lone last block),
  # rows (decode tiles and tails; the tiled kernel past DECODE_MAX_M) and parts; and near the float64 product through tinygrad
  import tempfile
  from tinyhet.kernels import quant_blocks as qb
  cols = 32 * blocks
  got, want = product(t, rows, out, cols, parts, seed)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
  rng = np.random.default_rng(seed)
  b, x = random_blocks(out, cols, t, rng), rng.standard_normal((rows, cols), dtype=np.float32)
  byte_path = qb.Q5_SCALES[t] + qb.q5_dequant(*qb.Q5_DEQUANT_ARGS[t], bytes_only=True)
  assert byte_path != qmm.DEQUANT[t]
  res = []
  with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as mp:
    for dequant in (qmm.DEQUANT[t], byte_path):
      mp.setitem(qmm.DEQUANT, t, dequant)
      fn, o = native_kernel(*qmm.kernel_source.__wrapped__(t, rows, out, cols, parts), tmp), np.zeros((rows, out), np.float32)
      for core in range(parts): fn(o, b, x, core_id=core)
      res.append(o)
  np.testing.assert_array_equal(res[0], res[1])

@settings(max_examples=10, deadline=None)
@given(t=st.sampled_from(TYPES), rows=st.integers(1, 40), int8=st.booleans(), parts=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_the_kernels_weight_prefetch_changes_no_bit(t, rows, int8, parts, seed, tmp_path_factory):
  # the prefetch only asks for bytes ahead of the loads (past a part's rows, past the matrix: a hint, never a fault), so
  # the kernel built without it gives the same bits: the decode kernels (float, the int8 ones) and the tiled one, built as
  # bench qmm builds them (the same C, clang with tinygrad's flags) and called on the same arrays
  from bench.qmm import direct
  cols = cols_for(t)
  rng = np.random.default_rng(seed)
  b = random_blocks(48, cols, t, rng)
  x = rng.standard_normal((rows, cols), dtype=np.float32)
  tiled = None if int8 else rows > qmm.DECODE_MAX_M   # past a decode tile: the float tiled kernel (int8: its own choice)
  with_pf, without = (qmm.kernel_source(t, rows, 48, cols, 1, tiled, int8, prefetch=p) for p in (True, False))
  assert qmm.WEIGHT_PREFETCH > 0 and f"#define PF {qmm.WEIGHT_PREFETCH}\n" in with_pf[1] and "#define PF 0\n" in without[1]
  assert without[0] == with_pf[0] + "_nopf"
  tmp = str(tmp_path_factory.mktemp("prefetch"))
  outs = [np.full((rows, 48), np.nan, np.float32) for _ in range(2)]
  for out, p in zip(outs, (True, False)): direct(t, rows, 48, cols, int8, out, b, x, tmp, tiled, prefetch=p)()
  np.testing.assert_array_equal(outs[0], outs[1])
  np.testing.assert_allclose(outs[0], qmm.quant_matmul(Tensor(x, device="MESH"), Tensor(b, device="MESH"), t, (48, cols), parts, tiled,
                                                       int8=int8).numpy(), rtol=1e-6, atol=1e-6 * np.abs(outs[0]).max())
