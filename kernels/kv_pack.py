"""Packing a prefilled layer's K, V into the paged pool's block layout (kernels/paged_attention.py), so that the bytes a
prefill node sends are exactly the bytes the decode node's blocks hold: packed block i goes to the sequence's i-th block."""
from __future__ import annotations
import numpy as np
from tinygrad import Tensor, dtypes
from tinygrad.device import Buffer
from tinygrad.dtype import DType
from tinyhet.kernels.kv_quant import decode, encode, is_coded, is_q8, np_storage, pack_q8_0_host, tile_len, unpack_q8_0_host

def pack_kv(k: Tensor, v: Tensor, block_size: int, dtype: DType | None = None) -> Tensor:
  """k, v: (T, n_kv, head_dim) for tokens 0..T-1 of one sequence -> (ceil(T / block_size), 2, n_kv, block_size * head_dim)
  in dtype (default k's dtype), tokens past T zero. Block i, K tile of head h holds element (t, d) at d * block_size + t;
  its V tile at t * head_dim + d. A q8_0 pool (dtype int8, kernels/kv_quant.py) is quantized on the host (numpy)."""
  T, KV, D = k.shape
  if v.shape != k.shape: raise ValueError(f"pack_kv: k {k.shape} and v {v.shape} differ")
  nb = -(-T // block_size)
  dtype = dtype or k.dtype
  if is_coded(dtype):   # 8-bit formats and bfloat16 bits are encoded on the host, by kernels/kv_quant.py's references
    out = np.zeros((nb, 2, KV, tile_len(dtype, block_size, D)), np_storage(dtype))
    if is_q8(dtype): pack_q8_0_host(k.float().numpy(), v.float().numpy(), out)
    else: pack_kv_host(encode(k.float().numpy(), dtype), encode(v.float().numpy(), dtype), out)
    return tensor_of_bytes(out, dtype, k.device)
  kp = k.cast(dtype).pad(((0, nb * block_size - T), None, None)).reshape(nb, block_size, KV, D)   # (nb, t, h, d)
  vp = v.cast(dtype).pad(((0, nb * block_size - T), None, None)).reshape(nb, block_size, KV, D)
  kt = kp.permute(0, 2, 3, 1).reshape(nb, KV, D * block_size)   # (nb, h, d, t)
  vt = vp.permute(0, 2, 1, 3).reshape(nb, KV, block_size * D)   # (nb, h, t, d)
  return Tensor.stack(kt, vt, dim=1).contiguous()

def unpack_kv(blocks: Tensor, n_tokens: int, head_dim: int) -> tuple[Tensor, Tensor]:
  """The inverse of pack_kv: (n_blocks, 2, n_kv, block_size * head_dim) -> k, v (n_tokens, n_kv, head_dim); q8_0 blocks
  dequantized on the host, float32."""
  if is_q8(blocks.dtype): return tuple(Tensor(x, device=blocks.device) for x in unpack_q8_0_host(blocks.numpy(), n_tokens, head_dim))
  if is_coded(blocks.dtype):
    plain = np.int16 if blocks.dtype.itemsize == 2 else np.uint8   # the same bytes under a dtype that is not a coded format
    raw = np.frombuffer(bytes(blocks.contiguous().realize().uop.buffer.as_memoryview()), plain).reshape(blocks.shape)   # no cast
    k, v = (decode(np.ascontiguousarray(x.numpy()).view(np_storage(blocks.dtype)), blocks.dtype) for x in unpack_kv(Tensor(raw), n_tokens, head_dim))
    return Tensor(k, device=blocks.device), Tensor(v, device=blocks.device)
  nb, _, KV, X = blocks.shape
  bs = X // head_dim
  k = blocks[:, 0].reshape(nb, KV, head_dim, bs).permute(0, 3, 1, 2).reshape(nb * bs, KV, head_dim)[:n_tokens]
  v = blocks[:, 1].reshape(nb, KV, bs, head_dim).permute(0, 2, 1, 3).reshape(nb * bs, KV, head_dim)[:n_tokens]
  return k, v

def pack_kv_host(k, v, out, q8: bool = False, code=None) -> None:
  """pack_kv on the host with numpy: k, v (T, n_kv, head_dim) arrays -> out (nb, 2, n_kv, block_size * head_dim), any view
  whose last axis is contiguous; the bytes pack_kv gives for tokens 0..min(T, nb * block_size) - 1, zeros past them. numpy
  releases the GIL while it copies, so a writer thread packs a layer while the prefill thread computes the next one
  (tinygrad's pack_kv costs a schedule and a kernel launch on the prefill thread: ~3-20 ms a layer here). q8: out is a
  q8_0 pool's (int8 or its bytes), k, v float: quantized (kernels/kv_quant.py). code: an fp8 or bfloat16-bits pool's dtype
  (kernels/kv_quant.py code_of), k, v float: encoded value by value."""
  if q8: return pack_q8_0_host(k, v, out)    # a q8_0 pool: quantized into its tiles
  if code is not None: k, v = encode(k, code), encode(v, code)   # an fp8 pool (its bytes) or bfloat16 bits: k, v float, encoded
  nb, two, KV, X = out.shape
  T, KV2, D = k.shape
  if two != 2 or KV2 != KV or X % D or v.shape != k.shape: raise ValueError(f"pack_kv_host: k {k.shape}, v {v.shape} do not fit out {out.shape}")
  BS = X // D
  rows = min(T, nb * BS)
  full = rows // BS
  # K tiles are (d, t), V tiles (t, d): reshape(copy=False) raises rather than write into a copy
  np.reshape(out[:full, 0], (full, KV, D, BS), copy=False)[...] = k[:full * BS].reshape(full, BS, KV, D).transpose(0, 2, 3, 1)
  np.reshape(out[:full, 1], (full, KV, BS, D), copy=False)[...] = v[:full * BS].reshape(full, BS, KV, D).transpose(0, 2, 1, 3)
  if full < nb:
    out[full:] = 0
    if (r := rows - full * BS):
      np.reshape(out[full, 0], (KV, D, BS), copy=False)[:, :, :r] = k[full * BS:rows].transpose(1, 2, 0)
      np.reshape(out[full, 1], (KV, BS, D), copy=False)[:, :r] = v[full * BS:rows].transpose(1, 0, 2)

def tensor_of_bytes(a, dtype: DType, device: str) -> Tensor:
  """A realized tensor of dtype holding a's bytes as they are: tinygrad's bitcast to an fp8 dtype goes through float32
  and flushes e4m3's subnormals, so an 8-bit pool's bytes are copied in, never cast."""
  t = Tensor.empty(*a.shape, dtype=dtype, device=device)
  data = memoryview(np.ascontiguousarray(a)).cast("B")
  t.uop.buffer.ensure_allocated().copy_from(Buffer("PYTHON", len(data), dtypes.uint8, opaque=data))
  return t
