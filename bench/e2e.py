"""`tinyhet bench e2e`: end to end on the embedded model (or --model), in one process and one run:

- the TTFT overhead of disaggregation, per prompt length and transport: TTFT with layer-wise KV streaming to a decode node
  in another process (until every layer has landed) minus TTFT of the same padded prompt prefilled on the same HET with
  no transfer. The runs with and without transfer alternate, in a rotating order, for --rounds rounds; each figure is the
  best of its rounds, so that machine noise does not decide the sign. With it: the KV moved, the rate over the time bytes
  were moving, a per-layer timeline (computed, posted, landed) of the best run, and the send path's CPU time on this host
  (side_cpu_ms: the writer and transport threads here and the decode node's process; medians), whole and per MiB;
- decode tokens/s, disaggregated against the single-device engine (the same paged engine on HET, no transfer: what
  `tinyhet run --no-disagg` runs) and against the read-bandwidth bound: bytes read per token (weights as stored + the KV
  of the context) over the memory read rate measured in the same run (bench/membw.py).
Each prompt length runs once untimed on every path to compile its kernels (tinygrad compiles per shape).
"""
from __future__ import annotations
import argparse, json, os, secrets, statistics, sys, time
import numpy as np
from tinyhet.bench.prompts import filler_ids

def steady_tok_s(marks: list[float]) -> float:
  """Decode tokens/s from token arrival times, past the first few (a TinyJit step is captured on its first two calls)."""
  gaps = np.diff(marks[3:])
  return float(1 / np.median(gaps)) if len(gaps) else 0.0

def side_cpu_ms(node_pid: int | None) -> float:
  """CPU milliseconds so far of the send path on this host: this process's threads other than the main one and the CPU
  pool's workers (the prefill's compute): the KV writer, the transports' threads, the control client; plus every thread
  of the decode node's process (node_pid: its receivers and notices). 0 where /proc has no schedstat."""
  def threads(pid: int, compute_too: bool) -> float:
    total = 0
    try: tids = os.listdir(f"/proc/{pid}/task")
    except OSError: return 0.0
    for tid in tids:
      try:
        if not compute_too and (tid == str(pid) or open(f"/proc/{pid}/task/{tid}/comm").read().startswith("tinyhet-cpu")): continue
        total += int(open(f"/proc/{pid}/task/{tid}/schedstat").read().split()[0])
      except (OSError, ValueError): continue
    return total / 1e6
  return threads(os.getpid(), False) + (threads(node_pid, True) if node_pid is not None else 0.0)

def say(msg: str):
  print(msg, file=sys.stderr, flush=True)

def measure_length(model, clients: dict, engine, ids: list[int], new: int, rounds: int, node_pid: int | None = None) -> tuple[list[dict], dict]:
  """One prompt length: (one row per transport with the overhead figures, the decode figures of this length).
  clients: transport -> DecodeClient; engine: a LocalEngine on the model's device; node_pid: the decode node's process on
  this host, whose CPU counts in the send path's (side_cpu_ms)."""
  from tinyhet.engine.prefill import prefill_bucket, ttft_no_transfer
  kv_dtype = next(iter(clients.values())).kv_dtype
  n = len(ids)
  say(f"{n}-token prompt: compiling (disaggregated over {', '.join(clients)}, no transfer, single device)")
  marks_d: list[float] = []
  for i, c in enumerate(clients.values()):       # the first also decodes `new` tokens: its rate is the disaggregated one
    c.generate(ids, new if i == 0 else 1, on_token=lambda _: marks_d.append(time.perf_counter()) if i == 0 else None)
  ttft_no_transfer(model, ids, kv_dtype)
  marks_a: list[float] = []
  _, alone = engine.generate(ids, new, on_token=lambda _: marks_a.append(time.perf_counter()))
  paths = ["none", *clients]
  runs: dict[str, list] = {p: [] for p in paths}
  cpu: dict[str, list[float]] = {p: [] for p in paths}          # the send path's CPU ms in each run (side_cpu_ms)
  for r in range(rounds):
    order = paths[r % len(paths):] + paths[:r % len(paths)]      # rotate: no path always runs first, or right after another
    say(f"{n}-token prompt: round {r + 1}/{rounds} ({', '.join(order)})")
    for p in order:
      c0 = side_cpu_ms(node_pid)
      if p == "none": runs[p].append(ttft_no_transfer(model, ids, kv_dtype))
      else: runs[p].append(clients[p].generate(ids, 1)[1])
      cpu[p].append(side_cpu_ms(node_pid) - c0)
  base = round(min(runs["none"]), 6)      # microseconds, as the timeline: a layer landing last is the TTFT itself
  rows = []
  for t in clients:
    st = min(runs[t], key=lambda s: s.ttft_s)
    ttft = round(st.ttft_s, 6)
    per_layer = [x.landed_s - x.posted_s for x in st.timeline]
    send_cpu = max(0.0, statistics.median(cpu[t]) - statistics.median(cpu["none"]))    # less what those threads use with no transfer
    rows.append({"prompt_tokens": n, "padded_tokens": prefill_bucket(n), "transport": t, "ttft_s": ttft,
                 "ttft_no_transfer_s": base, "overhead_s": round(ttft - base, 6),
                 "overhead_share": round((st.ttft_s - base) / st.ttft_s, 4), "kv_bytes": st.kv_bytes, "transfer_s": round(st.transfer_s, 6),
                 "transfer_gbps": round(st.transfer_gbps, 3), "kv_tail_s": round(st.kv_tail_s, 6),
                 "layer_transfer_s": round(statistics.median(per_layer), 6), "landed_clock": st.landed_clock,
                 "send_cpu_ms": round(send_cpu, 2), "send_cpu_ms_per_mib": round(send_cpu / (st.kv_bytes / 2**20), 3) if st.kv_bytes else 0.0,
                 "rounds": {"ttft_s": [round(s.ttft_s, 6) for s in runs[t]], "ttft_no_transfer_s": [round(x, 6) for x in runs["none"]]},
                 "timeline": [{"layer": x.layer, "computed_s": round(x.computed_s, 6), "posted_s": round(x.posted_s, 6),
                               "landed_s": round(x.landed_s, 6)} for x in st.timeline]})
  return rows, {"prompt_tokens": n, "new_tokens": new, "ttft_single_device_s": round(alone["ttft_s"], 5),
                "decode_tok_s": {"disagg": round(steady_tok_s(marks_d), 2), "single_device": round(steady_tok_s(marks_a), 2)}}

def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="tinyhet bench e2e", description=__doc__.splitlines()[0])
  ap.add_argument("--json", action="store_true")
  ap.add_argument("--quick", action="store_true", help="prompts of 100 and 1000 tokens, 32 new tokens, 2 rounds")
  ap.add_argument("--model", default=None)
  ap.add_argument("--prompt-lens", default=None,
                  help="comma list (default 100,1000,2000,4096,8000: 8,000 leaves SmolLM2's 8,192 room for new tokens; 8192 takes a "
                       "model with a longer context). Prompts past prefill_chunk (512) are prefilled in chunks on both paths")
  ap.add_argument("--new-tokens", type=int, default=None)
  ap.add_argument("--rounds", type=int, default=None, help="timed rounds per prompt length, best of them kept (default 3, --quick 2)")
  ap.add_argument("--transports", default="shm,tcp", help="comma list (default shm,tcp)")
  args = ap.parse_args(argv)
  lens = [int(x) for x in (args.prompt_lens or ("100,1000" if args.quick else "100,1000,2000,4096,8000")).split(",")]
  new = args.new_tokens or (32 if args.quick else 64)
  rounds = args.rounds or (2 if args.quick else 3)
  if rounds < 1 or new < 1 or min(lens) < 1: ap.error("--rounds, --new-tokens and every prompt length must be at least 1")
  os.environ.setdefault("TINYHET_TOKEN", secrets.token_hex(16))
  sys.setswitchinterval(1e-3)      # transport threads get the GIL sooner from the busy prefill thread
  from tinyhet.cli.run import LocalDecodeNode
  # no prefix cache: every round sends the same prompt, which the node would otherwise prefill itself from its cache
  child = LocalDecodeNode(argparse.Namespace(kv_memory="1G", model=args.model, quiet=True, float_weights=False, no_prefix_cache=True))
  try: out = measure(args, lens, new, rounds, child)
  finally: child.close()
  if args.json: print(json.dumps(out))
  else: print(table(out))
  return 0

def measure(args, lens, new, rounds, child) -> dict:
  import tinyhet  # noqa: F401
  from tinyhet.bench.membw import read_gbps
  from tinyhet.engine.local_engine import LocalEngine
  from tinyhet.device.memory import local_node
  from tinyhet.engine.client import DecodeClient
  from tinyhet.model.spec import load
  model, tok, model_id = load(args.model, "HET", quiet=True, packed=True)        # a file, the embedded SmolLM2, or random:...
  if (too_long := [n for n in lens if n + new > model.cfg.max_context]):
    raise SystemExit(f"tinyhet bench e2e: prompts of {too_long} tokens + {new} new tokens exceed the model's context ({model.cfg.max_context}): "
                     "pass shorter --prompt-lens, fewer --new-tokens, or a model with a longer context (random:...,max_context=16384)")
  address = child.address()
  clients = {t: DecodeClient(local_node(), address, model, model_id, t) for t in args.transports.split(",")}
  engine = LocalEngine(model, max(lens) + new)
  say("memory read bandwidth (bench/membw.py)")
  bw = read_gbps()
  w_bytes = model.w.nbytes()        # what one decode step reads: the weights as stored (packed blocks, or floats)
  kv_per_token = model.cfg.kv_bytes_per_token()
  rows, decode = [], []
  try:
    for n in lens:
      r, d = measure_length(model, clients, engine, filler_ids(tok, n), new, rounds, child.proc.pid)
      d["decode_tok_s"]["bandwidth_bound"] = round(bw * 1e9 / (w_bytes + kv_per_token * (n + new // 2)), 2)
      rows += r
      decode.append(d)
  finally:
    for c in clients.values(): c.close()
  return {"rows": rows, "decode": decode, "rounds": rounds, "read_gbps": round(bw, 2), "weights_bytes": w_bytes, "kv_bytes_per_token": kv_per_token}

def table(out: dict) -> str:
  lines = [f"TTFT overhead of disaggregation (best of {out['rounds']} alternating rounds; TTFT until every layer landed):",
           f"{'prompt':>7} {'transport':>9} {'TTFT':>9} {'no transfer':>12} {'overhead':>18} {'KV MiB':>7} {'moving GB/s':>12} "
           f"{'tail ms':>8} {'layer ms':>9} {'send CPU ms':>12} {'ms/MiB':>7}"]
  for r in out["rows"]:
    over = f"{r['overhead_s']:+.3f}s {100 * r['overhead_share']:+.1f}%"
    lines.append(f"{r['prompt_tokens']:>7} {r['transport']:>9} {r['ttft_s']:>8.3f}s {r['ttft_no_transfer_s']:>11.3f}s {over:>18} "
                 f"{r['kv_bytes'] / 2**20:>7.2f} {r['transfer_gbps']:>12.2f} {1e3 * r['kv_tail_s']:>8.2f} {1e3 * r['layer_transfer_s']:>9.2f} "
                 f"{r['send_cpu_ms']:>12.1f} {r['send_cpu_ms_per_mib']:>7.2f}")
  lines += ["decode (single device: the same paged engine on HET, no transfer):",
            f"{'prompt':>7} {'TTFT single':>12} {'tok/s disagg':>13} {'tok/s single':>13} {'read-bw bound':>14}"]
  for d in out["decode"]:
    t = d["decode_tok_s"]
    lines.append(f"{d['prompt_tokens']:>7} {d['ttft_single_device_s']:>11.3f}s {t['disagg']:>13.1f} {t['single_device']:>13.1f} "
                 f"{t['bandwidth_bound']:>14.1f}")
  lines.append(f"memory read {out['read_gbps']} GB/s; weights read per token {out['weights_bytes'] / 2**20:.0f} MiB; "
               f"KV {out['kv_bytes_per_token']} B/token; layer ms: median per-layer time from post to landed; send CPU: CPU time of "
               "the send path on this host per request (this process's writer and transport threads + the decode node's process, "
               "medians, less the same threads' with no transfer): on one host it shares the prefill's cores")
  return "\n".join(lines)

if __name__ == "__main__": sys.exit(main())
