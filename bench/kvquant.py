"""tinyhet bench kvquant: the KV cache's dtypes (kernels/kv_quant.py) against float16 KV on the embedded SmolLM2, in one
process, through `tinyhet run --no-disagg`'s engine (paged pool, the CPU C kernels reading the blocks as they are): greedy
tokens equal out of N at each context (bench/prompts.py filler), the prefill's last-position logit max abs error, the
perplexity of a fixed text (docs/*.md in name order, the first --ppl-tokens tokens), tokens held per GiB of pool, wire bytes
per prompt token (whole blocks of every layer, as the prefill node sends them), and at the longest context the prefill time
(the fastest of --rounds runs after the first, which compiles; it includes packing each layer's K, V into the pool's
format, the quantization) and aggregate decode tok/s at each of --batches (the fastest of --rounds windows).

The batches decode with the decode node's step (engine/decode_engine.py) over B sequences at that context, each holding its
own copy of the prompt's KV (the prefill's blocks copied byte for byte, so every row reads its own memory, as unrelated
requests do); timed over --rounds windows of --tokens steps each after the step's capture (3 steps). Every figure has its
ratio to the first dtype's (float16) at the same batch. One sample of a 9 s prefill or a 32-step window moved by 10-15%
between runs on a 2-core VM, more than the dtypes differ by: hence the fastest of several."""
from __future__ import annotations
import argparse, gc, json, math, pathlib, sys, time

DTYPES = ("float16", "q8_0", "fp8_e4m3", "fp8_e5m2", "bfloat16")
DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"

def fixed_text() -> str:
  return "\n\n".join(p.read_text() for p in sorted(DOCS.glob("*.md")))

def batch_decode_tok_s(engine, src: int, batch: int, steps: int, rounds: int = 1) -> float:
  """Tokens/s of `batch` sequences decoding together at src's context (src's KV copied into each of the others' blocks,
  layer by layer as bytes): the fastest of `rounds` windows of `steps` steps, after 3 untimed ones (TinyJit: run, capture,
  replay). The copies are freed after; src stays, cut back to its context (the next batch starts where this one did)."""
  cache, bm = engine.cache, engine.cache.block_manager
  n, first = bm.length(src), src + 1
  ids = [src, *range(first, first + batch - 1)]
  for s in ids[1:]: bm.allocate(s, n)
  try:
    for layer in range(cache.n_layers):
      data = b"".join(cache.read_block_bytes(layer, b) for b in bm.block_table(src))
      for s in ids[1:]: cache.write_sequence(s, layer, data)
    tokens = [1] * batch
    def one():
      nonlocal tokens
      for s in ids: bm.append_slot(s)
      tokens = [int(t) for t in engine.engine.step(ids, tokens).argmax(-1)]
    for _ in range(3): one()
    best = 0.0
    for _ in range(rounds):
      t0 = time.perf_counter()
      for _ in range(steps): one()
      best = max(best, batch * steps / (time.perf_counter() - t0))
    return best
  finally:
    for s in ids[1:]: bm.deallocate(s)
    bm.truncate(src, n)

def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(prog="tinyhet bench kvquant", description=__doc__.split("\n\n")[0])
  ap.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated kv_dtypes; float16 first is the baseline")
  ap.add_argument("--contexts", default="1024,4096", help="prompt lengths (tokens) for the greedy comparison")
  ap.add_argument("--tokens", type=int, default=32, help="greedy tokens generated per context, and decode steps timed per batch")
  ap.add_argument("--batches", default="1,16", help="decode batches timed at the longest context (comma list)")
  ap.add_argument("--ppl-tokens", type=int, default=4096, help="tokens of the fixed text scored for perplexity (0: skip)")
  ap.add_argument("--rounds", type=int, default=3, help="timed prefills and decode windows at the longest context (the fastest is the figure)")
  ap.add_argument("--json", action="store_true")
  args = ap.parse_args(argv)
  import numpy as np
  import tinyhet  # noqa: F401  (MESH)
  from tinyhet.bench.prompts import filler_ids
  from tinyhet.engine.local_engine import LocalEngine
  from tinyhet.engine.prefill import prefill_logits
  from tinyhet.engine.prompt_logprobs import prompt_logprobs
  from tinyhet.kernels.kv_quant import kv_format
  from tinyhet.kv.paged_cache import PagedKVCache
  from tinyhet.model.weights import embedded_model_path, load_model
  names, contexts = [d for d in args.dtypes.split(",") if d], [int(c) for c in args.contexts.split(",") if c]
  try:
    for d in names: kv_format(d)
    batches = [int(b) for b in args.batches.split(",") if b]
  except ValueError as e: ap.error(str(e))
  if not names or not contexts or not batches or min(batches) < 1 or min(contexts) < 1 or args.tokens < 1 or args.rounds < 1:
    ap.error("--dtypes, --contexts and --batches need at least one entry, every context, batch, --tokens and --rounds at least 1")
  longest = max([*contexts, args.ppl_tokens])
  steps = 3 + args.rounds * args.tokens       # a batch's decode steps past the longest context
  model, tok = load_model(str(embedded_model_path()), device="MESH", max_context=longest + steps + 16, quiet=True, packed=True)
  cfg, bs = model.cfg, 16
  text_ids = tok.encode(fixed_text(), add_special=False)[:args.ppl_tokens] if args.ppl_tokens else []
  if args.ppl_tokens and len(text_ids) < args.ppl_tokens: raise SystemExit(f"docs/*.md give {len(text_ids)} tokens, not {args.ppl_tokens}")
  rows, base = [], {}
  for name in names:
    fmt = kv_format(name)
    per_block = PagedKVCache.bytes_per_block(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, bs, fmt)
    row = {"kv_dtype": name, "tokens_per_gib": (1 << 30) // per_block * bs, "wire_bytes_per_token": per_block / bs}
    per_seq = max(contexts) + steps + 2 * bs      # a batch row: the context, its steps, whole blocks
    engine = LocalEngine(model, per_seq * (max(batches) + 1), block_size=bs, kv_dtype=name)   # + 1: the timed run's, beside the batch's
    for n in contexts:
      ids = filler_ids(tok, n)
      got, stats = engine.generate(ids, args.tokens)
      src = None
      if n == max(contexts):     # this prefill's blocks are the batches' KV
        src = 1 << 30            # past the engine's own sequence ids
        engine.cache.block_manager.allocate(src, n)
      store = engine.cache.layer_storer(src) if src is not None else None
      logits = np.asarray(prefill_logits(model, ids, fmt, on_layer=store)).reshape(-1)
      if name == names[0]: base[n] = (got, logits)
      row[f"same_tokens_{n}"] = sum(a == b for a, b in zip(got, base[n][0]))
      row[f"logit_max_abs_err_{n}"] = float(np.abs(logits - base[n][1]).max())
      if n == max(contexts):   # timed on the runs after the first, which compiled this length's kernels: the fastest
        runs = [engine.generate(ids, args.tokens) for _ in range(args.rounds)]
        row.update(prefill_s=min(st["ttft_s"] for _, st in runs), repeat_same=all(again == got for again, _ in runs))
        for B in batches: row[f"decode_tok_s_b{B}"] = batch_decode_tok_s(engine, src, B, args.tokens, args.rounds)
        engine.cache.block_manager.deallocate(src)
    del engine; gc.collect()      # its pools back to the arena now (its step capture holds a reference cycle)
    if text_ids:
      t0 = time.perf_counter()
      lp = [e["logprob"] for e in prompt_logprobs(model, text_ids, 0, fmt)[1:]]
      row.update(perplexity=math.exp(-sum(lp) / len(lp)), ppl_s=time.perf_counter() - t0)
    rows.append(row)
    if not args.json: print(" ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
  b = rows[0]
  for r in rows:
    r["capacity_x"] = r["tokens_per_gib"] / b["tokens_per_gib"]
    r["wire_x"] = r["wire_bytes_per_token"] / b["wire_bytes_per_token"]
    if "perplexity" in r: r["perplexity_x"] = r["perplexity"] / b["perplexity"]
    if "prefill_s" in r:
      r["prefill_x"] = r["prefill_s"] / b["prefill_s"]
      for B in batches: r[f"decode_b{B}_x"] = r[f"decode_tok_s_b{B}"] / b[f"decode_tok_s_b{B}"]
  out = {"model": "SmolLM2-135M-Instruct Q4_1", "baseline": names[0], "contexts": contexts, "batches": batches, "tokens": args.tokens,
         "rounds": args.rounds, "ppl_tokens": len(text_ids), "rows": rows}
  if args.json: print(json.dumps(out))
  else:
    cols = ["kv_dtype", *[f"same_tokens_{n}" for n in contexts], "perplexity_x", "capacity_x", "wire_x", "prefill_x",
            *[f"decode_b{B}_x" for B in batches]]
    print("  ".join(f"{c:>14}" for c in cols))
    for r in rows: print("  ".join(f"{r.get(c, '-'):>14.4g}" if isinstance(r.get(c), float) else f"{r.get(c, '-')!s:>14}" for c in cols))
  return 0

if __name__ == "__main__": sys.exit(main())
