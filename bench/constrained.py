"""`tinyhet bench serve --constrained`: what structured outputs cost a serving batch, in one run, on one `--role both` node
behind a router (tinyhet.engine.grammar computes each constrained row's token mask on the node while its step runs).

  decode   a batch of `--batch` (16) streamed completions decoding together, all unconstrained, against the same batch with
           half of them under a JSON schema (guided_json) that their `--max-tokens` cannot finish, so every row decodes
           the whole way: output tokens/s over the window in which every row of the batch is decoding (the last first token
           to the first finish). Target: constrained >= 0.9x unconstrained.
  ttft     time to first token of one request with the schema against one without, each the median of `--ttft-reps` (alternating),
           after the schema's first compile (a warm-up round compiles it; the node caches it per schema). Target <= 1.1x.
Each configuration first runs a warm-up round (tinygrad captures the decode step per batch bucket; the grammar compiles).
"""
from __future__ import annotations
import threading
import numpy as np

# a JSON schema no short reply completes: a long list of strings
SCHEMA = {"type": "object", "properties": {"notes": {"type": "array", "items": {"type": "string", "maxLength": 40}, "minItems": 200}},
          "required": ["notes"], "additionalProperties": False}

def batch_round(address: str, model: str, batch: int, constrained: int, prompt_tokens: int, max_tokens: int, salt: int, bias: dict) -> dict:
  """`batch` streamed completions at once, the first `constrained` of them under SCHEMA: the batch's decode rate. bias: the
  logit_bias that keeps every row from its end-of-reply tokens, so that all decode max_tokens."""
  from tinyhet.bench.serve import prompt_ids, stream_one
  results: list = [None] * batch
  def one(i: int):
    body = {"model": model, "prompt": prompt_ids(salt, i, prompt_tokens), "max_tokens": max_tokens, "temperature": 0,
            **({"logit_bias": bias} if bias else {}), **({"guided_json": SCHEMA} if i < constrained else {})}
    results[i] = stream_one(address, body)
  threads = [threading.Thread(target=one, args=(i,)) for i in range(batch)]
  for t in threads: t.start()
  for t in threads: t.join()
  marks = [m for _, m in results]
  if any(len(m) < 2 for m in marks): raise RuntimeError("a request of the batch produced fewer than 2 tokens")
  start, end = max(m[0] for m in marks), min(m[-1] for m in marks)      # every row decoding: after the last first token, before the first finish
  inside = sum(int(np.count_nonzero((np.array(m) > start) & (np.array(m) <= end))) for m in marks)
  return {"batch": batch, "constrained": constrained, "tokens": sum(len(m) for m in marks), "window_s": end - start,
          "decode_tok_s": inside / (end - start) if end > start else 0.0,
          "window_share": (end - start) / (max(m[-1] for m in marks) - min(m[0] for m in marks))}     # small: raise --max-tokens

def ttft(address: str, model: str, prompt_tokens: int, reps: int, salt: int) -> tuple[float, float]:
  """Median time to first token (without the schema, with it), the two kinds of request alternating so drift hits both alike."""
  from tinyhet.bench.serve import prompt_ids, stream_one
  out: dict = {False: [], True: []}
  for i in range(reps):
    for schema in (False, True):
      t0, marks = stream_one(address, {"model": model, "prompt": prompt_ids(salt + schema, i, prompt_tokens), "max_tokens": 2, "temperature": 0,
                                       **({"guided_json": SCHEMA} if schema else {})})
      out[schema].append(marks[0] - t0)
  return float(np.median(out[False])), float(np.median(out[True]))

def run(args) -> dict:
  from tinyhet.bench.serve import Proc, wait_ready
  from tinyhet.model import spec
  bias = {str(t): -100 for t in spec.load_tokenizer(args.model).stop_ids}
  model_flag = ["--model", args.model] if args.model else []
  procs = [Proc("node", "--role", "both", "--listen", "127.0.0.1:0", "--quiet", "--kv-memory", args.kv_memory, "--max-seqs", str(args.batch),
                *model_flag)]
  try:
    procs.append(Proc("serve", "--listen", "127.0.0.1:0", "--both", procs[0].info["address"], *model_flag, "--max-queue", "1024"))
    address, model = procs[1].info["address"], procs[1].info["model"]
    wait_ready(address)
    half = args.batch // 2
    for c in (0, half): batch_round(address, model, args.batch, c, args.prompt_tokens, args.max_tokens, 9000 + c, bias)     # warm-up
    free = batch_round(address, model, args.batch, 0, args.prompt_tokens, args.max_tokens, 1, bias)
    mixed = batch_round(address, model, args.batch, half, args.prompt_tokens, args.max_tokens, 2, bias)
    ttft_free, ttft_schema = ttft(address, model, args.prompt_tokens, args.ttft_reps, salt=3)
  finally:
    for p in procs[::-1]: p.stop()
  return {"model": model, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "unconstrained": free, "half_constrained": mixed,
          "decode_ratio": mixed["decode_tok_s"] / free["decode_tok_s"] if free["decode_tok_s"] else 0.0,
          "ttft_s": ttft_free, "ttft_schema_s": ttft_schema, "ttft_ratio": ttft_schema / ttft_free if ttft_free else 0.0}

def table(out: dict) -> str:
  f, m = out["unconstrained"], out["half_constrained"]
  warn = [f"the all-decoding window is {min(f['window_share'], m['window_share']):.0%} of the run: raise --max-tokens"] if min(
    f["window_share"], m["window_share"]) < 0.3 else []
  return "\n".join([f"model {out['model']}, {out['prompt_tokens']}-token prompts, {out['max_tokens']} new tokens, greedy; one --role both node",
                    f"decode, batch {f['batch']}: unconstrained {f['decode_tok_s']:.1f} tok/s, {m['constrained']} under a JSON schema "
                    f"{m['decode_tok_s']:.1f} tok/s: {out['decode_ratio']:.2f}x (target >= 0.9x)",
                    f"TTFT: {out['ttft_s'] * 1e3:.1f} ms, with the schema {out['ttft_schema_s'] * 1e3:.1f} ms: {out['ttft_ratio']:.2f}x "
                    "(target <= 1.1x)", *warn])
