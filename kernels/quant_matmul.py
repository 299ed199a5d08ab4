"""x @ W.T with W as stored in a GGUF file (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K blocks; F16, BF16 rows), as
hand-written C kernels for HET on a CPU and MESH.

Why not tinygrad's own kernels: for a lazy dequantization tinygrad renders scalar C (one byte load and a select per
nibble), which reads blocks at 1.5-2 GB/s on a core where memory gives 10-20, and for many rows of x it needed a float32
copy of the whole matrix each step. Unlike llama.cpp's default, x stays float32 (it is not rounded to 8 bits for integer
dot products), so the result is the float32 reference's up to the order of the additions.

Two kernels (C, clang vector extensions: no intrinsics beyond the CPU's half-float conversion, so they build for any -march
tinygrad's CPU compiler targets), both computing
  out[m, r] = sum_k x[m, k] * W[r, k]        x (M, K) float32, W (N, K) in its stored blocks, out (M, N) float32
with the rows r of W split into `parts` contiguous ranges, one per core_id:
- decode (M <= DECODE_MAX_M): each weight row's blocks are dequantized in registers (kernels/quant_blocks.py: 32 weights as
  two 16-lane vectors) and multiplied into up to 8 rows of x at once; the weights stream from memory once per 8 rows of x.
- tiled (prefill, big batches): a panel of NR weight rows by KC columns is dequantized once into a float32 tile on the
  stack (k-major, in the micro-kernel's order: 64 KiB, in L2) and reused for every row of x, MR rows at a time by an
  outer-product micro-kernel (MR x NR accumulators in registers, no horizontal sums). No float copy of the matrix exists.
They reach tinygrad as custom kernels (Tensor.custom_kernel with a compiled PROGRAM), so they are scheduled, captured by
TinyJit and run by the worker pool (runtime/cpu_pool.py) like any other kernel.
"""
from __future__ import annotations
import dataclasses, functools, math
from tinygrad import Tensor, dtypes
from tinygrad.uop.ops import UOp, Ops, KernelInfo, ProgramInfo
from tinyhet.kernels.quant_blocks import DEQUANT, LAYOUT, NAMES, supported
MIN_ROWS_PER_PART = 16   # fewer weight rows than this per core and a split costs more than it saves
MT_MAX = 8               # rows of x per decode tile, at most (the C picks 8 where AVX-512 gives 32 vector registers, else 4)
DECODE_MAX_M = 32        # rows of x up to which the decode kernel runs (measured crossover: 32-64 rows); past it, the tiled one
KC = 512                 # columns of a dequantized panel (a multiple of every block size)

_SOURCE = r"""
typedef unsigned char u8; typedef unsigned short u16; typedef unsigned int u32; typedef unsigned long size_t;
typedef float f32x16 __attribute__((vector_size(64)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef u8 u8x16 __attribute__((vector_size(16)));
typedef signed char i8x16 __attribute__((vector_size(16)));
typedef u16 u16x16 __attribute__((vector_size(32)));
typedef short i16x16 __attribute__((vector_size(32)));
typedef short i16x8 __attribute__((vector_size(16)));
typedef u32 u32x16 __attribute__((vector_size(64)));
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
#define NR 32                   /* weight rows in a panel of the tiled kernel: two 16-lane vectors */
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

/* tiled: rows n0..n0+nr of W, columns k0..k0+kc, dequantized once into wf[k][NR] (k-major: the micro-kernel reads the
   panel's NR weights at one k as two vectors); rows past nr are zeros */
INLINE void panel(float *restrict wf, const u8 *restrict w, int n0, int nr, int k0, int kc) {
  for (int n = 0; n < NR; n++) {
    if (n >= nr) { for (int k = 0; k < kc; k++) wf[k * NR + n] = 0.0f; continue; }
    const u8 *wr = w + (size_t)(n0 + n) * ROWB;
    int g = k0 / 32 / NSTEP, g1 = (k0 + kc) / 32 / NSTEP;
    for (; g < g1; g++) {
#pragma clang loop unroll(full)
      for (int jj = 0; jj < NSTEP; jj++) {
        f32x16 lo, hi;
        dq(wr, g, jj, &lo, &hi);
        float *p = wf + (size_t)((g * NSTEP + jj) * 32 - k0) * NR + n;
        for (int i = 0; i < 16; i++) { p[i * NR] = lo[i]; p[(16 + i) * NR] = hi[i]; }
      }
    }
    if ((k0 + kc) / 32 %% NSTEP) {   /* an odd last block of a 32-weight type */
      f32x16 lo, hi;
      dequant(wr + (size_t)((k0 + kc) / 32 - 1) * SBB, 0, &lo, &hi);
      float *p = wf + (size_t)(kc - 32) * NR + n;
      for (int i = 0; i < 16; i++) { p[i * NR] = lo[i]; p[(16 + i) * NR] = hi[i]; }
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

INLINE void tiled(float *restrict out, const u8 *restrict w, const float *restrict x, int r0, int r1) {
  float wf[KC * NR] __attribute__((aligned(64)));
  for (int n0 = r0; n0 < r1; n0 += NR) {
    int nr = r1 - n0 < NR ? r1 - n0 : NR;
    for (int k0 = 0; k0 < K; k0 += KC) {
      int kc = K - k0 < KC ? K - k0 : KC;
      panel(wf, w, n0, nr, k0, kc);
      int m0 = 0;
      for (; m0 + MR <= M; m0 += MR) micro(out, wf, x, m0, MR, n0, nr, k0, kc);
      switch (M - m0) {
%(micro_tails)s
      }
    }
  }
}

KERNEL void %(name)s(float *restrict out, const u8 *restrict w, const float *restrict x, int core_id) {
  if (PARTS == 1) core_id = 0;   /* a one-part kernel is called without a core_id */
  int r0 = (int)((long)core_id * N / PARTS), r1 = (int)((long)(core_id + 1) * N / PARTS);
  if (TILED) { tiled(out, w, x, r0, r1); return; }
  int m0 = 0;
  for (; m0 + MT <= M; m0 += MT) tile(out, w, x, m0, MT, r0, r1);
  switch (M - m0) {   /* the last rows: a tile of their own count, so its accumulators are registers too */
%(tails)s
  }
}
"""

def kernel_parts(rows: int, threads: int) -> int:
  """How many parts the weight rows are split in: every thread, unless that leaves a part fewer than MIN_ROWS_PER_PART rows."""
  return max(1, min(threads, rows // MIN_ROWS_PER_PART))

@functools.cache
def kernel_source(ggml_type: int, M: int, N: int, K: int, parts: int, tiled: bool | None = None) -> tuple[str, str]:
  """(function name, C source) of the kernel for x (M, K) against W (N, K) in GGML type `ggml_type`, split in `parts` parts;
  the tiled kernel past DECODE_MAX_M rows of x unless `tiled` says."""
  if not supported(ggml_type, K): raise ValueError(f"no quantized matmul kernel for GGML type {ggml_type} with {K} columns")
  tiled = M > DECODE_MAX_M if tiled is None else tiled
  name = f"qmatmul_{NAMES[ggml_type].lower()}_{M}_{N}_{K}_p{parts}{'_tiled' if tiled else ''}"
  qb, sbb = LAYOUT[ggml_type]
  return name, _SOURCE % {"name": name, "M": M, "N": N, "K": K, "QB": qb, "SBB": sbb, "parts": parts, "tiled": int(tiled), "KC": KC,
                          "tails": "\n".join(f"    case {i}: if ({i} < MT) tile(out, w, x, m0, {i}, r0, r1); break;" for i in range(1, MT_MAX)),
                          "micro_tails": "\n".join(f"        case {i}: if ({i} < MR) micro(out, wf, x, m0, {i}, n0, nr, k0, kc); break;"
                                                   for i in range(1, 8)),
                          "dequant": DEQUANT[ggml_type]}

def quant_matmul(x: Tensor, blocks: Tensor, ggml_type: int, shape: tuple[int, int], threads: int, tiled: bool | None = None) -> Tensor:
  """x (..., K) float32 @ W.T, W (N, K) held as stored (`blocks`: a Tensor of its bytes, any dtype: uint8 GGUF blocks, or the
  float16/bfloat16 matrix itself) -> (..., N) float32, by the C kernels above split over `threads` parts (one core each, on
  a device whose runtime runs the parts side by side)."""
  N, K = shape
  lead = x.shape[:-1]
  M = math.prod(int(s) for s in lead)
  parts = kernel_parts(N, threads)
  name, src = kernel_source(ggml_type, M, N, K, parts, tiled)
  xs = x.reshape(M, K).cast(dtypes.float32).contiguous()
  out = Tensor.empty(M, N, dtype=dtypes.float32, device=x.device)

  def program(*params: UOp) -> UOp:
    # the part id: the kernel's fourth argument (slot 3, after the three buffers), filled in by the pool for each part
    core = UOp.variable("core_id", 0, parts - 1, dtypes.int, param=True) if parts > 1 else None
    if core is not None: core = core.replace(arg=dataclasses.replace(core.arg, slot=3))
    sink = UOp.sink(*params, *([core] if core is not None else []), arg=KernelInfo(name=name))
    info = ProgramInfo(name=name, global_size=(parts, 1, 1), vars=(core,) if core is not None else (), globals=(0, 1, 2),
                       outs=(0,), ins=(1, 2))
    return UOp(Ops.PROGRAM, src=(sink, UOp(Ops.LINEAR, src=(*sink.src, sink)), UOp(Ops.SOURCE, arg=src)), arg=info)

  out = out.custom_kernel(blocks.contiguous(), xs, fxn=program)[0]
  return out.reshape(*lead, N)
