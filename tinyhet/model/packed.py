"""GGUF-quantized weight matrices kept in their blocks (Q4_0, Q4_1, Q8_0, and any type tinygrad's GGUF reader knows), read
directly by the kernels that use them: the dequantization is a lazy expression that tinygrad fuses into the matmul, so a
decode step reads 4.5-8.5 bits per weight instead of 32 and no float copy of the weights exists.

Block layouts (ggml-common.h), 32 weights per block, little-endian:
  Q4_0  18 bytes: d (f16), 16 bytes of nibbles          w = (nibble - 8) * d
  Q4_1  20 bytes: d (f16), m (f16), 16 bytes of nibbles  w = nibble * d + m
  Q8_0  34 bytes: d (f16), 32 int8                       w = q * d
Weight j < 16 of a 4-bit block is the low nibble of byte j, weight 16 + j its high nibble.
"""
from __future__ import annotations
from tinygrad import Tensor, dtypes

Q4_0, Q4_1, Q8_0 = 2, 3, 8
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}

class PackedWeight:
  """A (rows, cols) matrix as GGUF blocks: `blocks` is a uint8 Tensor (rows, cols/block_size * block_bytes)."""

  def __init__(self, blocks: Tensor, shape: tuple[int, int], ggml_type: int):
    from tinygrad.llm.gguf import _GGML_QUANT
    if ggml_type not in _GGML_QUANT: raise ValueError(f"GGML type {ggml_type} is not a block-quantized type")
    self.block_size, self.block_bytes = _GGML_QUANT[ggml_type]
    rows, cols = shape
    if cols % self.block_size: raise ValueError(f"{cols} columns are not whole blocks of {self.block_size}")
    self.blocks, self.shape, self.ggml_type = blocks.reshape(rows, cols // self.block_size * self.block_bytes), (rows, cols), ggml_type
    self.dtype, self.device = dtypes.float32, blocks.device

  def nbytes(self) -> int: return self.blocks.nbytes()

  def realize(self) -> PackedWeight:
    self.blocks = self.blocks.contiguous().realize()
    return self

  def dequantize(self, blocks: Tensor | None = None) -> Tensor:
    """float32 (rows, cols), lazy: realize it for a float copy, or use it in an expression to dequantize inside that kernel.
    `blocks` defaults to all rows; pass a gathered subset (..., row bytes) for those rows."""
    b = self.blocks if blocks is None else blocks
    lead = b.shape[:-1]
    b = b.reshape(*lead, -1, self.block_bytes)                                # (..., blocks per row, block bytes)
    if self.ggml_type in (Q4_0, Q4_1):
      qs = b[..., 2 if self.ggml_type == Q4_0 else 4:]                       # (..., nb, 16)
      q = qs.bitwise_and(15).unsqueeze(-2).cat(qs.rshift(4).unsqueeze(-2), dim=-2).cast(dtypes.float32)   # (..., nb, 2, 16)
      d = _f16(b[..., 0:2]).reshape(*lead, -1, 1, 1)
      w = (q - 8) * d if self.ggml_type == Q4_0 else q * d + _f16(b[..., 2:4]).reshape(*lead, -1, 1, 1)
    elif self.ggml_type == Q8_0:
      w = b[..., 2:].bitcast(dtypes.int8).cast(dtypes.float32) * _f16(b[..., 0:2])   # (..., nb, 32)
    else:   # K-quants and the rest: tinygrad's own dequantizer, also lazy
      from tinygrad.llm.gguf import ggml_data_to_tensor
      n = self.shape[1] * (b.numel() // (self.shape[1] // self.block_size * self.block_bytes))
      return ggml_data_to_tensor(b.flatten(), n, self.ggml_type).reshape(*lead, self.shape[1])
    return w.reshape(*lead, self.shape[1])

  @staticmethod
  def random(rows: int, cols: int, ggml_type: int = Q4_0, device: str | None = None) -> PackedWeight:
    """Random blocks generated on `device` (nothing of the full size passes through the host): uniform quants, one scale per
    block chosen so the weights have mean 0 and variance 1/cols, as a fan-in-scaled initialization would."""
    import numpy as np
    if ggml_type not in BLOCK_BYTES: raise ValueError(f"random packed weights are Q4_0, Q4_1 or Q8_0, not GGML type {ggml_type}")
    levels = 256 if ggml_type == Q8_0 else 16
    d = 1 / np.sqrt((levels * levels - 1) / 12 * cols)                     # uniform integers on `levels` values: variance (L^2-1)/12
    header = [np.float16(d)] + ([np.float16(-(levels - 1) / 2 * d)] if ggml_type == Q4_1 else [])   # Q4_1's m centres the weights
    head = Tensor(np.array(header, np.float16).view(np.uint8), device=device)                        # (2 or 4,) bytes
    nb, qbytes = cols // 32, BLOCK_BYTES[ggml_type] - head.shape[0]
    q = Tensor.randint(rows, nb, qbytes, high=256, dtype=dtypes.int32, device=device).cast(dtypes.uint8)
    if ggml_type == Q8_0: q = (q.cast(dtypes.int32) - 128).cast(dtypes.int8).bitcast(dtypes.uint8)   # int8 centred on 0
    blocks = head.reshape(1, 1, -1).expand(rows, nb, head.shape[0]).cat(q, dim=-1)
    return PackedWeight(blocks, (rows, cols), ggml_type).realize()

  def rows(self, index: Tensor) -> Tensor:
    """Dequantized rows picked by an integer Tensor (an embedding lookup): (*index.shape, cols) float32."""
    return self.dequantize(lookup(self.blocks, index))

def lookup(table: Tensor, index: Tensor) -> Tensor:
  """table[index] for a (rows, ...) Tensor: on a device whose kernels run on the worker pool (HET on a CPU, MESH), one C
  kernel copying the rows' bytes (kernels/gather_rows.py); elsewhere tinygrad's own indexing."""
  from tinyhet.device.cpu_threads import pool_threads
  if not pool_threads(table.device): return table[index]
  from tinyhet.kernels.gather_rows import gather_rows
  row = table.shape[1:]
  got = gather_rows(table, index, table.nbytes() // table.shape[0])   # (*index.shape, row bytes) uint8
  return got if table.dtype == dtypes.uint8 else got.bitcast(table.dtype).reshape(*index.shape, *row)

def _f16(two_bytes: Tensor) -> Tensor:
  """(..., 2) little-endian bytes -> (..., 1) float32 of the float16 they hold."""
  return two_bytes.bitcast(dtypes.float16).cast(dtypes.float32)
