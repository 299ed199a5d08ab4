"""`tinyhet bench staging`: layers leaving device memory no transport sends from (HET on a GPU without GPUDirect), with
and without the asynchronous staging buffers (tinyhet.staging), in one run.

The "device" is tinygrad's own CPU device (--device; CUDA on a GPU machine): its memory is not registered, so each packed
layer must be copied to registered host memory before a transport can send it, as from a GPU. Paths, alternating in a
rotating order for --rounds rounds, best of each kept:
  none         the same padded prefill with no transfer (the floor)
  sync         the copy on the prefill thread, then the write posted by the writer thread (tinyhet before staging)
  staged N     N staging buffers: the writer thread copies and posts, the prefill thread waits only when all N are in flight
each over the shm link at full speed and behind a rate-limited link (--link-gbps: every write lands no sooner than its
bytes take at that rate after the previous one; the real write then reads the staging buffer, late, as a slow DMA would).
Figures: prefill time (start to the first token sampled), TTFT (until every layer landed), the prefill thread's waits
for a staging buffer, and overlap: layers whose copy-and-post on the writer thread ended after the prefill thread had
started the next layer (0 on the synchronous path, by construction: that is what it costs).
"""
from __future__ import annotations
import argparse, json, os, secrets, sys, threading, time

class RateLimitedEndpoint:
  """An endpoint's writes behind a link of gbps: a write is made for real once the link would have carried its bytes."""
  def __init__(self, endpoint, gbps: float):
    self.endpoint, self.gbps, self.free_at, self.lock = endpoint, gbps, 0.0, threading.Lock()

  def write(self, peer, spans, notify=None):
    from tinyhet.runtime.transport import Transfer
    n = sum(s.nbytes for s in spans)
    with self.lock:
      self.free_at = max(time.perf_counter(), self.free_at) + n / (self.gbps * 1e9)
      land_at = self.free_at
    out = Transfer(peer.name, "rate-limited", 0, n)
    def land():
      time.sleep(max(0.0, land_at - time.perf_counter()))
      try:
        self.endpoint.write(peer, spans, notify).wait(60)
        out.finish()
      except Exception as e: out.finish(str(e))
    threading.Thread(target=land, name="bench-slow-link", daemon=True).start()
    return out

def say(msg: str): print(msg, file=sys.stderr, flush=True)

def figures(st) -> dict:
  tl = st.timeline
  return {"prefill_s": round(st.prefill_s, 5), "ttft_s": round(st.ttft_s, 5), "staging_waits": st.staging_waits, "kv_bytes": st.kv_bytes,
          "overlapped_layers": sum(1 for a, b in zip(tl, tl[1:]) if a.posted_s > b.computed_s)}

def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="tinyhet bench staging", description=__doc__.splitlines()[0])
  ap.add_argument("--json", action="store_true")
  ap.add_argument("--model", default=None, help="GGUF file or Hugging Face directory (default: the embedded SmolLM2-135M)")
  ap.add_argument("--device", default="CPU", help="tinygrad device the model runs on, unregistered memory (default CPU)")
  ap.add_argument("--prompt-tokens", type=int, default=512)
  ap.add_argument("--buffers", default="1,2,4", help="staging buffer counts to measure (default 1,2,4)")
  ap.add_argument("--link-gbps", type=float, default=0.5, help="rate of the slow link (default 0.5 GB/s)")
  ap.add_argument("--rounds", type=int, default=3)
  args = ap.parse_args(argv)
  buffers = [int(x) for x in args.buffers.split(",")]
  if args.rounds < 1 or args.prompt_tokens < 1 or args.link_gbps <= 0 or min(buffers) < 1:
    ap.error("--rounds, --prompt-tokens, --link-gbps and every buffer count must be positive")
  os.environ.setdefault("TINYHET_TOKEN", secrets.token_hex(16))
  sys.setswitchinterval(1e-3)
  from tinyhet.run import LocalDecodeNode
  child = LocalDecodeNode(argparse.Namespace(kv_memory="1G", model=args.model, quiet=True, float_weights=False))
  try: out = measure(args, buffers, child)
  finally: child.close()
  print(json.dumps(out) if args.json else table(out))
  return 0

def measure(args, buffers, child) -> dict:
  import tinyhet  # noqa: F401
  from tinyhet.bench.e2e import prompt_of
  from tinyhet.memory import local_node
  from tinyhet.prefill import DecodeClient, ttft_no_transfer
  from tinyhet.weights import load_model, model_name
  say(f"loading {model_name(args.model)} onto {args.device}")
  model, tok = load_model(args.model, device=args.device, quiet=True, packed=True)
  ids = prompt_of(tok, args.prompt_tokens)
  address = child.address()
  clients = {}
  for link in ("full", "slow"):
    for n in [0, *buffers]:
      c = DecodeClient(local_node(), address, model, model_name(args.model), "shm", staging_buffers=n)
      if link == "slow": c.endpoint = RateLimitedEndpoint(c.endpoint, args.link_gbps)
      clients[f"{'sync' if n == 0 else f'staged {n}'} / {link}"] = c
  try:
    say(f"{len(ids)}-token prompt: compiling")
    ttft_no_transfer(model, ids, next(iter(clients.values())).kv_dtype)
    next(iter(clients.values())).generate(ids, 1)
    paths = ["none", *clients]
    runs: dict[str, list] = {p: [] for p in paths}
    for r in range(args.rounds):
      order = paths[r % len(paths):] + paths[:r % len(paths)]
      say(f"round {r + 1}/{args.rounds}")
      for p in order:
        if p == "none": runs[p].append(ttft_no_transfer(model, ids, clients[paths[1]].kv_dtype))
        else: runs[p].append(clients[p].generate(ids, 1)[1])
  finally:
    for c in clients.values(): c.close()
  rows = [{"path": p, **figures(min(runs[p], key=lambda s: s.prefill_s))} for p in clients]
  return {"model": model_name(args.model), "device": args.device, "prompt_tokens": len(ids), "layers": model.cfg.n_layers,
          "link_gbps": args.link_gbps, "rounds": args.rounds, "no_transfer_s": round(min(runs["none"]), 5), "rows": rows}

def table(out: dict) -> str:
  lines = [f"{out['model']} on {out['device']} (unregistered memory), {out['prompt_tokens']}-token prompt, {out['layers']} layers; "
           f"best of {out['rounds']} rounds; slow link {out['link_gbps']} GB/s",
           f"prefill with no transfer: {out['no_transfer_s']:.3f} s",
           f"{'path':>16} {'prefill':>9} {'vs none':>8} {'TTFT':>9} {'waits':>6} {'overlapped':>11} {'KV MiB':>7}"]
  for r in out["rows"]:
    lines.append(f"{r['path']:>16} {r['prefill_s']:>8.3f}s {r['prefill_s'] - out['no_transfer_s']:>+7.3f}s {r['ttft_s']:>8.3f}s "
                 f"{r['staging_waits']:>6} {r['overlapped_layers']:>4}/{out['layers'] - 1:<6} {r['kv_bytes'] / 2**20:>7.2f}")
  lines.append("overlapped: layers whose copy and post ended after the prefill thread had started the next layer")
  return "\n".join(lines)

if __name__ == "__main__": sys.exit(main())
