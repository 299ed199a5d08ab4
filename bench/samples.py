"""`tinyhet bench samples`: n parallel samples of one prompt (`n` = 4, one request) against n separate requests for that prompt
sent at once (seeds s..s+3: the same tokens), through a router in front of one `--role both` node (a decode node prefills
an n > 1 request itself).

Per way: prefills the node ran and prompt tokens it computed (its decode.info counters), the most KV blocks in use at once
(decode.info's peak_used_blocks, reset before the round: the padding row's block counts in both), and the round's wall
time. The node runs without its prefix cache (--no-prefix-cache), so the separate requests cannot share blocks through it
and the two ways see the same prompt; the n samples share theirs by forking. Each way first runs a warm-up round with
another prompt (tinygrad compiles per shape, the decode step is captured per batch size).
"""
from __future__ import annotations
import argparse, http.client, json, os, secrets, sys, threading, time
import numpy as np
from tinyhet.bench.serve import Proc, wait_ready

def complete(address: str, body: dict) -> dict:
  host, port = address.rsplit(":", 1)
  c = http.client.HTTPConnection(host, int(port), timeout=600)
  c.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
  r = c.getresponse()
  obj = json.loads(r.read())
  c.close()
  if r.status != 200: raise RuntimeError(f"router answered {r.status}: {obj}")
  return obj

class NodeInfo:
  """decode.info on the node, over the control channel (the token the processes share)."""
  def __init__(self, address: str):
    from tinyhet.config import load_config
    from tinyhet.runtime.control import ControlClient
    from tinyhet.runtime.transport import Endpoint
    self.ep = Endpoint("bench-samples", token=os.environ["TINYHET_TOKEN"], config=load_config(env={}))
    self.ctl = ControlClient(self.ep, address)
  def __call__(self, reset: bool = False) -> dict: return self.ctl.call("decode.info", reset_peak=reset)
  def close(self):
    self.ctl.close()
    self.ep.close()

def one_round(address: str, info: NodeInfo, model: str, prompt: list[int], n: int, together: bool, max_tokens: int) -> dict:
  body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0, "seed": 1, "return_token_ids": True}
  before = info(reset=True)
  t0 = time.perf_counter()
  if together: tokens = [c["token_ids"] for c in complete(address, {**body, "n": n})["choices"]]
  else:
    tokens: list = [None] * n
    def one(i): tokens[i] = complete(address, {**body, "seed": 1 + i})["choices"][0]["token_ids"]
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads: t.start()
    for t in threads: t.join()
  wall = time.perf_counter() - t0
  after = info()
  return {"way": f"n={n}" if together else f"{n} requests", "prefills": after["prefills"] - before["prefills"],
          "prefilled_tokens": after["prefilled_tokens"] - before["prefilled_tokens"], "peak_kv_blocks": after["peak_used_blocks"],
          "wall_s": wall, "tokens": tokens}

def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="tinyhet bench samples", description=__doc__.splitlines()[0])
  ap.add_argument("--json", action="store_true")
  ap.add_argument("--model", default=None, help="the node's model (default: the embedded SmolLM2); random:max_context=512 for a quick check")
  ap.add_argument("--n", type=int, default=4)
  ap.add_argument("--prompt-tokens", type=int, default=200)
  ap.add_argument("--max-tokens", type=int, default=32)
  ap.add_argument("--kv-memory", default="256M")
  args = ap.parse_args(argv)
  os.environ.setdefault("TINYHET_TOKEN", secrets.token_hex(16))      # the processes started here share it
  model_flag = ["--model", args.model] if args.model else []
  node = Proc("node", "--role", "both", "--listen", "127.0.0.1:0", "--quiet", "--kv-memory", args.kv_memory, "--no-prefix-cache",
              *model_flag)
  router = None
  try:
    router = Proc("serve", "--listen", "127.0.0.1:0", "--both", node.info["address"], *model_flag)
    address, model = router.info["address"], router.info["model"]
    wait_ready(address)
    info = NodeInfo(node.info["address"])
    prompt = lambda salt: [int(t) for t in np.random.default_rng(salt).integers(1, 251, args.prompt_tokens)]
    rows = []
    for k, together in enumerate((False, True)):
      one_round(address, info, model, prompt(100 + k), args.n, together, args.max_tokens)         # warm-up
      rows.append(one_round(address, info, model, prompt(0), args.n, together, args.max_tokens))
    info.close()
  finally:
    for p in (router, node):
      if p is not None: p.stop()
  sep, tog = rows
  out = {"model": model, "n": args.n, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
         "same_tokens": sep["tokens"] == tog["tokens"], "rows": [{k: v for k, v in r.items() if k != "tokens"} for r in rows],
         "ratios": {"prefills": tog["prefills"] / max(1, sep["prefills"]), "peak_kv_blocks": tog["peak_kv_blocks"] / max(1, sep["peak_kv_blocks"]),
                    "wall": tog["wall_s"] / sep["wall_s"]}}
  if args.json: print(json.dumps(out))
  else:
    print(f"model {model}, {args.prompt_tokens}-token prompt, {args.max_tokens} new tokens, temperature 1; the same tokens both ways: "
          f"{out['same_tokens']}\n\n{'way':<14}{'prefills':>9}{'prefilled tok':>14}{'peak KV blocks':>15}{'wall s':>9}")
    for r in out["rows"]: print(f"{r['way']:<14}{r['prefills']:>9}{r['prefilled_tokens']:>14}{r['peak_kv_blocks']:>15}{r['wall_s']:>9.3f}")
    print(f"\nn={args.n} / {args.n} requests: prefills {out['ratios']['prefills']:.2f}x, peak KV blocks {out['ratios']['peak_kv_blocks']:.2f}x, "
          f"wall {out['ratios']['wall']:.2f}x")
  return 0

if __name__ == "__main__": sys.exit(main())
