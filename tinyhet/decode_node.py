"""The decode node: the model and a paged KV pool on MESH (registered memory), continuous batching, and the control
requests a prefill node uses to hand it a sequence.

A sequence arrives in three steps, each a control request (tinyhet.runtime.control):
  decode.reserve   prompt ids, max_new_tokens -> a sequence id, its block table and the per-layer pool descriptors. The
                   blocks are held (admission waits while the pool is full); the prefill node writes each layer's packed
                   K, V straight into them with one transport write per layer, notification (seq_id << 8) | layer.
  decode.generate  the first token (sampled by the prefill node) and sampling options -> once every layer's notice has
                   arrived the sequence joins the running batch; its tokens stream back as they are decoded.
  decode.release   give the sequence up (also done when the prefill node's connection closes).
A full pool never crashes the node: reservations wait, and a decode step that needs a block preempts the newest sequence,
which is recomputed here later (its prompt and generated tokens prefilled again on this node).
"""
from __future__ import annotations
import itertools, queue, threading, time
from dataclasses import asdict
import numpy as np
from tinygrad import Tensor, TinyJit, dtypes
from tinyhet.devices import region_of
from tinyhet.kv_cache import PagedKVCache
from tinyhet.memory import LocalNode
from tinyhet.model import Llama, one_worker
from tinyhet.runtime.wire import host_id
from tinyhet.sampling import Sampler
from tinyhet.scheduler import Scheduler, Sequence, SequenceStatus

LAYER_BITS = 8            # a notice's value: (seq_id << LAYER_BITS) | layer
MAX_SEQ_ID = 1 << (32 - LAYER_BITS)

def notice_value(seq_id: int, layer: int) -> int: return (seq_id << LAYER_BITS) | layer
def split_notice(value: int) -> tuple[int, int]: return value >> LAYER_BITS, value & ((1 << LAYER_BITS) - 1)

class DecodeNode:
  def __init__(self, model: Llama, node: LocalNode, kv_blocks: int, block_size: int = 16, kv_dtype: str = "float16",
               max_num_seqs: int = 16, model_id: str = "", stop_ids: tuple[int, ...] = ()):
    cfg = model.cfg
    if cfg.n_layers >= 1 << LAYER_BITS: raise ValueError(f"{cfg.n_layers} layers do not fit the {LAYER_BITS}-bit layer field of a notice")
    self.model, self.node, self.model_id, self.stop_ids = model, node, model_id, tuple(stop_ids)
    self.cache = PagedKVCache(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, kv_blocks, block_size, kv_dtype, device="MESH",
                              max_seq_len=cfg.max_context)
    self.scheduler = Scheduler(self.cache.block_manager, max_num_seqs=max_num_seqs)
    self.pools = [node.expose(*region_of(self.cache.pool_buffer(l))).narrow(0, self.cache.pool_buffer(l).nbytes) for l in range(cfg.n_layers)]
    self.cond = threading.Condition()       # guards the scheduler, its block manager and the sequences' states
    self.seq_ids = itertools.count(1)
    self.landed: dict[int, set[int]] = {}   # seq_id -> layers whose notice arrived
    self.steps: dict[int, TinyJit] = {}     # batch size -> jitted decode step
    self.stopped = False
    self.in_step: set[Sequence] = set()     # sequences of the step being computed: their blocks must not be freed meanwhile
    ep = node.endpoint
    for name in ("info", "reserve", "generate", "release"): ep.handle(f"decode.{name}", getattr(self, f"_serve_{name}"))
    self.notice_thread = threading.Thread(target=self._notices, name="tinyhet-decode-notices", daemon=True)
    self.notice_thread.start()

  # ---- control requests
  def _serve_info(self, conn) -> dict:
    c, bm = self.model.cfg, self.cache.block_manager
    return {"model": self.model_id, "config": {k: v for k, v in asdict(c).items() if isinstance(v, (int, float, str, bool))},
            "block_size": self.cache.block_size, "kv_dtype": self.cache.kv_dtype.name, "block_bytes": self.cache.block_nbytes,
            "kv_blocks": bm.num_blocks, "free_blocks": bm.num_free, "largest_fit": bm.largest_fit(), "host": host_id()}

  def _serve_reserve(self, conn, prompt_ids: list[int], max_new_tokens: int, timeout: float = 60.0) -> dict:
    if not isinstance(prompt_ids, list) or not prompt_ids or not all(isinstance(t, int) and 0 <= t < self.model.cfg.vocab_size for t in prompt_ids):
      raise ValueError(f"prompt_ids must be a non-empty list of token ids below {self.model.cfg.vocab_size}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if len(prompt_ids) + max_new_tokens > self.model.cfg.max_context:
      raise ValueError(f"prompt ({len(prompt_ids)}) + max_new_tokens ({max_new_tokens}) exceeds the model's context ({self.model.cfg.max_context})")
    seq = Sequence(next(self.seq_ids) % MAX_SEQ_ID, list(prompt_ids), max_new_tokens)
    seq.extra.update(queue=queue.SimpleQueue(), layers=threading.Event())
    deadline = time.monotonic() + timeout
    with self.cond:
      self.scheduler.check_fits(seq)
      while not self.scheduler.reserve_incoming(seq):            # admission waits for blocks (or a free batch slot)
        if (left := deadline - time.monotonic()) <= 0:
          raise TimeoutError(f"the KV pool stayed full for {timeout} s ({self.cache.block_manager.num_free} blocks free, "
                             f"{self.cache.block_manager.blocks_needed(seq.num_tokens)} needed)")
        self.cond.wait(left)
      self.landed[seq.seq_id] = set()
      blocks = self.cache.block_manager.block_table(seq.seq_id)
    conn.on_close(lambda: self._drop(seq))
    conn.__dict__.setdefault("seqs", {})[seq.seq_id] = seq
    return {"seq_id": seq.seq_id, "blocks": blocks, "pools": [d.to_hex() for d in self.pools], "block_bytes": self.cache.block_nbytes,
            "block_size": self.cache.block_size}

  def _serve_generate(self, conn, seq_id: int, first_token: int, temperature: float = 0.0, top_p: float = 1.0, rng_state: dict | None = None,
                      stop_ids: list[int] | None = None, timeout: float = 60.0, return_logits: bool = False):
    seq = conn.__dict__.get("seqs", {}).get(seq_id)
    if seq is None: raise ValueError(f"sequence {seq_id} was not reserved on this connection")
    if not isinstance(first_token, int) or not 0 <= first_token < self.model.cfg.vocab_size: raise ValueError(f"bad first_token {first_token!r}")
    sampler = Sampler(temperature, top_p, 0)
    if rng_state is not None: sampler.rng.bit_generator.state = rng_state      # continue the prefill node's random stream
    seq.extra.update(sampler=sampler, stop_ids=set(stop_ids if stop_ids is not None else self.stop_ids), want_logits=bool(return_logits))
    if not seq.extra["layers"].wait(timeout):
      n = len(self.landed.get(seq_id, ()))
      raise TimeoutError(f"sequence {seq_id}: KV of {n} of {self.model.cfg.n_layers} layers arrived within {timeout} s")
    t_ready = time.perf_counter()
    with self.cond:
      del self.landed[seq_id]
      done = self.scheduler.commit_incoming(seq, first_token) or first_token in seq.extra["stop_ids"]
      if done and seq.status is SequenceStatus.RUNNING: self.scheduler.finish(seq)
      self.cond.notify_all()
    return self._stream(seq, t_ready, done)

  def _stream(self, seq: Sequence, t_ready: float, done: bool):
    marks: list[float] = []
    while not done:
      tok = seq.extra["queue"].get()
      if isinstance(tok, Exception): raise tok
      if tok is None: break
      marks.append(time.perf_counter())
      yield {"token": tok}
    last = seq.extra.get("last_logits")
    # tokens/s between the first and the last decoded token: the rate of the running batch, not the wait for a free step
    rate = (len(marks) - 1) / (marks[-1] - marks[0]) if len(marks) > 1 and marks[-1] > marks[0] else 0.0
    yield {"done": True, "decode_tokens": len(marks), "decode_s": time.perf_counter() - t_ready, "decode_tok_s": rate,
           "first_token_wait_s": marks[0] - t_ready if marks else 0.0, "preemptions": seq.num_preemptions,
           "landed_at": seq.extra.get("landed_at", {}),
           **({"logits": last.tolist()} if last is not None else {})}

  def _serve_release(self, conn, seq_id: int) -> dict:
    seq = conn.__dict__.get("seqs", {}).pop(seq_id, None)
    if seq is None: raise ValueError(f"sequence {seq_id} was not reserved on this connection")
    self._drop(seq)
    return {}

  def _drop(self, seq: Sequence):
    with self.cond:
      if seq.status is SequenceStatus.INCOMING: self.scheduler.abort_incoming(seq)
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
    """Count each sequence's landed layers; the last one lets its generate request proceed."""
    while not self.stopped:
      try: n = self.node.endpoint.wait_notice(timeout=0.5)
      except TimeoutError: continue
      seq_id, layer = split_notice(n.value)
      with self.cond:
        if (layers := self.landed.get(seq_id)) is None: continue        # released, or a stale notice
        layers.add(layer)
        seq = self.scheduler.incoming.get(seq_id)
        if seq is not None: seq.extra.setdefault("landed_at", {})[str(layer)] = n.time     # for the prefill node's transfer figures
      if seq is not None and len(layers) == self.model.cfg.n_layers: seq.extra["layers"].set()

  def warm_up(self, batch_sizes=(1,)):
    """Capture the jitted decode step for these batch sizes now (a scratch sequence of one token), so the first request
    does not pay tinygrad's scheduling and compiles. Requests that arrive meanwhile wait for the loop."""
    bm, scratch = self.cache.block_manager, -1
    for B in batch_sizes:
      ids = [scratch - i for i in range(B)]
      with self.cond:
        if not all(bm.can_allocate(2) for _ in ids) or bm.num_free < 2 * B: return
        for i in ids: bm.allocate(i, 1)
      try:
        for _ in range(3):      # TinyJit: the first call runs, the second captures, the third replays
          with self.cond: positions = self.cache.begin_step(ids, 1)
          self._forward([[0]] * B, positions, False)
      finally:
        with self.cond:
          for i in ids: bm.deallocate(i)

  def run(self, stop: threading.Event, warm_up: bool = True):
    """Continuous batching until stop is set: one decode step for every running sequence, or the recompute of preempted
    ones. Call it from the thread that loaded the model: tinygrad's compile cache is bound to one thread."""
    if warm_up: self.warm_up()
    while not self.stopped and not stop.is_set():
      with self.cond:
        seqs, is_prefill = self.scheduler.schedule()
        if not seqs:
          self.cond.wait(0.5)
          continue
        self.in_step = set(seqs)
      for batch in ([[s] for s in seqs] if is_prefill else [seqs]):    # a recompute runs each sequence at its own length
        with self.cond: positions = self.cache.begin_step([s.seq_id for s in batch], batch[0].num_tokens if is_prefill else 1)
        tokens = [s.token_ids for s in batch] if is_prefill else [[s.token_ids[-1]] for s in batch]
        try: logits = self._forward(tokens, positions, is_prefill)
        except Exception as e:                 # a failed step fails its sequences, not the node
          logits = None
          for s in batch: s.extra["queue"].put(RuntimeError(f"decode step failed on {self.node.name}: {type(e).__name__}: {e}"))
        with self.cond:
          live = [s for s in batch if not s.extra.get("cancelled")]
          if logits is None: finished = list(live)
          else:
            new = {s.seq_id: s.extra["sampler"](logits[i]) for i, s in enumerate(batch)}
            for i, s in enumerate(batch):
              if s.extra.get("want_logits"): s.extra["last_logits"] = logits[i].copy()     # the logits behind the newest token
            finished = self.scheduler.postprocess(live, [new[s.seq_id] for s in live])
            for s in live:
              s.extra["queue"].put(new[s.seq_id])
              if new[s.seq_id] in s.extra["stop_ids"] and s not in finished: finished.append(s)
          for s in batch:
            if (s in finished or s.extra.get("cancelled")) and s.status is SequenceStatus.RUNNING: self.scheduler.finish(s)
          for s in finished: s.extra["queue"].put(None)
          self.cond.notify_all()
      with self.cond: self.in_step = set()

  def _forward(self, tokens: list[list[int]], positions: np.ndarray, is_prefill: bool) -> np.ndarray:
    toks = Tensor(np.array(tokens, dtype=np.int32), device="MESH")
    pos = Tensor(positions.astype(np.int32), device="MESH")
    with one_worker():
      if is_prefill: return self.model.forward(toks, pos, self.cache).numpy()
      B = len(tokens)
      if B not in self.steps:   # one capture per batch size; the block count reaches the JIT as a bound Variable argument
        self.steps[B] = TinyJit(lambda t, p, **kv: self.model.forward(t, p, self.cache).realize())
      return self.steps[B](toks, pos, **self.cache.jit_kwargs()).numpy()

  def close(self):
    self.stopped = True
    with self.cond: self.cond.notify_all()
    self.notice_thread.join(timeout=5)

def kv_blocks_for(cfg, block_size: int, kv_dtype: str, kv_bytes: int) -> int:
  """How many blocks a KV budget of kv_bytes holds (all layers, K and V)."""
  per_block = PagedKVCache.bytes_per_block(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, block_size, getattr(dtypes, kv_dtype))
  if kv_bytes < per_block: raise ValueError(f"a KV budget of {kv_bytes} bytes holds no block ({per_block} bytes each)")
  return kv_bytes // per_block
