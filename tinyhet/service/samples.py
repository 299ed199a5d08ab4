"""n > 1: the samples of one prompt served as one request to a decode node (run_samples, on a router's Cluster).

The router admits the n samples together (the prompt's blocks once, each sample's headroom) on one decode-capable node and
prefills the prompt once, where Cluster.run would: on the decode node itself (decode.submit with n: it forks the n sequences
from its prefill, sharing the prompt's KV blocks by reference count, a partial last block copied per sample;
tinyhet.engine.scheduler), or disaggregated (decode.reserve with n reserves the samples together, prefill.run with n
writes the first sample's blocks and samples every first token, decode.generate with first_tokens forks them once the KV
has landed; tinyhet.engine.forked_samples). Sample i is drawn with seed + i, so its tokens are those of a request of its
own with that seed. The items of the one stream carry their sample's index. A sample that its node lost, or that the
first attempt did not finish, goes on alone (Cluster.run) from its own tokens so far, on the same seed stream.
"""
from __future__ import annotations
import secrets, threading
from tinyhet.service.router import BadRequest, Cancelled, Request, _NodeLost, _logprobs

class Shared:
  """The samples of one prompt as one request to the nodes (run_samples): cancelled once every sample is; a
  connection it opens is registered with each sample and closed when the last sample lets it go."""
  def __init__(self, reqs: list[Request]):
    self.reqs, self.clients, self.lock, self.seed = reqs, set(), threading.Lock(), reqs[0].seed
    self.cancelled = threading.Event()
    self.holders = {id(r) for r in reqs}
    for r in reqs: r.clients.add(_Hold(self, r))
    if all(r.cancelled.is_set() for r in reqs): self.cancelled.set()

  def let_go(self, req: Request):
    with self.lock:
      self.holders.discard(id(req))
      last = not self.holders
    if last:
      self.cancelled.set()
      for c in list(self.clients): c.close()

class _Hold:
  """What a sample's cancel closes: its hold on the Shared request's connections."""
  def __init__(self, shared: Shared, req: Request): self.shared, self.req = shared, req
  def close(self): self.shared.let_go(self.req)

def run_samples(cluster, reqs: list[Request]) -> list[str]:
  """n samples of one prompt (reqs: the same prompt and settings, reqs[i].seed = reqs[0].seed + i): one prefill on one
  decode node, which forks the n sequences from it (decode.submit with n: the prompt's KV blocks shared, each sample its
  own seed), tokens sent to each request as they come. The samples are prefilled where they decode, never disaggregated.
  A sample its node lost (or one the first attempt did not finish) goes on alone (run), from its own tokens so far."""
  head = reqs[0]
  if head.seed is None: head.seed = secrets.randbits(63)
  for i, r in enumerate(reqs): r.seed = (head.seed + i) % 2**63
  ends: dict[int, str] = {}
  try: _attempt(cluster, reqs, ends)
  except (_NodeLost, Cancelled): pass
  return [ends[i] if i in ends else cluster.run(r) for i, r in enumerate(reqs)]

def _attempt(cluster, reqs: list[Request], ends: dict[int, str]):
  head, share = reqs[0], Shared(reqs)
  try: decode, blocks = cluster._admit(len(head.prompt_ids), head.max_tokens, head.prompt_ids, share.cancelled, samples=len(reqs))
  except Cancelled: return
  try:
    ctl = cluster._open(share, decode, "decode node lost")
    try:
      ids, n, stops = head.prompt_ids, len(reqs), {"stop": head.stop} if head.stop else {}
      sampling = dict(temperature=head.temperature, top_p=head.top_p, options={**head.options, "output_from": len(ids)})
      prefill = cluster._choose_prefill(decode, len(ids), head.max_tokens, cluster._cached(ctl, decode, ids))
      if prefill is None:
        cluster._count(decode, "prefill+decode")
        stream = ctl.stream("decode.submit", prompt_ids=ids, max_new_tokens=head.max_tokens, seed=head.seed, stop_ids=head.stop_ids, n=n,
                            **stops, **sampling)
      else:       # disaggregated: the prefill node prefills once and samples every first token; the decode node forks the samples
        r = ctl.call("decode.reserve", prompt_ids=ids, max_new_tokens=head.max_tokens, timeout=cluster.queue_timeout, n=n,
                     writer=prefill.status.get("node"), use_cache=bool(decode.status.get("prefix_cache")))
        cluster._landed(decode, blocks)
        cluster._done(head, decode, {"cached_tokens": r.get("cached_tokens", 0)}, len(ids))
        p = cluster._prefill(share, prefill, decode, ids, r, {**sampling, "n": n})
        if "prompt_logprobs" in p:
          for q in reqs: q.prompt_logprobs = p["prompt_logprobs"][:len(ids)]
        for i, q in enumerate(reqs): q.push(p["first_tokens"][i], p["first_logprobs"][i] if "first_logprobs" in p else None)
        cluster._count(decode, "decode")
        gen = {**sampling, "options": {k: v for k, v in sampling["options"].items() if k != "prompt_logprobs"}}
        stream = ctl.stream("decode.generate", seq_id=r["seq_id"], first_token=p["first_token"], first_tokens=p["first_tokens"], seed=p["seed"],
                            stop_ids=head.stop_ids, timeout=30.0, **stops, **gen)
      for item in stream:
        if "index" not in item:
          if item.get("done"): cluster._done(head, decode, item, len(head.prompt_ids))
          continue
        r = reqs[item["index"]]
        if "token" in item:
          if blocks.landed is None: cluster._landed(decode, blocks)     # the prompt's blocks are held by now
          r.push(item["token"], _logprobs(item))
        elif "prompt_logprobs" in item:                  # the prompt's, once for every sample
          for q in reqs: q.prompt_logprobs = q.prompt_logprobs or item["prompt_logprobs"][:len(q.prompt_ids)]
        elif item.get("done"):
          r.ended = r.ended or bool(item.get("ended"))       # the output completed its grammar
          ends[item["index"]] = ("cancelled" if r.cancelled.is_set() else
                                 "stop" if (r.generated and r.generated[-1] in r.stop_ids) or r.ended else "length")
    except (_NodeLost, BadRequest, Cancelled): raise                 # the prefill's failure, judged already
    except Exception as e: raise cluster._failed(share, decode, e, "decode node lost") from None
    finally: cluster._close(share, decode, ctl)
  finally: cluster._release(decode, blocks)
  for r in reqs: r.cached_tokens = head.cached_tokens

