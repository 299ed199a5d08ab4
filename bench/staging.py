"""`tinyhet bench staging`: layers leaving device memory no transport sends from (HET on a GPU without GPUDirect), with
and without the asynchronous staging buffers (tinyhet.device.gpu_staging), in one run.

The "device" is tinygrad's own CPU device (--device; CUDA on a GPU machine): its memory is not registered, so each packed
layer must be copied to registered host memory before a transport can send it, as from a GPU. The model is by default a
small random Llama whose layers compute in milliseconds on a CPU (8 layers, dim 256, 8 KV heads of 32: 1 KiB of KV per
token and layer), so that what a layer's copy costs is not lost in the CPU's compute as it would be on a real model here;
--model takes a GGUF or Hugging Face directory ("smollm2": the embedded one) instead. Paths, alternating in a
rotating order for --rounds rounds, best of each kept:
  none         the same padded prefill with no transfer (the floor)
  sync         the copy on the prefill thread, then the write posted by the writer thread (tinyhet before staging)
  staged N     N staging buffers: the writer thread copies and posts, the prefill thread waits only when all N are in flight
each over the shm link at full speed and behind a rate-limited link (--link-gbps: every write lands no sooner than its
bytes take at that rate after the previous one; the real write then reads the staging buffer, late, as a slow DMA would).
Figures: prefill time (start to the first token sampled), TTFT (until every layer landed), the prefill thread's time
per layer handing the layer off (pack, then copy or stage, queue), its waits for a staging buffer, and overlap: layers
whose copy-and-post on the writer thread ended after the prefill thread had started the next layer (0 on the synchronous
path, by construction: that is what it costs).
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

RANDOM = dict(n_layers=8, dim=256, n_heads=8, n_kv_heads=8, hidden_dim=512, vocab_size=512)

def random_model(device: str, max_context: int):
  from tinyhet.model.llama import Llama, random_weights, small_config
  cfg = small_config(**RANDOM, max_context=max_context, name="bench-random")
  return Llama(cfg, random_weights(cfg, device=device, seed=5), device)

class RandomDecodeNode:
  """A decode node process serving random_model (the same weights: tinygrad's RNG with the same seed)."""
  CODE = ("import json, sys, threading, tinyhet\nfrom tinyhet.bench.staging import random_model\nfrom tinyhet.engine.decode_node import DecodeNode\n"
          "from tinyhet.device.memory import local_node\nnode = local_node()\n"
          "decode = DecodeNode(random_model('MESH', {ctx}), node, kv_blocks={blocks}, block_size=16, max_num_seqs=2, model_id='bench-random')\n"
          "print(json.dumps({{'address': node.serve()}}), flush=True)\nstop = threading.Event()\n"
          "threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()\ndecode.run(stop)\n")

  def __init__(self, prompt_tokens: int):
    import subprocess
    ctx = prompt_tokens + 64
    self.proc = subprocess.Popen([sys.executable, "-c", self.CODE.format(ctx=ctx, blocks=4 * (ctx // 16 + 2))], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True, env={**os.environ, "TINYHET_NODE": "bench-decode", "TINYHET_ARENA_BYTES": "1G"})
    line = self.proc.stdout.readline()
    if not line: raise RuntimeError(f"the decode node did not start (exit status {self.proc.wait()})")
    self._address = json.loads(line)["address"]

  def address(self) -> str: return self._address

  def close(self):
    self.proc.stdin.close()
    try: self.proc.wait(30)
    except Exception: self.proc.kill()

def figures(st) -> dict:
  tl = st.timeline
  return {"prefill_s": round(st.prefill_s, 5), "ttft_s": round(st.ttft_s, 5), "staging_waits": st.staging_waits, "kv_bytes": st.kv_bytes,
          "handoff_ms_per_layer": round(1e3 * st.handoff_s / len(tl), 3),
          "overlapped_layers": sum(1 for a, b in zip(tl, tl[1:]) if a.posted_s > b.computed_s)}

def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="tinyhet bench staging", description=__doc__.splitlines()[0])
  ap.add_argument("--json", action="store_true")
  ap.add_argument("--model", default=None, help="GGUF file or Hugging Face directory, smollm2 for the embedded one (default: a small random Llama)")
  ap.add_argument("--device", default="CPU", help="tinygrad device the model runs on, unregistered memory (default CPU)")
  ap.add_argument("--prompt-tokens", type=int, default=512)
  ap.add_argument("--buffers", default="1,2,4", help="staging buffer counts to measure (default 1,2,4)")
  ap.add_argument("--link-gbps", type=float, default=0.003, help="rate of the slow link (default 0.003 GB/s: a layer of the random model "
                  "takes longer to send than to compute)")
  ap.add_argument("--rounds", type=int, default=5)
  args = ap.parse_args(argv)
  buffers = [int(x) for x in args.buffers.split(",")]
  if args.rounds < 1 or args.prompt_tokens < 1 or args.link_gbps <= 0 or min(buffers) < 1:
    ap.error("--rounds, --prompt-tokens, --link-gbps and every buffer count must be positive")
  os.environ.setdefault("TINYHET_TOKEN", secrets.token_hex(16))
  sys.setswitchinterval(1e-3)
  if args.model is None: child = RandomDecodeNode(args.prompt_tokens)
  else:
    from tinyhet.cli.run import LocalDecodeNode
    path = None if args.model == "smollm2" else args.model
    child = LocalDecodeNode(argparse.Namespace(kv_memory="1G", model=path, quiet=True, float_weights=False))
  try: out = measure(args, buffers, child)
  finally: child.close()
  print(json.dumps(out) if args.json else table(out))
  return 0

def measure(args, buffers, child) -> dict:
  import tinyhet  # noqa: F401
  from tinyhet.bench.prompts import filler_ids
  from tinyhet.device.memory import local_node
  from tinyhet.engine.client import DecodeClient
  from tinyhet.engine.prefill import ttft_no_transfer
  from tinyhet.device.gpu_staging import pinned_buffers
  from tinyhet.model.weights import load_model, model_name
  import numpy as np
  if args.model is None:
    name = "random Llama (8 layers, dim 256, 8 KV heads)"
    model, model_id = random_model(args.device, args.prompt_tokens + 64), "bench-random"
    ids = [int(x) for x in np.random.default_rng(0).integers(0, RANDOM["vocab_size"], args.prompt_tokens)]
  else:
    path = None if args.model == "smollm2" else args.model
    name = model_id = model_name(path)
    say(f"loading {name} onto {args.device}")
    model, tok = load_model(path, device=args.device, quiet=True, packed=True)
    ids = filler_ids(tok, args.prompt_tokens)
  address = child.address()
  clients = {}
  for link in ("full", "slow"):
    for n in [0, *buffers]:
      c = DecodeClient(local_node(), address, model, model_id, "shm", staging_buffers=n)
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
    pinned = pinned_buffers()            # staging buffers a CUDA driver page-locked (0 on other devices), before close() unpins them
  finally:
    for c in clients.values(): c.close()
  rows = [{"path": p, **figures(min(runs[p], key=lambda s: s.prefill_s))} for p in clients]
  return {"model": name, "device": args.device, "prompt_tokens": len(ids), "layers": model.cfg.n_layers,
          "link_gbps": args.link_gbps, "rounds": args.rounds, "pinned_buffers": pinned, "no_transfer_s": round(min(runs["none"]), 5), "rows": rows}

def table(out: dict) -> str:
  lines = [f"{out['model']} on {out['device']} (unregistered memory), {out['prompt_tokens']}-token prompt, {out['layers']} layers; "
           f"best of {out['rounds']} rounds; slow link {out['link_gbps']} GB/s",
           f"prefill with no transfer: {out['no_transfer_s']:.3f} s",
           f"{'path':>16} {'prefill':>9} {'vs none':>8} {'TTFT':>9} {'hand-off ms':>12} {'waits':>6} {'overlapped':>11} {'KV MiB':>7}"]
  for r in out["rows"]:
    lines.append(f"{r['path']:>16} {r['prefill_s']:>8.3f}s {r['prefill_s'] - out['no_transfer_s']:>+7.3f}s {r['ttft_s']:>8.3f}s "
                 f"{r['handoff_ms_per_layer']:>12.2f} {r['staging_waits']:>6} {r['overlapped_layers']:>4}/{out['layers'] - 1:<6} "
                 f"{r['kv_bytes'] / 2**20:>7.2f}")
  lines += ["hand-off ms: per layer, the prefill thread's time from K, V computed to the next layer (pack, copy or stage, queue)",
            "overlapped: layers whose copy and post ended after the prefill thread had started the next layer"]
  return "\n".join(lines)

if __name__ == "__main__": sys.exit(main())
