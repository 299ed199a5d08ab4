"""The reduced-precision mode's tiled kernel for BF16 weights (the int8 mode, TINYHET_INT8_ACTIVATIONS=1, from BF16_TILED_MIN_M
rows of x): x ROUNDED TO BFLOAT16 (nearest even, once, by a kernel of its own before the product, as kernels/int8_gemm.py
rounds x to int8: round_source), then
`vdpbf16ps` (AVX512-BF16: 16 lanes, each the sum of two bf16 products added into float32) against a panel of 16 weight rows
by KC columns copied once into the order it reads, [k/2][row][2], and reused for every row of x. The float path (the
default) keeps x float32; this mode's result is the product with the rounded x (tests). Without AVX512-BF16 the same sums
by widening both halves of each pair to float32. C, included by kernels/quant_matmul.py's source (INT8 == 4).
"""
from __future__ import annotations
from tinyhet.kernels import int8_gemm

def rounded_bytes(M: int, K: int) -> int:
  """Bytes of x rounded (the rounding kernel's output, the product's third argument): x as bfloat16, each row padded by 32
  values."""
  return M * (K + 32) * 2

SOURCE = r"""
#define XKB (K + 32)   /* bf16 values a row of x apart: not a multiple of 4 KiB */
#if defined(__AVX512F__)
#define MRB 8
#else
#define MRB 4
#endif
/* acc + (lane l: w.lo * x.lo + w.hi * x.hi), the halves of lane l of w and of x's pair as bfloat16 */
INLINE f32x16 dpbf16(f32x16 acc, u32x16 w, u32 xb) {
#if defined(__AVX512BF16__)
  return __builtin_ia32_dpbf16ps_512(acc, (i32x16)w, (i32x16)((u32x16){0} + xb));
#else
  const u32 lo = xb << 16, hi = xb & 0xffff0000u; float x0, x1;
  __builtin_memcpy(&x0, &lo, 4); __builtin_memcpy(&x1, &hi, 4);
  return acc + (f32x16)(w << 16) * x0 + (f32x16)(w & 0xffff0000u) * x1;
#endif
}

/* rows n0..n0+nr of W, columns k0..k0+kc, into wq[k/2][16][2]: per 32 columns two 16-row transposes of 8 dwords */
INLINE void panelb(u8 *restrict wq, const u8 *restrict w, int n0, int nr, int k0, int kc) {
  for (int c = 0; c < kc / 32; c++) {
    u32x8 lo[16], hi[16];
    for (int n = 0; n < 16; n++) {
      if (n < nr) {
        const u8 *p = w + (size_t)(n0 + n) * ROWB + (size_t)(k0 + 32 * c) * 2;
        __builtin_memcpy(&lo[n], p, 32); __builtin_memcpy(&hi[n], p + 32, 32);
      } else { lo[n] = (u32x8){0}; hi[n] = (u32x8){0}; }
    }
    transpose16(lo, wq + (size_t)c * 16 * 64); transpose16(hi, wq + (size_t)(c * 16 + 8) * 64);
  }
}

INLINE void microb(float *restrict out, const u8 *restrict wq, const u16 *restrict xq, int m0, const int mr, int n0, int nr, int k0, int kc) {
  f32x16 acc[MRB];
  for (int i = 0; i < mr; i++) {
    float *o = out + (size_t)(m0 + i) * N + n0;
    if (k0 == 0) acc[i] = (f32x16){0};
    else if (nr == 16) acc[i] = load16(o);
    else for (int n = 0; n < 16; n++) acc[i][n] = n < nr ? o[n] : 0.0f;
  }
  for (int p = 0; p < kc / 2; p++) {
    u32x16 wv; __builtin_memcpy(&wv, wq + (size_t)p * 64, 64);
    for (int i = 0; i < mr; i++) {
      u32 xb; __builtin_memcpy(&xb, xq + (size_t)(m0 + i) * XKB + k0 + 2 * p, 4);
      acc[i] = dpbf16(acc[i], wv, xb);
    }
  }
  for (int i = 0; i < mr; i++) {
    float *o = out + (size_t)(m0 + i) * N + n0;
    if (nr == 16) store16(o, acc[i]);
    else for (int n = 0; n < nr; n++) o[n] = acc[i][n];
  }
}

/* xr: x rounded by the rounding kernel (round_source) */
INLINE void tiledb(float *restrict out, const u8 *restrict w, const u8 *restrict xr, int r0, int r1) {
  const u16 *xq = (const u16 *)xr;
  u8 wq[KC * 32] __attribute__((aligned(64)));
  for (int n0 = r0; n0 < r1; n0 += 16) {
    const int nr = r1 - n0 < 16 ? r1 - n0 : 16;
    for (int k0 = 0; k0 < K; k0 += KC) {
      const int kc = K - k0 < KC ? K - k0 : KC;
      panelb(wq, w, n0, nr, k0, kc);
      /* the next panel's rows into L2 while this one is multiplied (a step's weights come from memory: one core, 16 rows of
         x, 1536 x 576 cold, 2 parts through the pool: 0.193 -> 0.155 ms a product; into L1 it gained little) */
      if (n0 + 16 < r1) for (int n = 0; n < (r1 - n0 - 16 < 16 ? r1 - n0 - 16 : 16); n++)
        for (int b = 0; b < kc * 2; b += 64) __builtin_prefetch(w + (size_t)(n0 + 16 + n) * ROWB + (size_t)k0 * 2 + b, 0, 1);
      int m0 = 0;
      for (; m0 + MRB <= M; m0 += MRB) microb(out, wq, xq, m0, MRB, n0, nr, k0, kc);
      switch (M - m0) {
%(tails)s
      }
    }
  }
}
"""

# the rounding kernel: x (M, K) float32 -> x as bfloat16, a row XKB values apart; rows split in PARTS parts
ROUND_SOURCE = r"""
typedef unsigned short u16; typedef unsigned int u32; typedef unsigned long size_t;
typedef u32 u32x16 __attribute__((vector_size(64))); typedef u16 u16x16 __attribute__((vector_size(32)));
#define KERNEL __attribute__((no_builtin("memset"), no_builtin("memcpy")))
#define INLINE static inline __attribute__((always_inline)) KERNEL
#define M %(M)d
#define K %(K)d
#define XKB (K + 32)
#define PARTS %(parts)d
/* rows i0..i1 of x as bfloat16, rounded to nearest even */
INLINE void round_xb(const float *restrict x, u16 *restrict xq, int i0, int i1) {
  for (int i = i0; i < i1; i++) for (int k = 0; k < K; k += 16) {
    u32x16 b; __builtin_memcpy(&b, x + (size_t)i * K + k, 64);
    b += 0x7fffu + ((b >> 16) & 1u);
    const u16x16 h = __builtin_convertvector(b >> 16, u16x16);
    __builtin_memcpy(xq + (size_t)i * XKB + k, &h, 32);
  }
}

KERNEL void %(name)s(u16 *restrict xr, const float *restrict x, int core_id) {
  if (PARTS == 1) core_id = 0;   /* a one-part kernel is called without a core_id */
  round_xb(x, xr, (int)((long)core_id * M / PARTS), (int)((long)(core_id + 1) * M / PARTS));
}
"""

def round_source(M: int, K: int, parts: int) -> tuple[str, str]:
  """(function name, C source) of the kernel that rounds x (M, K) to bfloat16 for the bf16 tiled kernel, in `parts` parts."""
  name = f"round_x_bf16_{M}_{K}_p{parts}"
  return name, ROUND_SOURCE % {"name": name, "M": M, "K": K, "parts": parts}

def source() -> str:
  """The C of the bf16 tiled kernel (tiledb)."""
  tails = "\n".join(f"        case {i}: if ({i} < MRB) microb(out, wq, xq, m0, {i}, n0, nr, k0, kc); break;" for i in range(1, 8))
  return int8_gemm.transpose_source() + SOURCE % {"tails": tails}
