"""tinyhet bench int8: the int8-activation mode's accuracy against the float path (the default) on the same GGUF, in one
process: per prompt, the relative error of the first logits (max |int8 - float| / max |float|; the prompt's own products take
the int8 kernels: past a few tokens the int8 tiled kernel, x per 32) and how many of N greedy tokens agree with the
float path's (the length of the common prefix, and the share of positions with the same token). Speed: `tinyhet bench
decode --engines tinyhet,tinyhet-int8,llama.cpp`."""
from __future__ import annotations
import argparse, json, os, sys
import numpy as np

PROMPTS = ("The capital of France is", "def fibonacci(n):", "Water boils at a temperature of", "Once upon a time, in a small village,",
           "The three primary colors are")

def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(prog="tinyhet bench int8", description=__doc__.split("\n\n")[0])
  ap.add_argument("--model", action="append", help="GGUF file (repeatable; default: the embedded SmolLM2 Q4_1)")
  ap.add_argument("--tokens", type=int, default=32)
  ap.add_argument("--json", action="store_true")
  args = ap.parse_args(argv)
  import tinyhet  # noqa: F401  (MESH)
  from tinygrad import Tensor, dtypes
  from tinyhet.device.cpu_threads import kernel_threads
  from tinyhet.model.llama import DenseKVCache
  from tinyhet.model.weights import embedded_model_path, load_model
  results = []
  for path in args.model or [str(embedded_model_path())]:
    model, tok = load_model(path, device="MESH", max_context=256, quiet=True, packed=True)
    for prompt in PROMPTS:
      ids, out = tok.encode(prompt, add_special=False), {}
      for mode in ("0", "1"):
        os.environ["TINYHET_INT8_ACTIVATIONS"] = mode
        cache = DenseKVCache(model.cfg, 1, len(ids) + 1, dtypes.float16, "MESH")
        with kernel_threads("MESH"):
          logits = model.forward(Tensor([ids], dtype=dtypes.int32, device="MESH"),
                                 Tensor([list(range(len(ids)))], dtype=dtypes.int32, device="MESH"), cache).numpy()[0]
        out[mode] = (logits, model.reference_generate(ids, args.tokens))
      (lf, tf), (li, ti) = out["0"], out["1"]
      prefix = next((i for i, (a, b) in enumerate(zip(tf, ti)) if a != b), min(len(tf), len(ti)))
      results.append({"model": os.path.basename(path), "prompt": prompt, "logit_rel_err": float(np.abs(li - lf).max() / np.abs(lf).max()),
                      "same_argmax": bool(lf.argmax() == li.argmax()), "common_prefix": prefix, "tokens": len(tf),
                      "same_share": float(np.mean([a == b for a, b in zip(tf, ti)]))})
      r = results[-1]
      if not args.json: print(f"{r['model']:36} {prompt[:30]:32} logit err {r['logit_rel_err']:.2e}  greedy: first {prefix}/{len(tf)} agree, "
                              f"{r['same_share']:.0%} of positions", flush=True)
  os.environ.pop("TINYHET_INT8_ACTIVATIONS")
  if args.json: print(json.dumps({"tokens": args.tokens, "rows": results}))
  return 0

if __name__ == "__main__": sys.exit(main())
