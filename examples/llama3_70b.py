"""Llama-3 / 3.1 70B runner: the real 70B shapes on any machine.

  python examples/llama3_70b.py --random-weights --layers 2          # 70B-shaped random weights, first 2 of 80 layers
  python examples/llama3_70b.py --model Meta-Llama-3-70B-Instruct-Q4_0.gguf --layers 4
  python examples/llama3_70b.py --model ./Meta-Llama-3.1-70B-Instruct/   # a Hugging Face directory (safetensors shards)

Prints the KV bytes per token (2 * layers * kv_heads * head_dim * bytes: 320 KiB in float16 for all 80 layers), the KV size
for the requested context and batch, where prefill and decode run, then runs a prefill and a few decode steps with timing:
disaggregated by default (prefill on HET here, the KV streamed layer by layer to a decode node on MESH — started here as a
second process of this script with --role decode, or --decode-node HOST:PORT), or --single-device (HET does both).
--layers N keeps the first N layers (of a checkpoint, only those are read); random weights are generated on the device,
the same on both nodes for the same --seed.
"""
from __future__ import annotations
import argparse, dataclasses, json, os, secrets, subprocess, sys, threading, time

def parse_args(argv):
  ap = argparse.ArgumentParser(prog="llama3_70b.py", description=__doc__.split("\n\n")[0])
  src = ap.add_mutually_exclusive_group(required=True)
  src.add_argument("--model", help="GGUF file or Hugging Face directory of a Llama-3/3.1 70B checkpoint")
  src.add_argument("--random-weights", action="store_true", help="70B-shaped random weights (no checkpoint needed)")
  ap.add_argument("--preset", choices=["Llama-3-70B", "Llama-3.1-70B", "Llama-3-8B", "Llama-3.1-8B"], default="Llama-3.1-70B",
                  help="shapes for --random-weights (default Llama-3.1-70B: 80 layers, dim 8192, 64 heads, 8 KV heads)")
  ap.add_argument("--layers", type=int, help="keep the first N layers (default: 2 with --random-weights, all of a checkpoint)")
  ap.add_argument("--weights", choices=["q4_0", "q8_0", "float16", "float32"], default="q4_0",
                  help="form of the random weights: GGUF blocks read directly by the kernels, or floats (default q4_0)")
  ap.add_argument("--context", type=int, default=8192, help="context length to size the KV cache for (default 8192)")
  ap.add_argument("--batch", type=int, default=1, help="sequences to size the KV cache for (default 1)")
  ap.add_argument("--kv-dtype", choices=["float16", "bfloat16", "float32"], default="float16")
  ap.add_argument("--prompt-tokens", type=int, default=32, help="prompt length of the timed prefill (default 32)")
  ap.add_argument("--decode-tokens", type=int, default=4, help="decode steps after it (default 4)")
  ap.add_argument("--single-device", action="store_true", help="the reference path: HET prefills and decodes, nothing is transferred")
  ap.add_argument("--decode-node", metavar="HOST:PORT", help="a running decode node of this script (--role decode) to decode on")
  ap.add_argument("--role", choices=["run", "decode"], default="run", help="decode: serve as the decode node (MESH) and print its address")
  ap.add_argument("--listen", default="127.0.0.1:0", help="with --role decode: where to accept the prefill node")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--json", action="store_true", help="print one JSON object at the end")
  return ap.parse_args(argv)

def weights_nbytes(args) -> int:
  """Bytes the weights take on a device, before loading them: for sizing the registered arena that holds them."""
  from tinyhet.model.llama import PRESETS
  from tinyhet.model.weights import model_nbytes
  if args.model: return model_nbytes(args.model, packed=True)
  cfg = dataclasses.replace(PRESETS[args.preset], n_layers=args.layers or 2)
  return int(cfg.n_params() * {"q4_0": 18 / 32, "q8_0": 34 / 32, "float16": 2, "float32": 4}[args.weights])

def model_id(args) -> str:
  return args.model or f"random:{args.preset}:{args.layers or 2}:{args.weights}:{args.seed}"

def size_arena(args, kv_bytes: int = 0):
  """HET and MESH allocate from a registered arena: make this process's big enough for the weights, the KV and activations
  (a prompt's matmuls dequantize one packed matrix at a time: up to ~4 GiB for 70B's output projection). Only the pages
  touched are memory: the rest of the arena is address space."""
  os.environ["TINYHET_ARENA_BYTES"] = str(weights_nbytes(args) + kv_bytes + (8 << 30))

def build_model(args, device: str = "HET"):
  """(Llama, Tokenizer or None): loaded from a checkpoint, or random weights of the preset's shapes."""
  from tinygrad import dtypes
  from tinyhet.model.llama import PRESETS, Llama, random_weights
  from tinyhet.model.packed import Q4_0, Q8_0
  if args.model:
    from tinyhet.model.weights import load_model
    return load_model(args.model, device, n_layers=args.layers, max_context=args.context, packed=True)
  cfg = dataclasses.replace(PRESETS[args.preset], n_layers=args.layers or 2, max_context=args.context)
  form = args.weights
  print(f"tinyhet: generating {cfg.name}-shaped random weights ({cfg.n_layers} layers, {form}) on {device}", file=sys.stderr)
  t0 = time.perf_counter()
  w = random_weights(cfg, device, dtype=getattr(dtypes, form, dtypes.float32), seed=args.seed, packed={"q4_0": Q4_0, "q8_0": Q8_0}.get(form))
  print(f"tinyhet: {w.nbytes() / 1e9:.2f} GB of weights in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
  return Llama(cfg, w, device), None

def checkpoint_layers(path: str) -> int:
  """How many layers the whole checkpoint has (--layers may keep fewer)."""
  import pathlib
  from tinyhet.model.weights import gguf_config, hf_config, read_gguf
  return (hf_config(pathlib.Path(path)) if pathlib.Path(path).is_dir() else gguf_config(read_gguf(path))).n_layers

def run_prefill_decode(model, prompt_ids: list[int], n_decode: int, kv_dtype) -> dict:
  """The single-device reference path: prefill the prompt and decode n_decode tokens (greedy) on HET with a DenseKVCache and
  a TinyJit decode step. Returns the tokens and the time of each step."""
  marks, t0 = [], time.perf_counter()
  tokens = model.reference_generate(prompt_ids, n_decode + 1, kv_dtype=kv_dtype, on_token=lambda _: marks.append(time.perf_counter()))
  steps = [b - a for a, b in zip(marks, marks[1:])]
  return {"tokens": tokens, "prefill_s": marks[0] - t0, "decode_step_s": steps}

def run_disaggregated(model, prompt_ids: list[int], n_decode: int, address: str, args) -> dict:
  """Prefill on HET, each layer's K, V written into the decode node's blocks as soon as it exists; decode there."""
  from tinyhet.device.memory import local_node
  from tinyhet.engine.client import DecodeClient
  client = DecodeClient(local_node(), address, model, model_id(args))
  marks: list[float] = []
  tokens, st = client.generate(prompt_ids, n_decode + 1, on_token=lambda _: marks.append(time.perf_counter()))
  client.close()
  return {"tokens": tokens, "prefill_s": st.prefill_s, "ttft_s": st.ttft_s, "decode_step_s": [b - a for a, b in zip(marks, marks[1:])],
          "kv_bytes_moved": st.kv_bytes, "transfer_gbps": st.transfer_gbps, "kv_tail_s": st.kv_tail_s, "transport": st.transport}

def kv_pool_bytes(cfg, args, kv_dtype) -> int:
  return cfg.kv_bytes_per_token(kv_dtype) * args.context * args.batch

def serve_decode(args) -> int:
  """--role decode: this script as the decode node, with the same model on MESH."""
  from tinygrad import dtypes
  from tinyhet.engine.decode_node import DecodeNode
  from tinyhet.kv.paged_cache import kv_blocks_for
  from tinyhet.device.memory import local_node
  from tinyhet.model.llama import PRESETS
  cfg0 = dataclasses.replace(PRESETS[args.preset], n_layers=args.layers or 2) if args.random_weights else None
  size_arena(args, kv_pool_bytes(cfg0, args, getattr(dtypes, args.kv_dtype)) if cfg0 else 8 << 30)
  model, _ = build_model(args, "MESH")
  kv_bytes = kv_pool_bytes(model.cfg, args, getattr(dtypes, args.kv_dtype))
  node = local_node()
  decode = DecodeNode(model, node, kv_blocks_for(model.cfg, node.config.kv_block_size, args.kv_dtype, kv_bytes), node.config.kv_block_size,
                      args.kv_dtype, max_num_seqs=max(1, args.batch), model_id=model_id(args))
  host, _, port = args.listen.rpartition(":")
  print(json.dumps({"address": node.serve(host, int(port))}), flush=True)
  stop = threading.Event()
  threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
  decode.run(stop)
  return 0

def start_decode_node(argv: list[str]) -> tuple[subprocess.Popen, str]:
  """This script again, as the decode node (another process: its memory is MESH, ours is HET)."""
  proc = subprocess.Popen([sys.executable, __file__, *argv, "--role", "decode"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                          env={**os.environ, "TINYHET_NODE": "decode-70b"})
  line = proc.stdout.readline()
  if not line: raise RuntimeError(f"the decode node exited ({proc.wait()}) before it was ready")
  return proc, json.loads(line)["address"]

def kib(n: float) -> str: return f"{n / 1024:.0f} KiB"
def gib(n: float) -> str: return f"{n / 2**30:.2f} GiB"

def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  args = parse_args(argv)
  os.environ.setdefault("TINYHET_TOKEN", secrets.token_hex(16))     # shared with the decode node started here
  if args.role == "decode": return serve_decode(args)
  size_arena(args)
  decode = None if args.single_device or args.decode_node else start_decode_node(argv)   # it loads while we do
  try: return run(args, decode[1] if decode else args.decode_node)
  finally:
    if decode:
      decode[0].stdin.close()
      decode[0].wait(60)

def run(args, address: str | None) -> int:
  from tinygrad import dtypes
  from tinyhet.model.llama import PRESETS
  kv_dtype = getattr(dtypes, args.kv_dtype)
  if args.random_weights and args.prompt_tokens + args.decode_tokens + 1 > args.context:
    print(f"--context {args.context} is shorter than --prompt-tokens + --decode-tokens", file=sys.stderr)
    return 2
  model, tok = build_model(args)
  cfg = model.cfg
  full_layers = PRESETS[args.preset].n_layers if args.random_weights else checkpoint_layers(args.model)
  per_layer = cfg.kv_bytes_per_token(kv_dtype) // cfg.n_layers
  report = {"model": cfg.name, "layers": cfg.n_layers, "of_layers": full_layers, "kv_dtype": args.kv_dtype,
            "kv_bytes_per_token_all_layers": per_layer * full_layers, "kv_bytes_per_token_kept_layers": per_layer * cfg.n_layers,
            "context": args.context, "batch": args.batch, "kv_bytes_for_context_and_batch": per_layer * full_layers * args.context * args.batch,
            "prefill_device": "HET", "decode_device": "HET" if args.single_device else "MESH (decode node)", "weight_bytes": model.w.nbytes()}
  print(f"{cfg.name}: {cfg.n_layers} of {full_layers} layers, dim {cfg.dim}, {cfg.n_heads} heads, {cfg.n_kv_heads} KV heads, "
        f"head_dim {cfg.head_dim}, FFN {cfg.hidden_dim}, vocab {cfg.vocab_size}; {gib(model.w.nbytes())} of weights here")
  print(f"KV per token ({args.kv_dtype}): {kib(per_layer * full_layers)} for all {full_layers} layers "
        f"(2 x {full_layers} x {cfg.n_kv_heads} x {cfg.head_dim} x {kv_dtype.itemsize} B), "
        f"{kib(per_layer * cfg.n_layers)} for the {cfg.n_layers} kept")
  print(f"KV for context {args.context} x batch {args.batch}: {gib(report['kv_bytes_for_context_and_batch'])} for all layers, "
        f"{gib(per_layer * cfg.n_layers * args.context * args.batch)} for the kept ones")
  print(f"prefill runs on {report['prefill_device']}, decode on {report['decode_device']}"
        + (" (the reference path: one device does both)" if args.single_device else f" at {address}, KV streamed layer by layer"))
  import numpy as np
  prompt = (tok.encode_prompt("Explain in one paragraph why the sky is blue.") if tok else
            [int(i) for i in np.random.default_rng(args.seed).integers(0, cfg.vocab_size, args.prompt_tokens)])
  res = run_prefill_decode(model, prompt, args.decode_tokens, kv_dtype) if args.single_device else \
        run_disaggregated(model, prompt, args.decode_tokens, address, args)
  steps = res["decode_step_s"]
  report |= {"prompt_tokens": len(prompt), **res}
  print(f"prefill of {len(prompt)} tokens: {res['prefill_s']:.2f} s ({len(prompt) / res['prefill_s']:.1f} tok/s)")
  if "kv_tail_s" in res: print(f"KV moved: {res['kv_bytes_moved'] / 2**20:.1f} MiB over {res['transport']}, {res['transfer_gbps']:.2f} GB/s "
                              f"while moving, last layer landed {res['kv_tail_s']:.3f} s after prefill; TTFT {res['ttft_s']:.2f} s")
  if steps: print(f"decode steps: {' '.join(f'{s:.2f}' for s in steps)} s; last {steps[-1]:.3f} s = {1 / steps[-1]:.2f} tok/s "
                  f"for {cfg.n_layers} layers")
  if tok: print(f"text: {tok.decode(res['tokens'])!r}")
  if args.json: print(json.dumps(report))
  return 0

if __name__ == "__main__": sys.exit(main())
