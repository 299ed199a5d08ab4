"""The weight formats the matmul kernels read (kernels/quant_matmul.py), each as a C snippet that turns 32 weights of a
stored block into two 16-lane float32 vectors, and random blocks of each for tests and benchmarks.

Layouts (ggml-common.h), little-endian. A stored block holds QB weights (32, or 256 for the K-quants' super-blocks); the
kernels walk it in sub-blocks of 32 weights, j = 0 .. QB/32-1, and `dequant(b, j, &lo, &hi)` gives weights 32j..32j+15 in
lo and 32j+16..32j+31 in hi, in the order of x's columns:
  Q4_0   18 B: d, 16 B nibbles                       w = (q - 8) d          (q = low nibble of byte i, high of byte i-16)
  Q4_1   20 B: d, m, 16 B nibbles                    w = q d + m
  Q5_0   22 B: d, qh (32 bits), 16 B nibbles         w = (q | bit i of qh << 4) - 16) d
  Q5_1   24 B: d, m, qh, 16 B nibbles                w = (q | bit i of qh << 4) d + m
  Q8_0   34 B: d, 32 int8                            w = q d
  Q4_K  144 B: d, dmin, 12 B of 6-bit scales and mins (8 each), 128 B nibbles; sub-block j: bytes 32(j/2).., nibble j&1,
               w = q d sc_j - dmin m_j
  Q5_K  176 B: d, dmin, 12 B scales/mins, 32 B qh (bit j of byte i: the fifth bit of sub-block j's weight i), 128 B nibbles
  Q6_K  210 B: 128 B low nibbles, 64 B of 2-bit highs, 16 int8 scales (one per 16 weights), d (at the end);
               w = (q - 32) d sc
  F16, BF16: 2 bytes a weight (a "block" of 32 weights is 64 bytes of the row)
d, m, dmin are float16. The K-quants' scale bytes are unpacked exactly as ggml's get_scale_min_k4.
"""
from __future__ import annotations
import numpy as np

F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = 1, 2, 3, 6, 7, 8, 12, 13, 14, 30
NAMES = {F16: "F16", Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1", Q8_0: "Q8_0", Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K",
         BF16: "BF16"}
# weights per stored block, bytes per stored block
LAYOUT = {F16: (32, 64), BF16: (32, 64), Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22), Q5_1: (32, 24), Q8_0: (32, 34),
          Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210)}
FLOAT_TYPES = (F16, BF16)
# where each type keeps its float16 scales (byte offsets in the block): random blocks get finite, small ones there
_SCALES = {Q4_0: (0,), Q4_1: (0, 2), Q5_0: (0,), Q5_1: (0, 2), Q8_0: (0,), Q4_K: (0, 2), Q5_K: (0, 2), Q6_K: (208,)}

# The fifth bits of Q5_0/Q5_1 (one 32-bit word, bit i for weight i) as bytes 0 or 16 (each byte of qh spread over 8 lanes and
# tested against its lane's bit, as llama.cpp's bytes_from_bits_32; in place of 32 lanes of 32-bit shifts): q0 holds weights
# 0-15, q1 16-31, as unsigned 5-bit quants
_QH5 = """  u32 qh; __builtin_memcpy(&qh, b + %(qh)d, 4); u8x16 q; __builtin_memcpy(&q, b + %(qs)d, 16);
  const u8x16 BIT = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
  const u8x16 hv = (u8x16)((u32x4){0} + qh);
  const u8x16 h0 = __builtin_shufflevector(hv, hv, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  const u8x16 h1 = __builtin_shufflevector(hv, hv, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  u8x16 q0 = (q & 15) | ((u8x16)((h0 & BIT) != 0) & 16), q1 = (q >> 4) | ((u8x16)((h1 & BIT) != 0) & 16);"""

# The float kernels' Q5_0/Q5_1 with AVX-512: the 16 quant bytes zero-extended to 32-bit lanes once (one vpmovzxbd for both
# nibbles: low & 15, high >> 4) and each fifth bit shifted into place from the qh word broadcast to all lanes (lane i of the
# low half: (qh << 4) >> i, of the high half: (qh >> 12) >> i, then & 16: variable shifts, no byte shuffles or compares).
# The same 5-bit quants as _QH5's, so the same fma and the same bits. Why: at one row of x the decode kernel is bound by its
# dequantization's vector ops, not by memory (a SmolLM2 576-column matrix is in L2), and the byte path's shuffles, byte tests
# and two zero-extensions per sub-block sat on the one shuffle port. Measured (unpublished, shared cores, one thread, bench
# qmm's ctypes call, old and new kernel alternately, medians of 15 x 200 calls): 1.20-1.24x at one row, 1.15-1.19x at two, on
# 1536 x 576 and 576 x 1536, bit-equal; Q5_0 still ~1.2x Q4_1's time there. A mask from the bits (vptestmd against
# {1 << i}) measured a little slower than the shifts. Other targets keep the byte path (not measured there).
_Q5_32 = """  u32 qh; __builtin_memcpy(&qh, b + %(qh)d, 4); u8x16 q; __builtin_memcpy(&q, b + %(qs)d, 16);
  typedef int s32x16 __attribute__((vector_size(64)));
  const u32x16 LANE = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const u32x16 v = __builtin_convertvector(q, u32x16), hb = (u32x16){0} + qh;
  const s32x16 q0 = (s32x16)((v & 15) | (((hb << 4) >> LANE) & 16)), q1 = (s32x16)((v >> 4) | (((hb >> 12) >> LANE) & 16));"""

def q5_dequant(qh: int, qs: int, affine: str, bytes_only: bool = False) -> str:
  """Q5_0/Q5_1's float dequantization (qh, qs: byte offsets in the block): w = q * <affine> (Q5_0's (q - 16) d as one fma
  where there is one: the same bits); the 32-bit-lane expansion with AVX-512, else (or with bytes_only: the tests' reference
  for the same bits) the byte path."""
  tail = f"""
  *lo = __builtin_convertvector(q0, f32x16) * {affine}; *hi = __builtin_convertvector(q1, f32x16) * {affine};"""
  byte_path = _QH5 % {"qh": qh, "qs": qs} + tail
  return byte_path if bytes_only else "#if defined(__AVX512F__)\n" + _Q5_32 % {"qh": qh, "qs": qs} + tail + "\n#else\n" + byte_path + "\n#endif"
Q5_DEQUANT_ARGS = {Q5_0: (2, 6, "d + -16.0f * d"), Q5_1: (4, 8, "d + m")}   # Q5_0 and Q5_1's q5_dequant arguments
Q5_SCALES = {Q5_0: "  float d = h2f(b);\n", Q5_1: "  float d = h2f(b), m = h2f(b + 2);\n"}

# The K-quants' 6-bit scale and min of sub-block j (ggml's get_scale_min_k4; j is a constant in each unrolled copy)
_SCALE_MIN_K4 = """  const u8 *s = b + 4; int sc, mn;
  if (j < 4) { sc = s[j] & 63; mn = s[j + 4] & 63; }
  else { sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4); mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4); }
  float d = h2f(b) * (float)sc, m = h2f(b + 2) * (float)mn;"""

# sub-block j's 32 quants of a Q4_K / Q5_K super-block as two 16-lane byte vectors q0, q1 (Q5_K: the fifth bit added from qh)
_Q4K = """
  u8x16 q0, q1; __builtin_memcpy(&q0, b + 16 + 32 * (j / 2), 16); __builtin_memcpy(&q1, b + 32 + 32 * (j / 2), 16);
  if (j & 1) { q0 >>= 4; q1 >>= 4; } else { q0 &= 15; q1 &= 15; }"""
_Q5K = """
  u8x16 q0, q1, h0, h1;
  __builtin_memcpy(&q0, b + 48 + 32 * (j / 2), 16); __builtin_memcpy(&q1, b + 64 + 32 * (j / 2), 16);
  __builtin_memcpy(&h0, b + 16, 16); __builtin_memcpy(&h1, b + 32, 16);
  if (j & 1) { q0 >>= 4; q1 >>= 4; } else { q0 &= 15; q1 &= 15; }
  q0 |= ((h0 >> j) & 1) << 4; q1 |= ((h1 >> j) & 1) << 4;"""

# Q6_K: a half-block j of 16 weights' low 4 bits (l0, l1) and high 2 bits (h0, h1), its two int8 scales sc[0..1], d
_Q6K = """  const int n = j >> 2, k = j & 3;
  const u8 *ql = b + 64 * n + (k & 1) * 32, *qh = b + 128 + 32 * n;
  const signed char *sc = (const signed char *)(b + 192) + 8 * n + 2 * k;
  float d = h2f(b + 208);
  u8x16 l0, l1, h0, h1; __builtin_memcpy(&l0, ql, 16); __builtin_memcpy(&l1, ql + 16, 16);
  __builtin_memcpy(&h0, qh, 16); __builtin_memcpy(&h1, qh + 16, 16);
  if (k >> 1) { l0 >>= 4; l1 >>= 4; } else { l0 &= 15; l1 &= 15; }"""

DEQUANT = {
  Q4_0: """  float d = h2f(b); u8x16 q; __builtin_memcpy(&q, b + 2, 16);
  *lo = (__builtin_convertvector(q & 15, f32x16) - 8.0f) * d; *hi = (__builtin_convertvector(q >> 4, f32x16) - 8.0f) * d;""",
  Q4_1: """  float d = h2f(b), m = h2f(b + 2); u8x16 q; __builtin_memcpy(&q, b + 4, 16);
  *lo = __builtin_convertvector(q & 15, f32x16) * d + m; *hi = __builtin_convertvector(q >> 4, f32x16) * d + m;""",
  Q5_0: Q5_SCALES[Q5_0] + q5_dequant(*Q5_DEQUANT_ARGS[Q5_0]),
  Q5_1: Q5_SCALES[Q5_1] + q5_dequant(*Q5_DEQUANT_ARGS[Q5_1]),
  Q8_0: """  float d = h2f(b); i8x16 q0, q1; __builtin_memcpy(&q0, b + 2, 16); __builtin_memcpy(&q1, b + 18, 16);
  *lo = __builtin_convertvector(q0, f32x16) * d; *hi = __builtin_convertvector(q1, f32x16) * d;""",
  Q4_K: _SCALE_MIN_K4 + _Q4K + """
  *lo = __builtin_convertvector(q0, f32x16) * d - m; *hi = __builtin_convertvector(q1, f32x16) * d - m;""",
  Q5_K: _SCALE_MIN_K4 + _Q5K + """
  *lo = __builtin_convertvector(q0, f32x16) * d - m; *hi = __builtin_convertvector(q1, f32x16) * d - m;""",
  Q6_K: _Q6K + """
  i8x16 v0 = (i8x16)(l0 | ((h0 >> (2 * k)) & 3) << 4) - 32, v1 = (i8x16)(l1 | ((h1 >> (2 * k)) & 3) << 4) - 32;
  *lo = __builtin_convertvector(v0, f32x16) * (d * sc[0]); *hi = __builtin_convertvector(v1, f32x16) * (d * sc[1]);""",
  F16: """  *lo = h2f16(b); *hi = h2f16(b + 32);""",
  BF16: """  u16x16 h0, h1; __builtin_memcpy(&h0, b, 32); __builtin_memcpy(&h1, b + 32, 32);
  *lo = (f32x16)(__builtin_convertvector(h0, u32x16) << 16); *hi = (f32x16)(__builtin_convertvector(h1, u32x16) << 16);""",
}

def supported(ggml_type: int, cols: int) -> bool:
  return ggml_type in DEQUANT and cols % LAYOUT[ggml_type][0] == 0

def row_bytes(ggml_type: int, cols: int) -> int:
  qb, bb = LAYOUT[ggml_type]
  return cols // qb * bb

def random_blocks(rows: int, cols: int, ggml_type: int, rng: np.random.Generator) -> np.ndarray:
  """(rows, row bytes) uint8 of random blocks: random quants, scales and mins, with each float16 scale finite and of a size
  that keeps the weights near 1/sqrt(cols) (float types: normal values of that size)."""
  if not supported(ggml_type, cols): raise ValueError(f"{cols} columns are not whole blocks of GGML type {ggml_type}")
  if ggml_type in FLOAT_TYPES:
    w = (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)
    if ggml_type == F16: return w.astype(np.float16).view(np.uint8).reshape(rows, -1)
    return (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(rows, -1)   # bfloat16 by truncation
  qb, bb = LAYOUT[ggml_type]
  b = rng.integers(0, 256, (rows, cols // qb, bb), dtype=np.uint8)
  levels = {Q4_K: 16 * 63, Q5_K: 32 * 63, Q6_K: 32 * 127, Q8_0: 128, Q5_0: 16, Q5_1: 32, Q4_1: 16}.get(ggml_type, 8)
  for off in _SCALES[ggml_type]:
    d = rng.uniform(0.2, 1.0, b.shape[:2]) / (levels * np.sqrt(cols))
    b[..., off:off + 2] = d.astype(np.float16).reshape(*b.shape[:2], 1).view(np.uint8)
  return b.reshape(rows, -1)

def dequantize_reference(blocks: np.ndarray, ggml_type: int, cols: int) -> np.ndarray:
  """float32 (rows, cols) by the gguf package's own dequantizer (independent of these kernels; tests and the benchmark only)."""
  from gguf.quants import dequantize
  from gguf import GGMLQuantizationType
  if ggml_type == F16: return blocks.view(np.float16).astype(np.float32).reshape(-1, cols)
  return dequantize(blocks, GGMLQuantizationType(ggml_type)).astype(np.float32).reshape(-1, cols)

# The int8-activation kernels (quant_matmul's int8 mode) read sub-block j as 32 unsigned quants q (in x's order) and, for each
# half of 16 weights, a scale s and an offset m with w = s q + m: the dot product with x rounded to int8 per block is then
# integer (u8 x s8, VNNI's vpdpbusd), scaled once per half. The signed types are shifted to unsigned and the shift goes to m.
_QH5_U8 = _QH5 + """
  u8x16 a = q0, c = q1;"""
_KQ_SCALES = """
  *s0 = *s1 = d; *m0 = *m1 = -m;"""
QUANTS = {
  Q4_0: """  float d = h2f(b); u8x16 q; __builtin_memcpy(&q, b + 2, 16);
  *q32 = cat16(q & 15, q >> 4); *s0 = *s1 = d; *m0 = *m1 = -8.0f * d;""",
  Q4_1: """  float d = h2f(b), m = h2f(b + 2); u8x16 q; __builtin_memcpy(&q, b + 4, 16);
  *q32 = cat16(q & 15, q >> 4); *s0 = *s1 = d; *m0 = *m1 = m;""",
  Q5_0: "  float d = h2f(b);\n" + _QH5_U8 % {"qh": 2, "qs": 6} + """
  *q32 = cat16(a, c); *s0 = *s1 = d; *m0 = *m1 = -16.0f * d;""",
  Q5_1: "  float d = h2f(b), m = h2f(b + 2);\n" + _QH5_U8 % {"qh": 4, "qs": 8} + """
  *q32 = cat16(a, c); *s0 = *s1 = d; *m0 = *m1 = m;""",
  Q8_0: """  float d = h2f(b); u8x16 a, c; __builtin_memcpy(&a, b + 2, 16); __builtin_memcpy(&c, b + 18, 16);
  *q32 = cat16(a ^ 0x80, c ^ 0x80); *s0 = *s1 = d; *m0 = *m1 = -128.0f * d;""",
  Q4_K: _SCALE_MIN_K4 + _Q4K + """
  *q32 = cat16(q0, q1);""" + _KQ_SCALES,
  Q5_K: _SCALE_MIN_K4 + _Q5K + """
  *q32 = cat16(q0, q1);""" + _KQ_SCALES,
  Q6_K: _Q6K + """
  *q32 = cat16(l0 | ((h0 >> (2 * k)) & 3) << 4, l1 | ((h1 >> (2 * k)) & 3) << 4);
  *s0 = d * sc[0]; *s1 = d * sc[1]; *m0 = -32.0f * *s0; *m1 = -32.0f * *s1;""",
}

def supported_int8(ggml_type: int, cols: int) -> bool:
  """The int8-activation kernel pairs sub-blocks: block types only (not F16/BF16), an even count of 32-weight sub-blocks."""
  return ggml_type in QUANTS and supported(ggml_type, cols) and cols % 64 == 0
