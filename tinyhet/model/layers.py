"""The pieces of the Llama forward pass (tinyhet.model.llama), each a function of tensors: RoPE, RMSNorm, the linear layer
(dispatching a weight to the kernel for its stored form) and grouped-query attention. Shapes in each docstring."""
from __future__ import annotations
import math, os
import numpy as np
from tinygrad import Tensor, dtypes
from tinyhet.device.cpu_threads import pool_threads
from tinyhet.kernels import quant_blocks, quant_matmul as qmm
from tinyhet.model.packed import PackedWeight

Matrix = Tensor | PackedWeight   # a weight matrix: float (any dtype), GGUF blocks, or bfloat16 bits (BF16Weight, a PackedWeight)

def rope_frequencies(cfg) -> np.ndarray:
  """(head_dim/2,) float64 rotation frequencies of a LlamaConfig, with Llama 3.1's scaling: long wavelengths slowed by `factor`, short ones
  kept, a smooth blend between."""
  freqs = 1.0 / cfg.rope_theta ** (np.arange(0, cfg.head_dim, 2, dtype=np.float64) / cfg.head_dim)
  if cfg.rope_freq_factors is not None: return freqs / np.asarray(cfg.rope_freq_factors, dtype=np.float64)
  if (s := cfg.rope_scaling) is None: return freqs
  wavelen = 2 * math.pi / freqs
  smooth = (s.original_max_context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
  blended = (1 - smooth) * freqs / s.factor + smooth * freqs
  return np.where(wavelen < s.original_max_context / s.high_freq_factor, freqs,
                  np.where(wavelen > s.original_max_context / s.low_freq_factor, freqs / s.factor, blended))

def rope_tables(cfg, max_context: int, device: str | None) -> tuple[Tensor, Tensor]:
  """cos and sin of position * frequency, each (max_context, head_dim/2) float32, computed in float64 on the host."""
  angles = np.outer(np.arange(max_context, dtype=np.float64), rope_frequencies(cfg))
  return (Tensor(np.cos(angles).astype(np.float32), device=device).realize(), Tensor(np.sin(angles).astype(np.float32), device=device).realize())

def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
  """x: (B, T, heads, head_dim); cos, sin: (B, T, head_dim/2). Rotates each interleaved pair (x[2i], x[2i+1]) by its angle."""
  B, T, H, D = x.shape
  pairs = x.reshape(B, T, H, D // 2, 2)
  x0, x1 = pairs[..., 0], pairs[..., 1]                                   # (B, T, H, D/2)
  c, s = cos.reshape(B, T, 1, D // 2), sin.reshape(B, T, 1, D // 2)
  return (x0 * c - x1 * s).stack(x0 * s + x1 * c, dim=-1).reshape(B, T, H, D)

def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
  return x * (x.square().mean(-1, keepdim=True) + eps).rsqrt() * weight.float()

MATVEC_LANES, MATVEC_MAX_ROWS = 8, 8

def stored_format(w: Matrix) -> int | None:
  """The GGML type the matmul kernels (kernels/quant_matmul.py) read `w` as: its blocks' type, F16 or BF16 for a float16 or
  bfloat16 matrix; None where they have no kernel for it (float32, other block types, columns that are not whole blocks)."""
  t = w.ggml_type if isinstance(w, PackedWeight) else _FLOAT_TYPES.get(w.dtype)
  return t if t is not None and len(w.shape) == 2 and quant_blocks.supported(t, w.shape[1]) else None

_FLOAT_TYPES = {dtypes.float16: quant_blocks.F16, dtypes.bfloat16: quant_blocks.BF16}

def int8_activations() -> bool:
  """The int8-activation mode (off by default; TINYHET_INT8_ACTIVATIONS=1, `tinyhet run --int8-activations`): x rounded to int8
  per block (kernels/quant_matmul.py says which) and integer dot products (VNNI where the CPU has it) against block-quantized
  weights, as llama.cpp does, in decode, batches and prefill; bfloat16 weights from 4 rows with x rounded to bfloat16; float16
  weights stay float32. Read when a kernel is chosen:
  a captured step keeps the mode it was captured in."""
  return os.environ.get("TINYHET_INT8_ACTIVATIONS", "0") not in ("", "0")

def linear(x: Tensor, w: Matrix) -> Tensor:
  """x (..., in) @ w.T with w (out, in) in its stored dtype or blocks; the sum is float32.
  On HET (a CPU) and MESH, a weight in a form the hand-written kernels read (GGUF blocks Q4_0/1, Q5_0/1, Q8_0, Q4_K, Q5_K,
  Q6_K; float16; bfloat16) goes to them, for any number of rows (decode and prefill). Elsewhere, for a few rows, the sum over
  `in` is written as MATVEC_LANES interleaved partial sums added at the end: tinygrad's CPU code then has that many
  independent accumulator chains instead of one serial chain of dependent adds (measured 2-5x faster on matrix-vector products)."""
  rows = math.prod(x.shape[:-1])
  if (t := stored_format(w)) is not None and (threads := pool_threads(x.device)):
    return qmm.quant_matmul(x, w.blocks if isinstance(w, PackedWeight) else w, t, w.shape, threads, int8=int8_activations())
  if isinstance(w, PackedWeight):
    # a few rows: dequantized inside the matmul kernel, reading only the blocks; many rows (prefill): dequantized once into a
    # temporary float32 copy, since inside the matmul every block would be dequantized again for each tile of rows. bfloat16
    # widens with one shift (tinyhet.model.bf16_weight), cheap enough to repeat per tile: no copy
    w = w.dequantize() if rows <= MATVEC_MAX_ROWS or w.block_size == 1 else w.dequantize().contiguous()
  O, K = w.shape
  if rows <= MATVEC_MAX_ROWS and K % MATVEC_LANES == 0:
    xs = x.reshape(*x.shape[:-1], 1, K // MATVEC_LANES, MATVEC_LANES)                # (..., 1, K/L, L)
    return (xs * w.reshape(O, K // MATVEC_LANES, MATVEC_LANES)).sum(-2, dtype=dtypes.float32).sum(-1)   # (..., O)
  return x.matmul(w.T, dtype=dtypes.float32)

def attention(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor) -> Tensor:
  """Grouped-query attention. q: (B, T, n_heads, D); k, v: (B, S, n_kv_heads, D) float32; allowed: (B, T, S) bool, which keys
  each query may see. Query head h reads KV head h // (n_heads / n_kv_heads). Returns (B, T, n_heads, D) float32."""
  B, T, H, D = q.shape
  S, KVH = k.shape[1], k.shape[2]
  G = H // KVH
  qg = q.reshape(B, T, KVH, G, D).permute(0, 2, 3, 1, 4)                   # (B, KVH, G, T, D)
  kt = k.permute(0, 2, 3, 1).reshape(B, KVH, 1, D, S)                      # (B, KVH, 1, D, S)
  vg = v.permute(0, 2, 1, 3).reshape(B, KVH, 1, S, D)                      # (B, KVH, 1, S, D)
  scores = (qg @ kt) * (1.0 / math.sqrt(D))                                # (B, KVH, G, T, S)
  scores = allowed.reshape(B, 1, 1, T, S).where(scores, -math.inf)
  # realized probabilities: fused into the next matmul, softmax's exp would be recomputed for every output element
  out = scores.softmax(-1).contiguous() @ vg                               # (B, KVH, G, T, D)
  return out.permute(0, 3, 1, 2, 4).reshape(B, T, H, D)
