"""`tinyhet bench latency`: what a request waits for besides its own work, in three parts, one run.

  first      a `--role both` node just started (TINYHET_WARM_UP=before: every capture built before it says ready) behind a
             router: one 4-token request (the process's first of all: connections, threads), then the first request at each
             of N random prompt lengths, then a second request of each length (other tokens: no prefix-cache hit). Per
             length the TTFT of both and their ratio; the node's warm-up time and captures.
  fresh      a long prompt (--run-tokens, default 7,876) in a fresh `tinyhet run` (--keep-alive 0; run twice, so tinygrad's
             caches on disk, kernels and generated programs, are warm for the second) against a prompt of the same length in
             the resident process (--keep-alive: a second run served by the process the first one left, in a run directory
             of its own): TTFT of each and the ratio.
  load       the `both` node at each concurrency with prompts of random lengths (default 100-2,000 tokens; every round the
             same prompts, the first max(--requests, 2 x concurrency) of one draw): TPOT p50 and p99 (the gaps between a
             request's streamed tokens) and requests/s. The node's prefill_budget is the environment's
             (TINYHET_PREFILL_BUDGET=128 tinyhet bench latency ... runs the node with 128).
  pieces     in this process, on a decode node's KV cache: a prompt of --piece-tokens prefilled whole against the same prompt
             in the pieces a stall-free step gives it (each --budgets size), and the decode step of 1 and 4 sequences at that
             context: each budget's cost per prompt token against the whole prompt's, and its step (a piece beside a batch-4
             decode step) against the batch-4 step alone. What a budget costs in requests/s and in TPOT, without a server.

With --json one JSON object. --quick: the small random model, short prompts, one concurrency level (checks that it runs).
"""
from __future__ import annotations
import argparse, json, os, secrets, subprocess, sys, threading, time
import numpy as np
from tinyhet.bench.serve import Proc, prompt_ids, stream_one, wait_ready

def start_both(args, warm_up: str) -> tuple[list[Proc], str, str]:
  """A `both` node (the warm-up mode given) and a router in front of it: (processes, router address, model id)."""
  env, model = {"TINYHET_WARM_UP": warm_up}, (["--model", args.model] if args.model else [])
  node = Proc("node", "--role", "both", "--listen", "127.0.0.1:0", "--quiet", "--kv-memory", args.kv_memory, "--max-seqs", "16", *model, env=env)
  router = Proc("serve", "--listen", "127.0.0.1:0", "--both", node.info["address"], *model, "--max-queue", "1024", "--queue-timeout", "600")
  wait_ready(router.info["address"])
  return [node, router], router.info["address"], router.info["model"]

def ttft(address: str, model: str, ids: list[int], max_tokens: int = 2) -> float:
  t0, marks = stream_one(address, {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0})
  if not marks: raise RuntimeError(f"a {len(ids)}-token request streamed no token")
  return marks[0] - t0

def part_first(args, rng) -> dict:
  lengths = sorted(int(n) for n in rng.integers(args.min_len, args.max_len + 1, args.lengths))
  t0 = time.perf_counter()
  procs, address, model = start_both(args, "before")
  try:
    started_s = time.perf_counter() - t0
    # the process's first request of all (connections, threads, the first sampled token) apart from the lengths': 4 tokens
    opening = ttft(address, model, prompt_ids(0, 0, 4))
    first = [ttft(address, model, prompt_ids(1, i, n)) for i, n in enumerate(lengths)]
    again = [ttft(address, model, prompt_ids(2, i, n)) for i, n in enumerate(lengths)]
  finally:
    for p in procs[::-1]: p.stop()
  rows = [{"prompt_tokens": n, "first_ttft_s": a, "again_ttft_s": b, "ratio": a / b if b else 0.0} for n, a, b in zip(lengths, first, again)]
  return {"node_start_s": started_s, "warm_up": procs[0].info.get("warm_up_status", {}), "opening_ttft_s": opening, "rows": rows,
          "worst_ratio": max(r["ratio"] for r in rows)}

def run_ttft(args, prompt: str, keep_alive: str, env: dict) -> dict:
  cmd = [sys.executable, "-m", "tinyhet", "run", "--json", "--raw", "--quiet", "--max-tokens", "2", "--keep-alive", keep_alive,
         *(["--model", args.model] if args.model else []), prompt]
  p = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=env)
  if p.returncode != 0: raise RuntimeError(f"tinyhet run failed ({p.returncode}): {p.stderr.strip()[-300:]}")
  out = json.loads(p.stdout.strip().splitlines()[-1])
  return {"ttft_s": out["ttft_s"], "prompt_tokens": len(out["prompt_ids"])}

def part_fresh(args) -> dict:
  """Four `tinyhet run`s of one prompt length: a fresh process that fills tinygrad's caches on disk (kernels, generated
  programs: tinyhet.device.program_cache), the fresh process measured, a run that starts a resident process (it captures
  there), and the run that process serves measured. The resident process lives in a run directory of its own (its
  XDG_CACHE_HOME), so its `--stop` stops no one else's; tinygrad's cache stays the user's (CACHEDB)."""
  import tempfile
  from tinygrad.helpers import CACHEDB
  from tinyhet.bench.prompts import FILLER
  # ~4.9 characters a SmolLM2 token of this text; each run's own first words, so no run finds another's blocks in a prefix cache
  prompt = lambda k: f"Run {k}. " + (FILLER * (1 + args.run_tokens // 20))[:int(args.run_tokens * 4.9)]
  with tempfile.TemporaryDirectory(prefix="tinyhet-bench-fresh-") as home:
    env = {**os.environ, "XDG_CACHE_HOME": home, "CACHEDB": CACHEDB}
    run_ttft(args, prompt(0), "0", env)                                  # fills tinygrad's caches on disk
    fresh = run_ttft(args, prompt(1), "0", env)
    try:
      run_ttft(args, prompt(2), "10m", env)                              # starts the resident process and captures there
      resident = run_ttft(args, prompt(3), "10m", env)
    finally: subprocess.run([sys.executable, "-m", "tinyhet", "run", "--stop"], capture_output=True, timeout=120, env=env)
  return {"prompt_tokens": fresh["prompt_tokens"], "fresh_ttft_s": fresh["ttft_s"], "resident_ttft_s": resident["ttft_s"],
          "ratio": fresh["ttft_s"] / resident["ttft_s"] if resident["ttft_s"] else 0.0}

def load_round(address: str, model: str, concurrency: int, lengths: list[int], max_tokens: int, salt: int) -> dict:
  results, lock, todo = [], threading.Lock(), iter(enumerate(lengths))
  def worker():
    while True:
      with lock: item = next(todo, None)
      if item is None: return
      i, n = item
      results.append(stream_one(address, {"model": model, "prompt": prompt_ids(salt, i, n), "max_tokens": max_tokens, "temperature": 0}))
  t0 = time.perf_counter()
  threads = [threading.Thread(target=worker) for _ in range(concurrency)]
  for t in threads: t.start()
  for t in threads: t.join()
  wall = time.perf_counter() - t0
  gaps = np.concatenate([np.diff(m) for _, m in results if len(m) > 1] or [np.zeros(1)])
  return {"concurrency": concurrency, "requests": len(results), "requests_s": len(results) / wall, "tpot_p50_s": float(np.percentile(gaps, 50)),
          "tpot_p99_s": float(np.percentile(gaps, 99)), "tpot_samples": len(gaps)}

def round_lengths(rng, lo: int, hi: int, requests: int, concurrency: list[int]) -> dict[int, list[int]]:
  """Each load round's prompt lengths: the first max(requests, 2c) of one draw, so requests/s at one concurrency against
  another compares the same work (drawn per round, concurrency 1's 16 prompts averaged 832 tokens and concurrency 4's
  1,115 at seed 3). Each round's tokens are its own (salt 100 + c): no prefix-cache hit across rounds."""
  draw = [int(x) for x in rng.integers(lo, hi + 1, max(requests, 2 * max(concurrency)))]
  return {c: draw[:max(requests, 2 * c)] for c in concurrency}

def part_load(args, rng) -> dict:
  procs, address, model = start_both(args, "before")
  try:
    lengths = round_lengths(rng, args.load_min, args.load_max, args.requests, args.concurrency)
    rows = [load_round(address, model, c, lengths[c], args.max_tokens, salt=100 + c) for c in args.concurrency]
  finally:
    for p in procs[::-1]: p.stop()
  return {"prompt_tokens": [args.load_min, args.load_max], "max_tokens": args.max_tokens, "rows": rows}

def part_pieces(args) -> dict:
  from tinyhet.cli.node import start
  from tinyhet.engine.local_engine import LocalEngine
  from tinyhet.engine.prefill import prefill_sequence_logits
  T, budgets = args.piece_tokens, [int(b) for b in args.budgets.split(",")]
  _, model, _, _ = start(args.model, 0, None, True)
  engine = LocalEngine(model, (T + 16) * (len(budgets) + 6))   # the whole prompt, 5 decoding, one a budget
  bm, seq = engine.cache.block_manager, iter(range(1, 1 << 30))
  def best(fn, reps: int = 3) -> float:           # the least of reps runs after one that builds its captures
    fn()
    return min(timed(fn) for _ in range(reps))
  def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
  def prompt() -> tuple[int, list[int]]:
    bm.allocate(s := next(seq), T)
    return s, prompt_ids(300, s, T)
  s, ids = prompt()
  whole = best(lambda: prefill_sequence_logits(model, engine.cache, s, ids)) / T
  rows = []
  decodes = {}
  for B in (1, 4):
    seqs = [prompt()[0] for _ in range(B)]
    for q in seqs: bm.append_slot(q)
    decodes[B] = best(lambda: engine.engine.step(seqs, [1] * B), 5)
  for C in budgets:
    s, ids = prompt()
    per = best(lambda: [prefill_sequence_logits(model, engine.cache, s, ids, a, min(a + C, T)) for a in range(0, T, C)], 1) / T
    rows.append({"budget": C, "ms_per_token": per * 1e3, "vs_whole": per / whole, "step_ms": (decodes[4] + C * per) * 1e3,
                 "step_vs_decode": (decodes[4] + C * per) / decodes[4]})
  return {"prompt_tokens": T, "whole_ms_per_token": whole * 1e3, "decode_ms": {str(b): t * 1e3 for b, t in decodes.items()}, "rows": rows}

def table(out: dict) -> str:
  lines = [f"model {out['model']}"]
  if (f := out.get("first")):
    w = f["warm_up"]
    lines += ["", f"first request at each length on a node just started (warm-up {w.get('seconds', 0):.1f} s, {w.get('captures', 0)} captures;"
              f" node ready in {f['node_start_s']:.1f} s; its first request of 4 tokens {f['opening_ttft_s']:.3f} s)",
              f"{'tokens':>8}{'first TTFT':>12}{'again':>10}{'ratio':>8}"]
    lines += [f"{r['prompt_tokens']:>8}{r['first_ttft_s']:>11.3f}s{r['again_ttft_s']:>9.3f}s{r['ratio']:>7.2f}x" for r in f["rows"]]
  if (r := out.get("fresh")):
    lines += ["", f"{r['prompt_tokens']}-token prompt: fresh `tinyhet run` (kernel cache warm) {r['fresh_ttft_s']:.3f} s, resident process "
              f"{r['resident_ttft_s']:.3f} s: {r['ratio']:.2f}x"]
  if (ld := out.get("load")):
    lines += ["", f"`both` node, prompts of {ld['prompt_tokens'][0]}-{ld['prompt_tokens'][1]} tokens, {ld['max_tokens']} new",
              f"{'conc.':>6}{'req/s':>8}{'TPOT p50':>10}{'TPOT p99':>10}{'p99/p50':>9}"]
    lines += [f"{x['concurrency']:>6}{x['requests_s']:>8.2f}{x['tpot_p50_s'] * 1e3:>8.1f}ms{x['tpot_p99_s'] * 1e3:>8.1f}ms"
              f"{x['tpot_p99_s'] / x['tpot_p50_s'] if x['tpot_p50_s'] else 0:>8.2f}x" for x in ld["rows"]]
  if (pc := out.get("pieces")):
    lines += ["", f"a {pc['prompt_tokens']}-token prompt whole: {pc['whole_ms_per_token']:.3f} ms a token; decode step of 1: "
              f"{pc['decode_ms']['1']:.1f} ms, of 4: {pc['decode_ms']['4']:.1f} ms",
              f"{'budget':>7}{'ms/token':>10}{'vs whole':>10}{'step':>10}{'vs decode':>10}"]
    lines += [f"{r['budget']:>7}{r['ms_per_token']:>10.3f}{r['vs_whole']:>9.2f}x{r['step_ms']:>8.1f}ms{r['step_vs_decode']:>9.2f}x"
              for r in pc["rows"]]
  return "\n".join(lines)

def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="tinyhet bench latency", description=__doc__.splitlines()[0])
  ap.add_argument("--json", action="store_true")
  ap.add_argument("--quick", action="store_true", help="the small random model, short prompts, concurrency 1 and 4, no `tinyhet run` part")
  ap.add_argument("--model", default=None, help="a model every process loads (default: the embedded SmolLM2)")
  ap.add_argument("--parts", default="first,fresh,load", help="comma list of first, fresh, load, pieces (default: first,fresh,load)")
  ap.add_argument("--lengths", type=int, default=10, help="random prompt lengths of the first-request part (default 10)")
  ap.add_argument("--min-len", type=int, default=10)
  ap.add_argument("--max-len", type=int, default=4000)
  ap.add_argument("--run-tokens", type=int, default=7876, help="the fresh-run part's prompt length (about; default 7876)")
  ap.add_argument("--concurrency", default="1,4,16")
  ap.add_argument("--requests", type=int, default=16, help="requests per load round at least (default 16; twice the concurrency)")
  ap.add_argument("--load-min", type=int, default=100)
  ap.add_argument("--load-max", type=int, default=2000)
  ap.add_argument("--max-tokens", type=int, default=32, help="new tokens per load request (default 32)")
  ap.add_argument("--kv-memory", default="512M")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--piece-tokens", type=int, default=1000, help="the pieces part's prompt length (default 1000)")
  ap.add_argument("--budgets", default="16,32,64,128,256", help="the pieces part's prefill budgets (default 16,32,64,128,256)")
  args = ap.parse_args(argv)
  parts = set(args.parts.split(","))
  if bad := parts - {"first", "fresh", "load", "pieces"}: ap.error(f"--parts: unknown {', '.join(sorted(bad))}")
  if args.quick:
    args.model = args.model or "random:max_context=512"
    args.max_len, args.load_min, args.load_max, args.concurrency, args.requests = 400, 20, 200, "1,4", 4
    args.piece_tokens, args.budgets = min(args.piece_tokens, 200), "16,64"
    parts.discard("fresh")           # `tinyhet run` loads a model file
  args.concurrency = [int(x) for x in args.concurrency.split(",")]
  os.environ.setdefault("TINYHET_TOKEN", secrets.token_hex(16))      # the processes started here share it
  from tinyhet.model import spec as service_model
  rng = np.random.default_rng(args.seed)
  out = {"model": service_model.model_id(args.model)}
  if "first" in parts: out["first"] = part_first(args, rng)
  if "fresh" in parts: out["fresh"] = part_fresh(args)
  if "load" in parts: out["load"] = part_load(args, rng)
  if "pieces" in parts: out["pieces"] = part_pieces(args)
  print(json.dumps(out) if args.json else table(out))
  return 0

if __name__ == "__main__": sys.exit(main())
