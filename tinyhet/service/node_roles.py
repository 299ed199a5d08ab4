"""What a node process adds for the cluster service (`tinyhet serve`): heartbeats, `decode.submit`, and the `both` role of
`tinyhet node` (the prefill role, `tinyhet.cli.node.main_prefill`, is a PrefillNode and heartbeats).

  decode.submit  prompt ids, max_new_tokens, sampling options -> the decode node prefills the prompt itself (its batching
                 loop's recompute path, on MESH) and streams every token, the first included. With n > 1: n samples of the
                 prompt from one prefill, forked there (sharing the prompt's KV blocks), sample i drawn with seed + i; each
                 item carries its sample's index. The router uses it for a
                 prompt short enough to prefill where it is decoded, for a `both` node's own requests, and when no prefill
                 node is left.
  --role prefill the model on HET and a PrefillNode (tinyhet.service.prefill_node) answering prefill.run.
  --role both    a decode node and a PrefillNode over one copy of the model on MESH: prefill jobs run on the batching
                 loop's thread between its steps, and the router gives the node prefill or decode work from the queue
                 lengths and free KV blocks its heartbeats report. A job keeps the node's decoding sequences at their pace
                 (KeepPace): between its layers, once a step's prefill_budget of prompt tokens' work has run, one decode step,
                 as the loop's own steps carry at most that many tokens of a prompt of its own (Scheduler.schedule_step).
"""
from __future__ import annotations
import queue
from tinyhet.service import heartbeat

def install_submit(decode) -> None:
  from tinyhet.engine.checks import check_prompt, check_salt, is_int
  from tinyhet.engine.forked_samples import Tagged
  from tinyhet.model.sampling import Sampler
  from tinyhet.engine.scheduler import Sequence
  from tinyhet.engine.grammar import constrain

  def serve_submit(conn, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
                   stop_ids: list[int] | None = None, options: dict | None = None, stop: list[str] | None = None, n: int = 1,
                   cache_salt: str = ""):
    check_prompt(decode.model.cfg, prompt_ids, max_new_tokens)
    check_salt(cache_salt)
    if not is_int(n) or not 1 <= n <= decode.scheduler.max_num_seqs:
      raise ValueError(f"n must be an integer in 1..{decode.scheduler.max_num_seqs} (this node's batch), got {n!r}")
    first = Sampler(temperature, top_p, seed, **(options or {}))      # a bad setting fails before an id is taken
    # sample i draws from seed + i: the same tokens as a request of its own with that seed
    samplers = [first] + [Sampler(temperature, top_p, (first.seed + i) % 2**64, **(options or {})) for i in range(1, n)]
    for sampler in samplers: constrain(sampler, decode.tokenizer, decode.model.cfg.vocab_size)   # a grammar that does not compile too
    seqs = [Sequence(decode.new_seq_id(), list(prompt_ids), max_new_tokens, cache_salt=cache_salt) for _ in range(n)]
    shared = queue.SimpleQueue()
    for i, (seq, sampler) in enumerate(zip(seqs, samplers)):
      seq.extra.update(queue=shared if n == 1 else Tagged(shared, i), sampler=sampler, want_logits=False, index=i, prompt_sent=i > 0,
                       stop_ids=set(stop_ids if stop_ids is not None else decode.stop_ids))
    try:
      for seq in seqs: decode.set_stop_strings(seq, stop)     # before the sequences join the batch
    except ValueError:
      with decode.cond: decode.live_ids.difference_update(s.seq_id for s in seqs)
      raise
    seqs[0].forks = seqs[1:]               # one prefill: the others fork from it (tinyhet.engine.scheduler)
    if decode.disk is not None: decode.disk.stage(prompt_ids, cache_salt)   # its blocks on disk read now, before the loop admits it
    with decode.cond:
      try: decode.scheduler.add(seqs[0])   # the batching loop prefills it when its blocks fit (first come, first served)
      except ValueError:
        decode.live_ids.difference_update(s.seq_id for s in seqs)
        raise
      decode.cond.notify_all()
    for seq in seqs: decode._attach(conn, seq)   # the connection closing drops them
    return stream_submitted(decode, conn, seqs[0]) if n == 1 else stream_samples(decode, conn, seqs, shared)

  decode.node.endpoint.handle("decode.submit", serve_submit)
  decode.can_submit = True

def stream_submitted(decode, conn, seq):
  """Every token of a submitted sequence, as the batching loop samples it. It yields None while it waits (the control
  channel then checks for a cancel or a departed client); however it ends, the sequence leaves the node."""
  from tinyhet.engine.decode_node import queued_tokens, token_item
  try:
    for tok in queued_tokens(seq): yield None if tok is None else token_item(tok)
    yield {"done": True, "preemptions": seq.num_preemptions, "cached_tokens": seq.extra.get("cached_tokens", 0),
           "ended": bool(seq.extra.get("grammar_done"))}
  finally: decode._detach(conn.state.get("seqs", {}), seq)

def stream_samples(decode, conn, seqs: list, shared: queue.SimpleQueue):
  """The tokens of n samples of one prompt, each item with its sample's `index`, and a {"done", "index"} item as each ends;
  the last item is {"done": True} with no index. None while nothing comes (as stream_submitted)."""
  from tinyhet.engine.forked_samples import sample_items
  try:
    yield from sample_items(seqs, shared, set(range(len(seqs))))
    yield {"done": True, "preemptions": sum(s.num_preemptions for s in seqs), "cached_tokens": seqs[0].extra.get("cached_tokens", 0)}
  finally:
    for seq in seqs: decode._detach(conn.state.get("seqs", {}), seq)

SUMMARY_HASHES = 1 << 18   # block hashes the router's view of a node's cache holds at most (4M tokens of 16-token blocks; ~6 MB of JSON)

class CacheSummary:
  """The block hashes of a node's prefix cache, for one heartbeat stream (KV-aware routing: the router walks a prompt's
  chain of hashes through them). Its first beat carries them all ("cached_hashes"), every later one what changed since
  the beat before ("cached_added", "cached_removed"): a stream's beats arrive in order and a new stream starts whole
  again, so the router's set is the node's, however long a conversation's chain. Past SUMMARY_HASHES the newest only.
  kind "disk" with hashes (a function: the disk tier's hashes, newest last) is the same summary of its disk tier
  ("disk_hashes", ...; tinyhet.service.cache_view)."""
  def __init__(self, bm, limit: int = SUMMARY_HASHES, kind: str = "cached", hashes=None):
    self.limit, self.sent, self.kind = limit, None, kind
    self.hashes = hashes or (lambda: list(bm.hash_block))       # newest last (tinyhet.kv.block_manager)

  def _now(self) -> set[int] | None:
    for _ in range(5):       # read without the lock: another thread may change the map meanwhile (then read again)
      try: return set(self.hashes()[-self.limit:])
      except RuntimeError: continue
    return None

  def __call__(self) -> dict:
    if (now := self._now()) is None: return {}            # this beat says nothing of the cache; the next one catches up
    k = self.kind
    if self.sent is None or len(now ^ self.sent) > self.limit: out = {f"{k}_hashes": list(now)}
    else: out = {f"{k}_added": list(now - self.sent), f"{k}_removed": list(self.sent - now)}
    self.sent = now
    return out

def cache_summaries(decode):
  """One heartbeat stream's summaries: the RAM prefix cache's, and the disk tier's where the node has one."""
  parts = [CacheSummary(decode.cache.block_manager)]
  if decode.disk is not None: parts.append(CacheSummary(None, kind="disk", hashes=decode.disk.store.hashes))
  return lambda: {k: v for part in parts for k, v in part().items()}

def decode_status(decode) -> dict:
  # read without decode.cond: a `both` node's batching loop can hold it while it waits for the model (a long prefill), and a
  # heartbeat must not wait that long; a count a moment stale is what a heartbeat is anyway
  bm, s = decode.cache.block_manager, decode.scheduler
  return {"model": decode.model_id, "fingerprint": decode.fingerprint, "cache_key": bm.model_id,
          "kv_blocks": s.capacity, "free_blocks": bm.num_free, "block_size": decode.cache.block_size,
          "running": len(s.running), "waiting": len(s.waiting), "incoming": len(s.incoming), "max_seqs": s.max_num_seqs,
          "max_context": decode.model.cfg.max_context, "cached_blocks": bm.num_cached, "prefix_queried_tokens": bm.queried_tokens,
          "prefix_hit_tokens": bm.matched_tokens, "preemptions": s.num_preemptions, "prefix_cache": bm.prefix_cache,
          "prefills": decode.prefills, "prefilled_tokens": decode.prefilled_tokens, **(decode.disk.status() if decode.disk else {}),
          "spec_drafted_tokens": decode.spec.drafted if decode.spec else 0, "spec_accepted_tokens": decode.spec.accepted if decode.spec else 0,
          **({"warm_up": decode.warm.status()} if decode.warm is not None else {})}

class KeepPace:
  """A `both` node's prefill job spread over decode steps: called with the rows of each layer (or chunk of a layer) the job
  has computed, it runs one decode step of the node's decoding sequences (batch_step.decode_only_step) once a step's budget
  of prompt tokens has gone by (a layer of T rows is T / n_layers tokens of a whole prompt's work). The job's KV and first
  token are the same (its computation is untouched); the decoding sequences' tokens too (their steps, only earlier)."""
  def __init__(self, decode):
    self.decode, self.owed, self.steps = decode, 0.0, 0

  def __call__(self, rows: int) -> None:
    from tinyhet.engine.batch_step import decode_only_step
    self.owed += rows / self.decode.model.cfg.n_layers
    if self.owed < self.decode.prefill_budget: return
    self.owed = 0.0
    if decode_only_step(self.decode): self.steps += 1

class ServiceExtras:
  """Heartbeats and decode.submit on a decode node; with role `both`, a PrefillNode sharing its model, on its own thread."""
  def __init__(self, decode, role: str):
    from tinyhet.service.prefill_node import PrefillNode
    install_submit(decode)
    self.prefill = None
    if role == "both":
      # tinygrad may be used from one thread only (its compile cache is a sqlite connection bound to the thread that opened
      # it, and its scheduler flips process-wide flags while it works), so prefill jobs run on the batching loop's thread:
      # before each step the loop runs queued prefills (DecodeNode.between_steps), without its lock, so that this node's own
      # control requests go on meanwhile.
      self.prefill = PrefillNode(decode.model, decode.node, decode.model_id, on_job=lambda: self._wake(decode), fingerprint=decode.fingerprint)
      self.prefill.tokenizer = decode.tokenizer
      self.prefill.pace = self.pace = KeepPace(decode)
      def prefill_first():                   # queued prefills before the next decode step; all of them while nothing decodes
        if self.prefill.jobs.qsize():
          self.prefill.run_one()
          while self.prefill.jobs.qsize() and not (decode.scheduler.running or decode.scheduler.waiting): self.prefill.run_one()
      decode.between_steps = prefill_first
    heartbeat.install(decode.node.endpoint, role, lambda: {**decode_status(decode), **(self.prefill.status() if self.prefill else {}),
                                                           **({"paced_steps": self.pace.steps} if self.prefill else {})},
                      per_stream=lambda: cache_summaries(decode))

  @staticmethod
  def _wake(decode):
    with decode.cond: decode.cond.notify_all()

  def close(self):
    if self.prefill is not None: self.prefill.close()
