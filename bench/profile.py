"""tinyhet bench profile: where a prefill and a decode step spend their time, kernel by kernel, on HET (CPU) and MESH.

A TinyJit replay on these devices is one call into the worker pool for all its kernels, so tinygrad's DEBUG=2 timing does
not see them. Here each captured launch runs on its own (the pool runs one command at a time, its parts side by side) and
is timed with the wall clock; the sum over kernels against the same work run normally (every launch in one call, between
the Python of the captures) gives the time outside the kernels: Python, the captures' input patching, the pool's wake-ups.
Kernels are grouped: the matrix products per (type, rows, out, in) with their GFLOP/s, attention, elementwise/reductions
(norms, RoPE, SiLU, casts, copies), the logits. The baseline is the matmul kernels' own rate alone on one core
(`tinyhet bench qmm`), not measured here; the unprofiled time is measured in the same run. With more than one thread each
launch run alone wakes the pool's sleeping workers, which overstates short kernels (a SmolLM2 batch-16 step's launches summed
to ~2x its unprofiled time): for shares, profile with TINYHET_CPU_THREADS=1 and read the CPU-time columns."""
from __future__ import annotations
import argparse, collections, contextlib, ctypes, json, re, sys, time

class KernelTimes:
  """Wall time and launch count per kernel name, from every pool launch while installed (captures and eager launches)."""
  def __init__(self):
    self.t, self.cpu, self.n, self.src = collections.defaultdict(float), collections.defaultdict(float), collections.defaultdict(int), {}

  @contextlib.contextmanager
  def installed(self):
    from tinyhet.device import cpu_threads as ct
    graph_call, prog_call = ct.PoolGraph.__call__, ct.PoolProgram.__call__
    times = self
    def graph(g, input_uops, var_vals, wait=False):
      # let the real call patch the arguments with the pool stubbed out, then run each command alone
      real_pool, ct.pool = ct.pool, lambda: _NoRun
      try: graph_call(g, input_uops, var_vals)
      finally: ct.pool = real_pool
      pool, size = ct.pool(), ctypes.sizeof(ct.Command)
      for j, (_, prg, _, _) in enumerate(g.calls):
        one = (ct.Command * 1).from_address(ctypes.addressof(g.cmds) + j * size)
        st, ct0 = time.perf_counter(), time.thread_time()
        pool.run(one)
        times.add(prg.arg.function_name, time.perf_counter() - st, prg, time.thread_time() - ct0)
    def prog(p, *bufs, **kw):
      st, ct0 = time.perf_counter(), time.thread_time()
      out = prog_call(p, *bufs, **kw)
      times.add(p.name, time.perf_counter() - st, None, time.thread_time() - ct0)
      return out
    ct.PoolGraph.__call__, ct.PoolProgram.__call__ = graph, prog
    try: yield self
    finally: ct.PoolGraph.__call__, ct.PoolProgram.__call__ = graph_call, prog_call

  def add(self, name: str, s: float, prg, cpu: float = 0.0):
    self.t[name] += s
    self.cpu[name] += cpu
    self.n[name] += 1
    if prg is not None and name not in self.src: self.src[name] = prg

  def clear(self): self.t.clear(); self.cpu.clear(); self.n.clear()

class _NoRun:
  @staticmethod
  def run(cmds, n=None): return False

QMM = re.compile(r"qmatmul_(\w+?)_(\d+)_(\d+)_(\d+)_p(\d+)(_tiled|_dot)?(_int8[ktv]?|_bf16t)?(_r16)?$")
ROUND = re.compile(r"round_x_(int8|bf16)\w*?_(\d+)_(\d+)_p(\d+)$")   # the kernels that round x once before the int8, bf16 tiled ones
ATTENTION = ("attention", "paged")

def group(name: str, vocab: int) -> tuple[str, float]:
  """(group, FLOP per launch or 0) of a kernel name."""
  if m := QMM.match(name):
    t, M, N, K, parts = m.group(1), *map(int, m.group(2, 3, 4, 5))
    what = "logits" if N == vocab else "matmul"
    return f"{what} {t} {M}x{N}x{K} p{parts}{''.join(g or '' for g in m.group(6, 7, 8))}", 2.0 * M * N * K
  if m := ROUND.match(name): return f"rounding x {m.group(1)} {m.group(2)}x{m.group(3)} p{m.group(4)}", 0.0
  if any(a in name for a in ATTENTION): return "attention (C)", 0.0
  return "tinygrad " + name, 0.0

def report(times: KernelTimes, wall: float, reps: int, vocab: int) -> dict:
  """Rows per group (ms per run, share of the run's wall time, GFLOP/s for the products) and the time outside kernels."""
  rows = collections.defaultdict(lambda: [0.0, 0, 0.0, 0.0])
  for name, s in times.t.items():
    g, flop = group(name, vocab)
    r = rows[g]
    r[0] += s / reps
    r[1] += times.n[name] // reps
    r[2] += flop * times.n[name] / reps
    r[3] += times.cpu[name] / reps
  kern = sum(r[0] for r in rows.values())
  out = {"wall_ms": wall * 1e3, "kernels_ms": kern * 1e3, "outside_ms": (wall - kern) * 1e3, "groups": {}}
  for g, (s, n, flop, cpu) in sorted(rows.items(), key=lambda kv: -kv[1][0]):
    # cpu: the calling thread's CPU time (part 0's); with one thread the kernel's own, steady on a shared machine
    out["groups"][g] = {"ms": s * 1e3, "cpu_ms": cpu * 1e3, "launches": n, "share": s / wall if wall else 0.0,
                        "gflops": flop / s / 1e9 if flop and s else None, "gflops_cpu": flop / cpu / 1e9 if flop and cpu else None}
  return out

def summary(rep: dict) -> dict:
  """Totals by kind: matmul, logits, attention (C), tinygrad kernels (elementwise, norms, tinygrad attention), outside."""
  kinds = collections.defaultdict(float)
  for g, r in rep["groups"].items(): kinds[g.split(" ")[0] if not g.startswith("attention") else "attention"] += r["ms"]
  kinds["outside kernels"] = rep["outside_ms"]
  return dict(kinds)

def show(title: str, rep: dict, top: int) -> None:
  print(f"\n{title}: {rep['wall_ms']:.1f} ms a run unprofiled, kernels {rep['kernels_ms']:.1f} ms run one at a time, "
        f"outside kernels {rep['outside_ms']:.1f} ms ({rep['outside_ms'] / rep['wall_ms']:.0%})")
  for k, ms in sorted(summary(rep).items(), key=lambda kv: -kv[1]): print(f"  {k:<22}{ms:9.1f} ms  {ms / rep['wall_ms']:6.1%}")
  print(f"  {'kernel group':<52}{'ms':>9}{'cpu ms':>9}{'launches':>9}{'share':>8}{'GFLOP/s':>9}{'(cpu)':>7}")
  for g, r in list(rep["groups"].items())[:top]:
    gf, gc = (f"{r[k]:.1f}" if r[k] else "" for k in ("gflops", "gflops_cpu"))
    print(f"  {g[:52]:<52}{r['ms']:9.2f}{r['cpu_ms']:9.2f}{r['launches']:9d}{r['share']:8.1%}{gf:>9}{gc:>7}")

def timed(fn, reps: int) -> float:
  """Least wall time of reps calls of fn (after two warm-up calls: capture and first replay)."""
  for _ in range(2): fn()
  best = float("inf")
  for _ in range(reps):
    st = time.perf_counter()
    fn()
    best = min(best, time.perf_counter() - st)
  return best

def profile(fn, reps: int, vocab: int, sources: str | None = None) -> dict:
  wall = timed(fn, reps)
  times = KernelTimes()
  with times.installed():
    fn()
    times.clear()
    for _ in range(reps): fn()
  if sources: write_sources(times, sources)
  return report(times, wall, reps, vocab)

def write_sources(times: KernelTimes, folder: str) -> None:
  import pathlib
  from tinygrad.uop.ops import Ops
  pathlib.Path(folder).mkdir(parents=True, exist_ok=True)
  for name, prg in times.src.items():
    src = next((u.arg for u in prg.src if u.op is Ops.SOURCE), None)
    if src is not None: (pathlib.Path(folder) / f"{name}.c").write_text(src)

def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="tinyhet bench profile", description=__doc__.split("\n\n")[0])
  ap.add_argument("--model", default=None, help="a model spec or file (default: the embedded SmolLM2-135M Q4_1)")
  ap.add_argument("--prompts", default="512", help="prefill lengths, comma-separated (past prefill_chunk: the chunked path; empty or 0: none)")
  ap.add_argument("--batch", type=int, default=16, help="decode batch of the step profiled (0: no decode step)")
  ap.add_argument("--context", type=int, default=100, help="tokens of context per sequence in the decode step")
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--top", type=int, default=25)
  ap.add_argument("--sources", default=None, help="a folder to write each profiled kernel's source into (NAME.c)")
  ap.add_argument("--json", action="store_true")
  a = ap.parse_args(argv)
  import tinyhet  # noqa: F401  (HET and MESH)
  from tinygrad import Tensor, dtypes
  from tinyhet.model.spec import load
  out = {"model": a.model or "embedded SmolLM2-135M", "prefill": {}, "decode": None}
  het = load(a.model, "HET", quiet=True, packed=True)[0]
  vocab = het.cfg.vocab_size
  for T in (int(t) for t in a.prompts.split(",") if t and int(t) > 0):
    toks = Tensor([[(7 * i + 11) % (vocab - 1) + 1 for i in range(T)]], dtype=dtypes.int32, device="HET").realize()
    rep = profile(lambda: het.prefill(toks).numpy(), a.reps, vocab, a.sources and f"{a.sources}/prefill{T}")
    out["prefill"][T] = rep
    if not a.json: show(f"prefill {T} tokens ({T / rep['wall_ms'] * 1e3:.1f} tok/s)", rep, a.top)
  if a.batch:
    from tinyhet.engine.decode_engine import DecodeEngine
    from tinyhet.kv.paged_cache import PagedKVCache
    mesh = load(a.model, "MESH", quiet=True, packed=True)[0]
    cfg = mesh.cfg
    ctx = a.context + 3 * a.reps + 8
    cache = PagedKVCache(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, (a.batch + 1) * -(-ctx // 16) + 2, 16, "float16", device="MESH",
                         max_seq_len=ctx)
    engine, ids, tokens = DecodeEngine(mesh, cache), list(range(a.batch)), [1] * a.batch
    for i in ids: cache.block_manager.allocate(i, a.context)
    def step():
      for i in ids: cache.block_manager.append_slot(i)
      engine.step(ids, tokens)
    rep = profile(step, a.reps, vocab, a.sources and f"{a.sources}/decode{a.batch}")
    out["decode"] = rep
    if not a.json: show(f"decode step, batch {a.batch} at {a.context} tokens ({a.batch / rep['wall_ms'] * 1e3:.1f} tok/s)", rep, a.top)
  if a.json: print(json.dumps(out))
  return 0

if __name__ == "__main__": sys.exit(main())
