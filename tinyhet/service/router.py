"""The router's engine (`tinyhet serve`): which node prefills and which decodes each request, and what happens when one is
lost. Blocking code, one thread per request; tinyhet.service.http_api puts the HTTP API in front of it.

A request, end to end:
  1. admit     pick a decode-capable node (role decode or both) whose KV pool has room for the whole request (free blocks
               from its heartbeats, less what this router's requests hold there; figures a request of its own there made
               stale, by landing or ending, are asked for again: node.status), the least loaded first. None has room:
               wait in a bounded queue (past the bound, or past the queue timeout: Overloaded, HTTP 503 + Retry-After).
  2. prefill   disaggregate or not: with a cluster file, the planner's cost model decides from the prompt's length (for two
               nodes the file names, tinyhet.planner.plan.disaggregation_pays; else tinyhet.planner.plan.route); a `both`
               decode node prefills for itself when its own queue is no longer than the best prefill node's; with no
               prefill node up, the decode node prefills for itself (decode.submit). Disaggregated: decode.reserve on the
               decode node, then prefill.run on the prefill-capable node with the least queued prompt tokens, which writes
               each layer's KV into the reserved blocks and answers with the first token.
  3. decode    decode.generate on the connection that reserved; tokens go to the client as they arrive.
Recovery: a node is down when its heartbeat stream breaks or falls silent (tinyhet.service.heartbeat) or when a request's
connection to it breaks; its in-flight requests then start over from step 1 with prompt + the tokens already sent as the
new prompt, so the client sees one answer (the same tokens as a clean run, sampled ones too: every attempt draws from the
request's (seed, position) stream) and never a token twice. Closing a request's
connections (client gone, node lost) frees its reservation and sequence on the decode node.
"""
from __future__ import annotations
import itertools, secrets, threading, time
from tinyhet.service import heartbeat
from tinyhet.service.cache_view import SUMMARY_KEYS, cache_view
from tinyhet.service.node_view import Admission, Node
from tinyhet.service.request import BadRequest, Cancelled, Overloaded, Request, Unavailable, cached_prompt_tokens  # noqa: F401  (their home for callers)
from tinyhet.runtime.control import ControlClient, ControlError

MAX_ATTEMPTS = 5           # node losses one request survives
OVERLAP_WEIGHT = 1.0       # a prompt wholly cached on a node outweighs one max_seqs-worth of decode load there
HEADROOM_TOKENS = 16       # admission holds the prompt and this many new tokens; decode grows from there (a full pool preempts)

class _NodeLost(Exception):
  def __init__(self, reason: str, message: str):
    super().__init__(message)
    self.reason = reason

def _logprobs(item: dict) -> dict | None:
  return {"logprob": item["logprob"], "top_logprobs": item["top_logprobs"]} if "logprob" in item else None

class Cluster:
  def __init__(self, endpoint, nodes: dict[str, str], model_id: str, metrics=None, max_queue: int = 64, queue_timeout: float = 60.0,
               planner=None, hb_interval: float = heartbeat.INTERVAL_S, hb_timeout: float = heartbeat.TIMEOUT_S, names: dict | None = None):
    """nodes: address -> role. planner: (Cluster from a cluster file, catalog model name) for tinyhet.planner.plan.route, or None.
    names: address -> the cluster file's node name, for the nodes the file gives an address."""
    self.endpoint, self.model_id, self.metrics, self.planner, self.names = endpoint, model_id, metrics, planner, names or {}
    self.max_queue, self.queue_timeout, self.hb_interval = max_queue, queue_timeout, hb_interval
    self.nodes = {a: Node(a, r) for a, r in nodes.items()}
    self.hb_timeout = hb_timeout                # for nodes added at run time (add_node)
    self.cond = threading.Condition()
    self.waiting, self.fingerprint = 0, None    # fingerprint: the first node's (tinyhet.model.fingerprint); others must match
    self.prefill_s_per_token = 0.0              # an average of the prefills seen, for the planner's prefill_queue_s
    self.ids = itertools.count(1)
    self.watches = [heartbeat.Watch(endpoint, a, lambda b, n=n: self._beat(n, b), lambda why, n=n: self._lost(n, why), hb_interval, hb_timeout)
                    for a, n in self.nodes.items()]

  # ---- node state
  def _beat(self, node: Node, beat: dict):
    with self.cond:
      if (fp := beat.get("fingerprint")) and self.fingerprint is None and beat.get("model") == self.model_id: self.fingerprint = fp
      if beat.get("model") != self.model_id or (fp and fp != self.fingerprint):
        node.up, node.reason = False, (f"serves {beat.get('model')!r} (fingerprint {beat.get('fingerprint')}), this router {self.model_id!r} "
                                       f"({self.fingerprint}): start every node with the same --model file and flags")
      else: node.up, node.reason = True, ""
      # a beat made before the figures an _ask brought (the same node's clock, the same stream) is older news: its liveness
      # and cache only
      if node.asked_at is None or not beat.get("time", 0) < node.asked_at:
        node.status, node.asked_at = {k: v for k, v in beat.items() if k not in SUMMARY_KEYS}, None
      node.cached, node.disk = cache_view(node.cached, beat), cache_view(node.disk, beat, "disk")
      shown = time.monotonic() - 2 * self.hb_interval      # a beat arriving now was made after these reservations landed
      node.recent = [a for a in node.recent if a.at > shown]
      self.cond.notify_all()
    if self.metrics is not None:
      self.metrics.node_up.labels(node.address, node.role).set(1 if node.up else 0)
      if node.can_decode and beat.get("kv_blocks"): self.metrics.kv_usage.labels(node.address).set(1 - beat["free_blocks"] / beat["kv_blocks"])
      if node.can_decode: self.metrics.node_figures(node.address, beat)     # RAM and disk hits, disk bytes

  def _lost(self, node: Node, why: str, close_clients: bool = True):
    with self.cond:
      was_up, node.up, node.reason, node.asked_at = node.up, False, why, None
      clients = list(node.clients) if close_clients else []
    for c in clients: c.close()           # a silent node: its requests move on now instead of waiting for a socket timeout
    if self.metrics is not None: self.metrics.node_up.labels(node.address, node.role).set(0)
    if was_up: print(f"tinyhet serve: node {node.address} ({node.role}) is down: {why}", flush=True)

  def add_node(self, address: str, role: str) -> None:
    """A node that joined at run time (tinyhet.service.ray_cluster places them): watched and given requests from now on."""
    with self.cond:
      if address in self.nodes: return
      node = self.nodes[address] = Node(address, role)
      self.watches.append(heartbeat.Watch(self.endpoint, address, lambda b: self._beat(node, b), lambda why: self._lost(node, why),
                                          self.hb_interval, self.hb_timeout))

  def remove_node(self, address: str) -> Node | None:
    """No new requests go to the node; those on it go on (its assigned and inflight_tokens say when they are done)."""
    with self.cond:
      node = self.nodes.pop(address, None)
      gone = [w for w in self.watches if w.address == address]
      self.watches = [w for w in self.watches if w.address != address]
    for w in gone: w.close()
    if node is not None and self.metrics is not None: self.metrics.node_up.labels(node.address, node.role).set(0)
    return node

  def ready(self) -> bool:
    with self.cond: return any(n.up and n.can_decode for n in self.nodes.values())

  def max_context(self) -> int | None:
    with self.cond: return min((n.status["max_context"] for n in self.nodes.values() if n.up and "max_context" in n.status), default=None)

  def describe(self) -> list[dict]:
    with self.cond:
      return [{"address": n.address, "role": n.role, "up": n.up, "reason": n.reason, **n.status} for n in self.nodes.values()]

  # ---- choosing nodes
  def _admit(self, prompt_tokens: int, new_tokens: int = 0, ids: list[int] | None = None,
             cancelled: threading.Event | None = None, samples: int = 1, salt: str = "") -> tuple[Node, int]:
    """A decode-capable node with room for the prompt and a little headroom (admission by need: a sequence grows a block at
    a time, and a full pool evicts cached blocks, then preempts), and the blocks now counted there for the request (release
    them after). Without room anywhere the request waits in the queue, unless max_queue requests wait already; a prompt no
    pool holds is a BadRequest. Where some node's whole pool holds the prompt and every token asked for, only such nodes
    take the request (it waits for one rather than being cut short on a smaller pool). KV-aware: with the prompt's ids, a
    node whose prefix cache holds more of it scores better (Dynamo's overlap score: the cached share of the prompt against
    the decode load), and needs its blocks less the hit.
    Cancelled once `cancelled` is set. samples: n samples of the prompt (they share its blocks; one more block each, and room
    for them in the node's batch). A request no node could ever hold is a BadRequest.
    Where only the node's figures stand in the way (this router's own count has room there) and one of this router's
    requests there landed or ended since they were made, the node is asked for its figures now (_ask): a request waits
    for an event (a release, a beat, an answer), never for the next beat to show what has already happened.
    Returns (node, its Admission): hand it to _landed once the node holds the blocks, and to _release after."""
    tokens, more = prompt_tokens + min(new_tokens, HEADROOM_TOKENS), samples - 1
    with self.cond:
      deadline, queued = time.monotonic() + self.queue_timeout, False
      try:
        while True:
          if cancelled is not None and cancelled.is_set(): raise Cancelled()
          up = [n for n in self.nodes.values() if n.up and n.can_decode]
          # a pool that holds the whole answer, where one exists: a smaller one would cut it short with 'length'
          whole = [n for n in up if n.blocks_for(prompt_tokens + new_tokens) + more <= n.status.get("kv_blocks", 0)] or up
          hit = {n: n.cached_tokens(ids, salt) if ids else 0 for n in whole}
          need = {n: n.blocks_for(tokens) - n.blocks_for(hit[n]) + more for n in whole}
          fits = [n for n in whole if n.free_blocks() >= need[n]]
          if not fits and self.endpoint is not None and (stale := [n for n in whole if n.changed and not n.asking and not n.no_status
                                                                   and n.status.get("kv_blocks", 0) - n.reserved_blocks >= need[n]]):
            for n in stale: n.changed, n.asking = False, True
            self.cond.release()         # the round trip without the lock (held once here: `with self.cond`)
            try:
              for n in stale: self._ask(n)
            finally: self.cond.acquire()
            continue
          if fits:
            score = {n: n.overlap(ids, salt) if ids else 0 for n in fits}
            node = min(fits, key=lambda n: (n.decode_load() - OVERLAP_WEIGHT * score[n] / max(1, prompt_tokens), -n.free_blocks()))
            node.reserved_blocks += need[node]
            node.recent.append(adm := Admission(need[node]))
            node.assigned += 1
            return node, adm
          if more and up and all(samples > n.status.get("max_seqs", samples) for n in up):
            raise BadRequest(f"n must be at most {max(n.status.get('max_seqs', 1) for n in up)} here (the decode nodes' batch, --max-seqs)")
          if up and all(n.blocks_for(prompt_tokens) + more > n.status.get("kv_blocks", 0) for n in up):
            raise BadRequest(f"a prompt of {prompt_tokens} tokens needs more KV blocks than any decode node has: shorten the prompt" +
                             (f" or ask for fewer than {samples} samples" if more else ""))
          if not queued:
            if self.waiting >= self.max_queue: raise Overloaded(f"every KV pool is full and {self.waiting} requests wait already")
            queued, self.waiting = True, self.waiting + 1
            self._gauge_waiting()
          if (left := deadline - time.monotonic()) <= 0:
            if not up: raise Unavailable("no decode node is up: " + "; ".join(f"{n.address}: {n.reason}" for n in self.nodes.values()))
            raise Overloaded(f"every KV pool stayed full for {self.queue_timeout:g} s")
          self.cond.wait(min(left, 0.5))
      finally:
        if queued:
          self.waiting -= 1
          self._gauge_waiting()

  def _ask(self, node: Node) -> None:
    """The node's figures now (node.status: what its next beat would say), without the lock: they show every admission
    that landed before the question, so those leave node.recent. Failing, the heartbeats' figures stand."""
    asked, s = time.monotonic(), None
    try:
      if node.status_client is None: node.status_client = ControlClient(self.endpoint, node.address)
      s = node.status_client.call("node.status", reply_timeout=max(1.0, self.hb_interval))
    except ControlError as e:
      if "unknown request" in str(e): node.no_status = True
    except Exception:                  # the heartbeat watch says whether the node is down; only this client goes
      client, node.status_client = node.status_client, None
      if client is not None: client.close()
    with self.cond:
      node.asking = False
      if isinstance(s, dict) and s.get("model") == node.status.get("model"):
        node.status = {**node.status, **{k: v for k, v in s.items() if k not in SUMMARY_KEYS}}
        node.asked_at = s.get("time") if isinstance(s.get("time"), (int, float)) else None
        node.recent = [a for a in node.recent if a.landed is None or a.landed >= asked]
      self.cond.notify_all()

  def _landed(self, node: Node, adm: Admission) -> None:
    """The node holds the admission's blocks now (its reservation answered, or its first token came)."""
    with self.cond:
      if adm.landed is None: adm.landed, node.changed = time.monotonic(), True

  def _release(self, node: Node, adm: Admission):
    """The request is over there: its blocks are back in the node's pool (its stream ended after the node freed them, or its
    connection closed), so no figure of the node's is to be read as missing them any more."""
    with self.cond:
      node.reserved_blocks -= adm.blocks
      node.assigned -= 1
      if adm in node.recent: node.recent.remove(adm)
      node.changed = True
      self.cond.notify_all()

  def _gauge_waiting(self):
    if self.metrics is not None: self.metrics.waiting.set(self.waiting)

  def _choose_prefill(self, decode: Node, prompt_len: int, output_len: int, cached: int = 0) -> Node | None:
    """The node to prefill on, or None: the decode node prefills for itself. cached: prompt tokens in the decode node's
    prefix cache: there it would prefill only the rest; a prefill node pulls the prefix out of its blocks or computes it
    again (its own measured choice, tinyhet.kv.pull.PullCost) and sends the suffix only. With a cluster file the planner
    weighs the two (plan.cached_disaggregation_pays for the file's pair, else plan.route for the suffix's length); without
    one a prefill node takes it (the decode node's own prefill rate is not measured here)."""
    with self.cond:
      others = [n for n in self.nodes.values() if n.up and n.can_prefill and n is not decode]
      if not others: return None
      best = min(others, key=Node.prefill_load)
      if decode.role == "both" and decode.prefill_load() <= best.prefill_load(): return None
      queue_s, local_queue_s = best.prefill_load() * self.prefill_s_per_token, decode.prefill_load() * self.prefill_s_per_token
    if self.planner is not None:
      from tinyhet.planner.plan import cached_disaggregation_pays, disaggregation_pays, route
      cluster, model = self.planner
      p, d = self.names.get(best.address), self.names.get(decode.address)
      try:
        if p and d and cached:     # a prefix-cache hit there: the suffix here against a pull (or recompute) and the suffix there
          if not cached_disaggregation_pays(cluster, cluster.model(model), p, d, prompt_len, cached, queue_s, local_queue_s): return None
        elif p and d:     # both in the file, with their roles: the cost model for this pair
          if not disaggregation_pays(cluster, cluster.model(model), p, d, prompt_len, queue_s, local_queue_s): return None
        elif not route(cluster, model, prompt_len - cached, output_len, prefill_queue_s=queue_s).disaggregate: return None   # the suffix
      except Exception as e: print(f"tinyhet serve: the planner failed ({e}); disaggregating", flush=True)
    return best

  # ---- one request
  def run(self, req: Request) -> str:
    """Serve req to the end: 'stop' (a stop id), 'length' (max_tokens) or 'cancelled'. Raises Overloaded, BadRequest, Unavailable."""
    # a sampled token's draw depends on (seed, position) only (tinyhet.model.sampling), so with one seed for every attempt a request
    # that starts over on another node continues the stream it began; without a seed from the client, one of its own
    if req.seed is None: req.seed = secrets.randbits(63)
    while True:
      if req.cancelled.is_set(): return "cancelled"
      if (req.generated and req.generated[-1] in req.stop_ids) or req.ended: return "stop"
      left = req.max_tokens - len(req.generated)
      if left <= 0: return "length"
      ids = req.prompt_ids + req.generated          # after a lost node: what the client has seen becomes prompt
      try: decode, adm = self._admit(len(ids), left, ids, req.cancelled, salt=req.cache_salt)
      except Cancelled: return "cancelled"
      try: self._attempt(req, decode, ids, left, adm)
      except Cancelled: return "cancelled"
      except _NodeLost as e:
        if req.cancelled.is_set(): return "cancelled"
        req.attempts += 1
        if self.metrics is not None: self.metrics.retries.labels(e.reason).inc()
        if req.attempts >= MAX_ATTEMPTS: raise Unavailable(f"the request lost a node {req.attempts} times; last: {e}") from None
        continue
      finally: self._release(decode, adm)
      if (req.generated and req.generated[-1] in req.stop_ids) or req.ended: return "stop"
      return "length"

  def _open(self, req: Request, node: Node, reason: str) -> ControlClient:
    if req.cancelled.is_set(): raise Cancelled()
    try: ctl = ControlClient(self.endpoint, node.address)
    except Exception as e:
      self._lost(node, f"cannot connect: {e}", close_clients=False)
      raise _NodeLost(reason, f"{node.address}: {e}") from None
    with self.cond:
      node.clients.add(ctl)
      req.clients.add(ctl)
    if req.cancelled.is_set(): ctl.close()       # cancel() ran between the check and the registration
    return ctl

  def _close(self, req: Request, node: Node, ctl: ControlClient):
    with self.cond:
      node.clients.discard(ctl)
      req.clients.discard(ctl)
    ctl.close()

  def _failed(self, req: Request, node: Node, e: Exception, reason: str) -> Exception:
    """What a failed call means for the request: the exception to raise. reason: '<role> node lost', the metric's label."""
    if req.cancelled.is_set(): return Cancelled()
    if isinstance(e, ControlError):
      msg = str(e)
      if e.kind in ("RequestTooLarge", "ValueError"): return BadRequest(msg)      # the node's own words: the request is at fault
      # the node answered, but the step failed (the KV did not arrive, the prefill could not reach the decode node): start over
      return _NodeLost(reason.replace("node lost", "failed"), msg)
    self._lost(node, f"{type(e).__name__}: {e}", close_clients=False)
    return _NodeLost(reason, f"{node.address} ({node.role}) lost: {type(e).__name__}: {e}")

  def _attempt(self, req: Request, decode: Node, ids: list[int], left: int, adm: Admission | None = None):
    # penalties count the client's output only: after a lost node the tokens already sent are part of the new prompt
    sampling = dict(temperature=req.temperature, top_p=req.top_p, options={**req.options, "output_from": len(req.prompt_ids)})
    ctl = self._open(req, decode, "decode node lost")
    try:
      prefill = self._choose_prefill(decode, len(ids), left, self._cached(ctl, decode, ids, req.cache_salt))
      try:
        if prefill is None:
          self._count(decode, "prefill+decode")
          stream = ctl.stream("decode.submit", prompt_ids=ids, max_new_tokens=left, seed=req.seed, stop_ids=req.stop_ids,
                              **({"stop": req.stop} if req.stop else {}), cache_salt=req.cache_salt, **sampling)
        else:
          # the prefill node writes the KV: the reservation's blocks open to it, not to this router (tcp checks every frame)
          # use_cache: a hit's shared blocks come with a read grant for the prefill node, which pulls (or recomputes) them
          r = ctl.call("decode.reserve", prompt_ids=ids, max_new_tokens=left, timeout=self.queue_timeout, writer=prefill.status.get("node"),
                       use_cache=bool(decode.status.get("prefix_cache")), cache_salt=req.cache_salt)
          if adm is not None: self._landed(decode, adm)
          self._done(req, decode, {"cached_tokens": r.get("cached_tokens", 0)}, len(ids))
      except Exception as e: raise self._failed(req, decode, e, "decode node lost") from None
      if prefill is not None:
        p = self._prefill(req, prefill, decode, ids, r, sampling)
        if "prompt_logprobs" in p and req.prompt_logprobs is None: req.prompt_logprobs = p["prompt_logprobs"][:len(req.prompt_ids)]
        req.push(p["first_token"], _logprobs(p))
        self._count(decode, "decode")
        gen = {**sampling, "options": {k: v for k, v in sampling["options"].items() if k != "prompt_logprobs"}}   # the prefill's part
        try: stream = ctl.stream("decode.generate", seq_id=r["seq_id"], first_token=p["first_token"], seed=p["seed"],
                                 stop_ids=req.stop_ids, timeout=30.0, **({"stop": req.stop} if req.stop else {}), **gen)
        except Exception as e: raise self._failed(req, decode, e, "decode node lost") from None
      try:
        for item in stream:
          if "token" in item:
            if adm is not None and adm.landed is None: self._landed(decode, adm)    # a submitted prompt's blocks: held by now
            req.push(item["token"], _logprobs(item))
          elif "prompt_logprobs" in item and req.prompt_logprobs is None: req.prompt_logprobs = item["prompt_logprobs"][:len(req.prompt_ids)]
          elif item.get("done"): self._done(req, decode, item, len(ids))
      except Exception as e: raise self._failed(req, decode, e, "decode node lost") from None
    finally: self._close(req, decode, ctl)

  def _prefill(self, req: Request, node: Node, decode: Node, ids: list[int], reservation: dict, sampling: dict) -> dict:
    ctl = self._open(req, node, "prefill node lost")
    with self.cond: node.inflight_tokens += len(ids)
    try:
      p = ctl.call("prefill.run", prompt_ids=ids, decode=decode.address, reservation=reservation, seed=req.seed, **sampling)
    except Exception as e: raise self._failed(req, node, e, "prefill node lost") from None
    finally:
      self._close(req, node, ctl)
      with self.cond: node.inflight_tokens -= len(ids)
    self._count(node, "prefill")
    computed = max(1, len(ids) - p.get("pulled_tokens", 0))     # a pulled prefix was read, not computed
    self.prefill_s_per_token = 0.8 * self.prefill_s_per_token + 0.2 * p["prefill_s"] / computed
    if self.metrics is not None:
      self.metrics.kv_bytes.inc(p["kv_bytes"])
      self.metrics.kv_pulled_bytes.inc(p.get("pulled_bytes", 0))
      self.metrics.kv_pulled_tokens.inc(p.get("pulled_tokens", 0))
      self.metrics.kv_pull_seconds.inc(p.get("pull_s", 0.0))
      self.metrics.kv_pull_wait_seconds.inc(p.get("pull_wait_s", 0.0))
      self.metrics.cached_recomputed.inc(p.get("cached_tokens", 0) - p.get("pulled_tokens", 0))
      self.metrics.kv_seconds.observe(p["transfer_s"])
    return p

  def _cached(self, ctl: ControlClient, node: Node, ids: list[int], salt: str = "") -> int:
    """The prompt tokens the decode node holds: its heartbeat's summary, or, where that shows less (a turn that ended a moment
    ago, before the next beat), the node's own answer (decode.lookup: one round trip, asked only when a prefill node could
    take the request instead)."""
    cached = node.cached_tokens(ids, salt)
    if cached < len(ids) - node.status.get("block_size", 16) and node.status.get("prefix_cache") and self._prefill_nodes(node):
      try: cached = max(cached, int(ctl.call("decode.lookup", prompt_ids=ids, cache_salt=salt)["cached_tokens"]))
      except Exception: pass                  # an older node without lookup, or a failing one: the summary's figure
    return cached

  def _prefill_nodes(self, decode: Node) -> bool:
    with self.cond: return any(n.up and n.can_prefill and n is not decode for n in self.nodes.values())

  def _done(self, req: Request, node: Node, item: dict, prompt_tokens: int):
    """A decode stream's last item: the prefix cache's hit (a decode node that prefilled for itself) and its preemptions."""
    # the prompt's tokens served from the cache: after a lost node the attempt's prompt holds tokens already generated,
    # which may be cached on the new node, but they are no prompt tokens of the client's
    if "cached_tokens" in item: req.cached_tokens = cached_prompt_tokens(item["cached_tokens"], len(req.prompt_ids))
    if item.get("ended"): req.ended = True
    if self.metrics is None: return
    if "cached_tokens" in item and node.status.get("prefix_cache", True):
      self.metrics.prefix_queries.inc(prompt_tokens)
      self.metrics.prefix_hits.inc(cached_prompt_tokens(item["cached_tokens"], prompt_tokens))    # the attempt's prompt, as the node saw it
    if item.get("preemptions"): self.metrics.preemptions.inc(int(item["preemptions"]))

  def _count(self, node: Node, role: str):
    if self.metrics is not None: self.metrics.node_work.labels(node.address, role).inc()

  def close(self):
    for w in self.watches: w.close()
    with self.cond: clients = [n.status_client for n in self.nodes.values() if n.status_client is not None]
    for c in clients: c.close()
