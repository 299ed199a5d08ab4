"""The int8-activation tiled kernel (int8 mode, batches and prefill): x rounded to int8 once per block of 32 for every type
(the K-quants too: per 32 is the finer rounding, and with every type alike one micro-kernel serves all), then, as the float
tiled kernel does, a panel of NR8 weight rows by KC columns is unpacked ONCE into a u8 tile on the stack and reused for every
row of x. C, included by kernels/quant_matmul.py's source in its int8 mode (INT8 == 3), where qs (a sub-block's unsigned
quants, scales and offsets: kernels/quant_blocks.py's QUANTS), dot4 and the vector types are defined.

The tile is in the order the micro-kernel reads: wq[k/4][row][4], so one vpdpbusd (u8 x s8, 4 products summed into each
32-bit lane) takes 16 weight rows x 4 k against a broadcast of 4 bytes of x; beside it, per group of G weights (32; Q6_K 16,
its scales' span) and row, the float scale s and offset m of w = s q + m. Per group the MR8 x 16 int32 sums are converted once
and scaled into float accumulators:
  acc[i] += float(sum_k q[r, k] xq[i, k]) * (s[r, g] dx[i, g])  +  m[r, g] sx[i, g]      (sx: the group's sum of rounded x)
The weights are the unsigned operand (Q4_K 0..15, Q5_K 0..31, Q6_K 0..63, Q5_0 0..31, Q8_0 + 128, ...), their shift folded
into m, which meets the sums of the rounded x, so it cancels exactly (as in quant_matmul's tile8); for the symmetric types
(OFFSET) that correction is an integer instead, -OFF times the group's sum of x's quants, which starts the int32 sums.

x's rounding needs every row of x before the first panel, more than a stack holds for a long prefill, so it is a kernel of
its own (round_source), launched before the product and split over the rows of x: it writes x's quants, scales and sums once
into one buffer, which every part of the product reads as its third argument (before, each part rounded all of x into its own
scratch: at 192 parts the rounding was done 192 times). The pool runs a step's kernels in order, each part of one finished
before the next kernel starts, so no barrier is needed inside either kernel.
"""
from __future__ import annotations
from tinyhet.kernels.quant_blocks import Q4_0, Q4_K, Q5_0, Q5_K, Q6_K, Q8_0

NR8 = 16   # weight rows in a panel: one vector of 16 int32 lanes
# the unsigned shift of the symmetric types' quants (w = s (q - OFF)): their offset is -OFF s, so the product's correction is
# -OFF times the group's sum of x's quants, an integer of the row of x alone, which starts the int32 sums (one broadcast in
# place of a multiply-add per group and row: 1.08-1.12x at 512 rows, README); the other types (w = s q + m) keep m's
OFFSET = {Q4_0: 8, Q5_0: 16, Q8_0: 128, Q6_K: 32}

# Q4_K and Q5_K: a row's super-block unpacked whole (its 8 scales and mins at once, by ggml's kmask trick, and its 256 quants
# 64 at a time, as kquant_int8's tile8k reads them) in place of 8 sub-blocks' scalar scale decoding: V0 holds sub-blocks 0
# and 2, V1 1 and 3, V2 4 and 6, V3 5 and 7
_KROW = {
  Q4_K: """  u8x64 A, B; __builtin_memcpy(&A, b + 16, 64); __builtin_memcpy(&B, b + 80, 64);
  const u8x64 V0 = A & 15, V1 = A >> 4, V2 = B & 15, V3 = B >> 4;""",
  Q5_K: """  u8x64 A, B; u8x32 h; __builtin_memcpy(&A, b + 48, 64); __builtin_memcpy(&B, b + 112, 64); __builtin_memcpy(&h, b + 16, 32);
  const u8x64 H0 = __builtin_shufflevector(h, h >> 2, %(i64)s), H1 = __builtin_shufflevector(h >> 4, h >> 6, %(i64)s);
  const u8x64 V0 = (A & 15) | (H0 & 1) << 4, V1 = (A >> 4) | (H0 >> 1 & 1) << 4,
              V2 = (B & 15) | (H1 & 1) << 4, V3 = (B >> 4) | (H1 >> 1 & 1) << 4;""",
}
KROW = r"""
/* one row's super-block b: r[jj][n] its sub-block jj's 32 quants, ws/wm its scales d sc_jj and offsets -dmin m_jj */
INLINE void krow(const u8 *restrict b, u32x8 (*restrict r)[NR8], int n, float *restrict ws, float *restrict wm, int j0) {
  u32 ut[4]; __builtin_memcpy(ut, b + 4, 12);
  ut[3] = ((ut[2] >> 4) & 0x0f0f0f0fu) | ((ut[1] >> 6) & 0x03030303u) << 4;
  const u32 ua = ut[1] & 0x3f3f3f3fu;
  ut[1] = (ut[2] & 0x0f0f0f0fu) | ((ut[0] >> 6) & 0x03030303u) << 4;
  ut[2] = ua; ut[0] &= 0x3f3f3f3fu;
  u8x16 sm; __builtin_memcpy(&sm, ut, 16);   /* bytes 0-7 the scales of sub-blocks 0-7, 8-15 their mins */
  const float d = h2f(b), dm = -h2f(b + 2);
  const f32x16 f = __builtin_convertvector(sm, f32x16) * (f32x16){d, d, d, d, d, d, d, d, dm, dm, dm, dm, dm, dm, dm, dm};
  for (int jj = 0; jj < 8; jj++) { ws[(j0 + jj) * NR8 + n] = f[jj]; wm[(j0 + jj) * NR8 + n] = f[8 + jj]; }
%(quants)s
  const u8x64 V[4] = {V0, V1, V2, V3};
  for (int v = 0; v < 4; v++) {
    r[(v & 1) + 4 * (v >> 1)][n] = (u32x8)__builtin_shufflevector(V[v], V[v], %(lo)s);
    r[(v & 1) + 4 * (v >> 1) + 2][n] = (u32x8)__builtin_shufflevector(V[v], V[v], %(hi)s);
  }
}
#define KROW 1
"""

def group(ggml_type: int) -> int:
  """Weights per scale group: Q6_K's scales cover 16, every other type's 32 (a half of a 32-weight sub-block shares its scale)."""
  return 16 if ggml_type == Q6_K else 32

def rounded_bytes(ggml_type: int, M: int, K: int) -> int:
  """Bytes of x rounded (the rounding kernel's output, the product's third argument): its int8 quants, and per block of 32
  its scale, per group its sum."""
  return M * (K + 64) + 4 * M * (K // 32) + 4 * M * (K // group(ggml_type))

TRANSPOSE = r"""
typedef u32 u32x8 __attribute__((vector_size(32))); typedef unsigned long u64x8 __attribute__((vector_size(64)));
/* 16 rows' 32 quants (8 dwords each) -> 8 vectors of 16 dwords, vector c lane n = row n's dword c: a pair of rows interleaved
   into 8 qwords, then an 8 x 8 transpose of qwords in three butterflies (32 two-source shuffles for 512 bytes, in place of
   128 scalar stores) */
INLINE void transpose16(const u32x8 *restrict r, u8 *restrict dst) {
  u64x8 v[8];
  for (int k = 0; k < 8; k++) v[k] = (u64x8)__builtin_shufflevector(r[2 * k], r[2 * k + 1], %(zip8)s);
%(butterflies)s
  for (int c = 0; c < 8; c++) __builtin_memcpy(dst + 64 * c, &v[c], 64);
}

"""

SOURCE = r"""
#define G %(G)d
#define OFF %(OFF)d
#define NG (K / G)
#define NR8 16
#if defined(__AVX512F__)
#define MR8 8    /* rows of x per micro-kernel call: 12 measured slower (512 rows of 4096 x 4096 Q8_0: 72 against 62 ms) */
#else
#define MR8 4
#endif
#define XK (K + 64)   /* x's quants a row apart: not a multiple of 4 KiB, so the tile's rows of x do not share an L1 set */
INLINE i32x16 dpbusd(i32x16 acc, u8x64 a, i8x64 b) {
#if defined(__AVX512VNNI__)
  return __builtin_ia32_vpdpbusd512(acc, (i32x16)a, (i32x16)b);
#else
  return acc + dot4(a, b);
#endif
}

%(krow)s
/* rows n0..n0+nr of W, columns k0..k0+kc, unpacked into wq[k/4][NR8][4] and per group ws[g][NR8], wm[g][NR8]; rows past nr
   are zeros */
INLINE void panel8(u8 *restrict wq, float *restrict ws, float *restrict wm, const u8 *restrict w, int n0, int nr, int k0, int kc) {
  for (int g = k0 / 32 / NSTEP; g < (k0 + kc) / 32 / NSTEP; g++) {
    /* a row's whole stored block at a time (its sub-blocks unrolled: a K-quant's d and dmin converted once, not per sub-block),
       then each sub-block's 16 rows transposed */
    u32x8 r[NSTEP][NR8];
#if defined(KROW)
    for (int n = 0; n < NR8; n++) {
      if (n < nr) { krow(w + (size_t)(n0 + n) * ROWB + (size_t)g * SBB, r, n, ws, wm, g * NSTEP - k0 / 32); continue; }
      for (int jj = 0; jj < NSTEP; jj++) {   /* rows past nr: zeros */
        const int j = g * NSTEP + jj - k0 / 32;
        r[jj][n] = (u32x8){0}; ws[j * NR8 + n] = 0.0f; wm[j * NR8 + n] = 0.0f;
      }
    }
#else
    for (int n = 0; n < NR8; n++) {
#pragma clang loop unroll(full)
      for (int jj = 0; jj < NSTEP; jj++) {
        const int j = g * NSTEP + jj - k0 / 32;   /* the sub-block in the panel */
        u8x32 q = (u8x32){0}; float s0 = 0.0f, s1 = 0.0f, m0 = 0.0f, m1 = 0.0f;
        if (n < nr) qs(w + (size_t)(n0 + n) * ROWB, g, jj, &q, &s0, &s1, &m0, &m1);
        r[jj][n] = (u32x8)q;
        if (G == 32) { ws[j * NR8 + n] = s0; wm[j * NR8 + n] = m0; }
        else { ws[2 * j * NR8 + n] = s0; ws[(2 * j + 1) * NR8 + n] = s1; wm[2 * j * NR8 + n] = m0; wm[(2 * j + 1) * NR8 + n] = m1; }
      }
    }
#endif
#pragma clang loop unroll(full)
    for (int jj = 0; jj < NSTEP; jj++) transpose16(r[jj], wq + (size_t)(g * NSTEP + jj - k0 / 32) * 8 * 64);
  }
}

/* out[m0..m0+mr, n0..n0+nr] (+)= the panel's product with rows m0..m0+mr of the rounded x; mr is a constant in each copy */
INLINE void micro8(float *restrict out, const u8 *restrict wq, const float *restrict ws, const float *restrict wm, const i8 *restrict xq,
                   const float *restrict xd, const float *restrict xs, int m0, const int mr, int n0, int nr, int k0, int kc) {
  f32x16 acc[MR8];
  for (int i = 0; i < mr; i++) {
    float *o = out + (size_t)(m0 + i) * N + n0;
    if (k0 == 0) acc[i] = (f32x16){0};
    else if (nr == NR8) acc[i] = load16(o);
    else for (int n = 0; n < 16; n++) acc[i][n] = n < nr ? o[n] : 0.0f;
  }
  for (int g = 0; g < kc / G; g++) {
    i32x16 ia[MR8];
    const int kg = (k0 + g * G) / G, kb = (k0 + g * G) / 32;
    for (int i = 0; i < mr; i++) ia[i] = OFF ? (i32x16){0} + ((const int *)xs)[(size_t)(m0 + i) * NG + kg] : (i32x16){0};
#pragma clang loop unroll(full)
    for (int c = 0; c < G / 4; c++) {
      u8x64 wv; __builtin_memcpy(&wv, wq + (size_t)(g * (G / 4) + c) * 64, 64);
      for (int i = 0; i < mr; i++) {
        int xb; __builtin_memcpy(&xb, xq + (size_t)(m0 + i) * XK + k0 + g * G + 4 * c, 4);
        ia[i] = dpbusd(ia[i], wv, (i8x64)((i32x16){0} + xb));
      }
    }
    const f32x16 s = load16(ws + g * NR8), mn = load16(wm + g * NR8);
    for (int i = 0; i < mr; i++) {   /* two multiply-adds, not a multiply, a multiply-add and an add */
      acc[i] += __builtin_convertvector(ia[i], f32x16) * (s * xd[(size_t)(m0 + i) * (K / 32) + kb]);
      if (!OFF) acc[i] += mn * xs[(size_t)(m0 + i) * NG + kg];
    }
  }
  for (int i = 0; i < mr; i++) {
    float *o = out + (size_t)(m0 + i) * N + n0;
    if (nr == NR8) store16(o, acc[i]);
    else for (int n = 0; n < nr; n++) o[n] = acc[i][n];
  }
}

/* xr: x rounded by the rounding kernel (round_source); prefetch_panel: kernels/quant_matmul.py's source, which holds this one */
INLINE void tiled8(float *restrict out, const u8 *restrict w, const u8 *restrict xr, int r0, int r1) {
  const i8 *xq = (const i8 *)xr;
  const float *xd = (const float *)(xq + (size_t)M * XK), *xs = xd + (size_t)M * (K / 32);
  u8 wq[KC * NR8] __attribute__((aligned(64))); float ws[KC / G * NR8] __attribute__((aligned(64))), wm[KC / G * NR8] __attribute__((aligned(64)));
  for (int n0 = r0; n0 < r1; n0 += NR8) {
    const int nr = r1 - n0 < NR8 ? r1 - n0 : NR8;
    for (int k0 = 0; k0 < K; k0 += KC) {
      const int kc = K - k0 < KC ? K - k0 : KC;
      panel8(wq, ws, wm, w, n0, nr, k0, kc);
      if (n0 + NR8 < r1) prefetch_panel(w, n0 + NR8, r1 - n0 - NR8 < NR8 ? r1 - n0 - NR8 : NR8, k0, kc);
      int m0 = 0;
      for (; m0 + MR8 <= M; m0 += MR8) micro8(out, wq, ws, wm, xq, xd, xs, m0, MR8, n0, nr, k0, kc);
      switch (M - m0) {
%(tails)s
      }
    }
  }
}
"""

# the rounding kernel: x (M, K) float32 -> one buffer of its int8 quants (a row XK apart), then per block of 32 the scale, then
# per group the sum; rows split in PARTS parts (any count: a row is rounded the same way in any part)
ROUND_SOURCE = r"""
typedef unsigned char u8; typedef signed char i8; typedef unsigned long size_t;
typedef float f32x16 __attribute__((vector_size(64))); typedef int i32x16 __attribute__((vector_size(64)));
typedef signed char i8x16 __attribute__((vector_size(16)));
#define KERNEL __attribute__((no_builtin("memset"), no_builtin("memcpy")))
#define INLINE static inline __attribute__((always_inline)) KERNEL
#define M %(M)d
#define K %(K)d
#define G %(G)d
#define OFF %(OFF)d
#define NG (K / G)
#define XK (K + 64)
#define PARTS %(parts)d
INLINE f32x16 load16(const float *p) { f32x16 v; __builtin_memcpy(&v, p, 64); return v; }
/* a block's max |x| and its quants' sum as trees of lane shuffles (a serial loop of compares and adds was most of the kernel's
   time): a max and a sum of integers are exact in any order, so the bits are the serial loop's */
INLINE f32x16 vmax(f32x16 a, f32x16 b) { const i32x16 m = a > b; return (f32x16)(((i32x16)a & m) | ((i32x16)b & ~m)); }
#define HALVES(v, op) \
  v = op(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7)); \
  v = op(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11)); \
  v = op(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13)); \
  v = op(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
#define ADD(a, b) ((a) + (b))
INLINE float hmax(f32x16 v) { HALVES(v, vmax) return v[0]; }
INLINE int hsumi(i32x16 v) { HALVES(v, ADD) return v[0]; }
/* rows i0..i1 of x: xq its int8 quants (x's order), xd per block of 32 the scale max|x|/127, xs per group the sum of the rounded x
   (with OFF: in its place, as an int, -OFF times the sum of the quants) */
INLINE void round_x(const float *restrict x, i8 *restrict xq, float *restrict xd, float *restrict xs, int i0, int i1) {
  /* x inv rounded to float32 before its rounding to an integer (a fused multiply-add would round the exact product, and the
     two differ where x inv lies within half a float32 step of a half-integer) */
#pragma clang fp contract(off)
  for (int i = i0; i < i1; i++) for (int b = 0; b < K / 32; b++) {
    const float *xb = x + (size_t)i * K + b * 32;
    f32x16 lo = load16(xb), hi = load16(xb + 16);
    const float amax = hmax(vmax((f32x16)((i32x16)lo & 0x7fffffff), (f32x16)((i32x16)hi & 0x7fffffff)));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f, d = amax / 127.0f;
    /* round to nearest even: adding 1.5 * 2^23 puts the integer in the low mantissa bits */
    i32x16 ql = (i32x16)(lo * inv + 12582912.0f) - 0x4B400000, qh = (i32x16)(hi * inv + 12582912.0f) - 0x4B400000;
    i8x16 l8 = __builtin_convertvector(ql, i8x16), h8 = __builtin_convertvector(qh, i8x16);
    __builtin_memcpy(xq + (size_t)i * XK + b * 32, &l8, 16); __builtin_memcpy(xq + (size_t)i * XK + b * 32 + 16, &h8, 16);
    xd[(size_t)i * (K / 32) + b] = d;
    const float sl = (float)hsumi(ql), sh = (float)hsumi(qh);
    if (OFF) {
      int *xo = (int *)xs + (size_t)i * NG;
      if (G == 32) xo[b] = -OFF * (int)(sl + sh);
      else { xo[2 * b] = -OFF * (int)sl; xo[2 * b + 1] = -OFF * (int)sh; }
    }
    else if (G == 32) xs[(size_t)i * NG + b] = (sl + sh) * d;
    else { xs[(size_t)i * NG + 2 * b] = sl * d; xs[(size_t)i * NG + 2 * b + 1] = sh * d; }
  }
}

KERNEL void %(name)s(u8 *restrict xr, const float *restrict x, int core_id) {
  if (PARTS == 1) core_id = 0;   /* a one-part kernel is called without a core_id */
  i8 *xq = (i8 *)xr;
  float *xd = (float *)(xq + (size_t)M * XK), *xs = xd + (size_t)M * (K / 32);
  round_x(x, xq, xd, xs, (int)((long)core_id * M / PARTS), (int)((long)(core_id + 1) * M / PARTS));
}
"""

def round_source(ggml_type: int, M: int, K: int, parts: int) -> tuple[str, str]:
  """(function name, C source) of the kernel that rounds x (M, K) for the int8 tiled kernel of `ggml_type`, in `parts` parts."""
  G, OFF = group(ggml_type), OFFSET.get(ggml_type, 0)
  name = f"round_x_int8_g{G}_o{OFF}_{M}_{K}_p{parts}"
  return name, ROUND_SOURCE % {"name": name, "M": M, "K": K, "G": G, "OFF": OFF, "parts": parts}

def source(ggml_type: int) -> str:
  """The C of the int8 tiled kernel (tiled8) for `ggml_type`."""
  tails = "\n".join(f"        case {i}: if ({i} < MR8) micro8(out, wq, ws, wm, xq, xd, xs, m0, {i}, n0, nr, k0, kc); break;" for i in range(1, 8))
  i64 = ", ".join(map(str, range(64)))
  krow = KROW % {"quants": _KROW[ggml_type] % {"i64": i64}, "lo": ", ".join(map(str, range(32))), "hi": ", ".join(map(str, range(32, 64)))} \
    if ggml_type in _KROW else ""
  return transpose_source() + SOURCE % {"G": group(ggml_type), "OFF": OFFSET.get(ggml_type, 0), "tails": tails, "krow": krow}

def transpose_source() -> str:
  """The C of transpose16 (16 rows of 8 dwords -> 8 vectors of 16 dwords), shared with kernels/bf16_gemm.py."""
  return TRANSPOSE % {"butterflies": _butterflies(), "zip8": ", ".join(f"{i}, {8 + i}" for i in range(8))}

def _butterflies() -> str:
  """C of the 8 x 8 qword transpose v[k][l] -> v[l][k]: for bit b, rows k and k|b swap the lanes whose bit b differs from theirs."""
  lines = []
  for b in (1, 2, 4):
    lo = ", ".join(str(8 + (l ^ b) if l & b else l) for l in range(8))
    hi = ", ".join(str(8 + l if l & b else l ^ b) for l in range(8))
    for k in (k for k in range(8) if not k & b):
      lines.append(f"  {{ const u64x8 a = v[{k}], c = v[{k | b}]; v[{k}] = __builtin_shufflevector(a, c, {lo}); "
                   f"v[{k | b}] = __builtin_shufflevector(a, c, {hi}); }}")
  return "\n".join(lines)
