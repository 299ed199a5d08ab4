"""`tinyhet bench logprobs`: a prompt's own logprobs (completions' `echo` with `logprobs`, lm-evaluation-harness's
loglikelihood requests), in one run:

- in this process, a --prompt-tokens prompt (default 512) prefilled plain (tinyhet.engine.prefill.prefill_logits) against
  the same prefill scoring its rows (on_hidden: tinyhet.engine.prompt_logprobs), each the best of --rounds after one
  untimed run of each (tinygrad compiles per shape): seconds and their ratio;
- an lm-evaluation-harness-shaped load through the OpenAI API of a router over one `--role both` node: --requests
  loglikelihood requests (prompts of random lengths --min-len..--max-len, `echo`, `logprobs` 1, `max_tokens` 1, greedy),
  --batch of them in flight at a time, as `local-completions` sends them with batch_size > 1; requests/s, after a warm-up
  pass over the same lengths with other tokens;
- the baseline, llama-cpp-python over the same prompts on the same GGUF (`make bench-setup` installs it; without it the
  row says so), one request at a time (its Llama object serves one): what its `create_completion(echo=True, logprobs=1)`
  computes (an evaluation with logits_all, every position's log-softmax), called directly, since that echo path refuses
  token ids.
"""
from __future__ import annotations
import argparse, http.client, json, os, secrets, sys, threading, time
import numpy as np

def ids_of(n: int, salt: int, i: int, vocab: int) -> list[int]:
  """Request i's prompt of n tokens (no two requests share a block: no prefix-cache hits between them)."""
  return [int(t) for t in np.random.default_rng([salt, i]).integers(1, min(vocab, 30000), n)]

def in_process(spec, prompt_tokens: int, rounds: int) -> dict:
  from tinyhet.engine.prefill import prefill_logits
  from tinyhet.engine.prompt_logprobs import PromptLogprobs
  from tinyhet.model.spec import load
  model, _, model_id = load(spec, "HET", quiet=True, packed=True)
  ids = ids_of(prompt_tokens, 0, 0, model.cfg.vocab_size)
  def plain(): prefill_logits(model, ids)
  def scored():
    scorer = PromptLogprobs(model, ids, 1)
    prefill_logits(model, ids, on_hidden=scorer)
    return scorer.entries
  times: dict[str, list[float]] = {"plain": [], "logprobs": []}
  for fn in (plain, scored): fn()                                  # compiles and captures
  for _ in range(rounds):
    for name, fn in (("plain", plain), ("logprobs", scored)):
      t0 = time.perf_counter()
      fn()
      times[name].append(time.perf_counter() - t0)
  best = {k: min(v) for k, v in times.items()}
  return {"model": model_id, "vocab": model.cfg.vocab_size, "prompt_tokens": prompt_tokens, "rounds": rounds, "plain_prefill_s": best["plain"],
          "logprobs_prefill_s": best["logprobs"], "ratio": best["logprobs"] / best["plain"]}

def loglikelihood(address: str, model: str, ids: list[int]) -> list:
  host, port = address.rsplit(":", 1)
  c = http.client.HTTPConnection(host, int(port), timeout=600)
  body = {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True}
  c.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
  r = c.getresponse()
  text = r.read()
  c.close()
  if r.status != 200: raise RuntimeError(f"router answered {r.status}: {text[:300]!r}")
  lp = json.loads(text)["choices"][0]["logprobs"]["token_logprobs"]
  if len(lp) < len(ids) or lp[0] is not None: raise RuntimeError(f"{len(lp)} logprobs for a {len(ids)}-token prompt")
  return lp[:len(ids)]

def batches(address: str, model: str, prompts: list[list[int]], batch: int) -> float:
  """Seconds for every prompt, `batch` at a time (each batch's requests concurrent, the next batch after the last answer)."""
  t0 = time.perf_counter()
  for b in range(0, len(prompts), batch):
    errors: list[BaseException] = []
    def one(ids):
      try: loglikelihood(address, model, ids)
      except BaseException as e: errors.append(e)
    threads = [threading.Thread(target=one, args=(p,)) for p in prompts[b:b + batch]]
    for t in threads: t.start()
    for t in threads: t.join()
    if errors: raise errors[0]
  return time.perf_counter() - t0

def served(args, lengths: list[int], vocab: int) -> dict:
  from tinyhet.bench.serve import Proc, wait_ready
  model_flag = ["--model", args.model] if args.model else []
  procs = [Proc("node", "--role", "both", "--listen", "127.0.0.1:0", "--quiet", "--kv-memory", args.kv_memory, *model_flag)]
  try:
    procs.append(Proc("serve", "--listen", "127.0.0.1:0", "--both", procs[0].info["address"], *model_flag, "--max-queue", "1024",
                      "--queue-timeout", "600"))
    address, model = procs[1].info["address"], procs[1].info["model"]
    wait_ready(address)
    salt = secrets.randbits(32)
    batches(address, model, [ids_of(n, salt, i, vocab) for i, n in enumerate(lengths)], args.batch)      # warm-up: every length once
    wall = batches(address, model, [ids_of(n, salt + 1, i, vocab) for i, n in enumerate(lengths)], args.batch)
    return {"requests": len(lengths), "batch": args.batch, "seconds": wall, "requests_s": len(lengths) / wall}
  finally:
    for p in procs[::-1]: p.stop()

def llama_cpp_rate(args, lengths: list[int], vocab: int) -> dict:
  try: import llama_cpp
  except ImportError: return {"skipped": "llama-cpp-python is not installed (make bench-setup)"}
  from tinyhet.model.model_files import embedded_model_path
  if args.model is not None and not str(args.model).endswith(".gguf"): return {"skipped": f"{args.model} is not a GGUF file"}
  path = str(args.model or embedded_model_path())
  llm = llama_cpp.Llama(model_path=path, n_ctx=max(lengths) + 8, logits_all=True, verbose=False)
  salt = secrets.randbits(32)
  def score(ids: list[int]) -> np.ndarray:
    """What create_completion(echo=True, logprobs=1) computes for a prompt, from the same logits_all evaluation: every
    position's log-softmax, the prompt token's logprob and the top-1 (its echo path takes text only: a list of ids fails
    in llama-cpp-python 0.3's _create_completion, `prompt + text_str`)."""
    llm.reset()
    llm.eval(ids)
    logits = np.asarray(llm.scores[:len(ids)], dtype=np.float32)
    lp = logits - logits.max(-1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
    top = lp.argmax(-1)
    return np.stack([lp[np.arange(len(ids) - 1), ids[1:]], lp[np.arange(len(ids) - 1), top[:-1]]])
  def run(s: int) -> float:
    t0 = time.perf_counter()
    for i, n in enumerate(lengths):
      if score(ids_of(n, s, i, vocab)).shape[1] != n - 1: raise RuntimeError("llama-cpp-python returned fewer logits than tokens")
    return time.perf_counter() - t0
  run(salt)
  wall = run(salt + 1)
  return {"requests": len(lengths), "seconds": wall, "requests_s": len(lengths) / wall, "version": llama_cpp.__version__}

def table(out: dict) -> str:
  p, lines = out["prefill"], []
  lines.append(f"model {p['model']}: a {p['prompt_tokens']}-token prompt, best of {p['rounds']}")
  lines.append(f"  plain prefill      {p['plain_prefill_s'] * 1e3:9.1f} ms")
  lines.append(f"  with its logprobs  {p['logprobs_prefill_s'] * 1e3:9.1f} ms   {p['ratio']:.2f}x")
  if (s := out.get("served")) is not None:
    lines.append(f"loglikelihood load: {s['requests']} requests of {out['min_len']}-{out['max_len']} tokens, batch {s['batch']}")
    lines.append(f"  tinyhet (both node + router)   {s['requests_s']:7.2f} requests/s")
    b = out["llama_cpp"]
    if "skipped" in b: lines.append(f"  llama-cpp-python               skipped: {b['skipped']}")
    else: lines.append(f"  llama-cpp-python {b['version']:<13} {b['requests_s']:7.2f} requests/s   tinyhet {s['requests_s'] / b['requests_s']:.2f}x")
  return "\n".join(lines)

def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="tinyhet bench logprobs", description=__doc__.splitlines()[0])
  ap.add_argument("--json", action="store_true")
  ap.add_argument("--model", default=None, help="a model every process loads (default: the embedded SmolLM2)")
  ap.add_argument("--prompt-tokens", type=int, default=512)
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--requests", type=int, default=100)
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--min-len", type=int, default=20)
  ap.add_argument("--max-len", type=int, default=200)
  ap.add_argument("--kv-memory", default="256M")
  ap.add_argument("--prefill-only", action="store_true", help="only the in-process prefill rows (no service, no llama-cpp-python)")
  args = ap.parse_args(argv)
  if not 1 <= args.min_len <= args.max_len or args.requests < 1 or args.batch < 1 or args.prompt_tokens < 2 or args.rounds < 1:
    ap.error("need 1 <= --min-len <= --max-len, --requests, --batch, --rounds >= 1 and --prompt-tokens >= 2")
  out = {"command": "tinyhet bench logprobs " + " ".join(argv if argv is not None else sys.argv[1:]),
         "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "min_len": args.min_len, "max_len": args.max_len}
  out["prefill"] = in_process(args.model, args.prompt_tokens, args.rounds)
  if not args.prefill_only:
    os.environ.setdefault("TINYHET_TOKEN", secrets.token_hex(16))    # the node and the router started here share it
    vocab = out["prefill"]["vocab"]
    lengths = [int(n) for n in np.random.default_rng(1).integers(args.min_len, args.max_len + 1, args.requests)]
    out["served"] = served(args, lengths, vocab)
    out["llama_cpp"] = llama_cpp_rate(args, lengths, vocab)
  print(json.dumps(out) if args.json else table(out))
  return 0
