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

One kernel, flash-decoding: each (row, kv head) is cut along its context into `splits` parts (blocks [p * per, (p + 1) * per),
per = ceil(max_blocks / splits)); a part walks its blocks keeping a running max m, weight sum l and weighted V sum per head
(online softmax: per block the scores q.K in registers, the new max, exp(old max - new max) rescaling l and the V sum), and
writes those three; merge_splits rescales every part to the overall max and divides. So a batch-1 step at 32K tokens reads its
KV with every thread (the parts of one row run side by side), and nothing the size of the context is kept: the scratch is the
partials, (rows, n_heads, splits, head_dim + 2) float32. A masked slot scores NEG (finite: a part with no valid token ends with
m = NEG, l = 0 and weighs exp(NEG - m) = 0 in the merge). Softmax is float32; K and V are read in the pool dtype and cast.
Measured on this 2-core EPYC (shared with other jobs, best of 22 TinyJit calls, SmolLM2's 3 kv heads x 3 x 64, fp16, block 16)
against the two-kernel form it replaced (scores into a (rows, heads, cap * block) scratch, then softmax and V):
  batch 1, 32K tokens: 8.5-15.7 (two runs) -> 8.9 ms (1 thread) / 9.7 ms (2 parts);  batch 1, 4K: 0.46 -> 0.20 / 0.31 ms
  batch 16, 4K: 23.8 -> 7.9 ms
(the 2-part runs wait on the slower of two threads of a machine loaded ~4x over; the single-kernel form gains by reading K and V
once per block while they are in cache.)

JIT: the kernel loops over the first `max_blocks` entries of each block table. max_blocks is either a bound tinygrad Variable
named MAX_BLOCKS_VAR (symbolic: one compile serves every length; pass the bound Variable into the TinyJit-ed function) or an
int (bucketed: one compile and one JIT capture per bucket; the padded blocks are computed, then masked). Measured with
`tinyhet bench kv --compare-jit` (one layer of SmolLM2-135M's shape, 16 rows each growing by one token per step from <64 to
2048 tokens, block 16, fp16, scatter + attention per step, same run, 2 shared cores so times are noisy):
  symbolic                    : 1 capture,  4 programs compiled, 1.62 ms/step median (2.06 mean)
  bucketed (2^k blocks)       : 6 captures, 12 programs compiled, 3.15 ms/step median (2.65 mean)
Chosen: symbolic. It compiles once, never stalls a decode on a capture when a sequence crosses a bucket, and pads only up to
the batch's longest row (buckets pad up to 2x past it). Its one cost: the bound Variable must reach the JIT as an argument
(PagedKVCache.jit_kwargs).

On CPU devices (tinygrad's CPU, HET on a CPU, MESH) callers pass `threads` and the same call runs kernels/cpu_attention.py's
hand-written C instead (float32/float16/bfloat16 pools, head_dim and block size multiples of 16): vector scores and exp,
K and V converted once per block for every head of a kv group, and with `shared_table` (one sequence's rows: a chunked
prefill, a recompute) tiles of consecutive rows sharing each block read. Its splits are per row (kv heads stay in one part,
so a part reads whole blocks); max_blocks is not needed there (each row stops at its own length).
"""
from __future__ import annotations
import math
from tinygrad import Tensor, UOp, dtypes
from tinygrad.codegen.opt import Opt, OptOps
from tinygrad.dtype import AddrSpace
from tinygrad.helpers import NUM_CPU_THREADS
from tinygrad.uop.ops import AxisType, KernelInfo
from tinyhet.kernels import cpu_attention
from tinyhet.kernels.kv_quant import block_size_of, is_coded, is_q8

NEG = -1e30   # the score of a masked slot and the start of a running max: finite, so exp(NEG - NEG) is 1, not NaN
MAX_BLOCKS_VAR = "kv_max_blocks"  # the Variable that bounds the block loop: the longest row's number of blocks

def max_blocks_var(cap: int) -> UOp:
  """The symbolic block count, 1..cap; bind it to the step's longest row (in blocks) with .bind(n)."""
  return UOp.variable(MAX_BLOCKS_VAR, 1, cap)

def _block_loop_end(max_blocks: int | UOp, cap: int) -> int | UOp:
  # inside a kernel a Variable is an ALU PARAM; its value arrives at launch from the bound Variable passed with the call
  return max_blocks if isinstance(max_blocks, int) else UOp.variable(MAX_BLOCKS_VAR, 1, cap, param=True)

def _threads(sizes: tuple[int, ...]) -> tuple[Opt, ...]:
  # split the first outer loop whose size the thread count divides across CPU threads (tinygrad's THREAD opt), trying the
  # most parts first: as many as there are threads where a loop allows. Opt axes count the kernel's loops in order, without
  # the loops of size 1 (tinygrad drops them)
  loops = [s for s in sizes if s > 1]
  for n in range(NUM_CPU_THREADS.value, 1, -1):
    for axis, size in enumerate(loops):
      if size % n == 0: return (Opt(OptOps.THREAD, axis, n),)
  return ()

def decode_splits(rows: int, n_kv: int, cap: int, threads: int | None = None) -> int:
  """How many parts paged_attention cuts each row's context into: 1 where rows x kv heads already give every thread a
  part (a multiple of the thread count, or at least 4 per thread), else the thread count (so batch 1 at a long context reads
  its KV with every thread), at most the block-table width."""
  t = NUM_CPU_THREADS.value if threads is None else threads
  work = rows * n_kv
  if t <= 1 or work % t == 0 or work >= 4 * t: return 1
  return max(1, min(t, cap))

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
  if is_coded(pool.dtype): return cpu_attention.cpu_scatter_coded(pool, k, v, block_tables, positions)
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

def uses_c(device: str, pool: Tensor, head_dim: int, threads: int | None) -> bool:
  """Whether paged_attention(..., threads=threads) runs the C kernels (kernels/cpu_attention.py) for this pool on device."""
  return threads is not None and cpu_attention.supported(device, pool.dtype, head_dim, block_size_of(pool.dtype, pool.shape[3], head_dim))

def paged_attention(q: Tensor, pool: Tensor, block_tables: Tensor, context_lens: Tensor, max_blocks: int | UOp,
                    splits: int | None = None, threads: int | None = None, shared_table: bool = False,
                    split_count: Tensor | None = None) -> Tensor:
  """Attention of q (R, n_heads, head_dim) over each row's cached tokens 0..context_lens[r]-1.
  pool: (num_blocks, 2, n_kv, block_size * head_dim) in the module's layout; block_tables: (R, cap) int32 whose first
  max_blocks entries are valid block ids (pad with any valid id: padded slots are masked and their bytes never reach the
  result); context_lens: (R,) int32, 1 <= context_lens[r] <= max_blocks * block_size; max_blocks: int, or the bound
  Variable from max_blocks_var(cap). Grouped-query: head h reads kv head h // (n_heads // n_kv). Returns (R, n_heads,
  head_dim) float32; softmax in float32, scale 1/sqrt(head_dim).
  splits: how many parts each row's context is cut into (flash-decoding; default `decode_splits`): part p takes blocks
  [p * ceil(max_blocks / splits), ...), keeps a running max, weight sum and weighted V sum, and `merge_splits` combines
  the parts. The only scratch is those partials, (R, n_heads, splits, head_dim + 2) float32, whatever the length.
  threads: on a CPU device, run the C kernels in that many parts (0: one) where uses_c says; None: this module's kernel.
  shared_table: every row reads block-table row 0 (rows of one sequence); the C kernels then tile consecutive rows (whose
  K, V below the tile's longest row are stored: a chunk's own tokens scattered first), and splits is ignored.
  split_count: the C kernels' decode rows take their part count from this (1,) int32 at run time, 1..splits
  (cpu_attention.cpu_paged_attention); this module's kernel ignores it."""
  R, H, D = q.shape
  _, _, KV, X = pool.shape
  if is_coded(pool.dtype) and not uses_c(q.device, pool, D, threads):
    raise ValueError(f"paged_attention: an 8-bit or bfloat16-bits pool ({pool.dtype}) is read by the CPU C kernels only (device {q.device})")
  if not is_q8(pool.dtype) and (H % KV or X % D):
    raise ValueError(f"paged_attention: n_heads {H} must be a multiple of n_kv_heads {KV}, pool tile {X} of head_dim {D}")
  BS, cap, g = block_size_of(pool.dtype, X, D), block_tables.shape[1], H // KV
  c = uses_c(q.device, pool, D, threads)
  P = (decode_splits(R, 1, cap, max(1, threads)) if c else decode_splits(R, KV, cap)) if splits is None else splits
  if not 1 <= P <= cap: raise ValueError(f"paged_attention: splits must be in 1..{cap} (the block-table width), got {P}")
  if c: return cpu_attention.cpu_paged_attention(q, pool, block_tables, context_lens, threads or 1, P, shared_table, shared_table and R > 1,
                                                 None if shared_table else split_count)
  scale = 1.0 / math.sqrt(D)
  opts = _threads((R, KV, P))

  def partial(O: UOp, ML: UOp, q: UOp, pool: UOp, bt: UOp, n: UOp) -> UOp:
    pf = pool.flatten()
    r, kvh, p = UOp.range(R, 0), UOp.range(KV, 1), UOp.range(P, 2)
    nr = n[r].cast(dtypes.weakint)
    m = UOp.placeholder((g,), dtypes.float, 0, addrspace=AddrSpace.REG)       # running max (scaled scores) per head of the group
    l = UOp.placeholder((g,), dtypes.float, 1, addrspace=AddrSpace.REG)       # running sum of the weights
    acc = UOp.placeholder((g * D,), dtypes.float, 2, addrspace=AddrSpace.REG)  # running sum of weight * V
    s = UOp.placeholder((g * BS,), dtypes.float, 3, addrspace=AddrSpace.REG)   # one block's scores, then its weights
    mx = UOp.placeholder((g,), dtypes.float, 4, addrspace=AddrSpace.REG)      # the block's new running max
    cr = UOp.placeholder((g,), dtypes.float, 5, addrspace=AddrSpace.REG)      # exp(old max - new max): rescales l and acc
    i3, i4, i5, i6 = UOp.range(g, 3), UOp.range(g, 4), UOp.range(g, 5), UOp.range(D, 6)
    m = m.after(r, kvh, p)[i3].set(NEG, end=i3)
    l = l.after(r, kvh, p)[i4].set(0.0, end=i4)
    acc = acc.after(r, kvh, p)[i5 * D + i6].set(0.0, end=(i5, i6))
    per = (_block_loop_end(max_blocks, cap) + (P - 1)) // P                    # blocks per part
    jl = UOp.range(per, 7, AxisType.REDUCE)
    jb = p * per + jl
    blk = bt[r, (jb < cap).where(jb, cap - 1)].cast(dtypes.weakint)          # past the table (the last part's tail): masked anyway
    kbase, vbase = (blk * 2 * KV + kvh) * X, ((blk * 2 + 1) * KV + kvh) * X
    # scores of the block: s[gi, t] = q[gi] . K[:, t], vector lanes over t (the K tile is (d, t))
    g8, t8 = UOp.range(g, 8), UOp.range(BS, 9)
    s = s.after(m, l, acc, jl)[g8 * BS + t8].set(0.0, end=(g8, t8))
    d10, g11, t12 = UOp.range(D, 10, AxisType.REDUCE), UOp.range(g, 11), UOp.range(BS, 12)
    qk = q[r, kvh * g + g11, d10] * pf[kbase + d10 * BS + t12].cast(dtypes.float)
    s = s.after(d10, g11)[g11 * BS + t12].set(s.after(d10, g11, t12)[g11 * BS + t12] + qk, end=(t12, g11, d10))
    # the new running max over the block's valid tokens
    g13 = UOp.range(g, 13)
    mx = mx.after(s, g13)[g13].set(m.after(s)[g13], end=g13)
    g14, t15 = UOp.range(g, 14), UOp.range(BS, 15, AxisType.REDUCE)
    valid15 = jb * BS + t15 < nr
    mx = mx.after(g14, t15)[g14].set(mx.after(g14, t15)[g14].maximum(valid15.where(s[g14 * BS + t15] * scale, NEG)), end=(t15, g14))
    # weights of the block (0 where masked), the rescale of the old sums, and the new max kept
    g16, t17 = UOp.range(g, 16), UOp.range(BS, 17)
    s = s.after(mx, g16)[g16 * BS + t17].set((jb * BS + t17 < nr).where((s.after(mx)[g16 * BS + t17] * scale - mx[g16]).exp(), 0.0), end=(g16, t17))
    g18 = UOp.range(g, 18)
    cr = cr.after(mx, g18)[g18].set((m.after(mx)[g18] - mx[g18]).exp(), end=g18)
    g19 = UOp.range(g, 19)
    m = m.after(cr, g19)[g19].set(mx.after(cr)[g19], end=g19)
    g20, t21 = UOp.range(g, 20), UOp.range(BS, 21, AxisType.REDUCE)
    l = l.after(s, cr, g20)[g20].set(l.after(s, cr, g20)[g20] * cr[g20], end=g20)
    g22 = UOp.range(g, 22)
    l = l.after(g22, t21)[g22].set(l.after(g22, t21)[g22] + s[g22 * BS + t21], end=(t21, g22))
    g23, d24 = UOp.range(g, 23), UOp.range(D, 24)
    acc = acc.after(s, cr, g23, d24)[g23 * D + d24].set(acc.after(s, cr, g23, d24)[g23 * D + d24] * cr[g23], end=(g23, d24))
    # acc += weight * V row t; where, not a multiply by a zero weight: a masked slot may hold stale bytes (even NaN)
    t25, g26, d27 = UOp.range(BS, 25, AxisType.REDUCE), UOp.range(g, 26), UOp.range(D, 27)
    # (the weight outside the where: inside it, clang left this loop scalar)
    contrib = s[g26 * BS + t25] * (jb * BS + t25 < nr).where(pf[vbase + t25 * D + d27].cast(dtypes.float), 0.0)
    # the last update of the block ends the block loop; it comes after the block's m and l updates, so all three end with it
    acc = acc.after(m, l, t25, g26, d27)[g26 * D + d27].set(acc.after(m, l, t25, g26, d27)[g26 * D + d27] + contrib, end=(d27, g26, t25, jl))
    g28, d29, g30 = UOp.range(g, 28), UOp.range(D, 29), UOp.range(g, 30)
    st_o = O[r, kvh * g + g28, p, d29].store(acc[g28 * D + d29]).end(g28, d29)
    st_m = UOp.group(ML[r, kvh * g + g30, p, 0].store(m.after(acc)[g30]), ML[r, kvh * g + g30, p, 1].store(l.after(acc)[g30])).end(g30)
    return UOp.group(st_o, st_m).end(r, kvh, p).sink(arg=KernelInfo(name="paged_attention_part", opts_to_apply=opts))

  q = q.float().contiguous()
  dev = q.device
  O, ML = _launch(partial, [Tensor.empty(R, H, P, D, dtype=dtypes.float, device=dev), Tensor.empty(R, H, P, 2, dtype=dtypes.float, device=dev)],
                  [q, pool, block_tables, context_lens], max_blocks)
  return merge_splits(O, ML)

def merge_splits(O: Tensor, ML: Tensor) -> Tensor:
  """Combine flash-decoding partials: O (R, H, P, D) unnormalized sums of weight * V, ML (R, H, P, 2) each part's running
  max and weight sum (a part with no valid token: max NEG, sum 0) -> (R, H, D). Each part's weights are rescaled to the
  overall max: out = sum_p exp(m_p - m) O_p / sum_p exp(m_p - m) l_p."""
  m, l = ML[..., 0], ML[..., 1]
  w = (m - m.max(-1, keepdim=True)).exp()                                   # (R, H, P): 0 for an empty part
  return ((w.unsqueeze(-1) * O).sum(2) / (w * l).sum(-1).unsqueeze(-1)).contiguous()
