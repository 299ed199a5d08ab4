"""tinyhet bench bignode: the CPU node model (tinyhet/planner/cpu_node.py, cpu_step.py) fitted to this machine at one thread,
checked against decode steps measured at 1 and 2 threads, and its prediction for a 2 x 96-core node.

Each thread count runs in a process of its own (TINYHET_CPU_THREADS, fixed when the kernels are compiled): the read
bandwidth (bench/membw.py), the pool's cost per launch of an empty kernel at 1 and `threads` parts, and the embedded
SmolLM2's decode step profiled kernel by kernel (bench/profile.py) at each batch and context. From the one-thread run the
per-core figures are fitted (fit_two: least squares of a launch's time on its work); the 2-thread step is then predicted
from them, the 2-thread bandwidth and the dispatch measured alone, and compared with its measured time.
The big node: 2 x AMD EPYC 9654 (the planner catalog's cpu-node), 12 channels DDR5-4800 a socket (460.8 GB/s on AMD's
sheet) read at READ_SHARE of it, this machine's per-core figures and dispatch, weights replicated per socket."""
from __future__ import annotations
import argparse, json, os, re, subprocess, sys, time

READ_SHARE = 0.8     # share of the spec sheet's DDR5 bandwidth a read stream reaches on a socket (STREAM-class figure, assumed)
LINK = 256e9         # between the sockets per direction: 4 xGMI links x16 at 32 GT/s (assumed; fewer links halve it)
BIG = dict(name="2 x EPYC 9654", sockets=2, cores_per_socket=96, socket_bandwidth=460.8e9 * READ_SHARE, link_bandwidth=LINK)
QMM = re.compile(r"(matmul|logits) (\w+) (\d+)x(\d+)x(\d+) p(\d+)(\S*)$")

# --- fitting (pure) ----------------------------------------------------------------------------------------------------

def fit_two(points: list[tuple[float, float, float]]) -> tuple[float, float]:
  """(p, q) >= 0 minimizing sum (p a + q b - y)^2 over points (a, b, y); where the free fit is negative, that one is 0."""
  if not points: raise ValueError("fit_two: no points")
  saa = sum(a * a for a, _, _ in points); sbb = sum(b * b for _, b, _ in points); sab = sum(a * b for a, b, _ in points)
  say = sum(a * y for a, _, y in points); sby = sum(b * y for _, b, y in points)
  det = saa * sbb - sab * sab
  if det > 1e-12 * max(saa * sbb, 1e-300):
    p, q = (say * sbb - sby * sab) / det, (sby * saa - say * sab) / det
    if p >= 0 and q >= 0: return p, q
  only_q = (0.0, max(0.0, sby / sbb)) if sbb else (0.0, 0.0)
  only_p = (max(0.0, say / saa), 0.0) if saa else (0.0, 0.0)
  err = lambda pq: sum((pq[0] * a + pq[1] * b - y) ** 2 for a, b, y in points)
  return min(only_q, only_p, key=err)

def fit_dispatch(points: list[tuple[int, float]]) -> tuple[float, float]:
  """(base, per_part) of dispatch = base + per_part (parts - 1), from (parts, seconds a launch)."""
  if any(p < 1 or s < 0 for p, s in points): raise ValueError("fit_dispatch: parts must be >= 1 and seconds >= 0")
  return fit_two([(1.0, p - 1.0, s) for p, s in points])

def fit_bandwidth(points: list[tuple[int, float]]) -> tuple[float, float]:
  """(one core's, the socket's) read bytes/s from (threads, bytes/s): the rate at one thread, and the highest rate seen
  (a lower bound of the socket's where the cores did not saturate it)."""
  one = [r for t, r in points if t == 1]
  if not one or any(t < 1 or r <= 0 for t, r in points): raise ValueError("fit_bandwidth: needs a rate > 0 at 1 thread")
  return max(one), max(r for _, r in points)

def fit_figures(one: dict, mode: str = "float"):
  """CoreFigures from a one-thread measurement (measure()'s object): matmuls per (type, rows, kernel) from the profiled
  step's groups (t = r M K + s bytes), attention, the small kernels and the host's time per layer."""
  from tinyhet.planner.cpu_node import SHAPES, TYPE_BYTES, matmul_kernel
  from tinyhet.planner.cpu_step import CoreFigures
  shape = SHAPES["smollm2-135m"]
  mm, att, small, host, launches = {}, [], [], [], []
  for run in one["steps"]:
    B, ctx = run["batch"], run["context"]
    for g, r in run["groups"].items():
      s = r["cpu_ms"] / 1e3 / max(r["launches"], 1)
      if (m := QMM.match(g)):
        t, M, N, K = m.group(2).upper(), *map(int, m.group(3, 4, 5))
        mm.setdefault((t, M, matmul_kernel(t, mode, M)), []).append((M * K, N * K * TYPE_BYTES[t], s))
      elif g.startswith("attention"):
        att.append((1.0, B * ctx * 2 * shape.kv_heads * shape.head_dim * 2, s))
      else: launches.append(r["launches"] / shape.layers)
    small.append((1.0, B * shape.hidden, sum(r["cpu_ms"] for g, r in run["groups"].items() if g.startswith("tinygrad")) / 1e3 / shape.layers))
    host.append((1.0, B, max(0.0, run["outside_ms"]) / 1e3 / shape.layers))
  return CoreFigures({k: fit_two(v) for k, v in mm.items()}, fit_two(att) if att else (0.0, 0.0), fit_two(small),
                     round(sum(launches) / max(len(one["steps"]), 1)), fit_two(host), "this machine, one thread, the profiled step")

# --- measuring (one process per thread count) --------------------------------------------------------------------------

EMPTY = "void empty(unsigned long a, unsigned long core_id) { (void)a; (void)core_id; }\n"

def launch_seconds(parts: int, n: int = 256, reps: int = 5) -> float:
  """Least seconds a launch of an empty kernel in `parts` parts costs, n launches in one pool call (as a captured step)."""
  import ctypes, tempfile
  from tinyhet.device.cpu_threads import pool
  from tinyhet.runtime.cpu_pool import Command
  d = tempfile.mkdtemp(prefix="tinyhet-bignode-")
  subprocess.run(["clang", "-O1", "-shared", "-fPIC", "-x", "c", "-", "-o", f"{d}/e.so"], input=EMPTY.encode(), check=True)
  lib = ctypes.CDLL(f"{d}/e.so")
  cmds = (Command * n)()
  for c in cmds: c.fn, c.nargs, c.core_slot, c.parts = ctypes.cast(lib.empty, ctypes.c_void_p).value, 2, 1 if parts > 1 else -1, parts
  p, best = pool(), float("inf")
  for _ in range(reps):
    t0 = time.perf_counter(); p.run(cmds); best = min(best, (time.perf_counter() - t0) / n)
  return best

def measure(threads: int, batches: list[int], contexts: list[int], reps: int) -> dict:
  from tinyhet.bench import membw, profile as prof
  out = {"threads": threads, "read_gbps": membw.read_gbps(256 << 20, threads), "dispatch": [[1, launch_seconds(1)]], "steps": []}
  if threads > 1: out["dispatch"].append([threads, launch_seconds(threads)])
  import tinyhet  # noqa: F401
  from tinyhet.engine.decode_engine import DecodeEngine
  from tinyhet.kv.paged_cache import PagedKVCache
  from tinyhet.model.spec import load
  mesh = load(None, "MESH", quiet=True, packed=True)[0]
  cfg = mesh.cfg
  for B in batches:
    for C in contexts:
      ctx = C + 3 * reps + 8
      cache = PagedKVCache(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, (B + 1) * -(-ctx // 16) + 2, 16, "float16", device="MESH", max_seq_len=ctx)
      engine, ids = DecodeEngine(mesh, cache), list(range(B))
      for i in ids: cache.block_manager.allocate(i, C)
      def step():
        for i in ids: cache.block_manager.append_slot(i)
        engine.step(ids, [1] * B)
      rep = prof.profile(step, reps, cfg.vocab_size)
      out["steps"].append({"batch": B, "context": C, "wall_ms": rep["wall_ms"], "outside_ms": rep["outside_ms"],
                           "groups": {g: {k: r[k] for k in ("ms", "cpu_ms", "launches")} for g, r in rep["groups"].items()}})
  return out

def run_measure(threads: int, a) -> dict:
  env = {**os.environ, "TINYHET_CPU_THREADS": str(threads)}
  cmd = [sys.executable, "-m", "tinyhet.bench.bignode", "--measure", str(threads), "--batches", a.batches, "--contexts", a.contexts,
         "--reps", str(a.reps)]
  done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
  if done.returncode: raise RuntimeError(f"bench bignode: the {threads}-thread run failed: {done.stderr.strip().splitlines()[-1:]}")
  return json.loads(done.stdout.strip().splitlines()[-1])

# --- the model against the measurements, and the big node --------------------------------------------------------------

def kind(name: str) -> str:
  return "logits" if name.startswith("output") else "attention" if name.startswith("attention") else "matmul"

def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="tinyhet bench bignode", description=__doc__.split("\n\n")[0])
  ap.add_argument("--batches", default="1,16")
  ap.add_argument("--contexts", default="100,4096")
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--measure", type=int, default=0, help=argparse.SUPPRESS)
  ap.add_argument("--json", action="store_true")
  a = ap.parse_args(argv)
  ints = lambda s: [int(v) for v in s.split(",") if v]
  if a.measure:
    print(json.dumps(measure(a.measure, ints(a.batches), ints(a.contexts), a.reps))); return 0
  from tinyhet.planner.cpu_node import FORMATS, SHAPES, CpuNode, weight_bytes
  from tinyhet.planner.cpu_step import decode_step
  runs = {t: run_measure(t, a) for t in (1, 2)}
  fig = fit_figures(runs[1])
  core_bw, socket_bw = fit_bandwidth([(t, r["read_gbps"] * 1e9) for t, r in runs.items()])
  base, per_part = fit_dispatch([(p, s) for r in runs.values() for p, s in r["dispatch"]])
  shape, fmt = SHAPES["smollm2-135m"], FORMATS["Q4_1-embedded"]
  rows = []
  for t, run in runs.items():
    here = CpuNode(f"this machine, {t} thread{'s' * (t > 1)}", 1, t, socket_bw, core_bw, dispatch_base=base, dispatch_per_part=per_part)
    for m in run["steps"]:
      step = decode_step(here, shape, fmt, "float", m["batch"], m["context"], fig)
      got = {"matmul": 0.0, "logits": 0.0, "attention": 0.0}
      for g, r in m["groups"].items():
        k = "logits" if g.startswith("logits") else "attention" if g.startswith("attention") else "matmul" if g.startswith("matmul") else None
        if k: got[k] += r["ms"]
      want = {k: sum(v for n, v in step.groups().items() if kind(n) == k) * 1e3 for k in got}
      rows.append({"node": here.name, "model": "SmolLM2-135M Q4_1", "mode": "float", "batch": m["batch"], "context": m["context"],
                   "predicted_ms": step.seconds * 1e3, "measured_ms": m["wall_ms"], "error": step.seconds * 1e3 / m["wall_ms"] - 1,
                   "tok_s": step.tok_s, "wall": step.wall(), "kernels_ms": {k: [round(want[k], 3), round(got[k], 3)] for k in got}})
  big = CpuNode(**BIG, core_bandwidth=core_bw, dispatch_base=base, dispatch_per_part=per_part,
                source=f"AMD EPYC 9654 sheet x {READ_SHARE}; this machine's core and dispatch figures")
  ctx = max(ints(a.contexts))
  for B in ints(a.batches):
    for C in ints(a.contexts):
      s = decode_step(big, shape, fmt, "float", B, C, fig)
      rows.append({"node": big.name, "model": "SmolLM2-135M Q4_1", "mode": "float", "batch": B, "context": C, "predicted_ms": s.seconds * 1e3,
                   "tok_s": s.tok_s, "roofline_tok_s": B * big.sockets * big.socket_bandwidth / weight_bytes(shape, fmt), "wall": s.wall()})
  big70 = SHAPES["llama-3-70b"]
  skipped = []
  for name in ("Q4_K_M", "Q6_K", "Q8_0", "F16", "BF16", "Q4_1"):
    for B in ints(a.batches):
      try: s = decode_step(big, big70, FORMATS[name], "float", B, ctx, fig)
      except ValueError as e: skipped.append(f"Llama-3 70B {name} batch {B}: {e}"); continue
      rows.append({"node": big.name, "model": f"Llama-3 70B {name}", "mode": "float", "batch": B, "context": ctx, "predicted_ms": s.seconds * 1e3,
                   "tok_s": s.tok_s, "roofline_tok_s": B * big.sockets * big.socket_bandwidth / weight_bytes(big70, FORMATS[name]), "wall": s.wall()})
  cols = ["node", "model", "batch", "context", "predicted_ms", "measured_ms", "error", "tok_s", "roofline_tok_s", "wall"]
  out = {"fit": {"core_read_gbps": core_bw / 1e9, "read_gbps_2_threads": socket_bw / 1e9, "dispatch_base_us": base * 1e6,
                 "dispatch_per_part_us": per_part * 1e6, "figures": {"/".join(map(str, k)): v for k, v in fig.matmul.items()},
                 "attention": fig.attention, "small": fig.small, "host": fig.host},
         "big_node": {**BIG, "read_share": READ_SHARE}, "skipped": skipped, "rows": rows,
         "table": {"columns": cols, "rows": [[r.get(c) for c in cols] for r in rows]}}
  if a.json: print(json.dumps(out)); return 0
  print(f"fit: one core reads {core_bw / 1e9:.1f} GB/s, 2 threads {socket_bw / 1e9:.1f}; "
        f"dispatch {base * 1e6:.2f} us + {per_part * 1e6:.2f} us a part")
  print(f"{'node':<26}{'model':<24}{'B':>4}{'ctx':>6}{'pred ms':>10}{'meas ms':>10}{'err':>7}{'tok/s':>9}  wall")
  for r in rows:
    meas = f"{r['measured_ms']:10.2f}{r['error']:+7.0%}" if "measured_ms" in r else " " * 17
    print(f"{r['node']:<26}{r['model']:<24}{r['batch']:>4}{r['context']:>6}{r['predicted_ms']:10.2f}{meas}{r['tok_s']:9.1f}  {r['wall']}")
  for line in skipped: print(line)
  return 0

if __name__ == "__main__": sys.exit(main())
