"""`tinyhet bench serve`: the service under load, in one run: a router in front of 1 prefill + 1 decode node (disaggregated)
against a router in front of one `--role both` node doing everything (the baseline), each at several concurrencies.

Per configuration and concurrency: requests/s, time to first token (TTFT) and time per output token (TPOT: the gaps
between a request's tokens) at p50 and a tail percentile the samples support (TTFT p90: one sample per request, so a
round has at least 10 requests; TPOT p99 over every gap, p90 when a round has fewer than 100 gaps), from streamed
completions with fixed-length prompts and greedy decoding.
Each configuration first runs one warm-up round per concurrency (tinygrad compiles per shape and captures a decode step
per batch size), then the measured round. Nodes run as separate processes on this machine (loopback; shm for KV).
"""
from __future__ import annotations
import argparse, http.client, json, os, secrets, subprocess, sys, threading, time
import numpy as np

def wait_ready(address: str, timeout: float = 300):
  """Until the router at address answers /ready with 200 (a decode node is up), at most timeout seconds."""
  deadline = time.monotonic() + timeout
  while True:
    host, port = address.rsplit(":", 1)
    c = http.client.HTTPConnection(host, int(port), timeout=10)
    c.request("GET", "/ready")
    if c.getresponse().status == 200: return
    if time.monotonic() > deadline: raise RuntimeError("the router did not become ready")
    time.sleep(0.2)

class Proc:
  """A `tinyhet` process of a benchmark; env: variables set on top of this process's environment (the token, PATH, ...)."""
  def __init__(self, *args, env: dict | None = None):
    self.p = subprocess.Popen([sys.executable, "-m", "tinyhet", *args, "--stdin-stop"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env=None if env is None else {**os.environ, **env})
    line = self.p.stdout.readline()
    if not line: raise RuntimeError(f"tinyhet {' '.join(args)} did not start (exit {self.p.wait()})")
    self.info = json.loads(line)
  def stop(self):
    try:
      self.p.stdin.close()
      self.p.wait(20)
    except (subprocess.TimeoutExpired, OSError): self.p.kill()

def stream_one(address: str, body: dict) -> tuple[float, list[float]]:
  """(seconds to the first token, arrival time of every token) of one streamed completion."""
  host, port = address.rsplit(":", 1)
  c = http.client.HTTPConnection(host, int(port), timeout=600)
  t0 = time.perf_counter()
  c.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True, "return_token_ids": True}),
            headers={"Content-Type": "application/json"})
  r = c.getresponse()
  if r.status != 200: raise RuntimeError(f"router answered {r.status}: {r.read()[:300]!r}")
  marks = []
  for line in r:
    if line.startswith(b"data: {"):
      obj = json.loads(line[6:])
      if "error" in obj: raise RuntimeError(obj["error"]["message"])
      marks += [time.perf_counter()] * len(obj["choices"][0].get("token_ids", []))
  c.close()
  return t0, marks

def prompt_ids(salt: int, i: int, n: int) -> list[int]:
  """Request i's prompt of a round: tokens 1..250 drawn from a generator seeded by (salt, i), so no two requests of a run
  share a 16-token block and none is served from a prefix cache (the old (salt * 7919 + i * 37 + j * 11) % 250 gave the
  warm-up round, salt 1000 + c, the very prompts of the measured round, salt c: every measured request was a cache hit)."""
  return [int(t) for t in np.random.default_rng([salt, i]).integers(1, 251, n)]

def load_round(address: str, model: str, concurrency: int, n_requests: int, prompt_tokens: int, max_tokens: int, salt: int) -> dict:
  """n_requests completions, at most `concurrency` in flight at once."""
  results, lock, next_i = [], threading.Lock(), iter(range(n_requests))
  def worker():
    while True:
      with lock: i = next(next_i, None)
      if i is None: return
      ids = prompt_ids(salt, i, prompt_tokens)
      results.append(stream_one(address, {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0}))
  t0 = time.perf_counter()
  threads = [threading.Thread(target=worker) for _ in range(concurrency)]
  for t in threads: t.start()
  for t in threads: t.join()
  wall = time.perf_counter() - t0
  ttft = np.array([m[0] - s for s, m in results if m])
  tpot = np.concatenate([np.diff(m) for _, m in results if len(m) > 1] or [np.zeros(1)])
  q = lambda a, p: float(np.percentile(a, p)) if len(a) else 0.0
  tpot_tail = 99 if len(tpot) >= 100 else 90      # a p99 over fewer than 100 samples is their maximum
  return {"concurrency": concurrency, "requests": len(results), "requests_s": len(results) / wall,
          "output_tok_s": sum(len(m) for _, m in results) / wall,
          "ttft_p50_s": q(ttft, 50), "ttft_p90_s": q(ttft, 90), "tpot_p50_s": q(tpot, 50), "tpot_tail_s": q(tpot, tpot_tail),
          "tpot_tail_pct": tpot_tail, "tpot_samples": len(tpot)}

def run_config(name: str, args, levels: list[int]) -> list[dict]:
  node_args = ["--listen", "127.0.0.1:0", "--quiet", "--kv-memory", args.kv_memory] + (["--model", args.model] if args.model else [])
  procs = []
  try:
    if name == "disaggregated":
      procs += [Proc("node", "--role", "prefill", "--listen", "127.0.0.1:0", "--quiet", *(["--model", args.model] if args.model else [])),
                Proc("node", "--role", "decode", *node_args)]
      flags = ["--prefill", procs[0].info["address"], "--decode", procs[1].info["address"]]
    else:
      procs.append(Proc("node", "--role", "both", *node_args))
      flags = ["--both", procs[0].info["address"]]
    router = Proc("serve", "--listen", "127.0.0.1:0", *flags, *(["--model", args.model] if args.model else []), "--max-queue", "1024",
                  "--queue-timeout", "600")
    procs.append(router)
    address, model = router.info["address"], router.info["model"]
    wait_ready(address)
    rows = []
    for c in levels:
      load_round(address, model, c, c, args.prompt_tokens, args.max_tokens, salt=1000 + c)       # warm-up: compiles and captures
      n = max(args.requests or 0, 2 * c, 10)          # at least 10 TTFT samples for its p90
      rows.append({"config": name, **load_round(address, model, c, n, args.prompt_tokens, args.max_tokens, salt=c)})
      if not args.json: print(f"  {name} concurrency {c}: {rows[-1]['requests_s']:.2f} requests/s", file=sys.stderr, flush=True)
    return rows
  finally:
    for p in procs[::-1]: p.stop()

def table(out: dict) -> str:
  lines = [f"model {out['model']}, {out['prompt_tokens']}-token prompts, {out['max_tokens']} new tokens, greedy; baseline: one --role both node",
           "", f"{'configuration':<15}{'conc.':>6}{'req/s':>8}{'vs both':>9}{'TTFT p50':>10}{'TTFT p90':>10}{'TPOT p50':>10}{'TPOT tail':>11}"
           f"{'tok/s':>8}"]
  base = {r["concurrency"]: r for r in out["rows"] if r["config"] == "both"}
  for r in out["rows"]:
    ratio = r["requests_s"] / base[r["concurrency"]]["requests_s"] if r["concurrency"] in base and base[r["concurrency"]]["requests_s"] else 0
    lines.append(f"{r['config']:<15}{r['concurrency']:>6}{r['requests_s']:>8.2f}{ratio:>8.2f}x{r['ttft_p50_s']:>9.3f}s{r['ttft_p90_s']:>9.3f}s"
                 f"{r['tpot_p50_s'] * 1e3:>8.1f}ms{r['tpot_tail_s'] * 1e3:>6.1f}ms p{r['tpot_tail_pct']}{r['output_tok_s']:>8.1f}")
  return "\n".join(lines)

def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="tinyhet bench serve", description=__doc__.splitlines()[0])
  ap.add_argument("--json", action="store_true")
  ap.add_argument("--quick", action="store_true", help="the small random model (random:) instead of the embedded SmolLM2")
  ap.add_argument("--model", default=None, help="a model every node loads (default: the embedded SmolLM2; --quick: random:)")
  ap.add_argument("--concurrency", default="1,4,16", help="comma list of concurrent requests (default 1,4,16)")
  ap.add_argument("--requests", type=int, default=None, help="requests per measured round (default: twice the concurrency; at least 10)")
  ap.add_argument("--prompt-tokens", type=int, default=None, help="prompt length (default 100; --quick 24)")
  ap.add_argument("--max-tokens", type=int, default=None, help="new tokens per request (default 32; --constrained 64)")
  ap.add_argument("--kv-memory", default="256M")
  ap.add_argument("--constrained", action="store_true", help="structured outputs' cost instead (tinyhet.bench.constrained): a batch half "
                  "under a JSON schema against the same batch free, TTFT with a schema against without")
  ap.add_argument("--batch", type=int, default=16, help="--constrained: the decode batch (default 16)")
  ap.add_argument("--ttft-reps", type=int, default=5, help="--constrained: requests per TTFT median (default 5)")
  args = ap.parse_args(argv)
  if args.quick and args.model is None: args.model = "random:max_context=512"
  args.prompt_tokens = args.prompt_tokens or (24 if args.quick else 100)
  args.max_tokens = args.max_tokens or (64 if args.constrained else 32)
  levels = [int(x) for x in args.concurrency.split(",")]
  os.environ.setdefault("TINYHET_TOKEN", secrets.token_hex(16))      # the processes started here share it
  if args.constrained:
    from tinyhet.bench import constrained
    out = constrained.run(args)
    print(json.dumps(out) if args.json else constrained.table(out))
    return 0
  from tinyhet.model import spec as service_model
  rows = run_config("disaggregated", args, levels) + run_config("both", args, levels)
  out = {"model": service_model.model_id(args.model), "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "rows": rows}
  print(json.dumps(out) if args.json else table(out))
  return 0

if __name__ == "__main__": sys.exit(main())
