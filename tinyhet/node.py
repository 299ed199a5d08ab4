"""`tinyhet node --role decode`: a decode node process. It loads the model onto MESH, allocates the paged KV pool in
registered memory, listens, and prints one JSON line {"address", "node", "kv_blocks", ...} on stdout once it is ready.
Peers prove the shared token (TINYHET_TOKEN or the config file). Stop it with Ctrl-C or by closing its stdin (--stdin-stop).
"""
from __future__ import annotations
import argparse, json, signal, sys, threading

def parse_args(argv):
  ap = argparse.ArgumentParser(prog="tinyhet node", description=__doc__.splitlines()[0])
  ap.add_argument("--role", choices=["decode", "prefill"], required=True)
  ap.add_argument("--listen", default="127.0.0.1:7470", help="host:port to accept prefill nodes on (port 0: any free port)")
  ap.add_argument("--model", default=None, help="GGUF file or Hugging Face directory (default: the embedded SmolLM2-135M-Instruct)")
  ap.add_argument("--kv-memory", default="1G", help="KV pool size (all layers, K and V), e.g. 512M, 64G")
  ap.add_argument("--max-seqs", type=int, default=16, help="sequences decoded together at most")
  ap.add_argument("--max-context", type=int, default=None, help="cap the model's context (tokens) to bound memory")
  ap.add_argument("--float-weights", action="store_true", help="dequantize a GGUF's weights to float32 (default: keep its quantized "
                  "blocks and dequantize inside the matmul kernels, reading ~5x fewer bytes per token)")
  ap.add_argument("--stdin-stop", action="store_true", help="exit when stdin closes (for a parent process that owns this node)")
  ap.add_argument("--quiet", action="store_true")
  return ap.parse_args(argv)

def main(argv=None) -> int:
  args = parse_args(argv)
  if args.role == "prefill":
    print("tinyhet node: --role prefill is not built yet: standalone prefill nodes come with the cluster service (router, heartbeats, "
          "recovery; DESIGN.md point 6). `tinyhet run` prefills on HET in its own process.", file=sys.stderr)
    return 2
  from tinyhet.config import load_config, parse_bytes, ConfigError
  try:
    kv_bytes = parse_bytes(args.kv_memory, "--kv-memory")
    host, _, port = args.listen.rpartition(":")
    if not host or not port.isdigit(): raise ConfigError(f"--listen {args.listen!r} is not host:port")
  except ConfigError as e:
    print(f"tinyhet node: {e}", file=sys.stderr)
    return 2
  node, model, tok, model_id = start(args.model, kv_bytes, args.max_context, args.quiet, packed=not args.float_weights)
  from tinyhet.decode_node import DecodeNode, kv_blocks_for
  cfg = load_config()
  blocks = kv_blocks_for(model.cfg, cfg.kv_block_size, cfg.kv_dtype, kv_bytes)
  decode = DecodeNode(model, node, blocks, cfg.kv_block_size, cfg.kv_dtype, args.max_seqs, model_id, tok.stop_ids)
  address = node.serve(host, int(port))
  # capture the decode step before saying ready: a client's first request (and its TTFT) must not share the CPU with it
  decode.warm_up()
  print(json.dumps({"address": address, "node": node.name, "model": model_id, "kv_blocks": blocks, "block_size": cfg.kv_block_size,
                    "transports": node.endpoint.transports}), flush=True)
  stop = threading.Event()
  signal.signal(signal.SIGTERM, lambda *_: stop.set())
  if args.stdin_stop: threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
  try: decode.run(stop, warm_up=False)
  except KeyboardInterrupt: pass
  decode.close()
  node.endpoint.close()
  return 0

def start(model_path, kv_bytes: int, max_context: int | None, quiet: bool, packed: bool = True):
  """Size MESH's arena for the weights, the KV pool and activations, then load the model onto MESH."""
  import tinyhet  # noqa: F401  (HET and MESH)
  from tinyhet.config import load_config
  from tinyhet.memory import LocalNode
  import tinyhet.memory as memory
  from tinyhet.weights import load_model, model_nbytes, model_name
  need = model_nbytes(model_path, packed) + kv_bytes + (1 << 30)
  cfg = load_config()
  memory._node = node = LocalNode(load_config(arena_bytes=max(cfg.arena_bytes, need)))
  model, tok = load_model(model_path, device="MESH", max_context=max_context, quiet=quiet, packed=packed)
  return node, model, tok, model_name(model_path)

if __name__ == "__main__": sys.exit(main(sys.argv[1:]))
