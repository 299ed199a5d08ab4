"""Paged attention as hand-written C for CPU devices (HET on a CPU, MESH, CPU): flash-decoding for decode rows, and tiles of
query rows sharing one block table for a chunked prefill. Same pool layout, arguments and result as
kernels/paged_attention.py (whose tinygrad kernel stays the path for other devices and for block sizes that are not a
multiple of 16).

Why C: tinygrad renders the tinygrad kernel's loops as scalar C per (row, kv head), so a chunk of C prefill rows reads every
K, V block C times and converts it from float16 each time, and its exp is a scalar call per score. Here:
- a work item is a tile of query vectors sharing a kv head: a decode row's G = n_heads / n_kv heads (grouped-query: K and V
  are read once for the group), or in a prefill QR consecutive rows x G heads (QR * G vectors per K, V block read);
- per 16-token slice of a block, K (stored (head_dim, block) per head) and V are converted to float32 once (F16C's
  vcvtph2ps on x86; bfloat16 is a 16-bit shift) into an L1 buffer and reused by every vector of the tile;
- scores are 16-lane vectors (one per query vector: acc += q[d] * K[d, t0:t0+16]), up to 8 independent accumulators;
  the online softmax is in base 2 (q pre-scaled by log2(e) / sqrt(head_dim)) with a vector exp2 (Cephes' polynomial,
  relative error ~2e-7); the reference max moves (and the sums are rescaled) only when a score passes it by more than
  2^8, so most slices need no horizontal max; the weight sums stay 16-lane vectors; o += p V with 8 rows' accumulators;
- items are dealt round-robin to the parts (core_id), so a causal prefill's long and short tiles spread evenly.
Decode rows are cut along the context into `splits` parts (per row from its real length: blocks [p * per, (p + 1) * per),
per = ceil(row blocks / splits)); with splits > 1 each part writes (o, m, l) and a second kernel merges them. A decode
step may read its count at run time (split_count): a row's sums then depend on that count and its own length only, not on
how many rows the step has, so a speculative verify's rows get the bits of the plain step of their sequences.
Masking: a slot at or past a vector's length scores -inf-like (a select, never a multiply, so stale NaN bytes never reach the
result); V rows past the tile's longest length are zeroed before use. Within a prefill tile the rows share the block table
and the K, V of every position below the tile's longest length are stored (a chunk's own tokens are scattered first).
"""
from __future__ import annotations
import functools, math
from tinygrad import Device, Tensor, dtypes
from tinygrad.dtype import DType
from tinygrad.runtime.ops_cpu import CPUProgram
from tinyhet.kernels.c_program import c_program
from tinyhet.kernels.kv_quant import C_LOADS, SCATTER, block_size_of

# int8: q8_0; uint16: bfloat16 bits (kernels/kv_quant.py)
KV_CODES = {dtypes.float32: 0, dtypes.float16: 1, dtypes.uint16: 2, dtypes.int8: 3, dtypes.fp8e4m3: 4, dtypes.fp8e5m2: 5}
QR = 8      # prefill query rows per tile (x G heads = the vectors that share one K, V read)

_SOURCE = r"""
typedef float f32x16 __attribute__((vector_size(64)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef int i32x16 __attribute__((vector_size(64)));
typedef unsigned int u32x16 __attribute__((vector_size(64)));
typedef unsigned short u16x16 __attribute__((vector_size(32)));
typedef short i16x16 __attribute__((vector_size(32)));
typedef unsigned long size_t;
#define KERNEL __attribute__((no_builtin("memset"), no_builtin("memcpy")))
#define INLINE static inline __attribute__((always_inline)) KERNEL
#define D %(D)d
#define DV (D / 16)
#define BS %(BS)d
#define KVH %(KVH)d
#define G %(G)d
#define H (KVH * G)
#define R %(R)d
#define CAP %(CAP)d
#define NBLK %(NBLK)d
#define P %(P)d
%(SPLIT_COUNT)s
#define QR %(QR)d
#define NQ %(NQ)d
#define PARTS %(PARTS)d
#define SHARED %(SHARED)d
#define KVB %(KVB)d
#define X (BS * D)
#define NEG (-1e30f)
#define SLACK 8.0f   /* how far (base 2) a score may pass the reference max before the max moves */
#define AHEAD 4   /* blocks of prefetch distance (1, 2, 4 measured: 4 a few percent ahead, within the noise) */
#define SCALE %(SCALE).9ef
#define TX %(TX)d   /* a tile's length in pool elements (kernels/kv_quant.py: tile_len) */
#if KVB == 0
typedef float KVT;
#elif KVB <= 2
typedef unsigned short KVT;
#else
typedef unsigned char KVT;   /* 8-bit tiles, as bytes (q8_0: the int8 values, then the float16 scales) */
#endif
#if KVB >= 3
typedef float CT;            /* 8-bit: each 16-token slice is dequantized into L1 buffers, K (D, 16) and V (16, D) float32
                                (a decode step over q8_0 reads its tiles in place: scores_q8, pv_q8) */
#define KS 16
#else
typedef KVT CT;              /* the tiles are read in place, converted in the loops */
#define KS BS
#endif
%(LOADS)s

/* 16 KV elements -> 16 float32 */
INLINE f32x16 ld(const CT *p) {
#if KVB == 0 || KVB >= 3
  f32x16 v; __builtin_memcpy(&v, p, 64); return v;
#elif KVB == 2
  u16x16 h; __builtin_memcpy(&h, p, 32);
  return (f32x16)(__builtin_convertvector(h, u32x16) << 16);
#elif defined(__AVX512F__)
  i16x16 h; __builtin_memcpy(&h, p, 32);
  return __builtin_ia32_vcvtph2ps512_mask(h, (f32x16){0}, (unsigned short)0xffff, 4);
#else
  /* float16 without F16C: exponent and mantissa shifted into place, scaled by 2^112 (normal and subnormal halves exact; an
     inf or NaN half becomes a large finite value, only ever in a masked slot) */
  u16x16 h; __builtin_memcpy(&h, p, 32);
  u32x16 w = __builtin_convertvector(h, u32x16), bits = (w & 0x7fffu) << 13;
  f32x16 f = (f32x16)bits * 0x1p112f;
  return (f32x16)((u32x16)f | (w & 0x8000u) << 16);
#endif
}
INLINE f32x16 splat(float x) { return (f32x16){0} + x; }
INLINE f32x16 sel(i32x16 m, f32x16 a, f32x16 b) { return (f32x16)(((i32x16)a & m) | ((i32x16)b & ~m)); }
INLINE float hsum(f32x16 v) {
  f32x8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  float s = 0.0f;
  for (int i = 0; i < 8; i++) s += a[i];
  return s;
}
/* 2^x for x <= 0 (Cephes exp2f: x = n + f, |f| <= 1/2, 2^f by a degree-6 polynomial); below -126: 0 */
INLINE f32x16 exp2v(f32x16 x) {
  i32x16 under = x < -126.0f;
  x = __builtin_elementwise_max(x, splat(-126.0f));
  f32x16 n = (x + 12582912.0f) - 12582912.0f, f = x - n;
  f32x16 p = splat(1.535336188319500e-4f);
  p = p * f + 1.339887440266574e-3f; p = p * f + 9.618437357674640e-3f; p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f; p = p * f + 6.931472028550421e-1f; p = p * f + 1.0f;
  f32x16 r = p * (f32x16)((__builtin_convertvector(n, i32x16) + 127) << 23);
  return (f32x16)((i32x16)r & ~under);
}
INLINE float exp2s(float x) { return exp2v(splat(x))[0]; }

/* s[u] = q[u] . K[:, t0:t0+16] for n query vectors (n a constant after inlining), K read and converted in the loop (kp: the
   tile's column t0); up to 4 vectors, two accumulators each (even and odd d), so at least 4 independent FMA chains */
INLINE void scores(const int n, const CT *restrict kp, const float *restrict q, f32x16 *restrict s) {
  const int two = n <= 4;
  f32x16 a[8], b[4];
  for (int u = 0; u < n; u++) a[u] = (f32x16){0};
  for (int u = 0; u < 4; u++) b[u] = (f32x16){0};
  for (int d = 0; d < D; d += 2) {
    f32x16 k0 = ld(kp + d * KS), k1 = ld(kp + (d + 1) * KS);
    for (int u = 0; u < n; u++) {
      a[u] += q[u * D + d] * k0;
      if (two) b[u & 3] += q[u * D + d + 1] * k1; else a[u] += q[u * D + d + 1] * k1;
    }
  }
  for (int u = 0; u < n; u++) s[u] = two ? a[u] + b[u & 3] : a[u];
}

#if KVB == 3 && QR == 0
/* decode over a q8_0 pool: scores' sums read K's int8 slice t0 in place, each group of 32 dims summed in float32, then
   scaled per token by the group's scale: no float copy of the slice, which a decode row's few vectors (G a kv head) do
   not amortize (batch 1 at a 4,096-token context: 1.09x the tok/s of the copy on a 2-core AMD EPYC) */
INLINE void scores_q8(const int n, const KVT *restrict kp, int t0, const float *restrict q, f32x16 *restrict s) {
  const int two = n <= 4;
  const unsigned short *sc = (const unsigned short *)(kp + BS * D);
  for (int u = 0; u < n; u++) s[u] = (f32x16){0};
  for (int g = 0; g < D / 32; g++) {
    f32x16 a[8], b[4];
    for (int u = 0; u < n; u++) a[u] = (f32x16){0};
    for (int u = 0; u < 4; u++) b[u] = (f32x16){0};
    for (int d = g * 32; d < g * 32 + 32; d += 2) {
      f32x16 k0 = ld_i8((const signed char *)kp + d * BS + t0), k1 = ld_i8((const signed char *)kp + (d + 1) * BS + t0);
      for (int u = 0; u < n; u++) {
        a[u] += q[u * D + d] * k0;
        if (two) b[u & 3] += q[u * D + d + 1] * k1; else a[u] += q[u * D + d + 1] * k1;
      }
    }
    f32x16 sg = ld_h(sc + g * BS + t0);
    for (int u = 0; u < n; u++) s[u] += sg * (two ? a[u] + b[u & 3] : a[u]);
  }
}
/* o[u] += sum_t w[u][t] V[t] over V's int8 rows t0..t0+nv-1 in place: each token's scale per group of 32 dims folded into
   the weights first (rows past nv, stale bytes and scales, are never read) */
INLINE void pv_q8(const int n, const KVT *restrict vp, int t0, int nv, const float (*restrict w)[16], float *restrict o) {
  const unsigned short *sc = (const unsigned short *)(vp + BS * D);
  const signed char *vr = (const signed char *)vp + (size_t)t0 * D;
  float wg[D / 32][8][16];
  for (int g = 0; g < D / 32; g++) {
    f32x16 sg = ld_h(sc + g * BS + t0);
    for (int u = 0; u < n; u++) { f32x16 x; __builtin_memcpy(&x, w[u], 64); x *= sg; __builtin_memcpy(wg[g][u], &x, 64); }
  }
  if (n * DV <= 16) {
    f32x16 a[16];
    for (int u = 0; u < n; u++) for (int dv = 0; dv < DV; dv++) __builtin_memcpy(&a[u * DV + dv], o + u * D + dv * 16, 64);
    for (int t = 0; t < nv; t++)
      for (int dv = 0; dv < DV; dv++) {
        f32x16 v = ld_i8(vr + t * D + dv * 16);
        for (int u = 0; u < n; u++) a[u * DV + dv] += wg[dv / 2][u][t] * v;
      }
    for (int u = 0; u < n; u++) for (int dv = 0; dv < DV; dv++) __builtin_memcpy(o + u * D + dv * 16, &a[u * DV + dv], 64);
    return;
  }
  for (int dv = 0; dv < DV; dv++) {
    f32x16 a[8];
    for (int u = 0; u < n; u++) __builtin_memcpy(&a[u], o + u * D + dv * 16, 64);
    for (int t = 0; t < nv; t++) {
      f32x16 v = ld_i8(vr + t * D + dv * 16);
      for (int u = 0; u < n; u++) a[u] += wg[dv / 2][u][t] * v;
    }
    for (int u = 0; u < n; u++) __builtin_memcpy(o + u * D + dv * 16, &a[u], 64);
  }
}
#define SCORES(c) scores_q8(c, kp, t0, qs + i * D, s + i)
#define PV(c) pv_q8(c, vp, t0, nv, w + i, o + i * D)
#else
#define SCORES(c) scores(c, ks, qs + i * D, s + i)
#define PV(c) pv(c, vrows, w + i, o + i * D)
#endif
/* o[u] += sum_t w[u][t] V[t] for n query vectors (vp: V row t0, rows D apart): all of o's vectors in registers where they
   fit (n * DV <= 16), else one column of DV at a time */
INLINE void pv(const int n, const CT *restrict vp, const float (*restrict w)[16], float *restrict o) {
  if (n * DV <= 16) {
    f32x16 a[16];
    for (int u = 0; u < n; u++) for (int dv = 0; dv < DV; dv++) __builtin_memcpy(&a[u * DV + dv], o + u * D + dv * 16, 64);
    for (int t = 0; t < 16; t++)
      for (int dv = 0; dv < DV; dv++) {
        f32x16 v = ld(vp + t * D + dv * 16);
        for (int u = 0; u < n; u++) a[u * DV + dv] += w[u][t] * v;
      }
    for (int u = 0; u < n; u++) for (int dv = 0; dv < DV; dv++) __builtin_memcpy(o + u * D + dv * 16, &a[u * DV + dv], 64);
    return;
  }
  for (int dv = 0; dv < DV; dv++) {
    f32x16 a[8];
    for (int u = 0; u < n; u++) __builtin_memcpy(&a[u], o + u * D + dv * 16, 64);
    for (int t = 0; t < 16; t++) {
      f32x16 v = ld(vp + t * D + dv * 16);
      for (int u = 0; u < n; u++) a[u] += w[u][t] * v;
    }
    for (int u = 0; u < n; u++) __builtin_memcpy(o + u * D + dv * 16, &a[u], 64);
  }
}

#if KVB >= 3
/* one 16-token slice t0 of an 8-bit K tile -> kb (D, 16) float32; of a V tile -> vb (16, D), rows nv.. zero */
INLINE void deq_k(const KVT *restrict kp, int t0, float *restrict kb) {
#if KVB == 3
  const unsigned short *sc = (const unsigned short *)(kp + BS * D);
  for (int g = 0; g < D / 32; g++) {
    f32x16 s = ld_h(sc + g * BS + t0);
    for (int d = g * 32; d < g * 32 + 32; d++) {
      f32x16 x = ld_i8((const signed char *)kp + d * BS + t0) * s;
      __builtin_memcpy(kb + d * 16, &x, 64);
    }
  }
#else
  for (int d = 0; d < D; d++) {
    f32x16 x = ld_fp8(kp + d * BS + t0, KVB == 4 ? 3 : 2, KVB == 4 ? 7 : 15);
    __builtin_memcpy(kb + d * 16, &x, 64);
  }
#endif
}
INLINE void deq_v(const KVT *restrict vp, int t0, int nv, float *restrict vb) {
#if KVB == 3
  const unsigned short *sc = (const unsigned short *)(vp + BS * D);
  f32x16 s[D / 32];
  for (int g = 0; g < D / 32; g++) s[g] = ld_h(sc + g * BS + t0);
#endif
  for (int t = 0; t < 16; t++)
    for (int dv = 0; dv < DV; dv++) {
      f32x16 x = (f32x16){0};
#if KVB == 3
      if (t < nv) x = ld_i8((const signed char *)vp + (t0 + t) * D + dv * 16) * s[dv / 2][t];
#else
      if (t < nv) x = ld_fp8(vp + (t0 + t) * D + dv * 16, KVB == 4 ? 3 : 2, KVB == 4 ? 7 : 15);
#endif
      __builtin_memcpy(vb + t * D + dv * 16, &x, 64);
    }
}
#endif

/* one block jb (kp, vp: its K and V tiles of one kv head) for the tile's nq vectors qs (scaled by SCALE); vector i sees
   tokens 0..len[i]-1; maxlen: the largest len. m, l, o: reference max (base 2), weight sums (16 lanes), weighted V sum per vector */
INLINE void block(const KVT *restrict kp, const KVT *restrict vp, int jb, int nq, const float *restrict qs, const int *restrict len,
                  int maxlen, float *restrict m, f32x16 *restrict l, float *restrict o) {
  f32x16 s[NQ];
  float w[NQ][16];
#if KVB == 3 && QR == 0
#elif KVB >= 3
  float kb[D * 16], vb[16 * D];
#else
  KVT vtail[16 * D];
#endif
  const i32x16 iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  for (int t0 = 0; t0 < BS; t0 += 16) {
    int tok0 = jb * BS + t0;
    if (tok0 >= maxlen) break;
    int nv = maxlen - tok0 < 16 ? maxlen - tok0 : 16;
#if KVB == 3 && QR == 0
    /* scores_q8, pv_q8: the int8 tiles read in place */
#elif KVB >= 3
    deq_k(kp, t0, kb);
    deq_v(vp, t0, nv, vb);   /* V rows past the tile's longest length: zeros */
    const CT *ks = kb, *vrows = vb;
#else
    const CT *ks = kp + t0, *vrows = vp + t0 * D;
    if (nv < 16) {   /* the last slice: V rows past the tile's longest length may hold stale bytes (NaN): zeros instead */
      for (int i = 0; i < 16 * D; i++) vtail[i] = i < nv * D ? vrows[i] : 0;
      vrows = vtail;
    }
#endif
    for (int i = 0; i < nq; i += 8) {
      switch (nq - i < 8 ? nq - i : 8) {
        case 8: SCORES(8); break;   case 7: SCORES(7); break;   case 6: SCORES(6); break;   case 5: SCORES(5); break;
        case 4: SCORES(4); break;   case 3: SCORES(3); break;   case 2: SCORES(2); break;   default: SCORES(1); break;
      }
    }
    for (int i = 0; i < nq; i++) {
      int nvalid = len[i] - tok0;
      i32x16 ok = iota < nvalid;
      f32x16 si = nvalid < 16 ? sel(ok, s[i], splat(NEG)) : s[i];
      /* the reference max m moves only when a score passes it by more than SLACK: weights stay below 2^SLACK, and most
         slices take no horizontal max and no rescale */
      if (__builtin_reduce_or(si > m[i] + SLACK)) {
        float mn = __builtin_reduce_max(si), c = exp2s(m[i] - mn);
        l[i] *= c;
        for (int d = 0; d < D; d++) o[i * D + d] *= c;
        m[i] = mn;
      }
      f32x16 p = exp2v(si - m[i]);
      if (nvalid < 16) p = sel(ok, p, splat(0.0f));
      l[i] += p;
      __builtin_memcpy(w[i], &p, 64);
    }
    for (int i = 0; i < nq; i += 8) {
      switch (nq - i < 8 ? nq - i : 8) {
        case 8: PV(8); break;   case 7: PV(7); break;   case 6: PV(6); break;   case 5: PV(5); break;
        case 4: PV(4); break;   case 3: PV(3); break;   case 2: PV(2); break;   default: PV(1); break;
      }
    }
  }
}

INLINE const KVT *tile(const KVT *pool, int blk, int kv, int kvh) { return pool + (((size_t)blk * 2 + kv) * KVH + kvh) * TX; }
INLINE int block_id(const int *bt, int jb) {
  int blk = bt[jb];
  return (unsigned)blk < (unsigned)NBLK ? blk : 0;    /* a bad id reads block 0, never outside the pool */
}
/* blocks [b0, b1) of table bt for kv heads kvh0..kvh0+nkv-1, nqh vectors each (vector k * nqh + i is kv head kvh0 + k's).
   The tiles AHEAD blocks on are prefetched while this one is computed (a sequence's blocks need not be adjacent). */
INLINE void attend(const KVT *restrict pool, const int *restrict bt, int kvh0, int nkv, int b0, int b1, int nqh, const float *restrict qs,
                   const int *restrict len, int maxlen, float *restrict m, f32x16 *restrict l, float *restrict o) {
  for (int jb = b0; jb < b1; jb++) {
    int blk = block_id(bt, jb), nxt = jb + AHEAD < b1 ? block_id(bt, jb + AHEAD) : blk;
    for (int k = 0; k < nkv; k++) {
      const KVT *nk = tile(pool, nxt, 0, kvh0 + k), *nv = tile(pool, nxt, 1, kvh0 + k);
      for (int c = 0; c < TX * (int)sizeof(KVT); c += 64) { __builtin_prefetch((const char *)nk + c); __builtin_prefetch((const char *)nv + c); }
      int i = k * nqh;
      block(tile(pool, blk, 0, kvh0 + k), tile(pool, blk, 1, kvh0 + k), jb, nqh, qs + i * D, len + i, maxlen, m + i, l + i, o + i * D);
    }
  }
}

INLINE void start(int nq, float *m, f32x16 *l, float *o) {
  for (int i = 0; i < nq; i++) { m[i] = NEG; l[i] = (f32x16){0}; }
  for (int i = 0; i < nq * D; i++) o[i] = 0.0f;
}

#if QR == 0
/* decode: item (row r, part p), every kv head (a block's K, V tiles of all heads are one contiguous span); out is (R, H, D)
   where P == 1, else the partials (R, H, P, D + 2): o, then m, l */
KERNEL void %(name)s(float *restrict out, const float *restrict q, const KVT *restrict pool, const int *restrict bt,
                     const int *restrict lens, SPLIT_ARG int core_id) {
  if (PARTS == 1) core_id = 0;
  float qs[H * D], m[H], o[H * D];
  f32x16 l[H];   /* the weight sums, 16 lanes each until the end */
  int len[H];
  const int np = SPLITS;   /* the step's parts a row (at most P, the partials' stride) */
  for (int it = core_id; it < R * np; it += PARTS) {
    int r = it / np, p = it %% np;
    int n = lens[r], nblk = (n + BS - 1) / BS, per = (nblk + np - 1) / np, b0 = p * per, b1 = b0 + per < nblk ? b0 + per : nblk;
    for (int i = 0; i < H; i++) {
      len[i] = n;
      for (int d = 0; d < D; d++) qs[i * D + d] = q[((size_t)r * H + i) * D + d] * SCALE;
    }
    start(H, m, l, o);
    attend(pool, bt + (size_t)(SHARED ? 0 : r) * CAP, 0, KVH, b0, b1, G, qs, len, n, m, l, o);
    for (int i = 0; i < H; i++) {
      size_t h = (size_t)r * H + i;
      if (P == 1) { float inv = 1.0f / hsum(l[i]); for (int d = 0; d < D; d++) out[h * D + d] = o[i * D + d] * inv; }
      else {
        float *dst = out + (h * P + p) * (D + 2);
        for (int d = 0; d < D; d++) dst[d] = o[i * D + d];
        dst[D] = m[i]; dst[D + 1] = hsum(l[i]);
      }
    }
  }
}
#else
/* prefill: item (tile of QR consecutive rows sharing block-table row 0, kv head); out is (R, H, D) */
KERNEL void %(name)s(float *restrict out, const float *restrict q, const KVT *restrict pool, const int *restrict bt,
                     const int *restrict lens, int core_id) {
  if (PARTS == 1) core_id = 0;
  float qs[NQ * D], m[NQ], o[NQ * D];
  f32x16 l[NQ];
  int len[NQ];
  const int tiles = (R + QR - 1) / QR;
  for (int it = core_id; it < tiles * KVH; it += PARTS) {
    int r0 = it / KVH * QR, kvh = it %% KVH, qr = R - r0 < QR ? R - r0 : QR, nq = qr * G, maxlen = 0;
    for (int u = 0; u < qr; u++) {
      int n = lens[r0 + u];
      if (n > maxlen) maxlen = n;
      for (int g = 0; g < G; g++) {
        len[u * G + g] = n;
        for (int d = 0; d < D; d++) qs[(u * G + g) * D + d] = q[((size_t)(r0 + u) * H + kvh * G + g) * D + d] * SCALE;
      }
    }
    start(nq, m, l, o);
    attend(pool, bt, kvh, 1, 0, (maxlen + BS - 1) / BS, nq, qs, len, maxlen, m, l, o);
    for (int u = 0; u < qr; u++)
      for (int g = 0; g < G; g++) {
        int i = u * G + g;
        float inv = 1.0f / hsum(l[i]);
        for (int d = 0; d < D; d++) out[((size_t)(r0 + u) * H + kvh * G + g) * D + d] = o[i * D + d] * inv;
      }
  }
}
#endif
"""

_MERGE = r"""
typedef unsigned long size_t;
#define KERNEL __attribute__((no_builtin("memset"), no_builtin("memcpy")))
#define D %(D)d
#define P %(P)d
#define RH %(RH)d
#define PARTS %(PARTS)d
%(SPLIT_COUNT)s
typedef float f32x16 __attribute__((vector_size(64)));
typedef int i32x16 __attribute__((vector_size(64)));
static inline __attribute__((always_inline)) float exp2s(float x) {   /* 2^x, x <= 0, as the attention kernel's */
  if (x < -126.0f) return 0.0f;
  float n = (x + 12582912.0f) - 12582912.0f, f = x - n, p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f; p = p * f + 9.618437357674640e-3f; p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f; p = p * f + 6.931472028550421e-1f; p = p * f + 1.0f;
  int e = ((int)n + 127) << 23; float s; __builtin_memcpy(&s, &e, 4);
  return p * s;
}
/* out (R, H, D) from the parts' (o, m, l): every part's weights rescaled to the overall max */
KERNEL void %(name)s(float *restrict out, const float *restrict part, SPLIT_ARG int core_id) {
  if (PARTS == 1) core_id = 0;
  const int np = SPLITS;   /* parts written a row (one part: o / l, as the kernel's own P == 1 output) */
  for (int rh = core_id; rh < RH; rh += PARTS) {
    const float *pp = part + (size_t)rh * P * (D + 2);
    float mx = -1e30f, den = 0.0f, acc[D];
    for (int p = 0; p < np; p++) if (pp[p * (D + 2) + D] > mx) mx = pp[p * (D + 2) + D];
    for (int d = 0; d < D; d++) acc[d] = 0.0f;
    for (int p = 0; p < np; p++) {
      const float *x = pp + p * (D + 2);
      if (x[D + 1] == 0.0f) continue;   /* a part with no valid token */
      float w = exp2s(x[D] - mx);
      den += w * x[D + 1];
      for (int d = 0; d < D; d++) acc[d] += w * x[d];
    }
    float inv = 1.0f / den;
    for (int d = 0; d < D; d++) out[(size_t)rh * D + d] = acc[d] * inv;
  }
}
"""

def cpu_compiled(device: str) -> bool:
  """Whether `device` runs C compiled for this CPU (tinygrad's CPU device, HET on a CPU, MESH): where these kernels apply."""
  try: rt = Device[Device.canonicalize(device)].runtime_t
  except Exception: return False
  return isinstance(rt, type) and issubclass(rt, CPUProgram)

def supported(device: str, kv_dtype: DType, head_dim: int, block_size: int) -> bool:
  """Whether the C kernels take this case: a CPU device, a pool of a KV format (kernels/kv_quant.py), head_dim and
  block_size multiples of 16 (q8_0: head_dim of 32)."""
  if kv_dtype not in KV_CODES or head_dim % (32 if kv_dtype == dtypes.int8 else 16) or block_size % 16: return False
  return isinstance(device, str) and cpu_compiled(device)

# the decode and merge kernels' part count a row, 1..P: read at run time with RT (one capture serves steps of any count),
# else P itself
_SPLIT_COUNT = r"""#if %(RT)d
#define SPLIT_ARG const int *restrict nsplit,
#define SPLITS (nsplit[0] < 1 ? 1 : nsplit[0] > P ? P : nsplit[0])
#else
#define SPLIT_ARG
#define SPLITS P
#endif"""

@functools.cache
def _source(kind: str, **kw) -> tuple[str, str]:
  name = f"cpu_attention_{kind}_" + "_".join(f"{k}{v}" for k, v in sorted(kw.items()) if k != "SCALE").lower()
  template = {"merge": _MERGE, "scatter": SCATTER}.get(kind, _SOURCE)
  split_count = _SPLIT_COUNT % kw if kind in ("decode", "merge") else ""
  return name, template % {**kw, "name": name, "LOADS": C_LOADS, "SPLIT_COUNT": split_count}

def cpu_paged_attention(q: Tensor, pool: Tensor, block_tables: Tensor, context_lens: Tensor, threads: int, splits: int = 1,
                        shared_table: bool = False, prefill: bool = False, split_count: Tensor | None = None) -> Tensor:
  """paged_attention's result, (R, n_heads, head_dim) float32, by the C kernels split over `threads` parts.
  splits: parts along each decode row's context (merged by a second kernel past 1). shared_table: every row reads block-table
  row 0 (one sequence's rows). prefill: tiles of QR consecutive rows (needs shared_table; the rows' K, V below the tile's
  longest length are stored, as a chunked prefill's are). split_count: a decode step's part count, (1,) int32 read when the
  kernels run, 1..splits (splits the most, the partials' size): one capture serves steps of any count, and a row's sums
  are those of the kernel made for that count (the merge of one part is o / l, the unsplit kernel's output)."""
  R, H, D = q.shape
  NB, _, KV, X = pool.shape
  BS, cap, G = block_size_of(pool.dtype, X, D), block_tables.shape[1], H // KV
  parts = max(1, threads)
  if prefill and not shared_table: raise ValueError("cpu_paged_attention: prefill tiles need rows sharing one block table")
  rt = int(split_count is not None and not prefill and splits > 1)
  kw = dict(D=D, BS=BS, KVH=KV, G=G, R=R, CAP=cap, NBLK=NB, P=1 if prefill else splits, QR=QR if prefill else 0,
            NQ=QR * G if prefill else H, PARTS=parts, SHARED=int(shared_table), KVB=KV_CODES[pool.dtype], TX=X, RT=rt,
            SCALE=math.log2(math.e) / math.sqrt(D))
  name, src = _source("prefill" if prefill else "decode", **kw)
  ins = [q.float().contiguous(), pool, block_tables.cast(dtypes.int32).contiguous(), context_lens.cast(dtypes.int32).contiguous()]
  if rt: ins.append(split_count)
  P = kw["P"]
  shape = (R, H, D) if P == 1 else (R, H, P, D + 2)
  out = Tensor.empty(*shape, dtype=dtypes.float32, device=q.device).custom_kernel(*ins, fxn=c_program(name, src, parts, 5 + rt))[0]
  if P == 1: return out
  mname, msrc = _source("merge", D=D, P=P, RH=R * H, PARTS=parts, RT=rt)
  return Tensor.empty(R, H, D, dtype=dtypes.float32, device=q.device).custom_kernel(out, *([split_count] if rt else []),
                                                                                     fxn=c_program(mname, msrc, parts, 2 + rt))[0]

def cpu_scatter_coded(pool: Tensor, k: Tensor, v: Tensor, block_tables: Tensor, positions: Tensor) -> Tensor:
  """kernels/paged_attention.py's kv_scatter into a coded pool (8-bit or bfloat16 bits, kernels/kv_quant.py's tiles): each
  new token's K, V row encoded in C (q8_0 per 32 values, as llama.cpp's quantize_row_q8_0_ref; fp8 and bfloat16 value by
  value, bfloat16 rounded to nearest even). One part (a decode
  step's few rows). CPU devices only."""
  R, KV, D = k.shape
  NB, _, _, X = pool.shape
  if not cpu_compiled(pool.device): raise ValueError(f"an 8-bit or bfloat16 kv_dtype: the KV scatter is C for CPU devices, not {pool.device}")
  name, src = _source("scatter", KVB=KV_CODES[pool.dtype], R=R, KVH=KV, D=D, BS=block_size_of(pool.dtype, X, D), CAP=block_tables.shape[1], NBLK=NB)
  ins = [k.float().contiguous(), v.float().contiguous(), block_tables.cast(dtypes.int32).contiguous(), positions.cast(dtypes.int32).contiguous()]
  return pool.custom_kernel(*ins, fxn=c_program(name, src, 1, 5))[0]
