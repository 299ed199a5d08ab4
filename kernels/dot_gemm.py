"""The float path's kernel for F16 and BF16 weights past one decode tile (quant_matmul.DOT_TYPES, M > DECODE_MAX_M): blocks
of WR = 4 weight rows against tiles of XR = 4 rows of x, sixteen float32 accumulators in registers, each the dot product of
one weight row and one row of x along k (no panel: the weights are converted in registers straight from their rows, as the
decode kernel does, once per tile of x); at the end the sixteen accumulators are summed across their lanes at once
(reduce16: four rounds of shuffles and adds, one vector of sixteen sums). The rows go in groups of GROUP_BYTES, every tile of
x against a group before the next: the group's rows come from memory once and stay in L2, a tile of x is read once a group.
While the first tile runs, the next block's rows are asked of memory into L2 (one line of each row per sub-block; into
L1 the cold 16-row product took 0.43 ms, not 0.31).

Why: the tiled kernel's panel (kernels/quant_matmul.py) converts 32 rows by KC columns and transposes them into a k-major
scratch before its outer products; at 16 rows of x that is a quarter of the product, and its 32 strided row reads wait on
memory. Measured (one core, ctypes; AMD EPYC Zen 4; cold: a rotating 512 MB of copies of the matrix): F16 1536 x 576 at 16
rows 0.52 -> 0.31 ms cold (0.39 -> 0.27 hot), 576 x 1536 0.49 -> 0.31, 4096 x 4096 9.4 -> 5.9; at 64 rows 1.27 -> 1.19; at
512 rows within 3% either way (8.5 against 8.4-8.7 ms); BF16 the same. The block types gain at 16 rows (Q8_0 1.3x, Q4_1
1.17x) and lose past 24-32 (their dequantization, once per tile of x here, is shared by every row of x in a panel), so they
keep the tiled kernel.

Each output is one accumulator's sum in a fixed order whatever the tile's size, so a row of x gets the same bits at any M
this kernel serves. C, included by kernels/quant_matmul.py's source (TILED == 2).
"""
from __future__ import annotations

DG = "((int)(GROUP_BYTES / ROWB) < WR ? WR : (int)(GROUP_BYTES / ROWB) / WR * WR)"
GROUP_BYTES = 256 << 10   # bytes of weight rows in a group: in L2 with room for the tiles of x
WR, XR = 4, 4   # weight rows per block, rows of x per tile: 16 accumulators, reduced by one reduce16

def _shuffle(a: str, b: str, idx: list[int]) -> str:
  return f"__builtin_shufflevector({a}, {b}, {', '.join(map(str, idx))})"

def reduce_source() -> str:
  """reduce16: v[0..15] -> one vector whose lane l is the sum of v[l]'s lanes. Round 1 pairs v[i] with v[i + 8], each half of
  the new vector the sum of the halves of one of them; rounds 2-4 do the same within 8, 4 and 2 lanes, so lane
  8 b3 + 4 b2 + 2 b1 + b0 ends up holding v[8 b3 + 4 b2 + 2 b1 + b0]'s sum."""
  rounds = [(8, list(range(0, 8)) + list(range(16, 24)), list(range(8, 16)) + list(range(24, 32))),
            (4, [0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27], [4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31]),
            (2, sum(([4 * q, 4 * q + 1, 16 + 4 * q, 17 + 4 * q] for q in range(4)), []),
             sum(([4 * q + 2, 4 * q + 3, 18 + 4 * q, 19 + 4 * q] for q in range(4)), [])),
            (1, sum(([2 * p, 16 + 2 * p] for p in range(8)), []), sum(([2 * p + 1, 17 + 2 * p] for p in range(8)), []))]
  lines = []
  for s, lo, hi in rounds:
    for i in range(s):
      a, b = f"v[{i}]", f"v[{i + s}]"
      lines.append(f"  v[{i}] = {_shuffle(a, b, lo)} + {_shuffle(a, b, hi)};")
  return "INLINE f32x16 reduce16(f32x16 *restrict v) {\n" + "\n".join(lines) + "\n  return v[0];\n}\n"

SOURCE = r"""
#define WR %(WR)d
#define XR %(XR)d
#define GROUP_BYTES %(GB)d
#define DG %(DG)s   /* weight rows per group */
/* rows r0..r0+wr of W against rows m0..m0+xr of x (wr, xr constants in each inlined copy); accumulator i * WR + j: x row
   m0 + i, weight row r0 + j. pf: ask for the next block's rows as this tile reads its own (a prefetch never faults: past the
   part's rows or the matrix it is a wasted hint, not an error) */
INLINE void dtile(float *restrict out, const u8 *restrict w, const float *restrict x, int m0, const int xr, int r0, const int wr,
                  int pf) {
  f32x16 acc[16];
  for (int a = 0; a < 16; a++) acc[a] = (f32x16){0};   /* stores, not an initializer: no memset */
  for (int g = 0; g < NB / NSTEP; g++) {
#pragma clang loop unroll(full)
    for (int jj = 0; jj < NSTEP; jj++) {
      f32x16 lo[WR], hi[WR];
      for (int j = 0; j < wr; j++) dq(w + (size_t)(r0 + j) * ROWB, g, jj, &lo[j], &hi[j]);
      if (pf) for (int j = 0; j < WR; j++) __builtin_prefetch(w + (size_t)(r0 + WR + j) * ROWB + (size_t)(g * NSTEP + jj) * SBB / NSUB, 0, 1);
      for (int i = 0; i < xr; i++) {
        const float *xb = x + (size_t)(m0 + i) * K + (g * NSTEP + jj) * 32;
        const f32x16 xl = load16(xb), xh = load16(xb + 16);
        for (int j = 0; j < wr; j++) { acc[i * WR + j] += lo[j] * xl; acc[i * WR + j] += hi[j] * xh; }
      }
    }
  }
  if (NB %% NSTEP) {   /* an odd last block of a 32-weight type */
    f32x16 lo[WR], hi[WR];
    for (int j = 0; j < wr; j++) dequant(w + (size_t)(r0 + j) * ROWB + (size_t)(NB - 1) * SBB, 0, &lo[j], &hi[j]);
    for (int i = 0; i < xr; i++) {
      const float *xb = x + (size_t)(m0 + i) * K + (NB - 1) * 32;
      const f32x16 xl = load16(xb), xh = load16(xb + 16);
      for (int j = 0; j < wr; j++) { acc[i * WR + j] += lo[j] * xl; acc[i * WR + j] += hi[j] * xh; }
    }
  }
  const f32x16 s = reduce16(acc);
  for (int i = 0; i < xr; i++) for (int j = 0; j < wr; j++) out[(size_t)(m0 + i) * N + r0 + j] = s[i * WR + j];
}

/* each (rows of x, weight rows) tile shape a function of its own, not inlined into the loops below: inlined, the loops'
   values took registers from the sixteen accumulators, and clang spilled them inside the product's loop wherever the part's
   rows were not compile-time constants (measured: a part of a 2-part F16 1536 x 576 product at 16 rows, 0.18 -> 0.135 ms) */
%(tiles)s

/* every tile of x against the blocks of rows g0..g1, then the next group: a group's rows come from memory once, and at many
   rows of x, a tile of x is read from L2 once a group, not once a block. Prefetch (first tile): the next block's rows */
INLINE void dgroup(float *restrict out, const u8 *restrict w, const float *restrict x, int m0, const int xr, int g0, int g1, int r1) {
  int r = g0;
  for (; r + WR <= g1; r += WR) dtile_call(out, w, x, m0, xr, r, WR, m0 == 0 && r + WR < r1);
  switch (g1 - r) {
    case 1: dtile_call(out, w, x, m0, xr, r, 1, 0); break;
    case 2: dtile_call(out, w, x, m0, xr, r, 2, 0); break;
    case 3: dtile_call(out, w, x, m0, xr, r, 3, 0); break;
  }
}

INLINE void dotted(float *restrict out, const u8 *restrict w, const float *restrict x, int r0, int r1) {
  for (int g0 = r0; g0 < r1; g0 += DG) {
    const int g1 = r1 - g0 < DG ? r1 : g0 + DG;
    int m0 = 0;
    for (; m0 + XR <= M; m0 += XR) dgroup(out, w, x, m0, XR, g0, g1, r1);
    switch (M - m0) {
      case 1: dgroup(out, w, x, m0, 1, g0, g1, r1); break;
      case 2: dgroup(out, w, x, m0, 2, g0, g1, r1); break;
      case 3: dgroup(out, w, x, m0, 3, g0, g1, r1); break;
    }
  }
}
"""

def _tiles() -> str:
  """dtile_X_W (X rows of x, W weight rows) for every shape, not inlined, and dtile_call(): the one for constant xr, wr."""
  fns = [f"static __attribute__((noinline)) KERNEL void dtile_{x}_{w}(float *restrict out, const u8 *restrict w, const float *restrict x, "
         f"int m0, int r0, int pf) {{ dtile(out, w, x, m0, {x}, r0, {w}, pf); }}" for x in range(1, XR + 1) for w in range(1, WR + 1)]
  cases = "\n".join(f"    case {x * 8 + w}: dtile_{x}_{w}(out, w, x, m0, r0, pf); break;" for x in range(1, XR + 1) for w in range(1, WR + 1))
  return "\n".join(fns) + f"""
INLINE void dtile_call(float *restrict out, const u8 *restrict w, const float *restrict x, int m0, const int xr, int r0, const int wr, int pf) {{
  switch (xr * 8 + wr) {{
{cases}
  }}
}}"""

def source() -> str:
  """The C of the dot kernel (dotted), for the source of kernels/quant_matmul.py (which defines dq, dequant, load16)."""
  assert WR == XR == 4, "reduce16 sums sixteen accumulators; the tails of dgroup (weight rows) and dotted (rows of x) are 1-3"
  return reduce_source() + SOURCE % {"WR": WR, "XR": XR, "DG": DG, "GB": GROUP_BYTES, "tiles": _tiles()}
