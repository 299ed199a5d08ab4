"""x @ W.T with W in GGUF blocks (Q4_0, Q4_1, Q8_0), as one hand-written C kernel for HET on a CPU and MESH.

Why not tinygrad's own kernel: for the lazy dequantization in tinyhet/model/packed.py, tinygrad renders scalar C (one byte load
and a select per nibble), which reads the blocks at 1.5-2 GB/s on one core where the memory gives 10-20; BEAM search and
three other formulations were no faster (measured; README "Every core"). Decode is that matrix-vector product, so it set
the decode node's speed. This kernel widens 16 quants at a time to float lanes, dequantizes them in registers and
multiplies by x: 3-4x tinygrad's rate, but still bound by those instructions, not by memory (README "Benchmarks"). Unlike
llama.cpp's, x stays float32 (it is not rounded to 8 bits for integer dot products), so the result is the float32
reference's, up to the order of the additions.

The kernel (C, clang vector extensions: no intrinsics, so it builds for any -march tinygrad's CPU compiler targets):
  out[m, r] = sum_k x[m, k] * W[r, k]        x (M, K) float32, W (N, K) as N rows of K/32 blocks, out (M, N) float32
Rows r of W are split into `parts` contiguous ranges, one per core_id: each part streams its own slice of the weights once
per tile of 4-8 rows of x (decode: M is the batch, one tile; prefill: M is the prompt, M/MT tiles, W's slice stays in cache
when it fits). It reaches tinygrad as a custom kernel (Tensor.custom_kernel with a compiled PROGRAM), so it is scheduled,
captured by TinyJit and run by the worker pool like any other kernel.
"""
from __future__ import annotations
import dataclasses, functools, math
from tinygrad import Tensor, dtypes
from tinygrad.uop.ops import UOp, Ops, KernelInfo, ProgramInfo
from tinyhet.model.packed import BLOCK_BYTES, Q4_0, Q4_1, Q8_0
MIN_ROWS_PER_PART = 16   # fewer weight rows than this per core and a split costs more than it saves
MT_MAX = 8               # rows of x per tile, at most (the C picks 8 where AVX-512 gives 32 vector registers, else 4)

# Each block type turns the block at b into its 32 weights as two 16-lane vectors (weights 0-15, 16-31).
_DEQUANT = {
  Q4_0: """  float d = h2f(b); u8x16 q; __builtin_memcpy(&q, b + 2, 16);
  *lo = (__builtin_convertvector(q & 15, f32x16) - 8.0f) * d; *hi = (__builtin_convertvector(q >> 4, f32x16) - 8.0f) * d;""",
  Q4_1: """  float d = h2f(b), m = h2f(b + 2); u8x16 q; __builtin_memcpy(&q, b + 4, 16);
  *lo = __builtin_convertvector(q & 15, f32x16) * d + m; *hi = __builtin_convertvector(q >> 4, f32x16) * d + m;""",
  Q8_0: """  float d = h2f(b); i8x16 q0, q1; __builtin_memcpy(&q0, b + 2, 16); __builtin_memcpy(&q1, b + 18, 16);
  *lo = __builtin_convertvector(q0, f32x16) * d; *hi = __builtin_convertvector(q1, f32x16) * d;""",
}

_SOURCE = r"""
typedef unsigned char u8; typedef unsigned int u32; typedef unsigned long size_t;
typedef float f32x16 __attribute__((vector_size(64)));
typedef u8 u8x16 __attribute__((vector_size(16)));
typedef signed char i8x16 __attribute__((vector_size(16)));
/* no_builtin("memset"): clang must not turn the accumulators' zeroing into a call to memset, which a kernel cannot make
   (tinygrad loads it as a bare object: an external call does not link) */
#define KERNEL __attribute__((no_builtin("memset")))
#define INLINE static inline __attribute__((always_inline)) KERNEL
#define M %(M)d
#define N %(N)d
#define K %(K)d
#define NB (K / 32)
#define BB %(BB)d
#define PARTS %(parts)d
/* rows of x per tile, whose float32 accumulators of 16 lanes and the dequantized blocks must stay in registers: with
   AVX-512 (32 registers) 8 rows, two accumulators each (the even and the odd block: two chains of fused multiply-adds, not
   one); else 4 rows, one accumulator each */
#if defined(__AVX512F__)
#define MT 8
#define ACCS 2
#else
#define MT 4
#define ACCS 1
#endif

/* float16 -> float32: the CPU's conversion where it has one (x86 F16C, ARM's half type); elsewhere shift the exponent and
   mantissa into place and scale by 2^112 (exact for normal and subnormal halves; a block scale is never inf or nan) */
#if defined(__F16C__)
typedef short i16x8 __attribute__((vector_size(16)));
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

INLINE void dequant(const u8 *b, f32x16 *lo, f32x16 *hi) {
%(dequant)s
}

INLINE float hsum(f32x16 v) {
  float s = 0.0f;
  for (int i = 0; i < 16; i++) s += v[i];
  return s;
}

INLINE f32x16 load16(const float *p) { f32x16 v; __builtin_memcpy(&v, p, 64); return v; }

/* rows r0..r1 of W against rows m0..m0+mt of x; mt is a constant in each inlined copy, so the accumulators are registers.
   Two blocks per step, added to the accumulator together: half the chain of dependent adds. */
INLINE void tile(float *restrict out, const u8 *restrict w, const float *restrict x, int m0, const int mt, int r0, int r1) {
  for (int r = r0; r < r1; r++) {
    const u8 *wr = w + (size_t)r * NB * BB;
    f32x16 acc[MT][ACCS];
    for (int i = 0; i < MT; i++) for (int a = 0; a < ACCS; a++) acc[i][a] = (f32x16){0};   /* stores, not an initializer: no memset */
    int b = 0;
    for (; b + 2 <= NB; b += 2) {
      f32x16 lo0, hi0, lo1, hi1;
      dequant(wr + (size_t)b * BB, &lo0, &hi0);
      dequant(wr + (size_t)(b + 1) * BB, &lo1, &hi1);
      for (int i = 0; i < mt; i++) {
        const float *xb = x + (size_t)(m0 + i) * K + b * 32;
#if ACCS == 2
        acc[i][0] += lo0 * load16(xb); acc[i][0] += hi0 * load16(xb + 16);
        acc[i][1] += lo1 * load16(xb + 32); acc[i][1] += hi1 * load16(xb + 48);
#else
        acc[i][0] += (lo0 * load16(xb) + hi0 * load16(xb + 16)) + (lo1 * load16(xb + 32) + hi1 * load16(xb + 48));
#endif
      }
    }
    if (b < NB) {
      f32x16 lo, hi;
      dequant(wr + (size_t)b * BB, &lo, &hi);
      for (int i = 0; i < mt; i++) {
        const float *xb = x + (size_t)(m0 + i) * K + b * 32;
        acc[i][0] += lo * load16(xb) + hi * load16(xb + 16);
      }
    }
    for (int i = 0; i < mt; i++) out[(size_t)(m0 + i) * N + r] = hsum(ACCS == 2 ? acc[i][0] + acc[i][ACCS - 1] : acc[i][0]);
  }
}

KERNEL void %(name)s(float *restrict out, const u8 *restrict w, const float *restrict x, int core_id) {
  if (PARTS == 1) core_id = 0;   /* a one-part kernel is called without a core_id */
  int r0 = (int)((long)core_id * N / PARTS), r1 = (int)((long)(core_id + 1) * N / PARTS);
  int m0 = 0;
  for (; m0 + MT <= M; m0 += MT) tile(out, w, x, m0, MT, r0, r1);
  switch (M - m0) {   /* the last rows: a tile of their own count, so its accumulators are registers too */
%(tails)s
  }
}
"""

def supported(ggml_type: int, cols: int) -> bool:
  return ggml_type in _DEQUANT and cols % 32 == 0

def kernel_parts(rows: int, threads: int) -> int:
  """How many parts the weight rows are split in: every thread, unless that leaves a part fewer than MIN_ROWS_PER_PART rows."""
  return max(1, min(threads, rows // MIN_ROWS_PER_PART))

@functools.cache
def kernel_source(ggml_type: int, M: int, N: int, K: int, parts: int) -> tuple[str, str]:
  """(function name, C source) of the kernel for x (M, K) against W (N, K) blocks, split in `parts` parts."""
  if not supported(ggml_type, K): raise ValueError(f"no quantized matmul kernel for GGML type {ggml_type} with {K} columns")
  name = f"qmatmul_t{ggml_type}_{M}_{N}_{K}_p{parts}"
  return name, _SOURCE % {"name": name, "M": M, "N": N, "K": K, "BB": BLOCK_BYTES[ggml_type], "parts": parts,
                          "tails": "\n".join(f"    case {i}: if ({i} < MT) tile(out, w, x, m0, {i}, r0, r1); break;" for i in range(1, MT_MAX)),
                          "dequant": _DEQUANT[ggml_type]}

def quant_matmul(x: Tensor, blocks: Tensor, ggml_type: int, shape: tuple[int, int], threads: int) -> Tensor:
  """x (..., K) float32 @ W.T, W (N, K) held as GGUF blocks (the uint8 Tensor `blocks`, (N, K/32 * block bytes)) -> (..., N)
  float32, by the C kernel above split over `threads` parts (one core each, on a device whose runtime runs the parts
  side by side)."""
  N, K = shape
  lead = x.shape[:-1]
  M = math.prod(int(s) for s in lead)
  parts = kernel_parts(N, threads)
  name, src = kernel_source(ggml_type, M, N, K, parts)
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

  out = out.custom_kernel(blocks, xs, fxn=program)[0]
  return out.reshape(*lead, N)
