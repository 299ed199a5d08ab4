"""bench qmm's baseline (bench/ggml_matmul.py): llama.cpp's ggml_mul_mat on the same blocks computes the same product, up to
its rounding of x to its vec_dot type, and refuses blocks whose size does not match the type."""
import numpy as np
import pytest
from tinyhet.kernels.quant_blocks import BF16, F16, Q4_K, Q5_0, Q6_K, Q8_0, NAMES, dequantize_reference, random_blocks

pytest.importorskip("llama_cpp")
from tinyhet.bench.ggml_matmul import GgmlMatmul  # noqa: E402

# x rounded to 8 bits (q8_K, q8_0) or to F16/BF16 by ggml: the bound on the relative error of the product
@pytest.mark.parametrize("t,tol", [(Q4_K, 3e-2), (Q6_K, 3e-2), (Q5_0, 3e-2), (Q8_0, 3e-2), (F16, 2e-3), (BF16, 1e-2)],
                         ids=lambda v: NAMES.get(v, str(v)) if isinstance(v, int) else str(v))
@pytest.mark.parametrize("rows", [1, 5])
def test_ggml_computes_the_same_product(t, tol, rows):
  rng = np.random.default_rng(t + rows)
  raw = random_blocks(48, 512, t, rng)
  x = rng.standard_normal((rows, 512), dtype=np.float32)
  w = dequantize_reference(raw, t, 512) if t != BF16 else (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(48, 512)
  want = x.astype(np.float64) @ w.astype(np.float64).T
  g = GgmlMatmul(raw, t, (48, 512), x)
  g()
  err = np.abs(g.result() - want).max() / np.abs(want).max()
  assert err < tol
  # and a product with other weights is far off: the comparison can fail
  assert np.abs(g.result() - x.astype(np.float64) @ np.roll(w, 1, 0).astype(np.float64).T).max() / np.abs(want).max() > 10 * tol

def test_blocks_of_the_wrong_size_are_refused():
  rng = np.random.default_rng(0)
  with pytest.raises(ValueError, match="bytes"):
    GgmlMatmul(random_blocks(16, 512, Q8_0, rng), Q4_K, (16, 512), np.zeros((1, 512), np.float32))
