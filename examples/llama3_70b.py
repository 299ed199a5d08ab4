"""Llama-3 / 3.1 70B runner: the real 70B shapes on any machine.

  python examples/llama3_70b.py --random-weights --layers 2          # 70B-shaped random weights, first 2 of 80 layers
  python examples/llama3_70b.py --model Meta-Llama-3-70B-Instruct-Q4_0.gguf --layers 4
  python examples/llama3_70b.py --model ./Meta-Llama-3.1-70B-Instruct/   # a Hugging Face directory (safetensors shards)

Prints the KV bytes per token (2 * layers * kv_heads * head_dim * bytes: 320 KiB in float16 for all 80 layers), the KV size
for the requested context and batch, where prefill and decode run, then runs a prefill and a few decode steps with timing.
--layers N keeps the first N layers (of a checkpoint, only those are read); random weights are generated on the device.
"""
from __future__ import annotations
import argparse, dataclasses, json, sys, time

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
  ap.add_argument("--prefill-device", default="CPU", help="tinygrad device for prefill (default CPU)")
  ap.add_argument("--decode-device", default="CPU", help="tinygrad device for decode (default CPU)")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--json", action="store_true", help="print one JSON object at the end")
  return ap.parse_args(argv)

def build_model(args):
  """(Llama, Tokenizer or None): loaded from a checkpoint, or random weights of the preset's shapes."""
  from tinygrad import dtypes
  from tinyhet.model import PRESETS, Llama, random_weights
  from tinyhet.packed import Q4_0, Q8_0
  if args.model:
    from tinyhet.weights import load_model
    return load_model(args.model, args.prefill_device, n_layers=args.layers, max_context=args.context, packed=True)
  cfg = dataclasses.replace(PRESETS[args.preset], n_layers=args.layers or 2, max_context=args.context)
  form = args.weights
  print(f"tinyhet: generating {cfg.name}-shaped random weights ({cfg.n_layers} layers, {form}) on {args.prefill_device}", file=sys.stderr)
  t0 = time.perf_counter()
  w = random_weights(cfg, args.prefill_device, dtype=getattr(dtypes, form, dtypes.float32), seed=args.seed,
                     packed={"q4_0": Q4_0, "q8_0": Q8_0}.get(form))
  print(f"tinyhet: {w.nbytes() / 1e9:.2f} GB of weights in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
  return Llama(cfg, w), None

def checkpoint_layers(path: str) -> int:
  """How many layers the whole checkpoint has (--layers may keep fewer)."""
  import pathlib
  from tinyhet.weights import gguf_config, hf_config, read_gguf
  return (hf_config(pathlib.Path(path)) if pathlib.Path(path).is_dir() else gguf_config(read_gguf(path))).n_layers

def run_prefill_decode(model, prompt_ids: list[int], n_decode: int, kv_dtype) -> dict:
  """Prefill the prompt and decode n_decode tokens (greedy). This is the one call the disaggregated engine replaces; here it
  is the single-device reference path (DenseKVCache, a TinyJit decode step). Returns the tokens and the time of each step."""
  marks, t0 = [], time.perf_counter()
  tokens = model.reference_generate(prompt_ids, n_decode + 1, kv_dtype=kv_dtype, on_token=lambda _: marks.append(time.perf_counter()))
  steps = [b - a for a, b in zip(marks, marks[1:])]
  return {"tokens": tokens, "prefill_s": marks[0] - t0, "decode_step_s": steps}

def kib(n: float) -> str: return f"{n / 1024:.0f} KiB"
def gib(n: float) -> str: return f"{n / 2**30:.2f} GiB"

def main(argv: list[str] | None = None) -> int:
  args = parse_args(sys.argv[1:] if argv is None else argv)
  from tinygrad import dtypes
  from tinyhet.model import PRESETS
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
            "prefill_device": args.prefill_device, "decode_device": args.decode_device, "weight_bytes": model.w.nbytes()}
  print(f"{cfg.name}: {cfg.n_layers} of {full_layers} layers, dim {cfg.dim}, {cfg.n_heads} heads, {cfg.n_kv_heads} KV heads, "
        f"head_dim {cfg.head_dim}, FFN {cfg.hidden_dim}, vocab {cfg.vocab_size}; {gib(model.w.nbytes())} of weights here")
  print(f"KV per token ({args.kv_dtype}): {kib(per_layer * full_layers)} for all {full_layers} layers "
        f"(2 x {full_layers} x {cfg.n_kv_heads} x {cfg.head_dim} x {kv_dtype.itemsize} B), "
        f"{kib(per_layer * cfg.n_layers)} for the {cfg.n_layers} kept")
  print(f"KV for context {args.context} x batch {args.batch}: {gib(report['kv_bytes_for_context_and_batch'])} for all layers, "
        f"{gib(per_layer * cfg.n_layers * args.context * args.batch)} for the kept ones")
  print(f"prefill runs on {args.prefill_device}, decode on {args.decode_device}"
        + (" (the reference path: one device does both)" if args.prefill_device == args.decode_device else ""))
  import numpy as np
  prompt = (tok.encode_prompt("Explain in one paragraph why the sky is blue.") if tok else
            [int(i) for i in np.random.default_rng(args.seed).integers(0, cfg.vocab_size, args.prompt_tokens)])
  res = run_prefill_decode(model, prompt, args.decode_tokens, kv_dtype)
  steps = res["decode_step_s"]
  report |= {"prompt_tokens": len(prompt), **res}
  print(f"prefill of {len(prompt)} tokens: {res['prefill_s']:.2f} s ({len(prompt) / res['prefill_s']:.1f} tok/s)")
  if steps: print(f"decode steps: {' '.join(f'{s:.2f}' for s in steps)} s (the first two capture the TinyJit step); "
                  f"last {steps[-1]:.3f} s = {1 / steps[-1]:.2f} tok/s for {cfg.n_layers} layers")
  if tok: print(f"text: {tok.decode(res['tokens'])!r}")
  if args.json: print(json.dumps(report))
  return 0

if __name__ == "__main__": sys.exit(main())
