"""`tinyhet bench e2e`: end to end on the embedded model (or --model), in one run:

- disaggregated (prefill on HET, layer-wise KV to a decode node in another process) against --no-disagg (HET alone):
  TTFT, decode tokens/s, and the share of the KV transfer hidden behind prefill, per prompt length;
- decode tokens/s against the memory-bandwidth bound: bytes read per token (weights as stored + the KV of the
  context) over memcpy GB/s measured in the same run.
Each configuration runs once to compile its kernels (tinygrad compiles per shape) and is then measured warm.
"""
from __future__ import annotations
import argparse, json, secrets, os, sys, time
import numpy as np

FILLER = ("The history of the sea is the history of the people who crossed it: traders and fishermen, explorers and "
          "mapmakers, each leaving notes about currents, winds and the stars they steered by. ")

def prompt_of(tok, n_tokens: int) -> list[int]:
  ids: list[int] = []
  while len(ids) < n_tokens: ids += tok.encode(FILLER, add_special=False)
  return ids[:n_tokens]

def memcpy_gbps(nbytes: int = 256 << 20) -> float:
  src, dst = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
  dst[:] = src
  best = 0.0
  for _ in range(3):
    st = time.perf_counter()
    dst[:] = src
    best = max(best, nbytes / (time.perf_counter() - st) / 1e9)
  return best

def steady_tok_s(marks: list[float]) -> float:
  """Decode tokens/s from token arrival times, past the first few (a TinyJit step is captured on its first two calls)."""
  gaps = np.diff(marks[3:])
  return float(1 / np.median(gaps)) if len(gaps) else 0.0

def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="tinyhet bench e2e", description=__doc__.splitlines()[0])
  ap.add_argument("--json", action="store_true")
  ap.add_argument("--quick", action="store_true", help="prompts of 100 and 1000 tokens, 32 new tokens")
  ap.add_argument("--model", default=None)
  ap.add_argument("--prompt-lens", default=None, help="comma list (default 100,1000,2000)")
  ap.add_argument("--new-tokens", type=int, default=None)
  ap.add_argument("--transport", default=None)
  args = ap.parse_args(argv)
  lens = [int(x) for x in (args.prompt_lens or ("100,1000" if args.quick else "100,1000,2000")).split(",")]
  new = args.new_tokens or (32 if args.quick else 64)
  os.environ.setdefault("TINYHET_TOKEN", secrets.token_hex(16))
  sys.setswitchinterval(1e-3)      # transport threads get the GIL sooner from the busy prefill thread
  from tinyhet.run import LocalDecodeNode
  child = LocalDecodeNode(argparse.Namespace(kv_memory="1G", model=args.model, quiet=True, float_weights=False))
  try: rows, extra = measure(args, lens, new, child)
  finally: child.close()
  out = {"rows": rows, **extra}
  if args.json: print(json.dumps(out))
  else: print(table(out))
  return 0

def measure(args, lens, new, child):
  import tinyhet  # noqa: F401
  from tinyhet.memory import local_node
  from tinyhet.prefill import DecodeClient
  from tinyhet.weights import load_model, model_name
  say = lambda m: print(m, file=sys.stderr, flush=True)
  model, tok = load_model(args.model, device="HET", quiet=True, packed=True)
  client = DecodeClient(local_node(), child.address(), model, model_name(args.model), args.transport)
  bw = memcpy_gbps()
  w_bytes = model.w.nbytes()        # what one decode step reads: the weights as stored (packed blocks, or floats)
  kv_per_token = model.cfg.kv_bytes_per_token()
  rows = []
  for n in lens:
    ids = prompt_of(tok, n)
    for label in ("compile", "warm"):
      say(f"{n}-token prompt, {new} new tokens: disaggregated and single-device ({label})")
      marks_d: list[float] = []
      _, st = client.generate(ids, new, stop_ids=(), on_token=lambda _: marks_d.append(time.perf_counter()))
      stats: dict = {}
      marks_a: list[float] = []
      model.reference_generate(ids, new, stats=stats, on_token=lambda _: marks_a.append(time.perf_counter()))
    alone_tok_s = steady_tok_s(marks_a)
    bound = bw * 1e9 / (w_bytes + kv_per_token * (n + new // 2))
    rows.append({"prompt_tokens": n, "new_tokens": new, "ttft_s": {"disagg": round(st.ttft_s, 4), "alone": round(stats["prefill_s"], 4)},
                 "decode_tok_s": {"disagg": round(steady_tok_s(marks_d), 2), "alone": round(alone_tok_s, 2), "bandwidth_bound": round(bound, 2)},
                 "hidden_share": round(st.hidden_share, 4), "kv_bytes": st.kv_bytes, "transfer_gbps": round(st.transfer_gbps, 3),
                 "transport": st.transport})
  client.close()
  return rows, {"memcpy_gbps": round(bw, 2), "weights_bytes": w_bytes, "kv_bytes_per_token": kv_per_token}

def table(out: dict) -> str:
  head = (f"{'prompt':>7} {'TTFT disagg':>12} {'TTFT alone':>11} {'hidden':>7} {'KV MiB':>7} {'GB/s':>6} {'tok/s disagg':>13} "
          f"{'tok/s alone':>12} {'bw bound':>9}")
  lines = [head]
  for r in out["rows"]:
    lines.append(f"{r['prompt_tokens']:>7} {r['ttft_s']['disagg']:>11.3f}s {r['ttft_s']['alone']:>10.3f}s {100 * r['hidden_share']:>6.1f}% "
                 f"{r['kv_bytes'] / 2**20:>7.2f} {r['transfer_gbps']:>6.2f} {r['decode_tok_s']['disagg']:>13.1f} {r['decode_tok_s']['alone']:>12.1f} "
                 f"{r['decode_tok_s']['bandwidth_bound']:>9.1f}")
  lines.append(f"memcpy {out['memcpy_gbps']} GB/s; weights read per token {out['weights_bytes'] / 2**20:.0f} MiB; "
               f"KV {out['kv_bytes_per_token']} B/token; transport {out['rows'][0]['transport'] if out['rows'] else '-'}")
  return "\n".join(lines)

if __name__ == "__main__": sys.exit(main())
