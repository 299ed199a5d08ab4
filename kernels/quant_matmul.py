"""x @ W.T with W as stored in a GGUF file (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K blocks; F16, BF16 rows), as
hand-written C kernels for HET on a CPU and MESH.

Why not tinygrad's own kernels: for a lazy dequantization tinygrad renders scalar C (one byte load and a select per
nibble), which reads blocks at 1.5-2 GB/s on a core where memory gives 10-20, and for many rows of x it needed a float32
copy of the whole matrix each step. Unlike llama.cpp's default, x stays float32 (it is not rounded to 8 bits for integer
dot products), so the result is the float32 reference's up to the order of the additions.

Four kernels (C, clang vector extensions: no intrinsics beyond the CPU's half-float conversion, so they build for any -march
tinygrad's CPU compiler targets), each computing
  out[m, r] = sum_k x[m, k] * W[r, k]        x (M, K) float32, W (N, K) in its stored blocks, out (M, N) float32
with the rows r of W split into `parts` contiguous ranges, one per core_id:
- the block types' decode kernel (M <= DECODE_MAX_M; float mode): kernels/gemv16.py's gemvf, 16 weight rows at a time in
  registers (the kernel below runs for them only when asked for by tiled=False).
- decode (M <= DECODE_MAX_M): each weight row's blocks are dequantized in registers (kernels/quant_blocks.py: 32 weights as
  two 16-lane vectors) and multiplied into up to 8 rows of x at once; the weights stream from memory once per 8 rows of x.
  At one or two rows of x it is bound by the dequantization's vector ops, not memory (a 576-column matrix of SmolLM2 sits in
  L2), so Q5_0/Q5_1's fifth bits are, with AVX-512, spread in 32-bit lanes by shifts (quant_blocks._Q5_32) rather than by
  byte shuffles and compares: the same bits, fewer shuffle-port ops.
- tiled (prefill, batches past one decode tile): a panel of NR weight rows by KC columns is dequantized once into a float32 tile on the
  stack (k-major, in the micro-kernel's order: 64 KiB, in L2; 16 rows' sub-blocks transposed in registers, a vector store
  a column) and reused for every row of x, MR rows at a time by an
  outer-product micro-kernel (MR x NR accumulators in registers, no horizontal sums). No float copy of the matrix exists.
- dot (F16, BF16 past DECODE_MAX_M rows of x, in place of the tiled one): kernels/dot_gemm.py, 4 weight rows by 4 rows of x,
  dot products along k, the weights converted in registers as the decode kernel's are, no panel.
They reach tinygrad as custom kernels (Tensor.custom_kernel with a compiled PROGRAM), so they are scheduled, captured by
TinyJit and run by the worker pool (runtime/cpu_pool.py) like any other kernel.
The int8-activation mode (off by default): from INT8_TILED_MIN_M rows of x on, for any count, the int8 tiled kernel
(kernels/int8_gemm.py: x rounded per 32 once, by a kernel of its own, a u8 panel reused for every row of x); below it the
K-quants swap the decode kernel's tile for kernels/kquant_int8.py's tile8k (x per super-block of 256), the 32-weight types
take kernels/gemv16.py's kernel (x rounded by the same kernel of its own, 16 weight rows in registers, no panel: the tiled
kernel's bits; their older int8 decode tile, tile8, runs only when asked for by tiled=False). BF16 weights
in that mode: from BF16_TILED_MIN_M rows, kernels/bf16_gemm.py (x rounded to bfloat16, vdpbf16ps).
"""
from __future__ import annotations
import functools, math, weakref
from tinygrad import Tensor, dtypes
from tinyhet.kernels.quant_blocks import BF16, DEQUANT, FLOAT_TYPES, LAYOUT, NAMES, QUANTS, supported, supported_int8
from tinyhet.kernels import bf16_gemm, dot_gemm, int8_gemm, gemv16, kquant_int8
from tinyhet.kernels.c_program import c_program
MIN_ROWS_PER_PART = 16   # fewer weight rows than this per core and a split costs more than it saves
MIN_ROWS_PER_ROUNDING_PART = 8   # rows of x per part of the rounding kernel, at least (a row is a few microseconds' work)
MT_MAX = 8               # rows of x per decode tile, at most (the C picks 8 where AVX-512 gives 32 vector registers, else 4)
# rows of x up to which the decode kernel runs; past it, the tiled one. Measured (bench qmm's direct call, one core; Q4_1, Q8_0
# 1536 x 576, Q4_K, Q6_K, Q5_0, F16 1536 x 768): the tiled kernel 1.2-1.6x slower at 4-6 rows, 0.7-0.9x the time at 8, ~0.5x
# at 16, ~0.35x at 32-48; Q4_K 4096 x 4096: 0.59x at 8 rows, 0.35x at 16 (the crossover was 32-64 rows while the panel was
# stored one float at a time). 8, not 7: a batch of one's verify step (up to 7 drafts, bucket 8: engine/speculative.py's
# within_one_tile cuts the drafts of at most 8 sequences to 8 rows) then runs the matrix kernel plain decode runs, so its
# logits are plain decode's bits (docs/speculative.md); at exactly 8 rows the tiled kernel's gain is the smallest
DECODE_MAX_M = 8
# the float path past DECODE_MAX_M rows of F16 and BF16 weights: the dot kernel (kernels/dot_gemm.py), not the tiled one
# (measured there: 1.3-1.6x at 16 rows, 1.1x at 64, within 3% either way at 512). Not the block types: their dequantization
# runs once per tile of x there (they gain 1.1-1.3x at 16 rows and lose from 24-32), and a row must get the same bits at any
# M past DECODE_MAX_M (a 16-token chunk of a stall-free step against the whole prompt's product)
DOT_TYPES = FLOAT_TYPES
KC = 512                 # columns of a dequantized panel (a multiple of every block size)
# bytes ahead of a decode kernel's loads that it prefetches (0: none). Measured (one core, ctypes, 1 row of x, 1536 x 576 and
# 576 x 1536, weights cold: a rotating 512 MB of copies): Q8_0 155 -> 106-112 us, Q5_0 184 -> 92-98, Q4_K 167 -> 95, F16 177 ->
# 152-166 (hot: unchanged, 60 / 90 / 89 / 50); 1 KiB ahead gained less for Q5_0 and Q4_K, 4-8 KiB less for all
WEIGHT_PREFETCH = 2048
KQ8_MAX_M = 256          # rows of x up to which the K-quants' int8 decode kernel may run in the int8 mode
# rows of x from which the int8 mode takes its tiled kernel (kernels/int8_gemm.py), for any count past it, by weights per block.
# The K-quants: measured (one core, 4096 x 4096 and SmolLM2's 1536 x 576, 576 x 1536) against their int8 decode kernel, 0.73-0.8x
# at 8 rows, 1.0-1.3x at 16. The 32-weight types: below it kernels/gemv16.py's kernel, the same bits, faster at every count
# up to 16 (measured, one core, AMD EPYC, weights hot / cold: 1536 x 576 Q4_1 at 1 row 26 / 36 us against 63 / 78, at 8 rows
# 59 / 63 against 102 / 118, at 16 114 / 118 against 153 / 167; 4096 x 4096 Q8_0 at 16 rows 1.83 / 1.95 ms against 2.66 / 2.90);
# past 16 its accumulators would not fit in registers
INT8_TILED_MIN_M = {32: 17, 256: 16}
# rows of x from which the int8 (reduced-precision) mode rounds x to bfloat16 for BF16 weights (bf16_gemm.py): measured 1.7x
# the float decode kernel at 4 rows of 4096 x 4096, 3.0x at 16, 2.0x the float tiled kernel at 512
BF16_TILED_MIN_M = 4

_SOURCE = r"""
typedef unsigned char u8; typedef unsigned short u16; typedef unsigned int u32; typedef unsigned long size_t;
typedef float f32x16 __attribute__((vector_size(64)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef u8 u8x16 __attribute__((vector_size(16)));
typedef signed char i8x16 __attribute__((vector_size(16)));
typedef u16 u16x16 __attribute__((vector_size(32)));
typedef short i16x16 __attribute__((vector_size(32)));
typedef short i16x8 __attribute__((vector_size(16)));
typedef u32 u32x16 __attribute__((vector_size(64))); typedef u32 u32x4 __attribute__((vector_size(16)));
/* no_builtin: clang must not turn zeroing or copy loops into calls to memset/memcpy, which a kernel cannot make (tinygrad
   loads it as a bare object: an external call does not link) */
#define KERNEL __attribute__((no_builtin("memset"), no_builtin("memcpy")))
#define INLINE static inline __attribute__((always_inline)) KERNEL
#define M %(M)d
#define N %(N)d
#define K %(K)d
#define NB (K / 32)             /* sub-blocks of 32 weights in a row */
#define QB %(QB)d               /* weights in a stored block */
#define SBB %(SBB)d             /* bytes in a stored block */
#define NSUB (QB / 32)          /* sub-blocks in a stored block */
#define NSTEP (NSUB > 1 ? NSUB : 2)   /* sub-blocks per step of the loops: a whole stored block, at least two */
#define ROWB ((size_t)(K / QB) * SBB)
#define PARTS %(parts)d
#define TILED %(tiled)d
#define KC %(KC)d
#define INT8 %(int8)d
#define RB %(RB)d                /* weight rows per block of the decode kernel's loop (see the kernel's body) */
#define NR 32                   /* weight rows in a panel of the tiled kernel: two 16-lane vectors */
/* the decode kernels read each weight once, from memory (a model's weights do not stay in cache from one step to the next):
   each step of a row's loop asks for the bytes PF ahead of it, so the loads find them in L1 rather than wait on memory
   (the hardware prefetcher alone kept a core at 6 GB/s of Q8_0 weights where it streams 14; see WEIGHT_PREFETCH) */
#define PF %(pf)d
INLINE void prefetch(const u8 *p, const int bytes) {
  if (PF) for (int c = 0; c < bytes; c += 64) __builtin_prefetch(p + PF + c);
}
/* rows of x per tile, whose float32 accumulators must stay in registers: with AVX-512 (32 registers) 8, else fewer */
#if defined(__AVX512F__)
#define MT 8
#define ACCS 2
#define MR 8
#else
#define MT 4
#define ACCS 1
#define MR 3
#endif

/* float16 -> float32: the CPU's conversion where it has one (x86 F16C, ARM's half type); elsewhere shift the exponent and
   mantissa into place and scale by 2^112 (exact for normal and subnormal halves; weights and scales are never inf or nan) */
#if defined(__F16C__)
INLINE float h2f(const u8 *p) { short h; __builtin_memcpy(&h, p, 2); i16x8 v = {h}; return __builtin_ia32_vcvtph2ps(v)[0]; }
#elif defined(__aarch64__)
INLINE float h2f(const u8 *p) { __fp16 h; __builtin_memcpy(&h, p, 2); return (float)h; }
#else
INLINE float h2f(const u8 *p) {
  u32 h = p[0] | (u32)p[1] << 8, bits = (h & 0x7fffu) << 13; float f;
  __builtin_memcpy(&f, &bits, 4); f *= 0x1p112f;
  return (h & 0x8000u) ? -f : f;
}
#endif
/* 16 float16 -> 16 float32 */
INLINE f32x16 h2f16(const u8 *p) {
#if defined(__AVX512F__)
  i16x16 h; __builtin_memcpy(&h, p, 32);
  return __builtin_ia32_vcvtph2ps512_mask(h, (f32x16){0}, (unsigned short)0xffff, 4);
#else
  u16x16 h; __builtin_memcpy(&h, p, 32);
  u32x16 w = __builtin_convertvector(h, u32x16), bits = (w & 0x7fffu) << 13;
  f32x16 f = (f32x16)bits * 0x1p112f;
  return (f32x16)((u32x16)f | (w & 0x8000u) << 16);
#endif
}

/* sub-block j of the stored block at b: weights 32j..32j+15 into lo, 32j+16..32j+31 into hi */
INLINE void dequant(const u8 *restrict b, const int j, f32x16 *lo, f32x16 *hi) {
%(dequant)s
}
/* sub-block jj of step g of a row: jj is a constant in each unrolled copy, so is the sub-block index inside its block */
INLINE void dq(const u8 *restrict wr, int g, const int jj, f32x16 *lo, f32x16 *hi) {
  dequant(wr + (size_t)(g * (NSTEP / NSUB) + jj / NSUB) * SBB, jj %% NSUB, lo, hi);
}

INLINE float hsum(f32x16 v) {
  float s = 0.0f;
  for (int i = 0; i < 16; i++) s += v[i];
  return s;
}
INLINE f32x16 load16(const float *p) { f32x16 v; __builtin_memcpy(&v, p, 64); return v; }
INLINE void store16(float *p, f32x16 v) { __builtin_memcpy(p, &v, 64); }

/* decode: rows r0..r1 of W against rows m0..m0+mt of x; mt is a constant in each inlined copy, so the accumulators are
   registers. Two sub-blocks per step, into two accumulators (two chains of fused multiply-adds, not one). */
INLINE void tile(float *restrict out, const u8 *restrict w, const float *restrict x, int m0, const int mt, int r0, int r1) {
  for (int r = r0; r < r1; r++) {
    const u8 *wr = w + (size_t)r * ROWB;
    f32x16 acc[MT][ACCS];
    for (int i = 0; i < MT; i++) for (int a = 0; a < ACCS; a++) acc[i][a] = (f32x16){0};   /* stores, not an initializer: no memset */
    int g = 0;
    for (; g < NB / NSTEP; g++) {
      prefetch(wr + (size_t)g * (NSTEP / NSUB) * SBB, (NSTEP / NSUB) * SBB);
#pragma clang loop unroll(full)
      for (int jj = 0; jj < NSTEP; jj += 2) {
        f32x16 lo0, hi0, lo1, hi1;
        dq(wr, g, jj, &lo0, &hi0);
        dq(wr, g, jj + 1, &lo1, &hi1);
        for (int i = 0; i < mt; i++) {
          const float *xb = x + (size_t)(m0 + i) * K + (g * NSTEP + jj) * 32;
#if ACCS == 2
          acc[i][0] += lo0 * load16(xb); acc[i][0] += hi0 * load16(xb + 16);
          acc[i][1] += lo1 * load16(xb + 32); acc[i][1] += hi1 * load16(xb + 48);
#else
          acc[i][0] += (lo0 * load16(xb) + hi0 * load16(xb + 16)) + (lo1 * load16(xb + 32) + hi1 * load16(xb + 48));
#endif
        }
      }
    }
    if (NB %% NSTEP) {   /* an odd last block of a 32-weight type */
      f32x16 lo, hi;
      dequant(wr + (size_t)(NB - 1) * SBB, 0, &lo, &hi);
      for (int i = 0; i < mt; i++) {
        const float *xb = x + (size_t)(m0 + i) * K + (NB - 1) * 32;
        acc[i][0] += lo * load16(xb) + hi * load16(xb + 16);
      }
    }
    for (int i = 0; i < mt; i++) out[(size_t)(m0 + i) * N + r] = hsum(ACCS == 2 ? acc[i][0] + acc[i][ACCS - 1] : acc[i][0]);
  }
}

/* v[i][j] -> v[j][i]: a 16 x 16 transpose in registers, four rounds of shuffles (round s swaps the off-diagonal s x s blocks) */
INLINE void transpose16f(f32x16 *restrict v) {
  f32x16 a, b;
%(transpose)s
}
/* 16 weight rows' 32 weights of one sub-block (row i: lo[i], hi[i]) into the panel's columns kb..kb+31, rows 16h..16h+15:
   transposed in registers, one vector store a column (32 scalar stores a row, strided by the panel's width, cost the
   tiled kernel ~0.8 ms of a 1536 x 576 Q4_1 product at any row count: a 64-row chunk's products ran at the decode kernel's rate) */
INLINE void put16(float *restrict wf, f32x16 *restrict lo, f32x16 *restrict hi, int kb, int h) {
  transpose16f(lo);
  transpose16f(hi);
  for (int k = 0; k < 16; k++) { store16(wf + (size_t)(kb + k) * NR + 16 * h, lo[k]); store16(wf + (size_t)(kb + 16 + k) * NR + 16 * h, hi[k]); }
}

/* tiled: rows n0..n0+nr of W, columns k0..k0+kc, dequantized once into wf[k][NR] (k-major: the micro-kernel reads the
   panel's NR weights at one k as two vectors); rows past nr are zeros */
INLINE void panel(float *restrict wf, const u8 *restrict w, int n0, int nr, int k0, int kc) {
  for (int h = 0; h < NR / 16; h++) {
    int g = k0 / 32 / NSTEP, g1 = (k0 + kc) / 32 / NSTEP;
    for (; g < g1; g++) {
#pragma clang loop unroll(full)
      for (int jj = 0; jj < NSTEP; jj++) {
        f32x16 lo[16], hi[16];
        for (int i = 0; i < 16; i++) {
          if (16 * h + i < nr) dq(w + (size_t)(n0 + 16 * h + i) * ROWB, g, jj, &lo[i], &hi[i]);
          else { lo[i] = (f32x16){0}; hi[i] = (f32x16){0}; }
        }
        put16(wf, lo, hi, (g * NSTEP + jj) * 32 - k0, h);
      }
    }
    if ((k0 + kc) / 32 %% NSTEP) {   /* an odd last block of a 32-weight type */
      f32x16 lo[16], hi[16];
      for (int i = 0; i < 16; i++) {
        if (16 * h + i < nr) dequant(w + (size_t)(n0 + 16 * h + i) * ROWB + (size_t)((k0 + kc) / 32 - 1) * SBB, 0, &lo[i], &hi[i]);
        else { lo[i] = (f32x16){0}; hi[i] = (f32x16){0}; }
      }
      put16(wf, lo, hi, kc - 32, h);
    }
  }
}

/* out[m0..m0+mr, n0..n0+nr] (+)= x[m0..m0+mr, k0..k0+kc] @ panel.T: x broadcast one element at a time, the panel's row of NR */
INLINE void micro(float *restrict out, const float *restrict wf, const float *restrict x, int m0, const int mr, int n0, int nr,
                  int k0, int kc) {
  f32x16 acc[MR][2];
  for (int i = 0; i < mr; i++) {
    float *o = out + (size_t)(m0 + i) * N + n0;
    if (k0 == 0) { acc[i][0] = (f32x16){0}; acc[i][1] = (f32x16){0}; }
    else if (nr == NR) { acc[i][0] = load16(o); acc[i][1] = load16(o + 16); }
    else { for (int n = 0; n < 16; n++) { acc[i][0][n] = n < nr ? o[n] : 0.0f; acc[i][1][n] = n + 16 < nr ? o[n + 16] : 0.0f; } }
  }
  const float *xk = x + (size_t)m0 * K + k0;
  for (int k = 0; k < kc; k++) {
    f32x16 w0 = load16(wf + k * NR), w1 = load16(wf + k * NR + 16);
    for (int i = 0; i < mr; i++) { float xv = xk[(size_t)i * K + k]; acc[i][0] += w0 * xv; acc[i][1] += w1 * xv; }
  }
  for (int i = 0; i < mr; i++) {
    float *o = out + (size_t)(m0 + i) * N + n0;
    if (nr == NR) { store16(o, acc[i][0]); store16(o + 16, acc[i][1]); }
    else for (int n = 0; n < nr; n++) o[n] = n < 16 ? acc[i][0][n] : acc[i][1][n - 16];
  }
}

/* rows n0..n0+nr of W, columns k0..k0+kc, asked of memory into L2: the next panel's rows, while this one is multiplied (the
   float tiled kernel here and int8_gemm.py's tiled8). A step reads each matrix once, from memory, and a panel's 16-32 short
   row segments, fetched only when unpacked, stall it. Measured (one core, ctypes, weights cold: a rotating set of matrices
   as large as a model): the int8 kernel much of its gap to the hot figure closed (one panel ahead, not two; into L2, not
   L1); the float kernel, 1536 x 576 and 576 x 1536, at 16 rows of x F16 641 -> 502 us, Q8_0 546 -> 420, Q4_K 525 -> 430
   (hot 330-430), at 64 rows 1.03-1.1x (into L1, or before the panel is built, gained less). The bf16 kernel's panels,
   whole lines of 16 long row segments, gained nothing from it */
INLINE void prefetch_panel(const u8 *restrict w, int n0, int nr, int k0, int kc) {
  const size_t b0 = (size_t)(k0 / QB) * SBB, b1 = (size_t)((k0 + kc) / QB) * SBB;
  for (int n = 0; n < nr; n++) for (size_t b = b0; b < b1; b += 64) __builtin_prefetch(w + (size_t)(n0 + n) * ROWB + b, 0, 2);
}

/* each count of rows a function of its own, not inlined into tiled(): inlined, the loops' values took registers from the
   16 accumulators and clang spilled them inside the k loop wherever the part's rows were not compile-time constants (every
   split kernel; measured: a part of a 2-part Q4_1 1536 x 576 product at 16 rows, 0.36 -> 0.20 ms) */
%(micros)s

INLINE void tiled(float *restrict out, const u8 *restrict w, const float *restrict x, int r0, int r1) {
  float wf[KC * NR] __attribute__((aligned(64)));
  for (int n0 = r0; n0 < r1; n0 += NR) {
    int nr = r1 - n0 < NR ? r1 - n0 : NR;
    for (int k0 = 0; k0 < K; k0 += KC) {
      int kc = K - k0 < KC ? K - k0 : KC;
      panel(wf, w, n0, nr, k0, kc);
      if (PF && n0 + NR < r1) prefetch_panel(w, n0 + NR, r1 - n0 - NR < NR ? r1 - n0 - NR : NR, k0, kc);
      int m0 = 0;
      for (; m0 + MR <= M; m0 += MR) micro_MR(out, wf, x, m0, n0, nr, k0, kc);
      switch (M - m0) {
%(micro_tails)s
      }
    }
  }
}

%(dot)s
#define GEMVF %(gemvf)d
%(gemvf_source)s
#if INT8
/* int8 activations (off by default): each block of 32 of x rounded to int8 with scale max|x|/127, as llama.cpp's q8 blocks;
   a weight sub-block's unsigned quants against them is an integer dot product (u8 x s8: vpdpbusd with AVX512-VNNI), scaled
   per half of 16 weights; the offsets (w = s q + m) meet the sums of x's rounded halves */
typedef signed char i8; typedef int i32x16 __attribute__((vector_size(64)));
typedef u8 u8x32 __attribute__((vector_size(32))); typedef u8 u8x64 __attribute__((vector_size(64)));
typedef signed char i8x64 __attribute__((vector_size(64))); typedef float f32x4 __attribute__((vector_size(16)));
INLINE u8x32 cat16(u8x16 a, u8x16 b) { return __builtin_shufflevector(a, b, %(i32)s); }
INLINE void qsub(const u8 *restrict b, const int j, u8x32 *q32, float *s0, float *s1, float *m0, float *m1) {
%(quants)s
}
INLINE void qs(const u8 *restrict wr, int g, const int jj, u8x32 *q, float *s0, float *s1, float *m0, float *m1) {
  qsub(wr + (size_t)(g * (NSTEP / NSUB) + jj / NSUB) * SBB, jj %% NSUB, q, s0, s1, m0, m1);
}
/* 16 lanes, lane i the sum of a[4i..4i+3] * b[4i..4i+3] */
INLINE i32x16 dot4(u8x64 a, i8x64 b) {
#if defined(__AVX512VNNI__)
  return __builtin_ia32_vpdpbusd512((i32x16){0}, (i32x16)a, (i32x16)b);
#else
  i32x16 s = {0};
#define WIDE(v, ...) __builtin_convertvector(__builtin_shufflevector(v, v, __VA_ARGS__), i32x16)
#define LANE4(...) (WIDE(a, __VA_ARGS__) * WIDE(b, __VA_ARGS__))
  s += LANE4(%(l0)s); s += LANE4(%(l1)s); s += LANE4(%(l2)s); s += LANE4(%(l3)s);
  return s;
#endif
}
INLINE f32x4 load4(const float *p) { f32x4 v; __builtin_memcpy(&v, p, 16); return v; }

/* rows m0..m0+mt of x: int8 quants xq, per pair of blocks the scales as 16 lanes (8 each, as dot4's lanes fall), per half
   block the float sum */
INLINE void quantize_x(const float *restrict x, int m0, const int mt, i8 *restrict xq, f32x16 *restrict xd, float *restrict xs) {
  for (int i = 0; i < mt; i++) {
    float dxs[2];
    for (int b = 0; b < NB; b++) {
      const float *xb = x + (size_t)(m0 + i) * K + b * 32;
      f32x16 lo = load16(xb), hi = load16(xb + 16);
      float amax = 0.0f;
      for (int l = 0; l < 16; l++) {
        float a = lo[l] < 0 ? -lo[l] : lo[l], c = hi[l] < 0 ? -hi[l] : hi[l];
        amax = a > amax ? a : amax; amax = c > amax ? c : amax;
      }
      float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      /* round to nearest even: adding 1.5 * 2^23 puts the integer in the low mantissa bits */
      i32x16 ql = (i32x16)(lo * inv + 12582912.0f) - 0x4B400000, qh = (i32x16)(hi * inv + 12582912.0f) - 0x4B400000;
      for (int l = 0; l < 16; l++) { xq[i * K + b * 32 + l] = (i8)ql[l]; xq[i * K + b * 32 + 16 + l] = (i8)qh[l]; }
      /* the sums of the rounded x, not of x: an unsigned shift folded into m (Q8_0's 128, Q4_0's 8) then cancels exactly */
      dxs[b & 1] = amax / 127.0f;
      xs[i * NB * 2 + 2 * b] = hsum(__builtin_convertvector(ql, f32x16)) * dxs[b & 1];
      xs[i * NB * 2 + 2 * b + 1] = hsum(__builtin_convertvector(qh, f32x16)) * dxs[b & 1];
      if (b & 1) {
        f32x16 d;
        for (int l = 0; l < 16; l++) d[l] = dxs[l / 8];
        xd[i * (NB / 2) + b / 2] = d;
      }
    }
  }
}

INLINE void tile8(float *restrict out, const u8 *restrict w, const float *restrict x, int m0, const int mt, int r0, int r1) {
  i8 xq[MT * K] __attribute__((aligned(64))); f32x16 xd[MT * (NB / 2)]; float xs[MT * NB * 2];
  quantize_x(x, m0, mt, xq, xd, xs);
  for (int r = r0; r < r1; r++) {
    const u8 *wr = w + (size_t)r * ROWB;
    f32x16 acc[MT]; f32x4 macc[MT];
    for (int i = 0; i < MT; i++) { acc[i] = (f32x16){0}; macc[i] = (f32x4){0}; }
    for (int g = 0; g < NB / NSTEP; g++) {
      prefetch(wr + (size_t)g * (NSTEP / NSUB) * SBB, (NSTEP / NSUB) * SBB);
#pragma clang loop unroll(full)
      for (int jj = 0; jj < NSTEP; jj += 2) {
        u8x32 qa, qb; float sa0, sa1, ma0, ma1, sb0, sb1, mb0, mb1;
        qs(wr, g, jj, &qa, &sa0, &sa1, &ma0, &ma1);
        qs(wr, g, jj + 1, &qb, &sb0, &sb1, &mb0, &mb1);
        u8x64 q = __builtin_shufflevector(qa, qb, %(i64)s);
        f32x16 W = {sa0, sa0, sa0, sa0, sa1, sa1, sa1, sa1, sb0, sb0, sb0, sb0, sb1, sb1, sb1, sb1};
        f32x4 MN = {ma0, ma1, mb0, mb1};
        const int p = (g * NSTEP + jj) / 2;
        for (int i = 0; i < mt; i++) {
          i8x64 xv; __builtin_memcpy(&xv, xq + i * K + p * 64, 64);
          acc[i] += __builtin_convertvector(dot4(q, xv), f32x16) * (W * xd[i * (NB / 2) + p]);
          macc[i] += MN * load4(xs + i * NB * 2 + 4 * p);
        }
      }
    }
    for (int i = 0; i < mt; i++) out[(size_t)(m0 + i) * N + r] = hsum(acc[i]) + ((macc[i][0] + macc[i][1]) + (macc[i][2] + macc[i][3]));
  }
}
%(kint8)s
#if INT8 == 2
#define TILE tile8k
#else
#define TILE tile8
#endif
#else
#define TILE tile
#endif

/* the int8 and bf16 tiled kernels (INT8 3, 4): x here is x already rounded, the rounding kernel's output (rounding_source) */
KERNEL void %(name)s(float *restrict out, const u8 *restrict w, const float *restrict x, int core_id) {
  if (PARTS == 1) core_id = 0;   /* a one-part kernel is called without a core_id */
  int r0 = (int)((long)core_id * N / PARTS), r1 = (int)((long)(core_id + 1) * N / PARTS);
#if INT8 == 3
  tiled8(out, w, (const u8 *)x, r0, r1); return;
#elif INT8 == 4
  tiledb(out, w, (const u8 *)x, r0, r1); return;
#elif INT8 == 5
  gemv8(out, w, (const u8 *)x, r0, r1); return;
#endif
#if TILED == 2
  dotted(out, w, x, r0, r1); return;
#endif
#if GEMVF
  gemvf(out, w, x, r0, r1); return;
#endif
  if (TILED) { tiled(out, w, x, r0, r1); return; }
  /* weight rows in blocks of RB, every tile of x against one block before the next, so that a block is read from memory once
     and from L2 for the other tiles: the float kernel past one tile (measured, 16-32 rows of 4096 x 4096: F16/BF16 1.14-1.34x,
     Q8_0 1.13-1.17x, Q5_0 1.05-1.13x, Q4_K 1.0-1.05x), the int8 kernel past 32 rows (at 16 its x quants are the larger cost) */
  for (int rb = r0; rb < r1; rb += RB) {
    const int re = r1 - rb < RB ? r1 : rb + RB;
    int m0 = 0;
    for (; m0 + MT <= M; m0 += MT) TILE(out, w, x, m0, MT, rb, re);
    switch (M - m0) {   /* the last rows: a tile of their own count, so its accumulators are registers too */
%(tails)s
    }
  }
}
"""

def _transpose16() -> str:
  """transpose16f's body: round s (1, 2, 4, 8) pairs rows i and i + s (bit s of i clear); lane j of the new row i is row i's
  where bit s of j is clear, else row i + s's lane j - s; of the new row i + s, row i's lane j + s, else row i + s's lane j."""
  lines = []
  for s in (1, 2, 4, 8):
    lo = ", ".join(str(16 + j - s if j & s else j) for j in range(16))
    hi = ", ".join(str(16 + j if j & s else j + s) for j in range(16))
    for i in (i for i in range(16) if not i & s):
      lines.append(f"  a = v[{i}]; b = v[{i + s}]; v[{i}] = __builtin_shufflevector(a, b, {lo}); v[{i + s}] = __builtin_shufflevector(a, b, {hi});")
  return "\n".join(lines)

def _micros() -> str:
  """micro_1..micro_8: the tiled kernel's micro-kernel for each count of rows of x, not inlined; micro_MR the full tile's."""
  fns = [f"static __attribute__((noinline)) KERNEL void micro_{i}(float *restrict out, const float *restrict wf, const float *restrict x, "
         f"int m0, int n0, int nr, int k0, int kc) {{ if ({i} <= MR) micro(out, wf, x, m0, {i}, n0, nr, k0, kc); }}" for i in range(1, 9)]
  return "\n".join(fns) + "\n#define micro_MR_(m) micro_##m\n#define micro_MR__(m) micro_MR_(m)\n#define micro_MR micro_MR__(MR)"

def kernel_parts(rows: int, threads: int) -> int:
  """How many parts the weight rows are split in: every thread, unless that leaves a part fewer than MIN_ROWS_PER_PART rows."""
  return max(1, min(threads, rows // MIN_ROWS_PER_PART))

@functools.cache
def kernel_source(ggml_type: int, M: int, N: int, K: int, parts: int, tiled: bool | None = None, int8: bool = False,
                  prefetch: bool = True) -> tuple[str, str]:
  """(function name, C source) of the kernel for x (M, K) against W (N, K) in GGML type `ggml_type`, split in `parts` parts;
  past DECODE_MAX_M rows of x the tiled kernel (the dot kernel for DOT_TYPES), unless `tiled` says (True: the tiled kernel,
  False: the decode kernel, "dot": the dot kernel). int8: x rounded to int8 per block of 32 and integer dot
  products, in the decode kernel (where the type has it: quant_blocks.supported_int8; else the float kernel). prefetch=False:
  the same kernel without its weight prefetch (WEIGHT_PREFETCH), named `..._nopf`, for measurements and tests."""
  if not supported(ggml_type, K): raise ValueError(f"no quantized matmul kernel for GGML type {ggml_type} with {K} columns")
  tiled_arg = tiled
  # the K-quants' int8 kernel serves small prefills too, up to KQ8_MAX_M rows (unless the tiled one is asked for): measured
  # (bench qmm, one core, 1536 x 1536) 1.5x the float tiled kernel at 64 rows, 0.98-1.04x at 512
  # past INT8_TILED_MIN_M rows the int8 tiled kernel (unless a kernel is asked for: tiled True, the float tiled one; False, decode)
  gemm8 = int8 and tiled is None and supported_int8(ggml_type, K) and M >= INT8_TILED_MIN_M[LAYOUT[ggml_type][0]]
  gemmb = int8 and tiled is None and ggml_type == BF16 and M >= BF16_TILED_MIN_M   # x rounded to bfloat16, vdpbf16ps
  gemm8 = gemm8 or gemmb
  gemv = int8 and tiled is None and ggml_type in gemv16.GEMV16_TYPES and supported_int8(ggml_type, K) and not gemm8
  kq8 = int8 and ggml_type in kquant_int8.KQ_INT8_TYPES and supported_int8(ggml_type, K) and tiled is not True and M <= KQ8_MAX_M
  dot = tiled == "dot" or (tiled is None and not gemm8 and not kq8 and ggml_type in DOT_TYPES and M > DECODE_MAX_M)
  tiled = 2 if dot else True if gemm8 else False if kq8 or gemv else M > DECODE_MAX_M if tiled is None else tiled
  # the 32-weight types pay for x's rounding more than the integer products save at a few rows (measured: 0.4-0.7x at one row,
  # 1.1-1.3x at 16); the K-quants gain from one row on (1.3-1.6x at one, ~2x at 16)
  int8 = int8 and not tiled and supported_int8(ggml_type, K) and (LAYOUT[ggml_type][0] == 256 or M >= 8 or gemv)
  # the K-quants round x per super-block of 256 (llama.cpp's q8_K: integer sums over a whole super-block); the others per 32
  int8 = 5 if gemv else 4 if gemmb else 3 if gemm8 else int(int8) + int(int8 and ggml_type in kquant_int8.KQ_INT8_TYPES)
  kind = ['', '_tiled', '_dot'][int(tiled)] + ['', '_int8', '_int8k', '_int8t', '_bf16t', '_int8v'][int8]
  # the float path's block types within one decode tile: gemv16.py's 16-row kernel (unless the decode kernel is asked for)
  gemvf = not tiled and not int8 and tiled_arg is None and ggml_type in gemv16.GEMVF_TYPES
  kind += "_r16" if gemvf else ""
  name = f"qmatmul_{NAMES[ggml_type].lower()}_{M}_{N}_{K}_p{parts}{kind}"
  name += "" if prefetch else "_nopf"
  qb, sbb = LAYOUT[ggml_type]
  return name, _SOURCE % {"name": name, "pf": WEIGHT_PREFETCH if prefetch else 0, "M": M, "N": N, "K": K, "QB": qb, "SBB": sbb,
                          "parts": parts, "tiled": int(tiled), "KC": KC,
                          "RB": 64 if M > 4 * MT_MAX or (M > MT_MAX and not int8) else 1 << 30,
                          "tails": "\n".join(f"      case {i}: if ({i} < MT) TILE(out, w, x, m0, {i}, rb, re); break;" for i in range(1, MT_MAX)),
                          "micro_tails": "\n".join(f"        case {i}: if ({i} < MR) micro_{i}(out, wf, x, m0, n0, nr, k0, kc); break;"
                                                   for i in range(1, 8)),
                          "micros": _micros(),
                          "dequant": DEQUANT[ggml_type], "int8": int8,
                          "kint8": kquant_int8.source(ggml_type) if int8 == 2 else int8_gemm.source(ggml_type) if int8 == 3 else
                                   bf16_gemm.source() if int8 == 4 else gemv16.source(ggml_type, True) if int8 == 5 else "",
                          "gemvf": int(gemvf), "gemvf_source": gemv16.source(ggml_type, False) if gemvf else "",
                          "quants": QUANTS.get(ggml_type, ""), "transpose": _transpose16(), "dot": dot_gemm.source() if dot else "",
                          "i32": ", ".join(map(str, range(32))), "i64": ", ".join(map(str, range(64))),
                          **{f"l{k}": ", ".join(str(4 * i + k) for i in range(16)) for k in range(4)}}

def rounding_kernel(name: str, ggml_type: int, M: int, K: int, parts: int) -> tuple[str, str, int] | None:
  """(function name, C source, output bytes) of the kernel that rounds x once before the kernel `name` (the int8 and bf16
  tiled kernels read x rounded as their third argument), split over x's rows in `parts` parts; None: `name` reads x itself."""
  name = name.removesuffix("_nopf")   # the same kernel without its prefetch reads the same rounded x
  if name.endswith(("_int8t", "_int8v")): return *int8_gemm.round_source(ggml_type, M, K, parts), int8_gemm.rounded_bytes(ggml_type, M, K)
  return (*bf16_gemm.round_source(M, K, parts), bf16_gemm.rounded_bytes(M, K)) if name.endswith("_bf16t") else None

# (id of x's UOp, rounding kernel) -> x rounded, weakly: an entry lives while a graph holds it, which holds x's UOp (so its id
# is not reused meanwhile)
_ROUNDED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

def quant_matmul(x: Tensor, blocks: Tensor, ggml_type: int, shape: tuple[int, int], threads: int, tiled: bool | None = None,
                 int8: bool = False) -> Tensor:
  """x (..., K) float32 @ W.T, W (N, K) held as stored (`blocks`: a Tensor of its bytes, any dtype: uint8 GGUF blocks, or the
  float16/bfloat16 matrix itself) -> (..., N) float32, by the C kernels above split over `threads` parts (one core each, on
  a device whose runtime runs the parts side by side)."""
  N, K = shape
  lead = x.shape[:-1]
  M = math.prod(int(s) for s in lead)
  parts = kernel_parts(N, threads)
  name, src = kernel_source(ggml_type, M, N, K, parts, tiled, int8)
  xs = x.reshape(M, K).cast(dtypes.float32)
  xs = xs if xs.uop.has_buffer_identity(after_ok=True) else xs.contiguous()   # a kernel's output as it is: no copy
  out = Tensor.empty(M, N, dtype=dtypes.float32, device=x.device)
  rparts = max(1, min(threads, M // MIN_ROWS_PER_ROUNDING_PART))
  if (rounding := rounding_kernel(name, ggml_type, M, K, rparts)) is not None:   # x rounded once, into what every part reads
    # and once for every product of the same x (a layer's q, k, v; gate and up): the rounded x of a graph still being built
    if (xr := _ROUNDED.get(key := (id(xs.uop), rounding[0]))) is None:
      xr = Tensor.empty(rounding[2], dtype=dtypes.uint8, device=x.device)
      xr = _ROUNDED[key] = xr.custom_kernel(xs, fxn=c_program(*rounding[:2], rparts, 2))[0].uop
    xs = Tensor(xr, device=x.device)
  out = out.custom_kernel(blocks.contiguous(), xs, fxn=c_program(name, src, parts, 3))[0]
  return out.reshape(*lead, N)
