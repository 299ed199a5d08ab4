"""tinyhet bench spec: speculative decoding (docs/speculative.md) against plain decode, through the decode node's engine
(paged KV, the jitted bucketed decode step, SpeculativeStep's verify replaying it) on MESH, in one process: for each task
and batch, each mode decodes the same prompts greedily, --new-tokens tokens a row (no stop ids: every row the same count):
every prompt of the task in each pass, in batches of B (batch 1: one prompt after another; rows cycle through the
prompts when B is larger than their number).

  copy   rewrite a ~400-token passage with a small edit (bench/spec_prompts.py): the answer quotes the prompt
  chat   free chat prompts: little to quote

A row: decode tokens/s of the whole batch (the tokens after each row's first, which its prefill gives, over the decode
time), accept_len (tokens a sequence gains per speculative step: accepted drafts / steps + 1; 1.0 for off) and
tokens_equal (its greedy tokens equal mode off's in every pass). Every batch bucket up to B * (k + 1) rows is captured
first, and each row is decoded once untimed, then --rounds times (default 3) timed, the modes' passes alternating and
each mode's best pass kept (the untimed pass compiles its prompts' prefill and lets the policy measure the step
costs it needs: one engine.step_costs.StepCosts for the whole run, as a node keeps one; and one SpecPolicy per task and
batch for both passes, each sequence forgotten when it ends, so the timed pass starts from the acceptance figure the
untimed one left, as a node that has served such requests before; one a mode). ngram drafts through the adaptive
policy (engine/spec_policy.py) unless --fixed, which verifies every n-gram draft whole, up to k. With --draft-model F the
`draft` mode runs too: F (a smaller model of the same tokenizer, e.g. the embedded Q4_1 file drafting for an F16 one)
drafts greedily through its own paged pool (engine/draft_model.py), its steps timed inside the mode's decode time, its
buckets up to 128 rows captured first."""
from __future__ import annotations
import argparse, json, sys, time

MODES = ("off", "ngram", "draft")

def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(prog="tinyhet bench spec", description=__doc__.split("\n\n")[0])
  ap.add_argument("--model", default=None, help="GGUF file or Hugging Face directory (default: the embedded SmolLM2-135M-Instruct); "
                  "random:... for a quick check")
  ap.add_argument("--k", type=int, default=8, help="the most tokens a sequence drafts a step, 1..8 (default 8: the policy cuts "
                  "each draft to what pays)")
  ap.add_argument("--batch", default="1,16", help="comma-separated batch sizes (default 1,16)")
  ap.add_argument("--new-tokens", type=int, default=128, help="tokens generated per row (default 128)")
  ap.add_argument("--tasks", default="copy,chat", help="comma-separated tasks: copy, chat")
  ap.add_argument("--max-prompt", type=int, default=0, help="cut each prompt to its last N tokens (0: whole; for quick checks)")
  ap.add_argument("--rounds", type=int, default=3, help="timed passes of each mode, alternating, the best kept (default 3)")
  ap.add_argument("--fixed", action="store_true", help="no policy: verify every draft whole, up to k (the old behaviour)")
  ap.add_argument("--draft-model", default=None, help="a smaller model of the same tokenizer (GGUF or Hugging Face directory; "
                  "'embedded': the embedded SmolLM2 Q4_1): adds the draft mode's rows (default: none)")
  ap.add_argument("--json", action="store_true")
  args = ap.parse_args(argv)
  from tinyhet.bench.spec_prompts import TASKS
  from tinyhet.engine.speculative import MAX_K
  batches, tasks = [int(b) for b in args.batch.split(",") if b], [t for t in args.tasks.split(",") if t]
  if not 1 <= args.k <= MAX_K: ap.error(f"--k must be in 1..{MAX_K}")
  if not batches or min(batches) < 1 or args.new_tokens < 2: ap.error("--batch sizes must be positive and --new-tokens at least 2")
  if args.rounds < 1: ap.error("--rounds must be at least 1")
  if (bad := [t for t in tasks if t not in TASKS]): ap.error(f"unknown task {bad[0]!r}: known ones are {', '.join(TASKS)}")
  import tinyhet  # noqa: F401  (MESH)
  from tinyhet.engine.decode_engine import BATCH_BUCKETS, batch_bucket
  from tinyhet.model.spec import load, model_id
  model, tok, name = load(args.model, "MESH", quiet=True, packed=True)
  modes = MODES if args.draft_model else MODES[:2]
  draft = None
  if args.draft_model:
    from tinyhet.engine.draft_model import DraftModel, same_tokenizer
    from tinyhet.model.weights import embedded_model_path
    path = str(embedded_model_path()) if args.draft_model == "embedded" else args.draft_model
    dmodel, dtok, dname = load(path, "MESH", quiet=True, packed=True)
    if (why := same_tokenizer(tok, dtok)) is not None:
      raise SystemExit(f"tinyhet bench spec: --draft-model {args.draft_model}: its tokenizer is not the model's: {why}")
  prompts = {t: [cut(tok.encode_chat([{"role": "user", "content": p}]), args.max_prompt) for p in TASKS[t]] for t in tasks}
  longest = max(len(p) for ps in prompts.values() for p in ps)
  if longest + args.new_tokens + args.k > model.cfg.max_context:
    raise SystemExit(f"tinyhet bench spec: prompts of {longest} tokens + {args.new_tokens} new tokens exceed the model's context "
                     f"({model.cfg.max_context}): pass fewer --new-tokens or --max-prompt")
  engine = make_engine(model, max(batches), longest + args.new_tokens + args.k)
  if args.draft_model:
    draft = DraftModel(dmodel, engine.cache.block_manager.num_blocks - 1, engine.cache.block_size, dname)
    draft.engine.warm_up([b for b in BATCH_BUCKETS if b <= 128])
  from tinyhet.engine.step_costs import StepCosts
  costs = StepCosts(engine)
  rows = []
  for task in tasks:
    for B in batches:
      # a pass decodes every prompt of the task at least once, in batches of B (rows cycle through the prompts): batch 1
      # runs the prompts one after another, so its figure is the task's, not its first prompt's
      groups = [[prompts[task][i % len(prompts[task])] for i in range(j, j + B)] for j in range(0, max(B, len(prompts[task])), B)]
      base = None
      from tinyhet.engine.spec_policy import SpecPolicy
      policies = {mode: None if args.fixed else SpecPolicy() for mode in modes}
      # every bucket a step of this batch may run at captured first (a bucket met once in a run would capture in the timed one)
      engine.warm_up([b for b in BATCH_BUCKETS if b <= batch_bucket(B * (args.k + 1))])
      for mode in modes:       # untimed: the prompts' prefill compiles
        decode_all(engine, groups, args.new_tokens, mode, args.k, costs, policies[mode], draft)
      # the modes' timed passes alternate, each mode's best kept: a machine that speeds up or slows down over the run moves
      # both modes' figures, not one of them
      best: dict[str, tuple[float, float]] = {}     # mode -> (tokens/s, accept length) of its fastest pass
      equal = dict.fromkeys(modes, True)              # mode -> every pass's tokens equal off's first pass
      for _ in range(args.rounds):
        for mode in modes:
          toks, rate, accept = decode_all(engine, groups, args.new_tokens, mode, args.k, costs, policies[mode], draft)
          base = toks if base is None else base       # off runs first
          equal[mode] = equal[mode] and toks == base
          if rate > best.get(mode, (0.0,))[0]: best[mode] = (rate, accept)
      for mode in modes:
        rate, accept = best[mode]
        rows.append({"task": task, "mode": mode, "batch": B, "decode_tok_s": rate, "accept_len": accept, "tokens_equal": equal[mode]})
        if not args.json: print(f"{task} {mode} batch {B}: {rate:.2f} tok/s, accept length {accept:.2f}", file=sys.stderr, flush=True)
  out = {"model": model_id(args.model) if args.model else name, "draft_model": draft.name if draft else None, "k": args.k,
         "new_tokens": args.new_tokens,
         "policy": "fixed" if args.fixed else "adaptive", "step_ms": {b: round(t * 1e3, 3) for b, t in sorted(costs.seconds.items())},
         **({"draft_step_ms": {b: round(t * 1e3, 3) for b, t in sorted(draft.costs.seconds.items())}} if draft else {}),
         "rows": rows}
  print(json.dumps(out) if args.json else table(out))
  return 0

def cut(ids: list[int], n: int) -> list[int]: return ids[-n:] if n else ids

def make_engine(model, max_batch: int, seq_tokens: int):
  """A decode engine whose pool holds max_batch sequences of seq_tokens (and PAD_SEQ's block)."""
  from tinyhet.engine.decode_engine import DecodeEngine
  from tinyhet.kv.paged_cache import PagedKVCache
  cfg, bs = model.cfg, 16
  cache = PagedKVCache(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, max_batch * -(-seq_tokens // bs) + 1, bs, device=model.device,
                       max_seq_len=cfg.max_context)
  return DecodeEngine(model, cache)

def decode_all(engine, groups: list[list[list[int]]], new: int, mode: str, k: int, costs=None, policy=None,
               draft=None) -> tuple[list[list[int]], float, float]:
  """decode() of each group of prompts in turn: (every row's tokens, decode tokens/s over all the groups' decode time,
  accept length over all their steps)."""
  toks, elapsed, steps, accepted = [], 0.0, 0, 0
  for prompts in groups:
    t, seconds, n, a = decode(engine, prompts, new, mode, k, costs, policy, draft)
    toks, elapsed, steps, accepted = toks + t, elapsed + seconds, steps + n, accepted + a
  return toks, sum(len(g) for g in groups) * (new - 1) / elapsed, (accepted + steps) / steps if steps else 1.0

def decode(engine, prompts: list[list[int]], new: int, mode: str, k: int, costs=None, policy=None,
           draft=None) -> tuple[list[list[int]], float, int, int]:
  """Greedy decode of every prompt to `new` tokens in one batch: (tokens, decode seconds, sequence-steps, drafts accepted
  over them; 0, 0 for off). costs: the
  StepCosts the speculative step prices drafts with (kept across runs: measured once). policy: the SpecPolicy that cuts
  the drafts (None: every draft verified whole). draft: the DraftModel of mode draft."""
  from tinyhet.engine.prefill import prefill_first_token
  from tinyhet.engine.speculative import SpeculativeStep
  from tinyhet.model.sampling import Sampler, sample_batch
  cache, bm = engine.cache, engine.cache.block_manager
  spec = SpeculativeStep(engine, policy is not None, policy, draft=draft)
  samplers, toks = [Sampler(0.0) for _ in prompts], [list(p) for p in prompts]
  if costs is not None: spec.costs = costs
  try:
    for sid, p in enumerate(prompts):
      bm.allocate(sid, len(p))
      toks[sid].append(prefill_first_token(engine.model, p, samplers[sid], cache.kv_dtype, cache.layer_storer(sid))[0])
    t0 = time.perf_counter()
    while (live := [i for i, p in enumerate(prompts) if len(toks[i]) - len(p) < new]):
      for i in live: bm.append_slot(i)
      if mode == "off":
        logits = engine.step(live, [toks[i][-1] for i in live])
        draws = [[d] for d in sample_batch(logits, [samplers[i] for i in live], [len(toks[i]) for i in live], [toks[i] for i in live])]
      else: draws = spec.step(live, [toks[i] for i in live], [samplers[i] for i in live], k, [new - (len(toks[i]) - len(prompts[i])) for i in live],
                              modes=[mode] * len(live))
      for i, ds in zip(live, draws): toks[i] += [d.token for d in ds]
    elapsed = time.perf_counter() - t0
  finally:
    for sid in range(len(prompts)):
      if sid in bm: bm.deallocate(sid)
      spec.forget(sid)
  return [t[len(p):] for t, p in zip(toks, prompts)], elapsed, spec.steps, spec.accepted

def table(out: dict) -> str:
  drafter = f", draft model {out['draft_model']}" if out.get("draft_model") else ""
  lines = [f"tinyhet bench spec: {out['model']}{drafter}, k {out['k']}, {out['new_tokens']} new tokens a row, greedy, {out['policy']} drafts",
           "step ms by batch bucket (measured, the policy's cost model): " + ", ".join(f"{b}: {t}" for b, t in out["step_ms"].items()),
           *(["draft model's step ms by batch bucket: " + ", ".join(f"{b}: {t}" for b, t in out["draft_step_ms"].items())]
             if out.get("draft_step_ms") else []),
           f"{'task':<6}{'mode':<7}{'batch':>6}{'decode tok/s':>14}{'accept len':>12}{'x off':>8}  tokens equal"]
  off = {(r["task"], r["batch"]): r["decode_tok_s"] for r in out["rows"] if r["mode"] == "off"}
  for r in out["rows"]:
    x = r["decode_tok_s"] / off[r["task"], r["batch"]] if off.get((r["task"], r["batch"])) else float("nan")
    lines.append(f"{r['task']:<6}{r['mode']:<7}{r['batch']:>6}{r['decode_tok_s']:>14.2f}{r['accept_len']:>12.2f}{x:>8.2f}  {r['tokens_equal']}")
  return "\n".join(lines)

if __name__ == "__main__": sys.exit(main())
