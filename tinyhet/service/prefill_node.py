"""The prefill node: the model on HET, prefilling prompts for decode nodes it is told about, one at a time, in arrival order.

One control request (tinyhet.runtime.control) does the whole job:
  prefill.run   prompt ids, the decode node's address and the reservation it gave the router (decode.reserve's reply:
                seq_id, blocks, pools, block_bytes, block_size), sampling options -> the prompt is prefilled one layer at a
                time; each layer's K, V go to a writer thread (tinyhet.kv.sender) that packs them, or copies them out of a
                GPU through staging buffers, and writes them into the reserved blocks (notification (seq_id << 8) | layer)
                while the next layer computes; every write confirmed; the reply is the first token (sampled here), the seed it
                was sampled with (the decode node continues the (seed, position) stream with it) and the figures.
Before a byte is written the reservation's grant is checked (tinyhet.kv.grants): signed by the decode node this node
connected to, for this node and this prompt, so a caller cannot aim this node's writes or pulls at another request's blocks.
The router then sends decode.generate to the decode node on the connection that reserved. A transport error on a write
reconnects to the decode node and resends every layer once, after prefill. A job whose caller has gone away (the router
gave the reservation up) stops before its next write is posted, so no bytes land in blocks that may belong to another sequence by then.
A pull of a cached prefix that fails half-way (tinyhet.kv.pull.PullFailed) costs the job its pull, not its answer: the
prefix is computed here and every layer sent again (its pools are dropped, its staging freed).
"""
from __future__ import annotations
import queue, select, socket, sys, threading, time  # select.poll: select.select raises for a descriptor >= 1024
from dataclasses import dataclass, field
from tinygrad import Tensor
from tinyhet.kernels.kv_quant import kv_format
from tinyhet.kv.grants import check_grant
from tinyhet.kv.sender import KVSender, Pieces, SendBuffers
from tinyhet.engine.checks import IncompatibleDecodeNode, check_compatible, check_prompt
from tinyhet.engine.prefill import busy_time, prefill_first_token, prefill_pulled_logits
from tinyhet.engine.prompt_logprobs import PromptLogprobs
from tinyhet.kv.pull import PrefixPull, PullCost, PullFailed, RestoreGate, pull_spec
from tinyhet.runtime.control import ControlClient
from tinyhet.runtime.transport import TransportError
from tinyhet.model.sampling import Sampler
from tinyhet.engine.grammar import constrain

class CallerGone(RuntimeError):
  """The router closed the request's connection: the reservation is no longer ours to write."""

@dataclass(eq=False)
class Job:
  prompt_ids: list[int]
  decode: str
  reservation: dict
  sampling: dict
  sock: socket.socket | None = None          # the caller's control connection, watched for a hang-up
  done: threading.Event = field(default_factory=threading.Event)
  result: dict | None = None
  error: BaseException | None = None

  def caller_gone(self) -> bool:
    if self.sock is None: return False
    try:
      p = select.poll()
      p.register(self.sock, select.POLLIN | select.POLLHUP | select.POLLERR)
      events = p.poll(0)
      if any(ev & (select.POLLHUP | select.POLLERR | select.POLLNVAL) for _, ev in events): return True
      return bool(events) and self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (OSError, ValueError): return True

class PrefillNode:
  def __init__(self, model, node, model_id: str = "", transport: str | None = None, on_job=None, staging_buffers: int | None = None,
               fingerprint: str = ""):
    """on_job(): called when a job is queued (a `both` node wakes its batching loop, whose thread runs the jobs).
    staging_buffers: default node.config.staging_buffers (tinyhet.kv.sender.SendBuffers). fingerprint: the model's
    (tinyhet.model.fingerprint); a decode node of another one is refused."""
    self.model, self.node, self.model_id, self.transport, self.on_job = model, node, model_id, transport, on_job
    self.fingerprint = fingerprint
    self.jobs: queue.Queue[Job] = queue.Queue()
    self.queued_tokens = 0                       # prompt tokens waiting or being prefilled: the router's measure of load
    self.count_lock = threading.Lock()
    self.served = 0
    self.decoders: dict[str, tuple] = {}         # decode address -> (Peer, kv dtype)
    self.cost = PullCost()                       # pull a cached prefix or compute it again: this node's measured rates
    # host memory the layers leave from, kept between jobs; a GPU's packed layers leave through config.staging_buffers of it
    self.buffers = SendBuffers(node, node.config.staging_buffers if staging_buffers is None else staging_buffers)
    self.tokenizer = None                        # the model's tokenizer (tinyhet node sets it): a request's grammar needs its vocabulary
    self.pace = None                             # pace(tokens) as each layer of a job is computed (a `both` node's KeepPace)
    node.endpoint.handle("prefill.run", self._serve_run)

  def status(self) -> dict:
    return {"queued": self.jobs.qsize(), "queued_tokens": self.queued_tokens, "prefills": self.served, "model": self.model_id,
            "fingerprint": self.fingerprint,
            "link_gbps": round(self.cost.link_bps / 1e9, 4), "prefill_tok_s": round(self.cost.prefill_tok_s, 1)}

  def _serve_run(self, conn, prompt_ids: list[int], decode: str, reservation: dict, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int | None = None, timeout: float = 600.0, options: dict | None = None, n: int = 1) -> dict:
    cfg = self.model.cfg
    check_prompt(cfg, prompt_ids)
    need = ("seq_id", "blocks", "pools", "block_bytes", "block_size")
    if not isinstance(reservation, dict) or any(k not in reservation for k in need):
      raise ValueError(f"reservation must be decode.reserve's reply ({', '.join(need)})")
    blocks, _ = pull_spec(reservation)
    if blocks and not len(blocks) * reservation["block_size"] == reservation.get("cached_tokens") < len(prompt_ids):
      raise ValueError("the reservation's prefix blocks do not match its cached_tokens and the prompt")
    if len(reservation["pools"]) != cfg.n_layers:
      raise IncompatibleDecodeNode(f"the reservation has {len(reservation['pools'])} layers, this model {cfg.n_layers}: same --model everywhere")
    sampler = Sampler(temperature, top_p, seed, **(options or {}))     # a bad setting fails here, before the job queues
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 1024: raise ValueError(f"n must be an integer in 1..1024, got {n!r}")
    # n > 1: every sample's first token from the prompt's logits, sample i drawn with seed + i (tinyhet.engine.forked_samples)
    samplers = [sampler] + [Sampler(temperature, top_p, (sampler.seed + i) % 2**64, **(options or {})) for i in range(1, n)]
    for s in samplers: constrain(s, self.tokenizer, cfg.vocab_size)       # a grammar's first token is drawn here (tinyhet.engine.grammar)
    job = Job(list(prompt_ids), decode, reservation, {"sampler": sampler, "samplers": samplers}, conn.sock)
    with self.count_lock: self.queued_tokens += len(prompt_ids)
    self.jobs.put(job)
    if self.on_job is not None: self.on_job()
    if not job.done.wait(timeout): raise TimeoutError(f"prefill of {len(prompt_ids)} tokens did not finish within {timeout} s")
    if job.error is not None: raise job.error
    return job.result

  # ---- the model's thread
  def run(self, stop: threading.Event, idle=None):
    """Prefill jobs in arrival order until stop is set. Call it from the thread that loaded the model. idle() -> bool, if
    given, runs while no job is queued (a warm-up's next capture: tinyhet.engine.warm_up); False: it has nothing more to do."""
    while not stop.is_set():
      if idle is not None and not self.jobs.qsize() and idle(): continue
      self.run_one(timeout=0.5)

  def run_one(self, timeout: float = 0.0):
    """Run the oldest queued job, if one arrives within timeout."""
    try: job = self.jobs.get(timeout=timeout) if timeout > 0 else self.jobs.get_nowait()
    except queue.Empty: return
    try: job.result = self._prefill(job)
    except BaseException as e: job.error = e
    finally:
      with self.count_lock:
        self.queued_tokens -= len(job.prompt_ids)
        self.served += 1
      job.done.set()

  def _decoder(self, address: str, fresh: bool = False):
    if fresh and (old := self.decoders.pop(address, None)): old[0].close()
    if address not in self.decoders:
      ctl = ControlClient(self.node.endpoint, address)
      try: info = ctl.call("decode.info", reply_timeout=10)
      finally: ctl.close()
      check_compatible(self.model.cfg, self.model_id, info, f"at {address}", self.fingerprint, self.node.config.kv_dtype)
      self.decoders[address] = (self.node.endpoint.connect(address, self.transport), kv_format(info["kv_dtype"]))
    return self.decoders[address]

  def _prefill(self, job: Job) -> dict:
    if job.caller_gone(): raise CallerGone("the router went away before this prefill started")
    r, t0 = job.reservation, time.perf_counter()
    peer, kv_dtype = self._decoder(job.decode)
    check_grant(peer.name, peer.key, self.node.endpoint.name, r, job.prompt_ids)   # this node's writes and pulls go where the decode node said
    def still_wanted():                         # on the writer thread, before each layer's write is posted
      if job.caller_gone(): raise CallerGone("the router gave the reservation up during prefill")
    sender = KVSender(self.node.endpoint, peer, r, self.model.cfg, kv_dtype, self.buffers, still_wanted)
    kept: list[tuple[int, Tensor, Tensor, int]] = []   # every layer's K, V and first row sent, for a resend over a new link
    # a prefix-cache hit: the reservation's blocks are the suffix's; its prefix is pulled (read grant) or computed again here
    cached = len(pull_spec(r)[0]) * r["block_size"]
    sampler = job.sampling["sampler"]
    # the prompt's own logprobs need every row's hidden state: a cached prefix is computed again here then, never pulled
    scorer = None if sampler.prompt_logprobs is None else PromptLogprobs(self.model, job.prompt_ids, sampler.prompt_logprobs)
    pulled = cached > 0 and scorer is None and self.cost.should_pull(cached // r["block_size"] * r["block_bytes"] * self.model.cfg.n_layers, cached)

    def send_layer(layer: int, k: Tensor, v: Tensor):
      if isinstance(sender.writer.error, CallerGone): raise sender.writer.error    # stop prefilling for nobody
      first = cached if cached and not pulled else 0      # the whole prompt computed again: the suffix's rows only
      kept.append((layer, k, v, first))
      sender.send(layer, k, v, first)
      if self.pace is not None: self.pace(k.shape[0])

    def send_chunk(*piece) -> bool:     # a chunked prefill's blocks of a layer, as each chunk computes them (a pulled prefix's suffix too)
      if isinstance(sender.writer.error, CallerGone): raise sender.writer.error
      sent = sender.send_chunk(*piece)
      if self.pace is not None: self.pace((piece[3] - piece[2]) * r["block_size"])   # (layer, pool, b0, b1, ...): the blocks' rows
      return sent

    n, pull = len(job.prompt_ids), {}
    # a prefix the decode node is still reading back from its disk tier: each layer pulled once decode.restored says it is in
    gate = RestoreGate(self.node.endpoint, job.decode, r["seq_id"]) if r.get("restoring") else None
    try:
      if pulled:
        try:
          logits, pull = prefill_pulled_logits(self.model, job.prompt_ids, cached, r["block_size"], kv_dtype,
                                               lambda pools: PrefixPull(self.node, peer, r, pools, gate), send_layer, send_chunk)
          self.cost.saw_transfer(pull["pulled_bytes"], pull["pull_s"])
        except PullFailed as e:   # its pools are dropped and its reads ended: compute the prefix here, and send every layer again
          print(f"tinyhet: prefill node {self.node.name}: {e}; computing the prefix instead", file=sys.stderr, flush=True)
          sender.abort()
          peer, _ = self._decoder(job.decode, fresh=True)     # a refused read drops the link: writes go over a new one
          sender, pulled, pull = KVSender(self.node.endpoint, peer, r, self.model.cfg, kv_dtype, self.buffers, still_wanted), False, {}
          kept.clear()
      if not pulled: _, logits = prefill_first_token(self.model, job.prompt_ids, sampler, kv_dtype, send_layer, on_chunk=send_chunk, on_hidden=scorer)
      draws = [s.draw(logits, n, job.prompt_ids) for s in job.sampling["samplers"]]   # the first: the same draw again, with its logprobs
      first = draws[0]
      t_prefill = time.perf_counter()
      if not pulled: self.cost.saw_prefill(n, t_prefill - t0)
      try: transfers = sender.finish(60)
      except (TransportError, TimeoutError, OSError):    # the link broke (mid-stream, or since the last job): a new one, every layer again
        sender.abort()
        if job.caller_gone(): raise CallerGone("the router gave the reservation up during the transfer") from None
        peer, _ = self._decoder(job.decode, fresh=True)
        sender, old = KVSender(self.node.endpoint, peer, r, self.model.cfg, kv_dtype, self.buffers, still_wanted), sender
        for layer, k, v, row in kept: sender.send(layer, k, v, row)     # (not `first`: that is the sampled token)
        sender.resend_pieces(old)
        transfers = sender.finish(60)
    except BaseException as e:
      sender.abort()                            # kept layers and staging buffers outlive the writes that read them
      if isinstance(e, TransportError) and (old := self.decoders.pop(job.decode, None)): old[0].close()   # a broken link: a new one next job
      raise
    finally:
      if gate is not None: gate.close()
    kv_bytes, transfer_s = sum(t.nbytes for t in transfers.values()), busy_time([(t.started, t.finished) for t in transfers.values()])
    self.cost.saw_transfer(kv_bytes, transfer_s)
    last = max(t.finished for t in transfers.values())
    lp = {} if first.logprob is None else {"logprob": first.logprob, "top_logprobs": first.top}
    if scorer is not None: lp["prompt_logprobs"] = scorer.entries
    if len(draws) > 1:
      lp["first_tokens"] = [d.token for d in draws]
      if first.logprob is not None: lp["first_logprobs"] = [{"logprob": d.logprob, "top_logprobs": d.top} for d in draws]
    return {"first_token": first.token, **lp, "seed": sampler.seed, "prefill_s": t_prefill - t0, "kv_bytes": kv_bytes, "transfer_s": transfer_s,
            "hidden_share": 1 - max(0.0, last - t_prefill) / transfer_s if transfer_s > 0 else 1.0, "staging_waits": sender.staging_waits,
            "kv_writes": sum(len(t.transfers) if isinstance(t, Pieces) else 1 for t in transfers.values()),   # a chunked layer: one a piece
            "node": self.node.name, "cached_tokens": cached, "pulled_tokens": cached if pulled else 0,
            "pulled_bytes": pull.get("pulled_bytes", 0), "pull_s": pull.get("pull_s", 0.0), "pull_wait_s": pull.get("pull_wait_s", 0.0)}

  def close(self):
    for peer, _ in self.decoders.values(): peer.close()
    self.buffers.free()
