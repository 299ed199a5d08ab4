"""Paged attention for decode, and the KV scatter that stores new tokens, as tinygrad custom kernels (UOps).

Pool layout (one tensor per layer; kernels/kv_pack.py writes the same bytes): (num_blocks, 2, n_kv_heads, block_size * head_dim)
in the KV dtype. Block b is the contiguous span pool[b] = [K tiles of its n_kv heads | V tiles of its n_kv heads]:
  K[b, h, t, d] is at pool[b, 0, h, d * block_size + t]   (the K tile is stored transposed: (head_dim, block_size))
  V[b, h, t, d] is at pool[b, 1, h, t * head_dim + d]     (the V tile is row-major: (block_size, head_dim))
Why K is transposed: tinygrad renders every elementwise op as scalar C and relies on clang to vectorize; clang does not reorder a
float sum over head_dim (no fast-math), so a row-major K tile makes q.k a serial chain. With (head_dim, block_size) the score
loop is acc[t] += q[d] * K[d, t] over t: independent lanes that clang turns into vector FMAs. Measured on this 2-core EPYC with
16 rows x 1024 tokens, 3 kv heads x 3 (GQA) x 64: the score kernel took 6.4-7.5 ms with row-major K (two loop orders
tried), 0.47 ms transposed.

Rows: a query row has its own block table row and context length (the number of cached tokens it attends to, including the
ones just stored). A decode batch of B sequences is B rows; T tokens of one sequence are T rows sharing one block table.

Two kernels: paged_scores writes S[r, h, j] = q.K[j] / sqrt(head_dim) (-inf past the row's length), paged_softmax_pv takes
the row maximum, then sums exp(S - max) * V[j] and divides by the sum of the weights. Softmax is float32; K and V are read in
the pool dtype and cast to float32.

JIT: both kernels loop over the first `max_blocks` entries of each block table. max_blocks is either a bound tinygrad Variable
named MAX_BLOCKS_VAR (symbolic: one compile serves every length; pass the bound Variable into the TinyJit-ed function) or an
int (bucketed: one compile and one JIT capture per bucket; the padded blocks are computed, then masked). Measured with
`tinyhet bench kv --compare-jit` (one layer of SmolLM2-135M's shape, 16 rows each growing by one token per step from <64 to
2048 tokens, block 16, fp16, scatter + attention per step, same run, 2 shared cores so times are noisy):
  symbolic                    : 1 capture,  4 programs compiled, 1.62 ms/step median (2.06 mean)
  bucketed (2^k blocks)       : 6 captures, 12 programs compiled, 3.15 ms/step median (2.65 mean)
Chosen: symbolic. It compiles once, never stalls a decode on a capture when a sequence crosses a bucket, and pads only up to
the batch's longest row (buckets pad up to 2x past it). Its one cost: the bound Variable must reach the JIT as an argument
(PagedKVCache.jit_kwargs).
"""
from __future__ import annotations
import math
from tinygrad import Tensor, UOp, dtypes
from tinygrad.codegen.opt import Opt, OptOps
from tinygrad.dtype import AddrSpace
from tinygrad.helpers import NUM_CPU_THREADS
from tinygrad.uop.ops import AxisType, KernelInfo

MAX_BLOCKS_VAR = "kv_max_blocks"  # the Variable that bounds the block loop: the longest row's number of blocks

def max_blocks_var(cap: int) -> UOp:
  """The symbolic block count, 1..cap; bind it to the step's longest row (in blocks) with .bind(n)."""
  return UOp.variable(MAX_BLOCKS_VAR, 1, cap)

def _block_loop_end(max_blocks: int | UOp, cap: int) -> int | UOp:
  # inside a kernel a Variable is an ALU PARAM; its value arrives at launch from the bound Variable passed with the call
  return max_blocks if isinstance(max_blocks, int) else UOp.variable(MAX_BLOCKS_VAR, 1, cap, param=True)

def _threads(sizes: tuple[int, ...]) -> tuple[Opt, ...]:
  # split the first outer loop whose size the thread count divides across CPU threads (tinygrad's THREAD opt). Opt axes
  # count the kernel's loops in order, without the loops of size 1 (tinygrad drops them)
  loops = [s for s in sizes if s > 1]
  for n in range(min(NUM_CPU_THREADS.value, 8), 1, -1):
    for axis, size in enumerate(loops):
      if size % n == 0: return (Opt(OptOps.THREAD, axis, n),)
  return ()

def _launch(fxn, outs: list[Tensor], ins: list[Tensor], max_blocks: int | UOp | None = None) -> list[Tensor]:
  srcs = [t.uop for t in outs + ins]
  placeholders = [UOp.placeholder_like(s, slot=i) for i, s in enumerate(srcs)]
  call = fxn(*placeholders).call(*srcs, *([max_blocks] if isinstance(max_blocks, UOp) else []))
  return [Tensor(t.uop.after(call)) for t in outs]

def kv_scatter(pool: Tensor, k: Tensor, v: Tensor, block_tables: Tensor, positions: Tensor) -> Tensor:
  """Store k, v (R, n_kv, head_dim) of R tokens at positions (R,) int32 of rows whose block tables are block_tables (R, cap):
  token p of row r lands in block block_tables[r, p // block_size], slot p % block_size. Writes only those R * 2 * n_kv *
  head_dim elements (cast to the pool dtype), never the rest of the pool. Returns the pool after the write."""
  R, KV, D = k.shape
  BS = pool.shape[3] // D

  def kernel(pool: UOp, k: UOp, v: UOp, bt: UOp, pos: UOp) -> UOp:
    pf = pool.flatten()
    r, h, d = UOp.range(R, 0), UOp.range(KV, 1), UOp.range(D, 2)
    p = pos[r].cast(dtypes.weakint)
    blk, t = bt[r, p // BS].cast(dtypes.weakint), p % BS
    kdst = ((blk * 2 + 0) * KV + h) * (BS * D) + d * BS + t   # K tile is (d, t)
    vdst = ((blk * 2 + 1) * KV + h) * (BS * D) + t * D + d    # V tile is (t, d)
    st = UOp.group(pf[kdst].store(k[r, h, d].cast(pool.dtype)), pf[vdst].store(v[r, h, d].cast(pool.dtype)))
    return st.end(r, h, d).sink(arg=KernelInfo(name="kv_scatter", opts_to_apply=()))

  return _launch(kernel, [pool], [k.contiguous(), v.contiguous(), block_tables, positions])[0]

def paged_attention(q: Tensor, pool: Tensor, block_tables: Tensor, context_lens: Tensor, max_blocks: int | UOp) -> Tensor:
  """Attention of q (R, n_heads, head_dim) over each row's cached tokens 0..context_lens[r]-1.
  pool: (num_blocks, 2, n_kv, block_size * head_dim) in the module's layout; block_tables: (R, cap) int32 whose first
  max_blocks entries are valid block ids (pad with any valid id: padded slots are masked and their bytes never reach the
  result); context_lens: (R,) int32, 1 <= context_lens[r] <= max_blocks * block_size; max_blocks: int, or the bound
  Variable from max_blocks_var(cap). Grouped-query: head h reads kv head h // (n_heads // n_kv). Returns (R, n_heads,
  head_dim) float32; softmax in float32, scale 1/sqrt(head_dim)."""
  R, H, D = q.shape
  _, _, KV, X = pool.shape
  if H % KV or X % D: raise ValueError(f"paged_attention: n_heads {H} must be a multiple of n_kv_heads {KV}, pool tile {X} of head_dim {D}")
  BS, cap, g = X // D, block_tables.shape[1], H // KV
  scale = 1.0 / math.sqrt(D)
  opts = _threads((R, KV))

  def scores(S: UOp, q: UOp, pool: UOp, bt: UOp, n: UOp) -> UOp:
    pf = pool.flatten()
    r, kvh, jb, gi = UOp.range(R, 0), UOp.range(KV, 1), UOp.range(_block_loop_end(max_blocks, cap), 2), UOp.range(g, 3)
    kbase = (bt[r, jb].cast(dtypes.weakint) * 2 * KV + kvh) * X      # K tile (d, t) of block jb, kv head kvh
    acc = UOp.placeholder((BS,), dtypes.float, 0, addrspace=AddrSpace.REG)
    t0 = UOp.range(BS, 4)
    acc = acc.after(r, kvh, jb, gi)[t0].set(0.0, end=t0)
    d, t = UOp.range(D, 5, AxisType.REDUCE), UOp.range(BS, 6)
    acc = acc.after(d)[t].set(acc.after(d, t)[t] + q[r, kvh * g + gi, d] * pf[kbase + d * BS + t].cast(dtypes.float), end=(t, d))
    t2 = UOp.range(BS, 7)
    j = jb * BS + t2
    val = (j < n[r].cast(dtypes.weakint)).where(acc[t2] * scale, -math.inf)
    return S[r, kvh * g + gi, j].store(val).end(t2).end(r, kvh, jb, gi).sink(arg=KernelInfo(name="paged_scores", opts_to_apply=opts))

  def softmax_pv(O: UOp, S: UOp, pool: UOp, bt: UOp, n: UOp) -> UOp:
    pf = pool.flatten()
    r, kvh = UOp.range(R, 0), UOp.range(KV, 1)
    nr = n[r].cast(dtypes.weakint)
    # pass 1: row maximum of S per head of the group
    m = UOp.placeholder((g,), dtypes.float, 0, addrspace=AddrSpace.REG)
    gi0 = UOp.range(g, 2)
    m = m.after(r, kvh)[gi0].set(-math.inf, end=gi0)
    j1, gi1 = UOp.range(_block_loop_end(max_blocks, cap) * BS, 3, AxisType.REDUCE), UOp.range(g, 4)
    m = m.after(j1)[gi1].set(m.after(j1, gi1)[gi1].maximum(S[r, kvh * g + gi1, j1]), end=(gi1, j1))
    # pass 2: weights e = exp(S - max), their sum l, and acc = sum e * V over the row's tokens
    acc = UOp.placeholder((g * D,), dtypes.float, 1, addrspace=AddrSpace.REG)
    l = UOp.placeholder((g,), dtypes.float, 2, addrspace=AddrSpace.REG)
    gi5, d5, gi6 = UOp.range(g, 5), UOp.range(D, 6), UOp.range(g, 7)
    acc = acc.after(r, kvh)[gi5 * D + d5].set(0.0, end=(gi5, d5))
    l = l.after(r, kvh)[gi6].set(0.0, end=gi6)
    jb, t = UOp.range(_block_loop_end(max_blocks, cap), 8, AxisType.REDUCE), UOp.range(BS, 9, AxisType.REDUCE)
    j = jb * BS + t
    vbase = ((bt[r, jb].cast(dtypes.weakint) * 2 + 1) * KV + kvh) * X + t * D   # V row t of block jb, kv head kvh
    gi, d = UOp.range(g, 10), UOp.range(D, 11)
    e = (S[r, kvh * g + gi, j] - m[gi]).exp()
    l = l.after(jb, t, gi)[gi].set(l.after(jb, t, gi)[gi] + e)
    # where, not a multiply by a zero weight: a padded slot may hold stale bytes (even NaN) that must not reach the sum
    contrib = (j < nr).where(e * pf[vbase + d].cast(dtypes.float), 0.0)
    acc = acc.after(l, d)[gi * D + d].set(acc.after(l, d)[gi * D + d] + contrib, end=(d, gi, t, jb))
    gi3, d3 = UOp.range(g, 12), UOp.range(D, 13)
    out = O[r, kvh * g + gi3, d3].store(acc[gi3 * D + d3] / l.after(acc)[gi3])
    return out.end(gi3, d3).end(r, kvh).sink(arg=KernelInfo(name="paged_softmax_pv", opts_to_apply=opts))

  q = q.float().contiguous()
  S = _launch(scores, [Tensor.empty(R, H, cap * BS, dtype=dtypes.float, device=q.device)], [q, pool, block_tables, context_lens], max_blocks)[0]
  return _launch(softmax_pv, [Tensor.empty(R, H, D, dtype=dtypes.float, device=q.device)], [S, pool, block_tables, context_lens], max_blocks)[0]
