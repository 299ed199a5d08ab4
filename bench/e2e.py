"""`tinyhet bench e2e`: end to end on the embedded model (or --model), in one process and one run:

- the TTFT overhead of disaggregation, per prompt length and transport: TTFT with layer-wise KV streaming to a decode node
  in another process (until every layer has landed) minus TTFT of the same padded prompt prefilled on the same HET with
  no transfer. The runs with and without transfer alternate, in a rotating order, for --rounds rounds; each figure is the
  best of its rounds, so that machine noise does not decide the sign. With it: the KV moved, the rate over the time bytes
  were moving, a per-layer timeline (computed, posted, landed) of the best run, and the send path's CPU time on this host
  (side_cpu_ms: the writer and transport threads here and the decode node's process; medians), whole and per MiB; the
  best run's handoff_ms (the prefill thread's time handing layers and pieces to the transport: packing, posting, a shm
  memcpy), kv_writes and prefill_s (to the first token: TTFT less any wait for the last layer), where the overhead goes;
- decode tokens/s, disaggregated against the single-device engine (the same paged engine on HET, no transfer: what
  `tinyhet run --no-disagg` runs) and against the read-bandwidth bound: bytes read per token (weights as stored + the KV
  of the context) over the memory read rate measured in the same run (bench/membw.py).
Each prompt length runs once untimed on every path to compile its kernels (tinygrad compiles per shape).

--kv-dtypes float16,q8_0 measures every prompt length and transport once per KV dtype: a decode node per dtype (its Config
kv_dtype, TINYHET_KV_DTYPE), this side's client naming the same one (a mismatch is refused), the single-device engine and
the no-transfer prefill in that dtype too. The disaggregated TTFT then includes packing each layer into the dtype's format
(the quantization) as the prefill node does it; each row's transfer time and KV bytes (as sent: the dtype's blocks) get
their ratio to float16's row of the same prompt length and transport (transfer_x, kv_bytes_x) where float16 is measured.
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
  from tinyhet.kernels.kv_quant import kv_name
  kv_dtype = next(iter(clients.values())).kv_dtype
  if engine is not None and engine.cache.kv_dtype != kv_dtype: raise ValueError("the single-device engine holds KV in another dtype")
  n = len(ids)
  say(f"{n}-token prompt, {kv_name(kv_dtype)} KV: compiling (disaggregated over {', '.join(clients)}, no transfer, single device)")
  marks_d: list[float] = []
  for i, c in enumerate(clients.values()):       # the first also decodes `new` tokens: its rate is the disaggregated one
    c.generate(ids, new if i == 0 else 1, on_token=lambda _: marks_d.append(time.perf_counter()) if i == 0 else None)
  ttft_no_transfer(model, ids, kv_dtype)
  marks_a: list[float] = []     # engine None: no single-device engine holds this dtype on this device (the C kernels: a CPU)
  _, alone = engine.generate(ids, new, on_token=lambda _: marks_a.append(time.perf_counter())) if engine is not None else (None, None)
  paths = ["none", *clients]
  runs: dict[str, list] = {p: [] for p in paths}
  cpu: dict[str, list[float]] = {p: [] for p in paths}          # the send path's CPU ms in each run (side_cpu_ms)
  for r in range(rounds):
    order = paths[r % len(paths):] + paths[:r % len(paths)]      # rotate: no path always runs first, or right after another
    say(f"{n}-token prompt, {kv_name(kv_dtype)} KV: round {r + 1}/{rounds} ({', '.join(order)})")
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
    rows.append({"prompt_tokens": n, "padded_tokens": prefill_bucket(n), "transport": t, "kv_dtype": kv_name(kv_dtype), "ttft_s": ttft,
                 "ttft_no_transfer_s": base, "overhead_s": round(ttft - base, 6),
                 "overhead_share": round((st.ttft_s - base) / st.ttft_s, 4), "kv_bytes": st.kv_bytes, "transfer_s": round(st.transfer_s, 6),
                 "transfer_gbps": round(st.transfer_gbps, 3), "kv_tail_s": round(st.kv_tail_s, 6),
                 "layer_transfer_s": round(statistics.median(per_layer), 6), "landed_clock": st.landed_clock,
                 "handoff_ms": round(1e3 * st.handoff_s, 2), "kv_writes": st.kv_writes, "prefill_s": round(st.prefill_s, 6),
                 "send_cpu_ms": round(send_cpu, 2), "send_cpu_ms_per_mib": round(send_cpu / (st.kv_bytes / 2**20), 3) if st.kv_bytes else 0.0,
                 "rounds": {"ttft_s": [round(s.ttft_s, 6) for s in runs[t]], "ttft_no_transfer_s": [round(x, 6) for x in runs["none"]]},
                 "timeline": [{"layer": x.layer, "computed_s": round(x.computed_s, 6), "posted_s": round(x.posted_s, 6),
                               "landed_s": round(x.landed_s, 6)} for x in st.timeline]})
  return rows, {"prompt_tokens": n, "kv_dtype": kv_name(kv_dtype), "new_tokens": new,
                "ttft_single_device_s": round(alone["ttft_s"], 5) if alone else None,
                "decode_tok_s": {"disagg": round(steady_tok_s(marks_d), 2), "single_device": round(steady_tok_s(marks_a), 2) if alone else None}}

def add_ratios(rows: list[dict]) -> None:
  """Each row's transfer time and KV bytes over float16's row of the same prompt length and transport (where there is one)."""
  base = {(r["prompt_tokens"], r["transport"]): r for r in rows if r["kv_dtype"] == "float16"}
  for r in rows:
    if (b := base.get((r["prompt_tokens"], r["transport"]))) is None: continue
    r["transfer_x"] = round(r["transfer_s"] / b["transfer_s"], 4) if b["transfer_s"] else None
    r["kv_bytes_x"] = round(r["kv_bytes"] / b["kv_bytes"], 4) if b["kv_bytes"] else None

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
  ap.add_argument("--kv-dtypes", default="float16", help="comma list of KV dtypes, each measured (default float16; e.g. float16,q8_0)")
  args = ap.parse_args(argv)
  from tinyhet.kernels.kv_quant import kv_format
  kv_dtypes = [d for d in args.kv_dtypes.split(",") if d]
  try:
    for d in kv_dtypes: kv_format(d)
  except ValueError as e: ap.error(str(e))
  if not kv_dtypes or len(set(kv_dtypes)) < len(kv_dtypes): ap.error("--kv-dtypes needs one or more distinct KV dtypes")
  lens = [int(x) for x in (args.prompt_lens or ("100,1000" if args.quick else "100,1000,2000,4096,8000")).split(",")]
  new = args.new_tokens or (32 if args.quick else 64)
  rounds = args.rounds or (2 if args.quick else 3)
  if rounds < 1 or new < 1 or min(lens) < 1: ap.error("--rounds, --new-tokens and every prompt length must be at least 1")
  os.environ.setdefault("TINYHET_TOKEN", secrets.token_hex(16))
  sys.setswitchinterval(1e-3)      # transport threads get the GIL sooner from the busy prefill thread
  from tinyhet.cli.run import LocalDecodeNode
  # no prefix cache: every round sends the same prompt, which the node would otherwise prefill itself from its cache. A node
  # per KV dtype, started together
  children = {}
  try:
    for d in kv_dtypes:
      children[d] = LocalDecodeNode(argparse.Namespace(kv_memory="1G", model=args.model, quiet=True, float_weights=False,
                                                       no_prefix_cache=True, kv_dtype=d))
    out = measure(args, lens, new, rounds, children)
  finally:
    for c in children.values(): c.close()
  if args.json: print(json.dumps(out))
  else: print(table(out))
  return 0

def measure(args, lens, new, rounds, children: dict) -> dict:
  """children: KV dtype -> its decode node (LocalDecodeNode)."""
  import tinyhet  # noqa: F401
  from tinyhet.engine.local_engine import LocalEngine
  from tinyhet.device.memory import local_node
  from tinyhet.engine.client import DecodeClient
  from tinyhet.model.spec import load
  model, tok, model_id = load(args.model, "HET", quiet=True, packed=True)        # a file, the embedded SmolLM2, or random:...
  if (too_long := [n for n in lens if n + new > model.cfg.max_context]):
    raise SystemExit(f"tinyhet bench e2e: prompts of {too_long} tokens + {new} new tokens exceed the model's context ({model.cfg.max_context}): "
                     "pass shorter --prompt-lens, fewer --new-tokens, or a model with a longer context (random:...,max_context=16384)")
  clients, engines = {}, {}       # KV dtype -> {transport: client}, KV dtype -> single-device engine (or None)
  try:
    for d, child in children.items():
      address = child.address()
      clients[d] = {}
      for t in args.transports.split(","): clients[d][t] = DecodeClient(local_node(), address, model, model_id, t, kv_dtype=d)
      try: engines[d] = LocalEngine(model, max(lens) + new, kv_dtype=d)
      except ValueError as e:
        say(f"no single-device figures for {d} KV: {e}")
        engines[d] = None
    return measure_all(model, tok, lens, new, rounds, children, clients, engines)
  finally:
    for cs in clients.values():
      for c in cs.values(): c.close()

def measure_all(model, tok, lens, new, rounds, children: dict, clients: dict, engines: dict) -> dict:
  """Every prompt length, each KV dtype in turn at that length (its clients, engine and decode node's process)."""
  from tinyhet.bench.membw import read_gbps
  from tinyhet.kernels.kv_quant import kv_format
  from tinyhet.kv.paged_cache import PagedKVCache
  say("memory read bandwidth (bench/membw.py)")
  bw = read_gbps()
  w_bytes = model.w.nbytes()        # what one decode step reads: the weights as stored (packed blocks, or floats)
  cfg, bs = model.cfg, 16           # the decode node's and the engine's block size (kv_block_size's default)
  per_token = {d: PagedKVCache.bytes_per_block(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, bs, kv_format(d)) / bs for d in children}
  rows, decode = [], []
  for n in lens:
    for d, child in children.items():
      r, dec = measure_length(model, clients[d], engines[d], filler_ids(tok, n), new, rounds, child.proc.pid)
      dec["decode_tok_s"]["bandwidth_bound"] = round(bw * 1e9 / (w_bytes + per_token[d] * (n + new // 2)), 2)
      rows += r
      decode.append(dec)
  add_ratios(rows)
  return {"rows": rows, "decode": decode, "rounds": rounds, "kv_dtypes": list(children), "read_gbps": round(bw, 2), "weights_bytes": w_bytes,
          "kv_bytes_per_token": cfg.kv_bytes_per_token(), "kv_bytes_per_token_by_dtype": per_token}

def ratio(x) -> str: return f"{x:.2f}x" if x is not None else "-"

def table(out: dict) -> str:
  lines = [f"TTFT overhead of disaggregation (best of {out['rounds']} alternating rounds; TTFT until every layer landed):",
           f"{'prompt':>7} {'transport':>9} {'KV dtype':>9} {'TTFT':>9} {'no transfer':>12} {'overhead':>18} {'KV MiB':>7} {'vs f16':>7} "
           f"{'moving ms':>10} {'vs f16':>7} {'moving GB/s':>12} {'tail ms':>8} {'layer ms':>9} {'send CPU ms':>12} {'ms/MiB':>7} "
           f"{'handoff ms':>11} {'writes':>7}"]
  for r in out["rows"]:
    over = f"{r['overhead_s']:+.3f}s {100 * r['overhead_share']:+.1f}%"
    lines.append(f"{r['prompt_tokens']:>7} {r['transport']:>9} {r.get('kv_dtype', 'float16'):>9} {r['ttft_s']:>8.3f}s "
                 f"{r['ttft_no_transfer_s']:>11.3f}s {over:>18} {r['kv_bytes'] / 2**20:>7.2f} {ratio(r.get('kv_bytes_x')):>7} "
                 f"{1e3 * r['transfer_s']:>10.1f} {ratio(r.get('transfer_x')):>7} {r['transfer_gbps']:>12.2f} {1e3 * r['kv_tail_s']:>8.2f} "
                 f"{1e3 * r['layer_transfer_s']:>9.2f} {r['send_cpu_ms']:>12.1f} {r['send_cpu_ms_per_mib']:>7.2f} "
                 f"{r.get('handoff_ms', 0.0):>11.1f} {r.get('kv_writes', 0):>7}")
  lines += ["decode (single device: the same paged engine on HET, no transfer):",
            f"{'prompt':>7} {'KV dtype':>9} {'TTFT single':>12} {'tok/s disagg':>13} {'tok/s single':>13} {'read-bw bound':>14}"]
  for d in out["decode"]:
    t, single = d["decode_tok_s"], d["ttft_single_device_s"]
    alone = f"{t['single_device']:.1f}" if t["single_device"] is not None else "-"
    lines.append(f"{d['prompt_tokens']:>7} {d.get('kv_dtype', 'float16'):>9} {f'{single:.3f}s' if single is not None else '-':>12} "
                 f"{t['disagg']:>13.1f} {alone:>13} {t['bandwidth_bound']:>14.1f}")
  per_token = ", ".join(f"{k} {v:g}" for k, v in out.get("kv_bytes_per_token_by_dtype", {"float16": out["kv_bytes_per_token"]}).items())
  lines.append(f"memory read {out['read_gbps']} GB/s; weights read per token {out['weights_bytes'] / 2**20:.0f} MiB; "
               f"KV B/token: {per_token}; moving ms: the time bytes were moving; vs f16: over float16's row of the same prompt and "
               "transport; layer ms: median per-layer time from post to landed; send CPU: CPU time of "
               "the send path on this host per request (this process's writer and transport threads + the decode node's process, "
               "medians, less the same threads' with no transfer): on one host it shares the prefill's cores; handoff: the prefill "
               "thread's time handing the best run's layers to the transport (packing, posting, a shm memcpy); writes: its transport writes")
  return "\n".join(lines)

if __name__ == "__main__": sys.exit(main())
