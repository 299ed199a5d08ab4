"""The hand-written quantized matmul (kernels/quant_matmul.py) that HET on a CPU and MESH use for GGUF-block weights: the
float32 product with the dequantized weights for every block type and shape, the same bits whatever the part count, and
the linear layer of the model routed to it on the pool devices."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
import tinyhet  # noqa: F401  (MESH)
from tinygrad import Tensor
from tinyhet.kernels import quant_matmul as qmm
from tinyhet.model.packed import Q4_0, Q4_1, Q8_0, PackedWeight

@settings(max_examples=14, deadline=None)
@given(ggml_type=st.sampled_from([Q4_0, Q4_1, Q8_0]), rows=st.sampled_from([1, 2, 3, 5, 8, 17]), out=st.sampled_from([1, 16, 33, 100]),
       blocks=st.sampled_from([1, 3, 6]), parts=st.sampled_from([1, 2, 3, 5]), seed=st.integers(0, 2**16))
def test_equals_the_dequantized_float_product_for_any_part_count(ggml_type, rows, out, blocks, parts, seed):
  cols = 32 * blocks
  w = PackedWeight.random(out, cols, ggml_type, device="MESH")
  x = Tensor(np.random.default_rng(seed).standard_normal((rows, cols), dtype=np.float32), device="MESH")
  want = x.numpy().astype(np.float64) @ w.dequantize().numpy().astype(np.float64).T
  got = qmm.quant_matmul(x, w.blocks, ggml_type, w.shape, parts).numpy()
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
  # each output row is summed within one part, in one order: the split changes which core computes it, not its bits
  np.testing.assert_array_equal(qmm.quant_matmul(x, w.blocks, ggml_type, w.shape, 1).numpy(), got)

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
  assert not qmm.supported(12, 256) and not qmm.supported(Q4_1, 48)    # a K-quant; columns that are not whole blocks
  with pytest.raises(ValueError, match="no quantized matmul kernel"): qmm.kernel_source(12, 1, 32, 256, 1)

def test_the_model_uses_it_on_the_pool_devices_only():
  from tinygrad.engine.realize import runtime_cache
  from tinyhet.model.layers import linear
  w = PackedWeight.random(64, 64, Q4_1, device="MESH")
  linear(Tensor.randn(1, 64, device="MESH"), w).realize()
  assert any("qmatmul" in getattr(rt, "name", "") for rt in runtime_cache.values())
  before = len(runtime_cache)
  w_cpu = PackedWeight(w.blocks.to("CPU"), w.shape, Q4_1)
  linear(Tensor.randn(1, 64, device="CPU"), w_cpu).realize()           # tinygrad's own CPU device: its own kernels
  assert not any("qmatmul" in getattr(rt, "name", "") for rt in list(runtime_cache.values())[before:])

@pytest.mark.parametrize("ggml_type", [Q4_0, Q4_1, Q8_0])
def test_kernels_call_nothing_outside_themselves(ggml_type):
  # clang turned the accumulators' zero initializer into a call to memset for some shapes (one output row, a partial last
  # tile): tinygrad loads a kernel as a bare object, so the call's target was wherever the C library lay, and loading
  # failed whenever that was more than 2 GiB away (it depends on where the process's memory landed)
  from tinygrad import Device
  from tinygrad.runtime.support.elf import elf_loader
  for rows, out, cols, parts in [(5, 1, 32, 1), (9, 1, 32, 1), (16, 1, 32, 1), (40, 1, 32, 1), (1, 1536, 576, 2), (5, 48, 64, 3)]:
    _, src = qmm.kernel_source(ggml_type, rows, out, cols, parts)
    elf_loader(Device["MESH"].compiler.compile(src))   # raises on a relocation against a symbol it does not define
