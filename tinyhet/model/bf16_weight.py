"""bfloat16 weight matrices kept in their 2 bytes per weight, converted to float32 inside the kernels that read them.

Why not a tinygrad bfloat16 Tensor: tinygrad 0.14's CPU renderer declares a bfloat16 buffer as `__bf16*` (and converts with
`__builtin_bit_cast(__bf16, ...)`), a type clang accepts on x86 only from clang 15-17 on (Debian 12's clang 14 rejects it for
the `--target=x86_64-none-unknown-elf` tinygrad compiles for: "__bf16 is not supported on this target"), so any kernel that
touches a bfloat16 buffer fails to compile. A bfloat16 is the top half of a float32, so the bits are kept as uint16 and
widened exactly with an integer shift: float32 = bitcast(uint32(bits) << 16). That is exact and needs no bfloat16 type.

The class has PackedWeight's interface (blocks, shape, ggml_type, dequantize, rows), so the code paths that read packed
matrices (model.linear, the embedding lookup, layer_jit's captures) read it too. `blocks` is (rows, cols) uint16 holding
the file's bytes: its `.bitcast(dtypes.uint8)` is a free view of the same memory, (rows, 2 * cols) bytes, for a kernel
that wants bytes.
"""
from __future__ import annotations
import numpy as np
from tinygrad import Tensor, dtypes
from tinyhet.kernels.kv_quant import bf16_to_float, encode_bf16, round_to_bf16  # noqa: F401  (one definition: the KV's bfloat16 too)
from tinyhet.model.packed import PackedWeight

BF16 = 30   # GGML_TYPE_BF16

def float_to_bf16_bits(x) -> np.ndarray:
  """numpy float32 -> uint16 bfloat16 bits, rounded to nearest even (as torch and llama.cpp round); NaN stays NaN."""
  return np.where(np.isnan(np.asarray(x, np.float32)), np.uint16(0x7FC0), encode_bf16(x))

class BF16Weight(PackedWeight):
  """A matrix of bfloat16 weights: `blocks` is a uint16 Tensor (rows, cols) of their bits."""

  def __init__(self, blocks: Tensor, shape: tuple[int, int], ggml_type: int = BF16):   # PackedWeight.__init__ takes only block types: not called
    if ggml_type != BF16: raise ValueError(f"BF16Weight holds GGML type {BF16} (BF16), not {ggml_type}")
    if blocks.dtype == dtypes.uint8: blocks = blocks.bitcast(dtypes.uint16)
    if blocks.dtype not in (dtypes.uint16, dtypes.int16): raise ValueError(f"bfloat16 bits come as uint16 or bytes, not {blocks.dtype}")
    self.block_size, self.block_bytes, self.ggml_type, self.shape = 1, 2, BF16, tuple(shape)
    self.blocks = blocks.bitcast(dtypes.uint16).reshape(self.shape)
    self.dtype, self.device = dtypes.float32, blocks.device

  def dequantize(self, blocks: Tensor | None = None) -> Tensor:
    """float32 (rows, cols), lazy; `blocks` a gathered subset of rows (..., cols) of the bits."""
    return bf16_to_float(self.blocks if blocks is None else blocks)

  @staticmethod
  def from_float(x, device: str | None = None) -> BF16Weight:
    """A numpy float matrix rounded to bfloat16 (for tests and random weights)."""
    return BF16Weight(Tensor(float_to_bf16_bits(x), device=device), x.shape).realize()
