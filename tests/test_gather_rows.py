"""The embedding lookup's C kernel (kernels/gather_rows.py, through tinyhet.model.packed.lookup on HET/MESH): tinygrad's own
indexing's result, bit for bit, for float16, bfloat16 bits, float32 and GGUF block tables, any index shape, negative indices
(from the end, once) and indices past the table (a zero row)."""
import numpy as np
from hypothesis import given, settings, strategies as st
import tinyhet  # noqa: F401  (MESH)
from tinygrad import Tensor
from tinyhet.model.packed import PackedWeight, lookup

@settings(max_examples=20, deadline=None)
@given(dtype=st.sampled_from([np.float16, np.float32, np.uint16, np.uint8]), rows=st.integers(1, 40), cols=st.integers(1, 150),
       shape=st.sampled_from([(1,), (5,), (2, 3), (16, 1)]), seed=st.integers(0, 2**16))
def test_lookup_equals_tinygrads_indexing(dtype, rows, cols, shape, seed):
  rng = np.random.default_rng(seed)
  table = (rng.standard_normal((rows, cols)) * 10).astype(dtype) if dtype in (np.float16, np.float32) else \
          rng.integers(0, np.iinfo(dtype).max, (rows, cols), dtype=dtype)
  idx = rng.integers(-rows - 3, rows + 3, shape).astype(np.int32)   # in range, negative, past either end
  t, i = Tensor(table, device="MESH"), Tensor(idx, device="MESH")
  got = lookup(t, i).numpy()
  assert got.shape == (*shape, cols) and got.dtype == table.dtype
  np.testing.assert_array_equal(got, t[i].numpy())
  wrapped = np.where(idx < 0, idx + rows, idx)
  inside = (wrapped >= 0) & (wrapped < rows)
  np.testing.assert_array_equal(got[inside], table[wrapped[inside]])
  assert not got[~inside].any()

def test_packed_rows_are_the_dequantized_rows():
  w = PackedWeight.random(64, 96, device="MESH")
  idx = Tensor(np.array([[0, 63, 5], [17, -1, 2]], np.int32), device="MESH")
  np.testing.assert_array_equal(w.rows(idx).numpy(), w.dequantize().numpy()[[[0, 63, 5], [17, 63, 2]]])
