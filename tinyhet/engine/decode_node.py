"""The decode node: the model and a paged KV pool on MESH (registered memory), continuous batching, and the control
requests a prefill node uses to hand it a sequence.

A sequence arrives in three steps, each a control request (tinyhet.runtime.control):
  decode.reserve   prompt ids, max_new_tokens -> a sequence id, its block table and per-layer pool descriptors of its own
                   (tcp lets only the writer write, and only into these blocks; the writer is the reserving peer, or the node
                   named by `writer`, as a router names its prefill node: a name its handshake proved, never one it claimed).
                   The reply's `grant` is this node's signature of what it granted (tinyhet.kv.grants), which the writer
                   checks against the prompt it is asked to prefill. The sequence keeps the writer's name (extra["writer"])
                   and whether this node's configuration trusts it as a prefill writer (extra["trusted_writer"]).
                   With use_cache, a prefix-cache hit's shared blocks (prefix_blocks) come with read-only descriptors
                   (read_pools) for the same peer, so it can pull them until the sequence leaves; the write descriptors
                   cover the suffix only. The blocks are held (admission waits while the pool is full); the prefill node
                   writes each layer's packed K, V straight into them with one transport write per layer or per chunk of a
                   layer, each with a notice (tinyhet.kv.notices: sequence, layer, piece, last; counted only from the writer).
  decode.generate  the first token (sampled by the prefill node) and sampling options (the prefill node's seed: draws depend on
                   (seed, position) only, so the stream goes on where it began) -> once every layer's notice has
                   arrived the sequence joins the running batch; its tokens stream back as they are decoded. A cancel
                   (or the client leaving) stops it; however it ends, the sequence and its descriptors are gone after.
  decode.restored  (a disk hit, the reservation's `restoring`) for its writer: waits until a layer of the prefix's blocks is read
                   back from the disk tier (tinyhet.kv.disk_restore), so the writer pulls each layer as soon as it is in.
  decode.release   give the sequence up (also done when the prefill node's connection closes). Blocks are reused only once
                   no write into them can still land: at once over tcp (descriptors withdrawn, landing frames drained),
                   over shm/verbs when every layer landed, the writer says its writes are done, or its connections close.
A full pool never crashes the node: reservations wait, and a decode step that needs a block preempts the newest sequence,
which is recomputed here later (its prompt and generated tokens prefilled again on this node).
"""
from __future__ import annotations
import itertools, queue, threading, time
from dataclasses import asdict
import numpy as np
from tinyhet.device.backend import region_of
from tinyhet.kv.grants import sign_grant
from tinyhet.kv.notices import LAYER_BITS, MAX_SEQ_ID, NOTICE_FORMAT, Landing, split_notice
from tinyhet.kv.paged_cache import PagedKVCache
from tinyhet.device.memory import LocalNode
from tinyhet.engine.checks import check_prompt, is_int
from tinyhet.engine.decode_engine import DecodeEngine, decode_rate
from tinyhet.engine.batch_step import run_batch
from tinyhet.engine.forked_samples import generate_samples, with_forks
from tinyhet.engine.grammar import constrain
from tinyhet.runtime.arena import Region
from tinyhet.model.fingerprint import cache_key; from tinyhet.kernels.kv_quant import kv_name  # noqa: E702
from tinyhet.model.llama import Llama
from tinyhet.runtime.wire import host_id
from tinyhet.model.sampling import Sampler
from tinyhet.engine.scheduler import Scheduler, Sequence, SequenceStatus
from tinyhet.engine.speculative import DEFAULT_K
from tinyhet.engine.token_queue import TICK, queued_tokens, token_item  # noqa: F401  (node_roles reads them here too)

def _check_timeout(timeout):
  if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not 0 < timeout <= 3600:
    raise ValueError(f"timeout must be a number of seconds in (0, 3600], got {timeout!r}")

class DecodeNode:
  def __init__(self, model: Llama, node: LocalNode, kv_blocks: int, block_size: int = 16, kv_dtype: str = "float16",
               max_num_seqs: int = 16, model_id: str = "", stop_ids: tuple[int, ...] = (), prefix_cache: bool = True,
               fingerprint: str = "", trusted_writers: tuple[str, ...] | None = None, prefill_budget: int | None = None):
    cfg = model.cfg
    if cfg.n_layers >= 1 << LAYER_BITS: raise ValueError(f"{cfg.n_layers} layers do not fit the {LAYER_BITS}-bit layer field of a notice")
    self.model, self.node, self.model_id, self.stop_ids = model, node, model_id, tuple(stop_ids)
    self.fingerprint, self.trusted_writers = fingerprint or model_id, frozenset(trusted_writers or node.config.trusted_writers or ())
    self.cache = PagedKVCache(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, kv_blocks + 1, block_size, kv_dtype, device="MESH",   # +1: PAD_SEQ's
                              max_seq_len=cfg.max_context, prefix_cache=prefix_cache, model_id=cache_key(self.fingerprint, kv_dtype))
    self.scheduler = Scheduler(self.cache.block_manager, max_num_seqs=max_num_seqs, capacity=kv_blocks)
    self.pool_regions = [_pool_region(self.cache.pool_buffer(layer)) for layer in range(cfg.n_layers)]   # exposed per reservation
    self.cond = threading.Condition()       # guards the scheduler, its block manager and the sequences' states
    self.seq_ids, self.stopped = itertools.count(1), False
    self.live_ids: set[int] = set()         # ids handed out and not yet detached: new_seq_id skips them when the counter wraps
    self.landed: dict[int, Landing] = {}    # seq_id -> the pieces of its layers whose notices arrived
    self.engine = DecodeEngine(model, self.cache)   # the jitted decode step; it holds PAD_SEQ's block
    self.in_step: set[Sequence] = set()     # sequences of the step being computed: their blocks must not be freed meanwhile
    self.limbo: dict[int, Sequence] = {}    # released before all layers landed while its writer may still copy (shm, verbs)
    self.rejected_notices, self.disk = 0, None  # disk: the KV disk tier (tinyhet.kv.disk_tier), or None
    self.speculative, self.spec = {"mode": "off", "k": DEFAULT_K}, None   # requests' default; the SpeculativeStep (engine.speculative_rows)
    self.draft = None                       # a DraftModel (engine/draft_model.py) for mode "draft", or None (tinyhet node --draft-model)
    self.prefills = self.prefilled_tokens = 0   # prefills run here and the prompt tokens they computed (a prefix hit's are not)
    self.can_submit = False                 # decode.submit is served here too (tinyhet.service.node_roles installs it)
    self.between_steps = None               # called by run() before each step, without the lock: other work on the model's thread
    self.tokenizer = None                   # the model's tokenizer (tinyhet node sets it): stop strings are matched here with it
    self.prefill_budget = node.config.prefill_budget if prefill_budget is None else prefill_budget   # per step while decoding
    self.warm, self.on_warm = None, None    # a WarmUp (engine/warm_up.py) run() builds from while idle; on_warm(status) once it is over
    ep = node.endpoint
    for name in ("info", "reserve", "generate", "release", "lookup", "restored"): ep.handle(f"decode.{name}", getattr(self, f"_serve_{name}"))
    self.notice_thread = threading.Thread(target=self._notices, name="tinyhet-decode-notices", daemon=True)
    self.notice_thread.start()

  # ---- control requests
  def _serve_info(self, conn, reset_peak: bool = False) -> dict:
    """The node's state; peak_used_blocks: the most KV blocks in use at once since the last reset_peak (the sampling benchmark's)."""
    c, bm = self.model.cfg, self.cache.block_manager
    with self.cond:
      open_seqs = len(self.scheduler.incoming) + len(self.scheduler.running) + len(self.scheduler.waiting)
      peak = bm.take_peak() if reset_peak is True else max(bm.peak_used, bm.num_used)
    return {"model": self.model_id, "fingerprint": self.fingerprint, "cache_key": bm.model_id, "kv_notice_format": NOTICE_FORMAT,
            "config": {k: v for k, v in asdict(c).items() if isinstance(v, (int, float, str, bool))},
            "block_size": self.cache.block_size, "kv_dtype": kv_name(self.cache.kv_dtype), "block_bytes": self.cache.block_nbytes,
            "kv_blocks": bm.num_blocks - 1, "free_blocks": bm.num_free, "largest_fit": bm.largest_fit(), "host": host_id(),
            # what a long-lived or misbehaving peer could make grow: the soak and fuzz tests watch these stay flat
            "open_sequences": open_seqs, "held_for_writers": len(self.limbo), "exposed_regions": len(self.node.endpoint.exposed),
            "rejected_notices": self.rejected_notices, "prefix_cache": bm.prefix_cache, "cached_blocks": bm.num_cached, "submit": self.can_submit,
            "prefix_queried_tokens": bm.queried_tokens, "prefix_hit_tokens": bm.matched_tokens, "preemptions": self.scheduler.num_preemptions,
            "prefills": self.prefills, "prefilled_tokens": self.prefilled_tokens, **(self.disk.status() if self.disk else {}),
            "speculative": self.speculative["mode"], "draft_model": self.draft.name if self.draft else None,
            "peak_used_blocks": peak, "connection_sequences": len(conn.state.get("seqs", {})), "connection_cleanups": len(conn.cleanups)}

  def _serve_lookup(self, conn, prompt_ids: list[int], cache_salt: str = "") -> dict:
    """How many of these prompt tokens the prefix cache holds now for this salt (a request here would prefill only the rest)."""
    check_prompt(self.model.cfg, prompt_ids, 1)
    with self.cond: n = len(self.cache.block_manager.match(prompt_ids, salt=cache_salt))
    return {"cached_tokens": (n + (self.disk.chain(prompt_ids, cache_salt, n) if self.disk else 0)) * self.cache.block_size}

  def _serve_reserve(self, conn, prompt_ids: list[int], max_new_tokens: int, timeout: float = 60.0, writer: str | None = None,
                     use_cache: bool = False, cache_salt: str = "", n: int = 1) -> dict:
    check_prompt(self.model.cfg, prompt_ids, max_new_tokens)
    if not is_int(n) or not 1 <= n <= self.scheduler.max_num_seqs:
      raise ValueError(f"n must be an integer in 1..{self.scheduler.max_num_seqs} (this node's batch), got {n!r}")
    _check_timeout(timeout)
    if writer is not None and (not isinstance(writer, str) or not 0 < len(writer.encode()) <= 200):
      raise ValueError(f"writer must name the node that writes the KV (at most 200 bytes), got {writer!r}")
    if not isinstance(use_cache, bool): raise ValueError(f"use_cache must be true or false, got {use_cache!r}")
    # the peer whose writes and notices count: the reserver, or the prefill node a router names for it. Names are proven
    # (a signature at the handshake, tinyhet.runtime.identity), so a grant to one peer is refused to every other
    owner = conn.peer if writer is None else writer
    seq = Sequence(self.new_seq_id(), list(prompt_ids), max_new_tokens, cache_salt=cache_salt, writer=owner)
    seq.extra.update(queue=queue.SimpleQueue(), layers=threading.Event(), owner=owner, writer=owner,
                     trusted_writer=owner in self.trusted_writers)
    # n > 1: the other samples fork from it (tinyhet.engine.forked_samples); nothing is written into their own blocks
    seq.forks = [Sequence(self.new_seq_id(), list(prompt_ids), max_new_tokens, cache_salt=cache_salt, writer=owner,
                          extra={"owner": owner, "writer": owner, "writes_done": True})
                 for _ in range(n - 1)]
    seq.extra["samples"] = list(seq.forks)
    deadline, tier = time.monotonic() + timeout, self.disk if use_cache else None
    with self.cond:
      try:
        self.scheduler.check_fits(seq)
        # a disk hit's blocks are taken unfilled: the tier's reader fills them layer by layer while the writer pulls and prefills
        while not self._reserve_incoming(seq, use_cache, tier):   # admission waits for blocks (or a free batch slot)
          if (left := deadline - time.monotonic()) <= 0:
            raise TimeoutError(f"the KV pool stayed full for {timeout} s ({self.cache.block_manager.num_free} blocks free, "
                               f"{self.cache.block_manager.blocks_needed(seq.num_tokens)} needed)")
          self.cond.wait(left)
      except BaseException:
        self.live_ids.difference_update([seq.seq_id] + [f.seq_id for f in seq.extra["samples"]])
        raise
      self.landed[seq.seq_id] = Landing(self.model.cfg.n_layers)
      cached = self.cache.block_manager.cached_length(seq.seq_id)
      for f in ([] if seq.writer == self.node.name or seq.writer in self.trusted_writers else [seq, *seq.forks]): f.cache_limit = cached
      # a hit's shared blocks are not the writer's: it writes (and its descriptors cover) the suffix's blocks only
      table = self.cache.block_manager.block_table(seq.seq_id)
      prefix, blocks = table[:cached // self.cache.block_size], table[cached // self.cache.block_size:]
    # this reservation's own descriptors: per layer the pool, open to its reserver only, at its own blocks only (tcp checks
    # both on every frame; shm and verbs cannot, see README), withdrawn when the sequence leaves. A write grant for the
    # suffix's blocks; with a hit, a read grant for the prefix's shared blocks (the prefill node pulls them: PrefixPull)
    bb, ep = self.cache.block_nbytes, self.node.endpoint
    descs = [ep.expose(r, owner=owner, allowed=[(b * bb, bb) for b in blocks], access="write") for r in self.pool_regions]
    reads = [ep.expose(r, owner=owner, allowed=[(b * bb, bb) for b in prefix], access="read") for r in self.pool_regions] if prefix else []
    seq.extra["descs"] = descs + reads
    for s in [seq] + seq.extra["samples"]: self._attach(conn, s)
    reply = {"seq_id": seq.seq_id, "blocks": blocks, "pools": [d.to_hex() for d in descs], "block_bytes": bb, "block_size": self.cache.block_size,
             "cached_tokens": cached, "prefix_blocks": prefix, "read_pools": [d.to_hex() for d in reads],
             **({"restoring": True} if "restore" in seq.extra else {})}   # pull each layer after decode.restored says it is in
    return {**reply, "grant": sign_grant(ep.identity, ep.name, owner, reply, seq.token_ids)}

  def _reserve_incoming(self, seq: Sequence, use_cache: bool, tier) -> bool:
    if tier is None: return self.scheduler.reserve_incoming(seq, use_cache)
    with tier.planned() as plan:
      if not self.scheduler.reserve_incoming(seq, use_cache): return False
    if plan: seq.extra["restore"] = tier.start(plan)
    return True

  def _serve_restored(self, conn, seq_id: int, layer: int, timeout: float = 60.0) -> dict:
    """For the sequence's writer: wait until layer `layer` of its disk hit's blocks is read back (tinyhet.kv.disk_restore),
    so its pull of that layer reads the bytes; the reply's `layers`: how many are in. The last layer's answer waits for the
    checksums; a block that fails them fails this call (and the sequence: decode.generate refuses it)."""
    _check_timeout(timeout)
    with self.cond: seq = self.scheduler.incoming.get(seq_id) if is_int(seq_id) else None
    if seq is None or seq.extra.get("owner") != conn.peer or "restore" not in seq.extra or not is_int(layer):
      raise ValueError(f"sequence {seq_id} has no disk hit being read back for this peer")
    return {"layers": seq.extra["restore"].wait_layer(layer, timeout)}

  def _serve_generate(self, conn, seq_id: int, first_token: int, temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
                      stop_ids: list[int] | None = None, timeout: float = 60.0, return_logits: bool = False, options: dict | None = None,
                      stop: list[str] | None = None, first_tokens: list[int] | None = None):
    """first_tokens: with n > 1 reserved, every sample's first token (the prefill node's, first_token among them)."""
    seq = conn.state.get("seqs", {}).get(seq_id) if is_int(seq_id) else None
    if seq is None or "samples" not in seq.extra: raise ValueError(f"sequence {seq_id} was not reserved on this connection")
    if "sampler" in seq.extra: raise ValueError(f"sequence {seq_id} is already generating")
    if seq.extra["samples"] or first_tokens is not None:
      return generate_samples(self, conn, seq, first_tokens, dict(temperature=temperature, top_p=top_p, seed=seed, options=options),
                              stop_ids, stop, timeout)
    if not is_int(first_token) or not 0 <= first_token < self.model.cfg.vocab_size: raise ValueError(f"bad first_token {first_token!r}")
    if stop_ids is not None and (not isinstance(stop_ids, list) or not all(is_int(t) for t in stop_ids)):
      raise ValueError(f"stop_ids must be a list of token ids, got {stop_ids!r}")
    _check_timeout(timeout)
    # raises on NaN, inf, negative or tiny temperatures, top_p outside (0, 1] and a bad seed; the prefill node's seed
    # continues its stream, since each draw depends on (seed, position) only
    sampler = Sampler(temperature, top_p, seed, **(options or {}))     # options: tinyhet.model.sampling.OPTIONS, checked there
    constrain(sampler, self.tokenizer, self.model.cfg.vocab_size)       # a grammar's token masks (tinyhet.engine.grammar)
    seq.extra.update(sampler=sampler, first_token=first_token, want_logits=bool(return_logits),
                     stop_ids=set(stop_ids if stop_ids is not None else self.stop_ids))
    self.set_stop_strings(seq, stop)
    return self._stream(conn, seq, timeout)

  def _stream(self, conn, seq: Sequence, timeout: float):
    """The generate stream. It yields None while it waits (the control channel then checks for a cancel or a departed
    client); however it ends, the sequence leaves the node and its connection."""
    try:
      deadline = time.monotonic() + timeout
      while not seq.extra["layers"].wait(min(TICK, max(0.0, deadline - time.monotonic()))):
        if time.monotonic() >= deadline:
          n = len(self.landed.get(seq.seq_id, ()))
          raise TimeoutError(f"sequence {seq.seq_id}: KV of {n} of {self.model.cfg.n_layers} layers arrived within {timeout} s")
        yield None
      yield from self.wait_restore(seq, deadline, timeout)
      t_ready = time.perf_counter()
      with self.cond:
        self.commit_restore(seq)
        del self.landed[seq.seq_id]
        first = seq.extra["first_token"]
        done = self.scheduler.commit_incoming(seq, first) or first in seq.extra["stop_ids"] or self._hits_stop(seq, first) or self.grammar_done(seq)
        if done and seq.status is SequenceStatus.RUNNING: self.scheduler.finish(seq)
        self.cond.notify_all()
      marks: list[float] = []
      for tok in (() if done else queued_tokens(seq)):
        if tok is None:
          yield None
          continue
        item = token_item(tok)
        if "token" in item: marks.append(time.perf_counter())
        yield item
      last = seq.extra.get("last_logits")
      yield {"done": True, "decode_tokens": len(marks), "decode_s": time.perf_counter() - t_ready, "decode_tok_s": decode_rate(marks),
             "first_token_wait_s": marks[0] - t_ready if marks else 0.0, "preemptions": seq.num_preemptions,
             "landed_at": seq.extra.get("landed_at", {}), "ended": bool(seq.extra.get("grammar_done")),
             **({"logits": last.tolist()} if last is not None else {})}
    finally:
      self._detach(conn.state.get("seqs", {}), seq)

  def wait_restore(self, seq: Sequence, deadline: float, timeout: float):
    """A disk hit's read back (tinyhet.kv.disk_restore) done and checked before a token is decoded: None while it runs
    (a stream's tick); raises where a block failed its check (the router starts the request over)."""
    if (job := seq.extra.get("restore")) is None: return
    while not job.finished.wait(TICK):
      if time.monotonic() >= deadline: raise TimeoutError(f"sequence {seq.seq_id}: its disk hit was not read back within {timeout} s")
      yield None
    if job.failed: raise RuntimeError(f"sequence {seq.seq_id}: {job.failed}; start the request over")

  def commit_restore(self, seq: Sequence) -> None:
    """Under the lock, as the sequence joins the batch: its read-back blocks take their hashes (shared from now on)."""
    if (job := seq.extra.get("restore")) is not None: self.disk.committed(seq.seq_id, job)

  def _serve_release(self, conn, seq_id: int, writes_done: bool = False) -> dict:
    """Give a reserved sequence up. writes_done: the caller waited for every write it posted, so the blocks can be reused
    at once; otherwise blocks whose layers did not all land stay held while the caller's shm/verbs connections are open."""
    seq = conn.state.get("seqs", {}).get(seq_id) if is_int(seq_id) else None
    if seq is None: raise ValueError(f"sequence {seq_id} was not reserved on this connection")
    if writes_done is True: seq.extra["writes_done"] = True
    self._detach(conn.state["seqs"], seq)
    return {}

  def set_stop_strings(self, seq: Sequence, stop) -> None:
    """Stop strings (a request's `stop`) end the sequence here, its blocks freed at once, as a stop id does. Matched on the
    text decoded from the tokens generated on this node (the first token included)."""
    from tinyhet.model.request_rules import check_stop      # the rule the HTTP API checked already
    if stop is None: return
    stop = check_stop(stop)
    if stop and self.tokenizer is None: raise ValueError("this decode node has no tokenizer to match stop strings: leave stop out")
    if stop: seq.extra.update(stop_strings=stop, stop_decoder=self.tokenizer.stream_decoder(), stop_tail="")

  def _hits_stop(self, seq: Sequence, token: int) -> bool:
    """Whether token (appended already) completes a stop string; never one of the first min_tokens output tokens."""
    if not (stops := seq.extra.get("stop_strings")): return False
    piece = seq.extra["stop_decoder"].push(token)
    tail = seq.extra["stop_tail"] + piece
    seq.extra["stop_tail"] = tail[-max(len(x) for x in stops):]       # enough to find a stop string that spans tokens
    if seq.extra["sampler"].holds_back_stops(seq.num_tokens - 1): return False
    return any((i := tail.rfind(x)) >= 0 and i + len(x) > len(tail) - len(piece) for x in stops)   # one this token's text ends

  def grammar_done(self, seq: Sequence) -> bool:
    """The sequence's output completes its grammar (nothing more may follow): it ends as a stop id ends it."""
    c = seq.extra["sampler"].constraint
    if c is None: return False
    try: ended = c.done(seq.token_ids)
    except ValueError: ended = True            # output outside the grammar (cannot be drawn through its mask): end it there
    if ended: seq.extra["grammar_done"] = True
    return ended

  def new_seq_id(self) -> int:
    """An id for a new sequence: the counter modulo MAX_SEQ_ID (the notice's field), skipping ids a live sequence still holds
    (one reserved, running, held for its writer, or not yet detached from its connection)."""
    with self.cond:
      for _ in range(MAX_SEQ_ID):
        sid = next(self.seq_ids) % MAX_SEQ_ID
        if sid not in self.live_ids and sid not in self.limbo and sid not in self.cache.block_manager:
          self.live_ids.add(sid)
          return sid
    raise RuntimeError(f"all {MAX_SEQ_ID} sequence ids are in use")

  def _attach(self, conn, seq: Sequence):
    if (seqs := conn.state.get("seqs")) is None:   # one cleanup per connection, not one per request: bookkeeping stays flat
      seqs = conn.state["seqs"] = {}
      conn.on_close(lambda: [self._detach(seqs, s) for s in list(seqs.values())])
    seqs[seq.seq_id] = seq

  def _detach(self, seqs: dict, seq: Sequence):
    if seqs.pop(seq.seq_id, None) is not None:
      self._drop(seq)
      with self.cond: self.live_ids.discard(seq.seq_id)

  def _drop(self, seq: Sequence):
    """The sequence leaves the node. Its descriptors go first (tcp: no byte lands after that); its blocks go back to the
    pool unless a writer that the node cannot fence (shm, verbs) may still be copying into them."""
    for d in seq.extra.pop("descs", ()): self.node.endpoint.withdraw(d)
    if (job := seq.extra.get("restore")) is not None: job.cancel()   # no read-back write lands in its blocks after this
    with self.cond:
      if seq.status is SequenceStatus.INCOMING:
        landed = len(self.landed.get(seq.seq_id, ()))
        if landed < self.model.cfg.n_layers and not seq.extra.get("writes_done") and self.node.endpoint.one_sided.get(seq.extra["owner"]):
          self.limbo[seq.seq_id] = seq       # freed when its last layers land or its writer's connections close (_notices)
          return
        self.scheduler.abort_incoming(seq)
      elif seq in self.in_step:               # its blocks are being written by this step: the loop frees them after it
        seq.extra["cancelled"] = True
        return
      elif seq.status is SequenceStatus.RUNNING: self.scheduler.finish(seq)
      elif seq.status is SequenceStatus.WAITING and seq in self.scheduler.waiting: self.scheduler.waiting.remove(seq)
      seq.status = SequenceStatus.FINISHED
      self.landed.pop(seq.seq_id, None)
      self.cond.notify_all()

  # ---- threads
  def _notices(self):
    """Count each sequence's landed layers; the last one lets its generate request proceed. A notice counts only for a
    layer the model has, from the peer that reserved the sequence."""
    while not self.stopped:
      try: self._notice(self.node.endpoint.wait_notice(timeout=TICK))
      except TimeoutError: pass
      if self.limbo: self._settle_limbo()

  def _notice(self, n):
    seq_id, layer, piece, last = split_notice(n.value)
    with self.cond:
      seq, landing = self.scheduler.incoming.get(seq_id), self.landed.get(seq_id)
      if seq is None or landing is None or n.peer != seq.extra["owner"] or not landing.add(layer, piece, last):
        self.rejected_notices += 1             # released, stale, not this peer's to give, or a piece that does not fit (Landing.add)
        return
      if layer in landing.done: seq.extra.setdefault("landed_at", {}).setdefault(str(layer), n.time)   # the prefill node's transfer figures
      if not landing.complete(): return
      if self.limbo.pop(seq_id, None) is None:
        seq.extra["layers"].set()
        return
      self._free_limbo(seq)                  # a released sequence's writer finished: its blocks are free to reuse

  def _settle_limbo(self):
    with self.cond:
      for seq in list(self.limbo.values()):
        if not self.node.endpoint.one_sided.get(seq.extra["owner"]):   # its writer's connections closed: nothing more can land
          del self.limbo[seq.seq_id]
          self._free_limbo(seq)

  def _free_limbo(self, seq: Sequence):
    self.scheduler.abort_incoming(seq)
    seq.status = SequenceStatus.FINISHED
    self.landed.pop(seq.seq_id, None)
    self.cond.notify_all()

  def warm_up(self, batch_sizes=(1,)):
    """Capture the jitted decode step for these batch buckets now, so the first request does not pay tinygrad's scheduling
    and compiles. Requests that arrive meanwhile wait for the loop."""
    self.engine.warm_up(batch_sizes, self.cond)

  def run(self, stop: threading.Event, warm_up: bool = True):
    """Continuous batching until stop is set: each step (Scheduler.schedule_step) one decode step for every decoding sequence,
    then prompt chunks of at most prefill_budget tokens (submitted prompts, recomputes), so decode keeps its pace; idle, the
    warm-up's next capture. Call it from the thread that loaded the model: tinygrad's compile cache is bound to one thread."""
    if warm_up: self.warm_up()
    while not self.stopped and not stop.is_set():
      if self.between_steps is not None: self.between_steps()      # on this thread, without the lock (a `both` node's prefills)
      with self.cond:
        decode, chunks = self.scheduler.schedule_step(self.prefill_budget)
        idle = not decode and not chunks
        if idle and (self.warm is None or self.warm.done):
          self.cond.wait(0.5)
          continue
        # a prompt's last chunk runs with its forks (n > 1), which take its KV and its logits
        pieces = [(with_forks(self.scheduler, s) if end == s.num_tokens else [s], (first, end)) for s, first, end in chunks]
        self.in_step = {*decode, *(f for batch, _ in pieces for f in batch)}
      if idle:                               # the warm-up's next capture, on this thread (tinygrad's), without the lock
        if not self.warm.step() and self.on_warm is not None: self.on_warm(self.warm.status())
        continue
      for batch, piece in ([(decode, None)] if decode else []) + pieces: run_batch(self, batch, piece)
      with self.cond: self.in_step = set()

  def _prefill(self, s: Sequence, first: int | None = None, end: int | None = None) -> np.ndarray | None:
    """A sequence's prompt (a recomputed one's prompt and tokens so far), or tokens first..end-1 of it (a chunk: Scheduler.
    schedule_step), into its blocks (prefill_sequence_logits). Logits (1, vocab); None until the prompt's last chunk."""
    from tinyhet.engine.prefill import prefill_sequence_logits
    from tinyhet.engine.prompt_logprobs import PromptLogprobs
    s.extra.setdefault("cached_tokens", hit := self.cache.block_manager.cached_length(s.seq_id))   # its first prefill's hit only
    # a submitted one's first prefill, with its prompt's logprobs asked for: from this prefill's rows, every chunk's
    if first in (None, hit) and (n := s.extra["sampler"].prompt_logprobs) is not None and not s.extra.get("prompt_sent"):
      s.extra["scorer"] = PromptLogprobs(self.model, s.token_ids, n)
    logits = prefill_sequence_logits(self.model, self.cache, s.seq_id, s.token_ids, first, end, s.extra.get("scorer"))
    self.prefilled_tokens += (len(s.token_ids) if end is None else end) - (hit if first is None else first)
    if logits is None: return None
    self.prefills += 1
    with self.cond: self.cache.block_manager.cache_blocks(s.seq_id, s.token_ids)   # its prompt's full blocks: found while it runs
    if (scorer := s.extra.pop("scorer", None)) is not None:
      s.extra["prompt_sent"] = True
      s.extra["queue"].put(("prompt", scorer.entries))
    return logits[None]

  def close(self):
    with self.cond: self.stopped = self.cond.notify_all() or True
    self.notice_thread.join(timeout=5)

def _pool_region(buf) -> Region:
  region, offset = region_of(buf)
  return Region(region.arena, region.offset + offset, buf.nbytes)
