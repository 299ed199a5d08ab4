"""The int8-activation decode kernel for the K-quants (Q4_K, Q5_K, Q6_K), as llama.cpp computes them: x rounded to int8 per
super-block of 256 with one scale (llama.cpp's q8_K), so a whole super-block's integer dot products (u8 x s8) are summed as
integers with the sub-blocks' integer scales, and one float multiply-add per super-block and row turns them into the result.
With AVX-512BW the products and the scaling are vpmaddubsw + vpmaddwd (as llama.cpp's AVX2 code, at 64 bytes); a first
version with vpdpbusd (VNNI) and a 32-bit multiply by the scales (vpmulld) was slower on Zen 4 (1 row of 1536 x 1536: 0.24
against 0.14 ms); without AVX-512BW, dot4 (VNNI or a widening sum) and a 32-bit multiply. C, included by
kernels/quant_matmul.py's source in its int8 mode (INT8 == 2), where dot4, the vector types and the tile shape (MT) are defined.

Per super-block of W and row of x:
  Q4_K/Q5_K  w = d sc_j q - dmin m_j:  d dx sum_j sc_j (q_j . xq_j)  -  dmin dx sum_j m_j sum(xq_j)     (j: 8 sub-blocks of 32)
  Q6_K       w = d sc_g (q - 32):      d dx sum_g sc_g (q_g . xq_g - 32 sum(xq_g))                       (g: 16 groups of 16)
The quants are unpacked 64 at a time straight from the stored block (no repacking); x's quants are stored in the order the
64-byte loads of the block meet them (Q4_K/Q5_K: low nibbles of 32 bytes are sub-block 2c, high nibbles 2c+1, so the x of
sub-blocks 0, 2, 1, 3, 4, 6, 5, 7), their sums per 16 and per 32 beside them.
"""
from __future__ import annotations
from tinyhet.kernels.quant_blocks import Q4_K, Q5_K, Q6_K

KQ_INT8_TYPES = (Q4_K, Q5_K, Q6_K)

def _rep(*lanes: int, n: int) -> str:
  return ", ".join(str(v) for v in lanes for _ in range(n))

SOURCE = r"""
#define NSB (K / 256)
typedef int i32x8 __attribute__((vector_size(32))); typedef float f32x8v __attribute__((vector_size(32)));
typedef short i16x32 __attribute__((vector_size(64)));
INLINE u8x64 cat32(u8x32 a, u8x32 b) { return __builtin_shufflevector(a, b, %(i64)s); }
/* 16 lanes, lane i: s[2i] (a[4i] b[4i] + a[4i+1] b[4i+1]) + s[2i+1] (a[4i+2] b[4i+2] + a[4i+3] b[4i+3]): the products with the
   sub-blocks' integer scales s (equal in lanes 2i, 2i+1). With AVX-512BW u8 x s8 into pairs of i16 (no saturation: q <= 63)
   and an i16 multiply-add with s, added into acc (vpmaddubsw, then vpdpwssd with VNNI or vpmaddwd and an add: measured faster
   than vpdpbusd and a 32-bit multiply, vpmulld) */
INLINE i32x16 dots(i32x16 acc, u8x64 a, i8x64 b, i16x32 s) {
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
  return __builtin_ia32_vpdpwssd512(acc, (i32x16)__builtin_ia32_pmaddubsw512((i8x64)a, b), (i32x16)s);
#elif defined(__AVX512BW__)
  return acc + __builtin_ia32_pmaddwd512(__builtin_ia32_pmaddubsw512((i8x64)a, b), s);
#else
  return acc + dot4(a, b) * __builtin_convertvector(__builtin_shufflevector(s, s, %(even)s), i32x16);
#endif
}
/* acc + (lane i: a[2i] b[2i] + a[2i+1] b[2i+1]), 16-bit a and b (vpdpwssd, vpmaddwd) */
INLINE i32x16 madd16(i32x16 acc, i16x32 a, i16x32 b) {
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
  return __builtin_ia32_vpdpwssd512(acc, (i32x16)a, (i32x16)b);
#elif defined(__AVX512BW__)
  return acc + __builtin_ia32_pmaddwd512(a, b);
#else
#define HALF(v, ...) __builtin_convertvector(__builtin_shufflevector(v, v, __VA_ARGS__), i32x16)
  return acc + HALF(a, %(even)s) * HALF(b, %(even)s) + HALF(a, %(odd)s) * HALF(b, %(odd)s);
#undef HALF
#endif
}
/* where group c (16 weights, c = 0..15) of a super-block of x goes in xq */
INLINE int xpos(int c) {
  const int ch = c / 2;
  /* KPERM 1 (Q4_K/Q5_K): chunks 0, 2, 1, 3, 4, 6, 5, 7; KPERM 2 (Q6_K): chunk 4n + k at 2k + n (both halves' k-th quants in
     one 64-byte vector, beside the 64 bytes of both halves' high bits) */
  return KPERM == 1 ? 32 * ((ch & 4) | (ch & 1) << 1 | (ch >> 1 & 1)) + 16 * (c & 1) : 32 * (2 * (ch & 3) + (ch >> 2)) + 16 * (c & 1);
}
/* per row and super-block: xd the scale, b16 the sums per 16 as 16-bit pairs {sum, 0}, b32 the sums per 32 times xd */
INLINE void quantize_xk(const float *restrict x, int m0, const int mt, i8 *restrict xq, float *restrict xd, i16x32 *restrict b16,
                        f32x8v *restrict b32) {
  for (int i = 0; i < mt; i++) for (int s = 0; s < NSB; s++) {
    const float *xs = x + (size_t)(m0 + i) * K + s * 256;
    u32x16 mx = {0};
    for (int c = 0; c < 16; c++) {   /* max |x|: the bits of non-negative floats order as integers */
      u32x16 a = (u32x16)load16(xs + 16 * c) & 0x7fffffffu, gt = (u32x16)(a > mx);
      mx = (a & gt) | (mx & ~gt);
    }
    u32 ab = 0; float amax;
    for (int l = 0; l < 16; l++) ab = mx[l] > ab ? mx[l] : ab;
    __builtin_memcpy(&amax, &ab, 4);
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    xd[i * NSB + s] = amax / 127.0f;
    i32x16 g16;
    for (int c = 0; c < 16; c++) {
      /* round to nearest even: adding 1.5 * 2^23 puts the integer in the low mantissa bits */
      i32x16 q = (i32x16)(load16(xs + 16 * c) * inv + 12582912.0f) - 0x4B400000;
      int sum = 0;
      for (int l = 0; l < 16; l++) sum += q[l];
      g16[c] = sum;
      i8x16 q8 = __builtin_convertvector(q, i8x16);
      __builtin_memcpy(xq + (size_t)i * K + s * 256 + xpos(c), &q8, 16);
    }
    i32x8 g32;
    for (int j = 0; j < 8; j++) g32[j] = g16[2 * j] + g16[2 * j + 1];
    i16x32 p16;
    for (int c = 0; c < 16; c++) { p16[2 * c] = (short)g16[c]; p16[2 * c + 1] = 0; }
    b16[i * NSB + s] = p16; b32[i * NSB + s] = __builtin_convertvector(g32, f32x8v) * (amax / 127.0f);
  }
}

INLINE void tile8k(float *restrict out, const u8 *restrict w, const float *restrict x, int m0, const int mt, int r0, int r1) {
  i8 xq[MT * K] __attribute__((aligned(64))); float xd[MT * NSB]; i16x32 b16[MT * NSB]; f32x8v b32[MT * NSB];
  quantize_xk(x, m0, mt, xq, xd, b16, b32);
  for (int r = r0; r < r1; r++) {
    const u8 *wr = w + (size_t)r * ROWB;
    f32x16 acc[MT]; f32x8v macc[MT];
    for (int i = 0; i < MT; i++) { acc[i] = (f32x16){0}; macc[i] = (f32x8v){0}; }
    for (int s = 0; s < NSB; s++) {
      const u8 *b = wr + (size_t)s * SBB;
      prefetch(b, SBB);
%(block)s
    }
    for (int i = 0; i < mt; i++) {
      float m = 0.0f;
      for (int l = 0; l < 8; l++) m += macc[i][l];
      out[(size_t)(m0 + i) * N + r] = hsum(acc[i]) - m;
    }
  }
}
"""

# the K-quants' 6-bit scales and mins of a super-block, unpacked 4 at a time (ggml's kmask trick): bytes 0-7 of sm are the
# scales of sub-blocks 0-7, bytes 8-15 their mins
_SCALES_MINS = """      u32 ut[4]; __builtin_memcpy(ut, b + 4, 12);
      ut[3] = ((ut[2] >> 4) & 0x0f0f0f0fu) | ((ut[1] >> 6) & 0x03030303u) << 4;
      const u32 ua = ut[1] & 0x3f3f3f3fu;
      ut[1] = (ut[2] & 0x0f0f0f0fu) | ((ut[0] >> 6) & 0x03030303u) << 4;
      ut[2] = ua; ut[0] &= 0x3f3f3f3fu;
      u8x16 sm; __builtin_memcpy(&sm, ut, 16);
      const i16x16 SW = __builtin_convertvector(sm, i16x16);   /* widened once, then one permute per scale vector */
      const i16x32 S0 = __builtin_shufflevector(SW, SW, %(s02)s), S1 = __builtin_shufflevector(SW, SW, %(s13)s),
                   S2 = __builtin_shufflevector(SW, SW, %(s46)s), S3 = __builtin_shufflevector(SW, SW, %(s57)s);
      const float d = h2f(b), dm = h2f(b + 2);
      const f32x8v Mn = __builtin_convertvector(__builtin_shufflevector(sm, sm, 8, 9, 10, 11, 12, 13, 14, 15), f32x8v) * dm;
""" % {"s02": _rep(0, 2, n=16), "s13": _rep(1, 3, n=16), "s46": _rep(4, 6, n=16),
                                                  "s57": _rep(5, 7, n=16)}

_KQ_ROWS = """
      for (int i = 0; i < mt; i++) {
        const i8 *xp = xq + (size_t)i * K + s * 256; i8x64 x0, x1, x2, x3;
        __builtin_memcpy(&x0, xp, 64); __builtin_memcpy(&x1, xp + 64, 64); __builtin_memcpy(&x2, xp + 128, 64); __builtin_memcpy(&x3, xp + 192, 64);
        const i32x16 t = dots(dots(dots(dots(%(offset)s, V0, x0, S0), V1, x1, S1), V2, x2, S2), V3, x3, S3);
        const float dx = xd[i * NSB + s];
        acc[i] += __builtin_convertvector(t, f32x16) * (d * dx);%(mins)s
      }"""
_MINS = """
        macc[i] += Mn * b32[i * NSB + s];"""

BLOCK = {
  Q4_K: _SCALES_MINS + """
      u8x64 A, B; __builtin_memcpy(&A, b + 16, 64); __builtin_memcpy(&B, b + 80, 64);
      const u8x64 V0 = A & 15, V1 = A >> 4, V2 = B & 15, V3 = B >> 4;""" + _KQ_ROWS % {"offset": "(i32x16){0}", "mins": _MINS},
  Q5_K: _SCALES_MINS + """
      u8x64 A, B; u8x32 h; __builtin_memcpy(&A, b + 48, 64); __builtin_memcpy(&B, b + 112, 64); __builtin_memcpy(&h, b + 16, 32);
      const u8x64 H0 = cat32(h, h >> 2), H1 = cat32(h >> 4, h >> 6);
      const u8x64 V0 = (A & 15) | (H0 & 1) << 4, V1 = (A >> 4) | (H0 >> 1 & 1) << 4,
                  V2 = (B & 15) | (H1 & 1) << 4, V3 = (B >> 4) | (H1 >> 1 & 1) << 4;"""
        + _KQ_ROWS % {"offset": "(i32x16){0}", "mins": _MINS},
  Q6_K: """      const float d = h2f(b + 208), dm = 0.0f; (void)dm;
      i8x16 sc; __builtin_memcpy(&sc, b + 192, 16);
      const i16x16 SW = __builtin_convertvector(sc, i16x16);
      /* the quants' offset 32 against the sums of x per 16: {-32 sc_g, 0} pairs, one vpdpwssd a row */
      const i16x32 SCN = __builtin_shufflevector(SW * (short)-32, (i16x16){0}, %(zip)s);
      const i16x32 S0 = __builtin_shufflevector(SW, SW, %(s0)s), S1 = __builtin_shufflevector(SW, SW, %(s1)s),
                   S2 = __builtin_shufflevector(SW, SW, %(s2)s), S3 = __builtin_shufflevector(SW, SW, %(s3)s);
      /* V_k: the k-th 32 quants of half 0 (bytes 0-31) and of half 1 (32-63): low bits from ql, high from qh's bits 2k, 2k+1 */
      u8x64 A, B, H; __builtin_memcpy(&A, b, 64); __builtin_memcpy(&B, b + 64, 64); __builtin_memcpy(&H, b + 128, 64);
      const u8x64 Q0 = __builtin_shufflevector(A, B, %(lo)s), Q1 = __builtin_shufflevector(A, B, %(hi)s);
      const u8x64 V0 = (Q0 & 15) | (H << 4 & 0x30), V1 = (Q1 & 15) | (H << 2 & 0x30),
                  V2 = (Q0 >> 4) | (H & 0x30), V3 = (Q1 >> 4) | (H >> 2 & 0x30);"""
        % {**{f"s{k}": _rep(2 * k, 2 * k + 1, 8 + 2 * k, 9 + 2 * k, n=8) for k in range(4)},
           "lo": ", ".join(map(str, [*range(32), *range(64, 96)])), "hi": ", ".join(map(str, [*range(32, 64), *range(96, 128)])),
           "zip": ", ".join(f"{g}, {16 + g}" for g in range(16))}
        + _KQ_ROWS % {"offset": "madd16((i32x16){0}, SCN, b16[i * NSB + s])", "mins": ""},
}

def source(ggml_type: int) -> str:
  """The C of the q8_K-style int8 decode tile (tile8k) for `ggml_type`, with its KPERM (x's order) defined."""
  return f"#define KPERM {2 if ggml_type == Q6_K else 1}\n" + SOURCE % {"block": BLOCK[ggml_type], "i64": ", ".join(map(str, range(64))),
                                                                  "even": ", ".join(str(2 * i) for i in range(16)),
                                                                  "odd": ", ".join(str(2 * i + 1) for i in range(16))}
