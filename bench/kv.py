"""`tinyhet bench kv`: the paged KV cache against contiguous allocation, and paged attention against dense attention.

Memory: one random workload (prompts 20..4000 tokens, outputs 10..500) runs through the same scheduler twice over the same
KV memory: paged (block_size-token blocks) and contiguous (every sequence reserves the workload's maximum length up front,
i.e. blocks of that size). Utilization is tokens stored / token slots allocated, averaged over the steps.
Attention: one decode step (every layer) of a batch whose lengths come from the same workload, in the same run: the paged
kernel over scattered blocks (the figure), the same kernel over contiguous blocks (what paging itself costs), and dense
attention with tinygrad tensor ops over a contiguous (batch, max_len) cache holding the same K, V (the baseline: the fastest
of several forms timed in the same run, DENSE_VARIANTS: K row-major or transposed, float16 cast inside the kernels or into
realized float32 copies, or kept in float32; softmax fed into @ V or realized first).
"""
from __future__ import annotations
import argparse, json, math, statistics, sys, time

# (layers, heads, kv heads, head_dim): the model shapes the KV is sized for
MODELS = {"smollm2-135m": (30, 9, 3, 64), "llama3-8b": (32, 32, 8, 128)}
PROMPTS, OUTPUTS = (20, 4000), (10, 500)
# dense attention baselines timed in the same run (bench/kv.py's dense_attention): (cache form, cast, softmax); the
# fastest is the baseline. The first is the plain form (fp16 row-major K, cast inside the matmul, softmax fused into @ V)
DENSE_VARIANTS = [("rowmajor", "fused", "fused"), ("rowmajor", "copy", "realized"), ("kt16", "fused", "realized"),
                  ("kt16", "copy", "realized"), ("kt32", "-", "realized"), ("kt32", "-", "fused")]

def progress(msg: str, quiet: bool):
  if not quiet: print(msg, file=sys.stderr, flush=True)

def workload(n: int, rng) -> list[tuple[int, int]]:
  return [(rng.randint(*PROMPTS), rng.randint(*OUTPUTS)) for _ in range(n)]

def simulate(requests: list[tuple[int, int]], num_blocks: int, block_size: int, max_num_seqs: int, quiet: bool, name: str) -> dict:
  """Run the workload through Scheduler over a pool of num_blocks blocks (all requests arrive at once, no EOS). Returns
  mean utilization and mean running sequences over the steps, the number of steps and of preemptions."""
  from tinyhet.kv.block_manager import BlockManager
  from tinyhet.engine.scheduler import Scheduler, Sequence
  s = Scheduler(BlockManager(num_blocks, block_size), max_num_seqs=max_num_seqs, max_num_batched_tokens=1 << 30)
  for i, (p, o) in enumerate(requests): s.add(Sequence(i, [1] * p, max_new_tokens=o))
  utils, running, steps, done, t0 = [], [], 0, 0, time.perf_counter()
  while not s.is_finished():
    seqs, _ = s.schedule()
    if not seqs: raise RuntimeError(f"{name}: the scheduler stalled with {len(s.waiting)} requests waiting")
    done += len(s.postprocess(seqs, [5] * len(seqs)))
    utils.append(s.bm.utilization())
    running.append(len(s.running))
    steps += 1
    if time.perf_counter() - t0 > 5:
      progress(f"  {name}: step {steps}, {done}/{len(requests)} requests done", quiet)
      t0 = time.perf_counter()
  return {"utilization": statistics.fmean(utils), "running": statistics.fmean(running), "steps": steps, "preemptions": s.num_preemptions}

def time_step(fn, args, reps: int) -> float:
  """Median ms of a TinyJit-ed fn over reps calls, after the two calls that capture it."""
  from tinygrad import Device
  for _ in range(2): fn(*args)
  ts = []
  for _ in range(reps):
    t0 = time.perf_counter()
    fn(*args)
    Device["CPU"].synchronize()
    ts.append(time.perf_counter() - t0)
  return statistics.median(ts) * 1e3

def attention_bench(lengths: list[int], shape: tuple[int, int, int, int], block_size: int, reps: int, quiet: bool) -> dict:
  import numpy as np
  from tinygrad import Tensor, TinyJit, dtypes
  from tinyhet.kernels.paged_attention import kv_scatter, max_blocks_var, paged_attention
  n_layers, H, KV, D = shape
  B, BS = len(lengths), block_size
  nblk = [math.ceil(n / BS) for n in lengths]
  cap, total = max(nblk), sum(nblk)
  rng = np.random.default_rng(0)
  scattered = np.zeros((B, cap), np.int32)
  ids = rng.permutation(total)
  for b, nb in enumerate(nblk): scattered[b, :nb], ids = ids[:nb], ids[nb:]
  contiguous = np.zeros((B, cap), np.int32)
  for b, nb in enumerate(nblk): contiguous[b, :nb] = np.arange(sum(nblk[:b]), sum(nblk[:b]) + nb)
  progress(f"attention: {n_layers} layers of K, V for {B} sequences ({sum(lengths)} tokens, longest {max(lengths)}), paged and dense", quiet)
  Tensor.manual_seed(0)
  pools = [Tensor.randn(total, 2, KV, BS * D, dtype=dtypes.float16).contiguous().realize() for _ in range(n_layers)]
  t_scattered, t_contig = Tensor(scattered).realize(), Tensor(contiguous).realize()
  lens = Tensor(np.array(lengths, np.int32)).realize()
  def dense_layer(pool: Tensor) -> dict[str, Tensor]:
    # the same K, V gathered into a contiguous cache of L = cap * BS slots per sequence (padding masked), in the forms a
    # dense cache can keep: fp16 row-major (B, L, KV, D); fp16 with K transposed per head (B, KV, D, L) and V (B, KV, L, D);
    # the same transposed forms in float32 (cast once, when stored: twice the bytes, no cast in the step)
    kv = pool[t_scattered]                                                        # (B, cap, 2, KV, BS * D)
    k = kv[:, :, 0].reshape(B, cap, KV, D, BS).permute(0, 1, 4, 2, 3).reshape(B, cap * BS, KV, D)
    v = kv[:, :, 1].reshape(B, cap, KV, BS, D).permute(0, 1, 3, 2, 4).reshape(B, cap * BS, KV, D)
    kt, vh = k.permute(0, 2, 3, 1), v.permute(0, 2, 1, 3)                         # (B, KV, D, L), (B, KV, L, D)
    return {"k": k.contiguous().realize(), "v": v.contiguous().realize(), "kt16": kt.contiguous().realize(), "vh16": vh.contiguous().realize(),
            "kt32": kt.float().contiguous().realize(), "vh32": vh.float().contiguous().realize()}
  dense = [dense_layer(p) for p in pools]
  q = Tensor(rng.standard_normal((B, H, D)).astype(np.float32)).realize()
  k_new, v_new = (Tensor(rng.standard_normal((B, KV, D)).astype(np.float32)).realize() for _ in range(2))
  positions = Tensor(np.array([n - 1 for n in lengths], np.int32)).realize()
  mb = max_blocks_var(cap).bind(cap)
  slots = Tensor(np.arange(cap * BS, dtype=np.int32)).realize()
  g, L = H // KV, cap * BS

  def dense_attention(c: dict[str, Tensor], form: str, cast: str, softmax: str) -> Tensor:
    """Dense attention with tinygrad tensor ops: (B, KV, g, 1, L) scores, masked, softmax, @ V. form: "rowmajor" (fp16
    (B, L, KV, D)), "kt16" (fp16, K transposed), "kt32" (float32, K transposed); cast: "fused" (the float16->float32 cast
    inside the matmul kernels) or "copy" (cast once per step into realized float32 copies); softmax: "fused" (fed straight
    into @ V) or "realized" (its probabilities realized first)."""
    if form == "rowmajor": kt, vh = c["k"].permute(0, 2, 3, 1), c["v"].permute(0, 2, 1, 3)    # (B, KV, D, L), (B, KV, L, D) views
    else: kt, vh = c[form], c["vh" + form[2:]]
    if kt.dtype != dtypes.float32:
      kt, vh = kt.float(), vh.float()
      if cast == "copy": kt, vh = kt.contiguous(), vh.contiguous()
    s = (q.reshape(B, KV, g, 1, D) @ kt.reshape(B, KV, 1, D, L)) * (1.0 / math.sqrt(D))
    s = (slots.reshape(1, 1, 1, 1, L) < lens.reshape(B, 1, 1, 1, 1)).where(s, -math.inf).softmax(-1)
    if softmax == "realized": s = s.contiguous()
    return (s @ vh.reshape(B, KV, 1, L, D)).reshape(B, H, D)

  # each variant realizes its layers' outputs as a list: a Tensor.stack would let the scheduler fuse all layers into one kernel
  def realized(ts: list[Tensor]) -> list[Tensor]:
    Tensor.realize(*ts)
    return ts
  def dense_run(*variant: str): return TinyJit(lambda: realized([dense_attention(c, *variant) for c in dense]))
  runs = {
    "paged": TinyJit(lambda mb: realized([paged_attention(q, p, t_scattered, lens, mb) for p in pools])),
    "paged_contiguous_blocks": TinyJit(lambda mb: realized([paged_attention(q, p, t_contig, lens, mb) for p in pools])),
    "scatter": TinyJit(lambda: realized([kv_scatter(p, k_new, v_new, t_scattered, positions) for p in pools])),
    **{f"dense:{'/'.join(v)}": dense_run(*v) for v in DENSE_VARIANTS},
  }
  ms, outs = {}, {}
  for name, fn in runs.items():
    progress(f"  timing {name} ({reps} steps after 2 to capture)", quiet)
    args = (mb,) if name.startswith("paged") else ()
    ms[name] = time_step(fn, args, reps)
    if name != "scatter": outs[name] = np.stack([t.numpy() for t in fn(*args)])
  variants = {n[len("dense:"):]: t for n, t in ms.items() if n.startswith("dense:")}
  best = min(variants, key=variants.get)
  ms |= {"dense": variants[best], "dense_variant": best, "dense_variants": variants}
  ms["paged_vs_dense_max_abs_diff"] = max(float(np.abs(outs["paged"] - o).max()) for n, o in outs.items() if n.startswith("dense:"))
  return ms

def compare_jit(shape: tuple[int, int, int, int], block_size: int, rows: int, max_len: int, quiet: bool) -> dict:
  """One layer's decode step (scatter + paged attention) while every row grows by a token per step up to max_len: the block
  count as a symbolic Variable (one capture) against power-of-two buckets of blocks (one capture per bucket)."""
  import numpy as np
  from tinygrad import Device, Tensor, TinyJit, dtypes
  from tinygrad.engine import realize
  from tinyhet.kv.block_manager import BlockManager
  from tinyhet.kernels.paged_attention import kv_scatter, max_blocks_var, paged_attention
  _, H, KV, D = shape
  BS, cap = block_size, math.ceil(max_len / block_size)
  rng = np.random.default_rng(0)
  q, k, v = (Tensor(rng.standard_normal((rows, n, D)).astype(np.float32)).realize() for n in (H, KV, KV))
  out = {}
  for mode in ("symbolic", "bucketed"):
    progress(f"jit: {mode}, {rows} rows growing to {max_len} tokens", quiet)
    bm = BlockManager(rows * cap, BS)
    pool = Tensor.zeros(bm.num_blocks, 2, KV, BS * D, dtype=dtypes.float16).contiguous().realize()
    tables, pos = Tensor.zeros(rows, cap, dtype=dtypes.int32).contiguous().realize(), Tensor.zeros(rows, dtype=dtypes.int32).contiguous().realize()
    for r in range(rows): bm.allocate(r, int(rng.integers(0, 64)))
    def step(m): return paged_attention(q, kv_scatter(pool, k, v, tables, pos), tables, (pos + 1).contiguous(), m).realize()
    jits: dict[int, TinyJit] = {}
    programs, times, fresh = len(realize.to_program_cache), [], 0
    while True:
      for r in range(rows): bm.append_slot(r)
      if max(bm.length(r) for r in range(rows)) > max_len: break
      rows_np = np.zeros((rows, cap), np.int32)
      for r in range(rows): rows_np[r, :len(bm.block_table(r))] = bm.block_table(r)
      tables.uop.buffer.as_memoryview(force_zero_copy=True)[:] = rows_np.tobytes()
      pos.uop.buffer.as_memoryview(force_zero_copy=True)[:] = np.array([bm.length(r) - 1 for r in range(rows)], np.int32).tobytes()
      nb = max(len(bm.block_table(r)) for r in range(rows))
      key = 0 if mode == "symbolic" else 1 << (nb - 1).bit_length()
      if key not in jits: jits[key], fresh = TinyJit(step), 0
      t0 = time.perf_counter()
      jits[key](max_blocks_var(cap).bind(nb) if mode == "symbolic" else key)
      Device["CPU"].synchronize()
      if (fresh := fresh + 1) > 2: times.append(time.perf_counter() - t0)
    out[mode] = {"captures": len(jits), "programs_compiled": len(realize.to_program_cache) - programs,
                 "median_ms": statistics.median(times) * 1e3, "mean_ms": statistics.fmean(times) * 1e3}
  return out

def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="tinyhet bench kv", description=__doc__.splitlines()[0])
  ap.add_argument("--json", action="store_true", help='print only {"utilization": {...}, "attention_step_ms": {...}}')
  ap.add_argument("--quick", action="store_true", help="fewer requests, a smaller pool and batch (well under a minute)")
  ap.add_argument("--model", choices=list(MODELS), default="smollm2-135m", help="the shape KV is sized for (default smollm2-135m)")
  ap.add_argument("--kv-gib", type=float, default=None, help="KV memory for the workload (default: room for 20 sequences of the "
                  "workload's maximum length, --quick 6)")
  ap.add_argument("--requests", type=int, default=None, help="requests in the workload (default 300, --quick 60)")
  ap.add_argument("--batch", type=int, default=None, help="sequences in the timed decode step (default 16, --quick 6)")
  ap.add_argument("--block-size", type=int, default=16)
  ap.add_argument("--reps", type=int, default=None, help="timed decode steps per variant (default 10, --quick 3)")
  ap.add_argument("--compare-jit", action="store_true", help="also time symbolic against bucketed block counts under TinyJit")
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args(argv)
  import random
  quiet, rng = args.json, random.Random(args.seed)
  shape = MODELS[args.model]
  n_layers, _, KV, D = shape
  token_bytes = n_layers * 2 * KV * D * 2                                      # fp16 K and V of one token, all layers
  max_len = PROMPTS[1] + OUTPUTS[1]
  kv_bytes = int(args.kv_gib * (1 << 30)) if args.kv_gib else (6 if args.quick else 20) * max_len * token_bytes
  if kv_bytes < max_len * token_bytes:
    ap.error(f"--kv-gib {args.kv_gib} holds {kv_bytes // token_bytes} tokens, less than one sequence of the workload's maximum ({max_len})")
  requests = workload(args.requests or (60 if args.quick else 300), rng)
  BS = args.block_size

  progress(f"memory: {len(requests)} requests through the scheduler, {kv_bytes / (1 << 30):.2f} GiB of KV = {kv_bytes // token_bytes} tokens", quiet)
  paged = simulate(requests, kv_bytes // (token_bytes * BS), BS, 1024, quiet, "paged")
  contiguous = simulate(requests, kv_bytes // (token_bytes * max_len), max_len, 1024, quiet, "contiguous")

  batch = args.batch or (6 if args.quick else 16)
  lengths = [p + rng.randint(0, o) for p, o in rng.sample(requests, batch)]   # mid-generation: prompt plus part of the output
  att = attention_bench(lengths, shape, BS, args.reps or (3 if args.quick else 10), quiet)
  jit = compare_jit(shape, BS, 16, 512 if args.quick else 2048, quiet) if args.compare_jit else None

  if args.json:
    print(json.dumps({"utilization": {"paged": round(paged["utilization"], 4), "contiguous": round(contiguous["utilization"], 4)},
                      "attention_step_ms": {"paged": round(att["paged"], 3), "dense": round(att["dense"], 3),
                                            "paged_contiguous_blocks": round(att["paged_contiguous_blocks"], 3)},
                      "paged_vs_dense": round(att["paged"] / att["dense"], 3), "dense_variant": att["dense_variant"],
                      "dense_variants_ms": {k: round(v, 3) for k, v in att["dense_variants"].items()}}))
    return 0
  L, H_, _, _ = shape
  print(f"\ntinyhet bench kv: {args.model} ({L} layers, {KV} kv heads x {D}, fp16: {token_bytes / 1024:.1f} KiB/token), "
        f"{kv_bytes / (1 << 30):.2f} GiB of KV, {len(requests)} requests (prompts {PROMPTS[0]}..{PROMPTS[1]}, outputs {OUTPUTS[0]}..{OUTPUTS[1]})")
  print(f"  {'allocation':<34}{'utilization':>12}{'mean running':>14}{'steps':>8}{'preempted':>11}")
  for name, r in ((f"paged ({BS}-token blocks)", paged), (f"contiguous ({max_len} tokens each)", contiguous)):
    print(f"  {name:<34}{r['utilization']:>12.3f}{r['running']:>14.1f}{r['steps']:>8}{r['preemptions']:>11}")
  print(f"decode step attention, all {L} layers, {batch} sequences of {min(lengths)}..{max(lengths)} tokens (median of timed steps):")
  rows = [("paged kernel, scattered blocks", att["paged"]), ("paged kernel, contiguous blocks", att["paged_contiguous_blocks"])]
  rows += [(f"dense {v}" + (" (baseline: fastest)" if v == att["dense_variant"] else ""), t) for v, t in att["dense_variants"].items()]
  for name, ms in rows: print(f"  {name:<44}{ms:>10.2f} ms  {ms / att['dense']:>6.2f}x dense")
  print("  (dense forms: cache/cast/softmax: rowmajor = fp16 (B, L, KV, D), kt16/kt32 = K transposed (B, KV, D, L) in fp16/fp32; "
        "cast fused into the matmul or copied into realized fp32; softmax fused into @ V or realized)")
  print(f"  {'storing the new K, V (kv_scatter)':<44}{att['scatter']:>10.2f} ms")
  print(f"  paged vs dense: max |difference| {att['paged_vs_dense_max_abs_diff']:.1e}")
  if jit:
    print("TinyJit over a growing decode (16 rows, one layer):")
    for mode, r in jit.items():
      print(f"  {mode:<10} {r['captures']:>3} captures {r['programs_compiled']:>4} programs compiled  "
            f"{r['median_ms']:.3f} ms/step median, {r['mean_ms']:.3f} mean")
  return 0
