"""The block types' 16-row decode kernels (a few rows of x): 16 weight rows at a time, read straight from their stored blocks
into registers as vectors whose lane n is row n, so no row ever needs a horizontal sum and a sub-block's unpacking is shared
by 16 rows' worth of products. gemv8 (int8 mode) takes the 32-weight types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0); gemvf (float mode)
those and the K-quants (Q4_K, Q5_K, Q6_K). C, included by kernels/quant_matmul.py's source, where the vector types,
h2f16's conversions and (int8) dot4 are defined.

Per sub-block of 32 weights and group of 16 rows: each row's 16 quant bytes are loaded (one 16-byte load), four rows to a
vector (lane l of vector i: row i + 4l), and a 4 x 4 transpose of 32-bit words inside each 128-bit lane (eight two-source
shuffles) leaves vector j lane n = row n's word j: 4 quant bytes of each of the 16 rows. The float16 scales (and Q4_1/Q5_1's
offsets, Q5's fifth bits) of the 16 rows are one 32-bit load each, put side by side. Then:
- gemv8 (int8 mode, 1-16 rows of x): with x rounded per 32 (xq its quants, xd its scale, xs its sum; the symmetric types'
  offset as an integer that starts the sums, int8_gemm.OFFSET; the rounding is int8_gemm.py's kernel, the buffer the int8
  tiled kernel reads), one vpdpbusd takes 16 rows x 4 k against a broadcast of 4 bytes of x:
    acc[n] += float(sum_k q[n, k] xq[k]) * (s[n] xd)  +  m[n] xs
  The int8 tiled kernel (int8_gemm.py) does the same arithmetic, in the same order, through a panel on the stack unpacked
  once and reused for every row of x: the same bits (tested), and past 16 rows that wins; at one row its stores and reloads
  were the cost (measured, one core, AMD EPYC, 1536 x 576 Q4_1, one row, hot: float decode kernel 90 us, int8 tiled 62, this
  kernel 26, llama.cpp's ggml_mul_mat 43).
- gemvf (float mode, up to DECODE_MAX_M rows of x, x float32): the stored quants (bytes 1 and 2 of each word taken out by
  one byte shuffle each) converted to float and multiplied into x in four chains per row of x, then scaled once per
  sub-block; a symmetric type's offset joins x's sum as m = -OFF s, as an asymmetric type's offset does (measured as above:
  Q4_1 90 -> 47 us at one row, 271 -> 184 at 8; Q4_0 42, Q5_0 88 -> 53; Q8_0 55 -> 47, 274 -> 169 at 8; ggml_mul_mat: Q4_0
  42, Q4_1 42, Q5_0 50, Q8_0 36). The float path's conversions are most of its vector ops a weight: x as int8 (gemv8) is
  what passes llama.cpp's speed at one row.

The K-quants (gemvf only) are unpacked a super-block of 256 weights at a time into 64 quant vectors on the stack, so the
bytes two or four sub-blocks share (a byte's two nibbles, Q6_K's 2-bit highs, the scale bytes) are read and transposed once;
Q6_K's scale per 16 weights takes a term per 16 columns. Measured (one core, AMD EPYC, hot, least of 8 rounds; against the
float decode kernel they ran before): 576 x 1536 at one row Q4_K 75 -> 42-50 us, Q5_K 81 -> 50, Q6_K 86 -> 60; 4096 x 4096
Q4_K 1.34 -> 0.81 ms, Q5_K 1.48 -> 1.01, Q6_K 1.60 -> 1.35; at 8 rows 1.3-1.8x (ggml_mul_mat, x as int8: 4096 x 4096 Q4_K
0.45 ms, Q6_K 0.48-0.63 at one row; the int8 mode's kquant_int8 0.53, 0.54).

Rows of a part past a multiple of 16 are computed as a group whose missing rows repeat the part's last row (not stored), so a
row's bits never depend on how rows were grouped or split in parts.
"""
from __future__ import annotations
from tinyhet.kernels.quant_blocks import Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0

GEMV16_TYPES = (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0)
# the types whose 16 rows' scale words are one AVX-512 gather, not 16 loads put in lanes: the two with an offset beside the
# scale (measured, one core, 1536 x 576, one row: Q4_1 35 -> 26 us, Q5_1 45 -> 42; the others slower gathered, Q4_0 19 -> 24,
# Q5_0 34 -> 40, Q8_0 27 -> 31)
GATHER_TYPES = (Q4_1, Q5_1)

# per type: a sub-block's quants q[c] (c = 0..7: lane n, bytes of row n's weights 4c..4c+3, unsigned), scales s and offsets m
# (unused for the symmetric types) for the 16 rows whose blocks start at p[n] + o
_NIBBLES = """  u32x16 T[4]; rows16(p, o + %(qs)d, T);
  for (int c = 0; c < 4; c++) { q[c] = (u8x64)(T[c] & 0x0f0f0f0fu); q[c + 4] = (u8x64)((T[c] >> 4) & 0x0f0f0f0fu); }"""
# Q5's fifth bits: bits 4c..4c+3 of each row's qh word to bit 4 of each byte of q[c] (a multiply spreads 4 bits to 4 bytes)
_FIFTH = """
  const u32x16 qh = words16(p, o + %(qh)d);
  for (int c = 0; c < 8; c++) q[c] |= (u8x64)((((qh >> (4 * c)) & 15u) * 0x00204081u & 0x01010101u) << 4);"""
_O = "  const int o = b * SBB;\n"
_D = "  *s = h2f16w(words16(p, o));"
_DM = "  const u32x16 dm = words16(p, o); *s = h2f16w(dm); *m = h2f16w(dm >> 16);"
ROWS = {
  Q4_0: _O + _D + "\n" + _NIBBLES % {"qs": 2},
  Q4_1: _O + _DM + "\n" + _NIBBLES % {"qs": 4},
  Q5_0: _O + _D + "\n" + _NIBBLES % {"qs": 6} + _FIFTH % {"qh": 2},
  Q5_1: _O + _DM + "\n" + _NIBBLES % {"qs": 8} + _FIFTH % {"qh": 4},
  Q8_0: _O + _D + """
  u32x16 T[4], U[4]; rows16(p, o + 2, T); rows16(p, o + 18, U);
  for (int c = 0; c < 4; c++) { q[c] = (u8x64)(T[c] ^ 0x80808080u); q[c + 4] = (u8x64)(U[c] ^ 0x80808080u); }""",
}

# The K-quants (float mode only; their int8 mode is kquant_int8.py's): a whole super-block of 256 weights at a time, b its
# first sub-block, so bytes that serve two or four sub-blocks (a byte's two nibbles, Q6_K's 2-bit highs) are read and
# transposed once: q[8j + c] is sub-block j's q[c], s[j] and m[j] its scale and offset (Q6_K: s[2j], s[2j + 1], one per 16)
_KSCALES = """  const int o = b / 8 * SBB;
  u32x16 S[4]; rows16(p, o, S);   /* d, dmin; the 12 bytes of 6-bit scales and mins */
  const f32x16 d = h2f16w(S[0]), dmin = h2f16w(S[0] >> 16);
  for (int j = 0; j < 8; j++) {
    const int sh = 8 * (j & 3);
    const u32x16 sc = j < 4 ? (S[1] >> sh) & 63u : ((S[3] >> sh) & 15u) | (((S[1] >> sh) >> 6 & 3u) << 4);
    const u32x16 mn = j < 4 ? (S[2] >> sh) & 63u : ((S[3] >> sh) >> 4 & 15u) | (((S[2] >> sh) >> 6 & 3u) << 4);
    s[j] = d * __builtin_convertvector(sc, f32x16); m[j] = -(dmin * __builtin_convertvector(mn, f32x16));
  }"""
# sub-blocks 2r and 2r + 1: the low and high nibbles of the same 32 bytes (Q5_K: the fifth bits, bit j of qh byte k)
_KNIBBLES = """
  for (int r = 0; r < 4; r++) {
    u32x16 T[8]; rows16(p, o + %(qs)d + 32 * r, T); rows16(p, o + %(qs)d + 16 + 32 * r, T + 4);
    for (int c = 0; c < 8; c++) {
      q[16 * r + c] = (u8x64)(T[c] & 0x0f0f0f0fu); q[16 * r + 8 + c] = (u8x64)((T[c] >> 4) & 0x0f0f0f0fu);%(fifth)s
    }
  }"""
_KFIFTH = """
      q[16 * r + c] |= (u8x64)(((H[c] >> (2 * r)) & 0x01010101u) << 4); q[16 * r + 8 + c] |= (u8x64)(((H[c] >> (2 * r + 1)) & 0x01010101u) << 4);"""
KROWS = {
  Q4_K: _KSCALES + _KNIBBLES % {"qs": 16, "fifth": ""},
  Q5_K: _KSCALES + "\n  u32x16 H[8]; rows16(p, o + 16, H); rows16(p, o + 32, H + 4);" + _KNIBBLES % {"qs": 48, "fifth": _KFIFTH},
  # Q6_K: 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales, d; sub-block 4n + k: ql bytes 64n + 32(k & 1), nibble
  # k >> 1, qh bytes 128 + 32n, bits 2k (d read as the high half of the word before it: the block's last bytes)
  Q6_K: """  const int o = b / 8 * SBB;
  u32x16 S[4]; rows16(p, o + 192, S);
  const f32x16 d = h2f16w(words16(p, o + 206) >> 16);
  for (int j = 0; j < 16; j++) s[j] = d * __builtin_convertvector((i32x16)(S[j / 4] << (24 - 8 * (j & 3))) >> 24, f32x16);
  for (int n = 0; n < 2; n++) {
    u32x16 H[8]; rows16(p, o + 128 + 32 * n, H); rows16(p, o + 144 + 32 * n, H + 4);
    for (int h = 0; h < 2; h++) {
      u32x16 L[8]; rows16(p, o + 64 * n + 32 * h, L); rows16(p, o + 64 * n + 32 * h + 16, L + 4);
      for (int c = 0; c < 8; c++) {
        q[8 * (4 * n + h) + c] = (u8x64)((L[c] & 0x0f0f0f0fu) | (((H[c] >> (2 * h)) & 0x03030303u) << 4));
        q[8 * (4 * n + h + 2) + c] = (u8x64)(((L[c] >> 4) & 0x0f0f0f0fu) | (((H[c] >> (2 * h + 4)) & 0x03030303u) << 4));
      }
    }
  }""",
}
GEMVF_TYPES = GEMV16_TYPES + tuple(KROWS)   # the float path's 16-row kernel

ROWS_SOURCE = r"""
typedef u32 u32x8 __attribute__((vector_size(32))); typedef int i32x16 __attribute__((vector_size(64)));
typedef u8 u8x64 __attribute__((vector_size(64)));
#define OFF %(OFF)d
#define GATHER %(gather)d
/* where the next group of 16 rows is prefetched: into L1 while two groups fit beside x (its 16 rows' loads then hit), else into
   L2 (prefetched into L1, a large group evicted the current one's lines before their loads: measured, one core, weights
   cold, one row, 576 x 1536 Q4_K 91 -> 50 us, Q6_K 146 -> 85, Q8_0 80 -> 60; 4096 x 4096 Q8_0 1.36 -> 0.97 ms, Q4_K 1.44 ->
   0.82, Q6_K 2.51 -> 1.45; Q4_1, Q5_0 at 576 x 1536 (15-17 KB a group) 4-7%% faster into L1, 1536 x 576 Q4_0 64 -> 47) */
#define PFL_(big) ((big) || 16 * ROWB > 24576 ? 2 : 3)
/* 16 rows' 16 bytes at p[n] + o -> T[j], lane n = row n's 32-bit word j */
INLINE void rows16(const u8 *const *restrict p, const int o, u32x16 *restrict T) {
  u32x4 a[16];
  for (int n = 0; n < 16; n++) __builtin_memcpy(&a[n], p[n] + o, 16);
  u32x16 Z[4];   /* Z[i] lane l (of four 128-bit lanes): row i + 4l */
  for (int i = 0; i < 4; i++) {
    const u32x8 lo = __builtin_shufflevector(a[i], a[i + 4], 0, 1, 2, 3, 4, 5, 6, 7);
    const u32x8 hi = __builtin_shufflevector(a[i + 8], a[i + 12], 0, 1, 2, 3, 4, 5, 6, 7);
    Z[i] = __builtin_shufflevector(lo, hi, %(i16)s);
  }
  const u32x16 A = __builtin_shufflevector(Z[0], Z[1], %(unpacklo)s), B = __builtin_shufflevector(Z[0], Z[1], %(unpackhi)s);
  const u32x16 C = __builtin_shufflevector(Z[2], Z[3], %(unpacklo)s), D = __builtin_shufflevector(Z[2], Z[3], %(unpackhi)s);
  T[0] = __builtin_shufflevector(A, C, %(lo64)s); T[1] = __builtin_shufflevector(A, C, %(hi64)s);
  T[2] = __builtin_shufflevector(B, D, %(lo64)s); T[3] = __builtin_shufflevector(B, D, %(hi64)s);
}
/* the 32-bit word at p[n] + o of each of 16 rows */
#if defined(__AVX512F__) && GATHER
#define words16(p, o) ((u32x16)__builtin_ia32_gathersiv16si((i32x16){0}, (const void *)((p)[0] + (o)), gidx, (unsigned short)0xffff, 1))
#else
#define words16(p, o) words16_(p, o)
#endif
INLINE u32x16 words16_(const u8 *const *restrict p, const int o) {
  u32x16 v;
  for (int n = 0; n < 16; n++) { u32 t; __builtin_memcpy(&t, p[n] + o, 4); v[n] = t; }
  return v;
}
/* the float16 in the low half of each 32-bit lane */
INLINE f32x16 h2f16w(u32x16 v) {
  const u16x16 h = __builtin_convertvector(v, u16x16);
  u8 b[32]; __builtin_memcpy(b, &h, 32);
  return h2f16(b);
}
INLINE void rows_sub(const u8 *const *restrict p, const i32x16 gidx, const int b, u8x64 *restrict q, f32x16 *restrict s, f32x16 *restrict m) {
%(rows)s
}
"""

INT8_SOURCE = r"""
#define XK (K + 64)
INLINE i32x16 dpbusd(i32x16 acc, u8x64 a, i8x64 b) {
#if defined(__AVX512VNNI__)
  return __builtin_ia32_vpdpbusd512(acc, (i32x16)a, (i32x16)b);
#else
  return acc + dot4(a, b);
#endif
}
/* xr: x rounded by int8_gemm.py's rounding kernel */
INLINE void gemv8(float *restrict out, const u8 *restrict w, const u8 *restrict xr, int r0, int r1) {
  const i8 *xq = (const i8 *)xr;
  const float *xd = (const float *)(xq + (size_t)M * XK), *xs = xd + (size_t)M * NB;
  for (int n0 = r0; n0 < r1; n0 += 16) {
    const u8 *p[16];
    i32x16 gidx;
    for (int n = 0; n < 16; n++) { p[n] = w + (size_t)(n0 + n < r1 ? n0 + n : r1 - 1) * ROWB; gidx[n] = (int)(p[n] - p[0]); }
    /* the next group's rows, contiguous: asked of memory a sub-block's share at a time */
    const u8 *next = w + (size_t)(n0 + 16) * ROWB;
    const int ahead = n0 + 32 <= r1 ? 16 * ROWB : n0 + 16 < r1 ? (r1 - n0 - 16) * ROWB : 0;
    f32x16 acc[M];
    for (int i = 0; i < M; i++) acc[i] = (f32x16){0};
    for (int b = 0; b < NB; b++) {
      if (PF) for (int c = b * ahead / NB; c < (b + 1) * ahead / NB; c += 64) __builtin_prefetch(next + c, 0, PFL_(0));
      u8x64 q[8]; f32x16 s, m = (f32x16){0};
      rows_sub(p, gidx, b, q, &s, &m);
      for (int i = 0; i < M; i++) {
        i32x16 ia = OFF ? (i32x16){0} + ((const int *)xs)[(size_t)i * NB + b] : (i32x16){0};
        const i8 *xb = xq + (size_t)i * XK + b * 32;
#pragma clang loop unroll(full)
        for (int c = 0; c < 8; c++) { int x4; __builtin_memcpy(&x4, xb + 4 * c, 4); ia = dpbusd(ia, q[c], (i8x64)((i32x16){0} + x4)); }
        acc[i] += __builtin_convertvector(ia, f32x16) * (s * xd[(size_t)i * NB + b]);
        if (!OFF) acc[i] += m * xs[(size_t)i * NB + b];
      }
    }
    for (int i = 0; i < M; i++) {
      float *o = out + (size_t)i * N + n0;
      if (n0 + 16 <= r1) store16(o, acc[i]);
      else for (int n = 0; n < r1 - n0; n++) o[n] = acc[i][n];
    }
  }
}
"""

FLOAT_SOURCE = r"""
/* x float32, as the float decode kernel takes it: per sub-block, per row of x, the sum of q x over its 32 columns in four
   chains (column 4c + j into chain j; q as stored, a symmetric type's m = -OFF s), then w = s q + m makes the row's term
     acc[n] += s[n] (sum_k q[n, k] x[k]) + m[n] (sum_k x[k])
   (S16, Q6_K: one such term per 16 columns) with x's sums per sub-block (S16: per 16) computed once by each part, in one
   order (the same bits in any part). SUBS sub-blocks are unpacked at a time (the K-quants: a super-block) */
#define MF 4   /* rows of x per pass over a group's quants: 4 x 4 chains, 4 accumulators and 8 quant vectors in registers */
#define SUBS %(subs)d
#define S16 %(s16)d
#define NXS (NB * (1 + S16))   /* x's sums per row */
INLINE f32x16 chains(const f32x16 *a) { return (a[0] + a[1]) + (a[2] + a[3]); }
INLINE void gemvf(float *restrict out, const u8 *restrict w, const float *restrict x, int r0, int r1) {
  float xsum[M * NXS];
  for (int i = 0; i < M; i++) for (int b = 0; b < NB; b++) {
    const f32x16 lo = load16(x + (size_t)i * K + 32 * b), hi = load16(x + (size_t)i * K + 32 * b + 16);
    if (S16) { xsum[i * NXS + 2 * b] = hsum(lo); xsum[i * NXS + 2 * b + 1] = hsum(hi); }
    else xsum[i * NXS + b] = hsum(lo + hi);
  }
  for (int n0 = r0; n0 < r1; n0 += 16) {
    const u8 *p[16];
    i32x16 gidx;
    for (int n = 0; n < 16; n++) { p[n] = w + (size_t)(n0 + n < r1 ? n0 + n : r1 - 1) * ROWB; gidx[n] = (int)(p[n] - p[0]); }
    const u8 *next = w + (size_t)(n0 + 16) * ROWB;
    const int ahead = n0 + 32 <= r1 ? 16 * ROWB : n0 + 16 < r1 ? (r1 - n0 - 16) * ROWB : 0;
    for (int i0 = 0; i0 < M; i0 += MF) {
      const int mf = M - i0 < MF ? M - i0 : MF;
      f32x16 acc[MF];
      for (int i = 0; i < MF; i++) acc[i] = (f32x16){0};
      for (int b0 = 0; b0 < NB; b0 += SUBS) {
        if (PF && i0 == 0) for (int c = b0 * ahead / NB; c < (b0 + SUBS) * ahead / NB; c += 64) __builtin_prefetch(next + c, 0, PFL_(SUBS > 1));
        u8x64 q[8 * SUBS]; f32x16 s[SUBS * (1 + S16)], m[SUBS];
        for (int u = 0; u < SUBS; u++) m[u] = (f32x16){0};
        rows_sub(p, gidx, b0, q, s, m);
        for (int u = 0; u < SUBS; u++) {
          const int b = b0 + u;
          f32x16 a[MF][4];
          for (int i = 0; i < MF; i++) for (int j = 0; j < 4; j++) a[i][j] = (f32x16){0};
#pragma clang loop unroll(full)
          for (int c = 0; c < 8; c++) {
            const u8x64 qc = q[8 * u + c];
            const u32x16 v = (u32x16)qc;   /* the stored quants, unsigned (the offset comes in once, with x's sum) */
            const f32x16 f[4] = {__builtin_convertvector((i32x16)(v & 0xffu), f32x16),
                                 __builtin_convertvector((i32x16)__builtin_shufflevector(qc, (u8x64){0}, %(byte1)s), f32x16),
                                 __builtin_convertvector((i32x16)__builtin_shufflevector(qc, (u8x64){0}, %(byte2)s), f32x16),
                                 __builtin_convertvector((i32x16)(v >> 24), f32x16)};
            for (int i = 0; i < MF; i++) if (i < mf) {
              const float *xk = x + (size_t)(i0 + i) * K + 32 * b + 4 * c;
              for (int j = 0; j < 4; j++) a[i][j] += f[j] * xk[j];
            }
            if (S16 && c == 3) {   /* the sub-block's first 16 columns, under their own scale */
              const f32x16 s0 = s[2 * u], m0 = s0 * (float)-OFF;
              for (int i = 0; i < MF; i++) if (i < mf) {
                acc[i] += chains(a[i]) * s0 + m0 * xsum[(i0 + i) * NXS + 2 * b];
                for (int j = 0; j < 4; j++) a[i][j] = (f32x16){0};
              }
            }
          }
          const f32x16 sl = s[(1 + S16) * u + S16], ml = OFF ? sl * (float)-OFF : m[u];
          for (int i = 0; i < MF; i++) if (i < mf) acc[i] += chains(a[i]) * sl + ml * xsum[(i0 + i) * NXS + (1 + S16) * b + S16];
        }
      }
      for (int i = 0; i < MF; i++) if (i < mf) {
        float *o = out + (size_t)(i0 + i) * N + n0;
        if (n0 + 16 <= r1) store16(o, acc[i]);
        else for (int n = 0; n < r1 - n0; n++) o[n] = acc[i][n];
      }
    }
  }
}
"""

def byte_of_each_word(j: int) -> str:
  """The shuffle indices that leave byte j of each 32-bit word of a u8x64 in the word's low byte, zeros above it (index 64:
  the zero vector's first byte): one byte shuffle, where a shift and a mask were two ops."""
  return ", ".join(str(4 * w + j if b == 0 else 64) for w in range(16) for b in range(4))

def source(ggml_type: int, int8: bool) -> str:
  """The C of the 16-row decode kernel for a type: with int8, gemv8 (x rounded; GEMV16_TYPES); else gemvf (x float32;
  GEMVF_TYPES)."""
  from tinyhet.kernels.int8_gemm import OFFSET
  lanes = lambda f: ", ".join(str(f(l, i)) for l in range(4) for i in range(4))
  return ROWS_SOURCE % {"OFF": OFFSET.get(ggml_type, 0), "gather": int(ggml_type in GATHER_TYPES), "rows": {**ROWS, **KROWS}[ggml_type],
                        "i16": ", ".join(map(str, range(16))),
                        "unpacklo": lanes(lambda l, i: 4 * l + i // 2 + 16 * (i & 1)),
                        "unpackhi": lanes(lambda l, i: 4 * l + 2 + i // 2 + 16 * (i & 1)),
                        "lo64": lanes(lambda l, i: 4 * l + (i & 1) + 16 * (i >> 1)),
                        "hi64": lanes(lambda l, i: 4 * l + 2 + (i & 1) + 16 * (i >> 1))} + \
         (INT8_SOURCE if int8 else FLOAT_SOURCE % {"byte1": byte_of_each_word(1), "byte2": byte_of_each_word(2),
                                                    "subs": 8 if ggml_type in KROWS else 1, "s16": int(ggml_type == Q6_K)})
