"""The KV cache's formats: which tinygrad dtype a pool of each holds, a block tile's length, and the 8-bit encodings (numpy
references, the tinygrad round trip a prefill attends with, the C the CPU kernels read and write them with). One place: the
pools (tinyhet/kv/paged_cache.py), the packers (kernels/kv_pack.py), the C kernels (kernels/cpu_attention.py) all ask here.

Formats (config.kv_dtype) and the pool dtype that stands for each (a pool's dtype names its format):
  float32, float16              the values                                  4, 2 bytes a value
  bfloat16                      dtypes.uint16: the values' bfloat16 bits (the top half of their float32, rounded to
                                nearest even), never a tinygrad bfloat16 tensor: tinygrad's CPU renderer declares those
                                `__bf16`, which clang < 17 rejects on x86 ("__bf16 is not supported on this target"). The
                                C kernels widen them by a 16-bit shift, as tinyhet/model/bf16_weight.py does for weights.
                                                                            2 bytes a value
  fp8_e4m3, fp8_e5m2            dtypes.fp8e4m3 / fp8e5m2: the OCP 8-bit floats, round to nearest even, saturating (a value
                                past 448 / 57344 is stored as +-448 / +-57344); per-tensor scale 1.0 (SGLang's default
                                without calibration): K, V are stored as they are. e4m3: 3 mantissa bits, normal from
                                2^-6, subnormal to 2^-9; e5m2: 2 mantissa bits, normal from 2^-14.     1 byte a value
  q8_0                          dtypes.int8: llama.cpp's q8_0 numbers: per 32 consecutive values of a head row (one token's
                                K or V of one kv head, head_dim values: 32 * g .. 32 * g + 31) a float16 scale
                                d = amax / 127 and 32 int8 q = roundf(x / d) (half away from zero), value = d * q.
                                34 bytes per 32 values: 34/64 of float16.
Tile layout (one kv head's K or V of one block; kernels/paged_attention.py has the pool around it): the float and fp8
tiles are block_size * head_dim values, K as (head_dim, block_size), V as (block_size, head_dim). A q8_0 tile is those
block_size * head_dim int8 q's in the same order, then block_size * head_dim / 32 float16 scales as (head_dim / 32,
block_size): scale[g, t] is token t's values 32 g .. 32 g + 31, so a 16-token slice's scales of one group are 32 contiguous
bytes (one vector load). A q8_0 tile is 17/16 of the values' bytes; its pool's last axis is tile_len (int8 elements).
"""
from __future__ import annotations
import numpy as np
from tinygrad import Tensor, dtypes
from tinygrad.dtype import DType

FORMATS: dict[str, DType] = {"float16": dtypes.float16, "float32": dtypes.float32, "bfloat16": dtypes.uint16,
                             "q8_0": dtypes.int8, "fp8_e4m3": dtypes.fp8e4m3, "fp8_e5m2": dtypes.fp8e5m2}
Q8 = 32        # values per q8_0 scale
FP8 = {dtypes.fp8e4m3: (4, 3, 7, 448.0), dtypes.fp8e5m2: (5, 2, 15, 57344.0)}   # exponent bits, mantissa bits, bias, largest

def kv_format(name: str | DType) -> DType:
  """The pool dtype of a kv_dtype name (or a pool dtype, returned as it is). One line naming the choices otherwise."""
  if isinstance(name, DType):
    if name in FORMATS.values(): return name
    raise ValueError(f"kv dtype {name} is not a KV format ({', '.join(FORMATS)})")
  if name not in FORMATS: raise ValueError(f"kv_dtype {name!r} is not one of {', '.join(FORMATS)}")
  return FORMATS[name]

def kv_name(fmt: DType) -> str:
  """The config name of a pool dtype (decode.info's kv_dtype)."""
  return next(n for n, d in FORMATS.items() if d == fmt)

def is_q8(fmt: DType) -> bool: return fmt == dtypes.int8
def is_8bit(fmt: DType) -> bool: return fmt in (dtypes.int8, dtypes.fp8e4m3, dtypes.fp8e5m2)
def is_bf16(fmt: DType) -> bool: return fmt == dtypes.uint16
def is_coded(fmt: DType) -> bool:
  """Whether tinyhet encodes this format's bytes itself (the 8-bit ones, bfloat16's bits): written by the C scatter and the
  host packers from float32, never by a tinygrad cast."""
  return is_8bit(fmt) or is_bf16(fmt)
def code_of(fmt: DType) -> DType | None:
  """The value-by-value code a host packer applies (fp8, bfloat16 bits), or None (a float pool, or q8_0: per 32 values)."""
  return fmt if is_coded(fmt) and not is_q8(fmt) else None

def tile_len(fmt: DType, block_size: int, head_dim: int) -> int:
  """A tile's length in pool elements: block_size * head_dim values, q8_0's scales after them."""
  if is_q8(fmt):
    if head_dim % Q8: raise ValueError(f"kv_dtype q8_0 needs head_dim a multiple of {Q8}, got {head_dim}")
    return block_size * head_dim + 2 * block_size * head_dim // Q8
  return block_size * head_dim

def block_size_of(fmt: DType, tile: int, head_dim: int) -> int:
  """The inverse of tile_len: tokens per block of a pool whose last axis is `tile`."""
  return tile * Q8 // (head_dim * (Q8 + 2)) if is_q8(fmt) else tile // head_dim

def row_bytes(fmt: DType, head_dim: int) -> float:
  """Bytes one token's K (or V) of one kv head costs: head_dim values, with q8_0's scales."""
  return head_dim * (Q8 + 2) / Q8 if is_q8(fmt) else head_dim * fmt.itemsize

def carrier(fmt: DType) -> DType:
  """The dtype a prefill's K, V are handed out in (on_layer): the format's own, float32 for the coded ones (values on
  their grid: a q8_0 float16 scale times an int8 needs 19 bits; fp8 is encoded here, not by tinygrad's cast, which
  flushes e4m3's subnormals to zero)."""
  return dtypes.float32 if is_coded(fmt) else fmt

def np_storage(fmt: DType):
  """The numpy dtype a pool's elements are read as on the host (fp8: their bytes; bfloat16: its bits, uint16), or None."""
  if fmt.fmt is not None: return np.dtype(fmt.fmt)
  return np.dtype(np.uint8) if is_8bit(fmt) else None

# ***** the round trip a prefill attends with *****

def round_kv(x: Tensor, fmt: DType) -> Tensor:
  """x (..., head_dim) float as the pool will hold it, in carrier(fmt): a cast, or for q8_0 quantized per 32 values and
  expanded back (float32), so the prefill attends to the numbers the decode node will read."""
  if is_bf16(fmt): return bf16_to_float(round_to_bf16(x))
  if not is_8bit(fmt): return x.cast(fmt)
  if not is_q8(fmt): return _on_grid(x.float(), *FP8[fmt][1:])
  shape = x.shape
  g = x.float().reshape(*shape[:-1], shape[-1] // Q8, Q8)
  d = g.abs().max(-1, keepdim=True) / 127.0
  q = (g * (d > 0).where(1.0 / d, 0.0)).round()
  return (q * _on_grid(d, 10, 15, 65504.0)).reshape(shape)   # the scale as float16 holds it (a cast there is folded away)

def round_to_bf16(x: Tensor) -> Tensor:
  """float Tensor -> uint16 bfloat16 bits, round to nearest even, by integer ops on its float32 bits (no bfloat16 type)."""
  u = x.float().bitcast(dtypes.uint32)
  return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).cast(dtypes.uint16)

def bf16_to_float(bits: Tensor) -> Tensor:
  """uint16 bfloat16 bits -> float32, exact: a 16-bit shift."""
  return (bits.cast(dtypes.uint32) << 16).bitcast(dtypes.float32)

def _on_grid(x: Tensor, M: int, bias: int, top: float) -> Tensor:
  # x rounded (half to even, saturating) to a float format of M mantissa bits and this bias, in float32: |x| to the step
  # 2^(max(exponent, 1 - bias) - M) of its binade
  a = x.abs().minimum(top)
  e = ((a.bitcast(dtypes.uint32) >> 23) & 0xff).cast(dtypes.int32).maximum(128 - bias) - M
  step = (e.cast(dtypes.uint32) << 23).bitcast(dtypes.float32)
  r = (a / step).round() * step
  return (x < 0).where(-r, r)

# ***** numpy references: q8_0 *****

def roundf(x: np.ndarray) -> np.ndarray:
  """C's roundf (half away from zero) of float32 values, exactly (the half added in float64)."""
  return (np.sign(x) * np.floor(np.abs(x.astype(np.float64)) + 0.5)).astype(np.float32)

def quantize_q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """x (..., n * 32) -> q (..., n * 32) int8, d (..., n) float16, as llama.cpp's quantize_row_q8_0_ref (float32 math)."""
  g = np.asarray(x, np.float32).reshape(*x.shape[:-1], -1, Q8)
  d = np.abs(g).max(-1) / np.float32(127.0)
  inv = np.divide(np.float32(1.0), d, out=np.zeros_like(d), where=d > 0)
  q = roundf(g * inv[..., None]).astype(np.int8)
  return q.reshape(x.shape), d.astype(np.float16)

def dequantize_q8_0(q: np.ndarray, d: np.ndarray) -> np.ndarray:
  """q (..., n * 32) int8, d (..., n) float16 -> float32 values d * q."""
  g = q.reshape(*q.shape[:-1], -1, Q8).astype(np.float32) * d.astype(np.float32)[..., None]
  return g.reshape(q.shape)

def pack_q8_0_host(k: np.ndarray, v: np.ndarray, out: np.ndarray) -> None:
  """kernels/kv_pack.py's pack_kv_host for a q8_0 pool: k, v (T, n_kv, head_dim) float -> out (nb, 2, n_kv, tile_len) int8
  (or its bytes), tokens 0..min(T, nb * block_size) - 1 quantized into the tiles, zeros past them."""
  nb, two, KV, X = out.shape
  T, KV2, D = k.shape
  BS = block_size_of(dtypes.int8, X, D)
  if two != 2 or KV2 != KV or X != tile_len(dtypes.int8, BS, D) or v.shape != k.shape:
    raise ValueError(f"pack_q8_0_host: k {k.shape}, v {v.shape} do not fit out {out.shape}")
  rows = min(T, nb * BS)
  full = np.zeros((nb * BS, KV, D), np.float32)
  o = out.view(np.int8)
  for i, x in enumerate((k, v)):
    full[:rows] = x[:rows]
    q, d = quantize_q8_0(full.reshape(nb, BS, KV, D))                       # (nb, t, h, D), (nb, t, h, D/32)
    q = q.transpose(0, 2, 3, 1) if i == 0 else q.transpose(0, 2, 1, 3)      # K (nb, h, d, t), V (nb, h, t, d)
    o[:, i, :, :BS * D] = q.reshape(nb, KV, BS * D)
    o[:, i, :, BS * D:] = np.ascontiguousarray(d.transpose(0, 2, 3, 1)).view(np.int8).reshape(nb, KV, -1)   # (nb, h, g, t)

def unpack_q8_0_host(blocks: np.ndarray, n_tokens: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
  """The inverse: (nb, 2, n_kv, tile_len) int8 blocks -> k, v (n_tokens, n_kv, head_dim) float32, dequantized."""
  nb, _, KV, X = blocks.shape
  D, BS = head_dim, block_size_of(dtypes.int8, X, head_dim)
  b = np.ascontiguousarray(blocks).view(np.int8)
  out = []
  for i in (0, 1):
    vals = b[:, i, :, :BS * D]
    q = vals.reshape(nb, KV, D, BS).transpose(0, 3, 1, 2) if i == 0 else vals.reshape(nb, KV, BS, D).transpose(0, 2, 1, 3)
    d = np.ascontiguousarray(b[:, i, :, BS * D:]).view(np.float16).reshape(nb, KV, D // Q8, BS).transpose(0, 3, 1, 2)
    out.append(dequantize_q8_0(np.ascontiguousarray(q), d).reshape(nb * BS, KV, D)[:n_tokens])
  return out[0], out[1]

# ***** numpy references: bfloat16 bits, fp8 *****

def encode_bf16(x: np.ndarray) -> np.ndarray:
  """float values -> their bfloat16 bits (uint16), round to nearest even (torch's and llama.cpp's rounding)."""
  u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
  return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)

def decode_bf16(b: np.ndarray) -> np.ndarray:
  """bfloat16 bits -> float32 values (exact)."""
  return (np.asarray(b, np.uint16).astype(np.uint32) << 16).view(np.float32)

def encode(x: np.ndarray, fmt: DType) -> np.ndarray:
  """code_of(fmt)'s encoding of float values: fp8 bytes or bfloat16 bits."""
  return encode_bf16(x) if is_bf16(fmt) else encode_fp8(x, fmt)

def decode(b: np.ndarray, fmt: DType) -> np.ndarray:
  return decode_bf16(b) if is_bf16(fmt) else decode_fp8(b, fmt)

def encode_fp8(x: np.ndarray, fmt: DType) -> np.ndarray:
  """float values -> their fp8 bytes (uint8): round to nearest even, saturating at the largest finite value; float64 math."""
  E, M, bias, top = FP8[fmt]
  a = np.minimum(np.abs(np.asarray(x, np.float64)), top)
  e = np.floor(np.log2(np.where(a > 0, a, 1.0)))
  e = np.maximum(e, 1 - bias)                                     # subnormals share the smallest normal exponent's step
  m = np.rint(a / 2.0 ** (e - M))                                 # 2^M .. 2^(M+1) for normals (2^(M+1): the next binade)
  code = np.where(a < 2.0 ** (1 - bias), m, (e + bias) * 2 ** M + m - 2 ** M)   # subnormal: m alone; normal: exponent, mantissa
  return (code.astype(np.uint32) | (np.signbit(np.asarray(x)) & (a > 0)) * 0x80).astype(np.uint8)

def decode_fp8(b: np.ndarray, fmt: DType) -> np.ndarray:
  """fp8 bytes -> float32 values."""
  E, M, bias, _ = FP8[fmt]
  b = np.asarray(b, np.uint8).astype(np.int64)
  e, m = (b >> M) & ((1 << E) - 1), b & ((1 << M) - 1)
  val = np.where(e == 0, m * 2.0 ** (1 - bias - M), (1 + m / 2 ** M) * 2.0 ** (e - bias))
  return np.where(b & 0x80, -val, val).astype(np.float32)

# ***** C: the CPU kernels' loads (kernels/cpu_attention.py) and the q8_0 scatter *****

C_LOADS = r"""
typedef unsigned char u8x16 __attribute__((vector_size(16)));
typedef signed char i8x16 __attribute__((vector_size(16)));
/* 2^n for n in float32's normal range, built from its bits: clang leaves ldexpf(x, n) a call into libm, and tinygrad's
   loader links such a call by a 32-bit PC-relative offset, which fails where the kernel's image lies over 2 GiB from libm */
static inline float pow2f(int n) { unsigned b = (unsigned)(n + 127) << 23; float f; __builtin_memcpy(&f, &b, 4); return f; }
/* the loads build float32 bits in integers (normals: exponent rebased, mantissa shifted under float32's; subnormals: the
   mantissa converted and scaled), never a float32 subnormal, which the kernels' flags flush to zero */
INLINE f32x16 ld_small(u32x16 em, int mbits, int bias) {   /* em: exponent and mantissa bits of a (1 + E + M)-bit float */
  u32x16 normal = (em << (23 - mbits)) + ((unsigned)(127 - bias) << 23);
  f32x16 sub = __builtin_convertvector(em, f32x16) * pow2f(1 - bias - mbits);
  u32x16 is_sub = (u32x16)(em < (1u << mbits)), is_zero = (u32x16)(em == 0u);
  return (f32x16)(((u32x16)sub & is_sub) | (normal & ~is_sub & ~is_zero));
}
/* 16 fp8 bytes -> 16 float32, exact (the e4m3 NaN byte 0x7f, never written, reads 480) */
INLINE f32x16 ld_fp8(const unsigned char *p, int mbits, int bias) {
  u8x16 b; __builtin_memcpy(&b, p, 16);
  u32x16 w = __builtin_convertvector(b, u32x16);
  return (f32x16)((u32x16)ld_small(w & 0x7fu, mbits, bias) | (w & 0x80u) << 24);
}
INLINE f32x16 ld_i8(const signed char *p) { i8x16 b; __builtin_memcpy(&b, p, 16); return __builtin_convertvector(b, f32x16); }
INLINE f32x16 ld_h(const unsigned short *p) {   /* 16 float16 -> float32, exact (normal and subnormal halves) */
  u16x16 h; __builtin_memcpy(&h, p, 32);
  u32x16 w = __builtin_convertvector(h, u32x16);
  return (f32x16)((u32x16)ld_small(w & 0x7fffu, 10, 15) | (w & 0x8000u) << 16);
}
"""

SCATTER = r"""
typedef unsigned long size_t;
#define KERNEL __attribute__((no_builtin("memset"), no_builtin("memcpy")))
#define R %(R)d
#define KVH %(KVH)d
#define D %(D)d
#define BS %(BS)d
#define CAP %(CAP)d
#define NBLK %(NBLK)d
#define KVB %(KVB)d
#if KVB == 3
#define X (BS * D + BS * D / 16)
#else
#define X (BS * D)
#endif
static inline unsigned short f2h(float f) {   /* float32 -> float16, round to nearest even (numpy's astype) */
  unsigned x; __builtin_memcpy(&x, &f, 4);
  unsigned s = (x >> 16) & 0x8000u, a = x & 0x7fffffffu;
  if (a >= 0x477ff000u) return s | 0x7c00u;                     /* rounds past 65504: inf */
  if (a < 0x38800000u) { float h = __builtin_rintf(__builtin_fabsf(f) * 0x1p24f); return s | (unsigned short)h; }
  a += 0xfffu + ((a >> 13) & 1u);
  return s | (unsigned short)((a - 0x38000000u) >> 13);
}
/* 2^n for n in float32's normal range, built from its bits: clang leaves ldexpf(x, n) a call into libm, and tinygrad's
   loader links such a call by a 32-bit PC-relative offset, which fails where the kernel's image lies over 2 GiB from libm */
static inline float pow2f(int n) { unsigned b = (unsigned)(n + 127) << 23; float f; __builtin_memcpy(&f, &b, 4); return f; }
/* float32 -> fp8 (M mantissa bits, bias): round to nearest even, saturating at top */
static inline unsigned char to_fp8(float x, int M, int bias, float top) {
  unsigned s = x < 0.0f ? 0x80u : 0u;
  float a = __builtin_fminf(__builtin_fabsf(x), top);
  if (a < pow2f(1 - bias)) return s | (unsigned char)__builtin_rintf(a * pow2f(bias - 1 + M));
  unsigned b; __builtin_memcpy(&b, &a, 4);
  b += (1u << (22 - M)) - 1u + ((b >> (23 - M)) & 1u);
  return s | (unsigned char)((b >> (23 - M)) - ((unsigned)(127 - bias) << M));
}
/* K, V (R, KVH, D) float32 of R tokens into their slots: token r at position pos[r] of block table row r; q8_0: quantized
   per 32 values (d = amax / 127, q = roundf(x / d): llama.cpp's quantize_row_q8_0_ref); fp8, bfloat16: value by value */
KERNEL void %(name)s(signed char *restrict pool, const float *restrict k, const float *restrict v, const int *restrict bt,
                     const int *restrict pos) {
  for (int r = 0; r < R; r++) {
    int p = pos[r], jb = p / BS, t = p %% BS;
    int blk = (unsigned)jb < (unsigned)CAP ? bt[(size_t)r * CAP + jb] : -1;
    if ((unsigned)blk >= (unsigned)NBLK) continue;                /* a bad id writes nothing */
    for (int kv = 0; kv < 2; kv++)
      for (int h = 0; h < KVH; h++) {
        const float *x = (kv ? v : k) + ((size_t)r * KVH + h) * D;
#if KVB == 2
        unsigned short *bits = (unsigned short *)pool + (((size_t)blk * 2 + kv) * KVH + h) * X;
        for (int dd = 0; dd < D; dd++) {   /* bfloat16: the float32 bits' top half, rounded to nearest even */
          unsigned b; __builtin_memcpy(&b, x + dd, 4);
          unsigned short q = (unsigned short)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
          if (kv) bits[t * D + dd] = q; else bits[dd * BS + t] = q;
        }
        continue;
#endif
        signed char *tile = pool + (((size_t)blk * 2 + kv) * KVH + h) * X;
#if KVB != 3
        for (int dd = 0; dd < D; dd++) {
          signed char q = (signed char)(KVB == 4 ? to_fp8(x[dd], 3, 7, 448.0f) : to_fp8(x[dd], 2, 15, 57344.0f));
          if (kv) tile[t * D + dd] = q; else tile[dd * BS + t] = q;
        }
        continue;
#endif
        unsigned short *sc = (unsigned short *)(tile + BS * D);
        for (int g = 0; g < D / 32; g++) {
          float amax = 0.0f;
          for (int i = 0; i < 32; i++) { float a = __builtin_fabsf(x[g * 32 + i]); amax = a > amax ? a : amax; }
          float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
          sc[g * BS + t] = f2h(d);
          for (int i = 0; i < 32; i++) {
            int dd = g * 32 + i;
            signed char q = (signed char)__builtin_roundf(x[dd] * id);
            if (kv) tile[t * D + dd] = q; else tile[dd * BS + t] = q;
          }
        }
      }
  }
}
"""
