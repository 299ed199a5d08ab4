"""A prefill node's handle on one decode node (`tinyhet run`, `tinyhet bench e2e`): reserve blocks there, prefill here with
each layer's K, V written into them as soon as the layer exists (tinyhet.kv.sender), then stream the tokens the decode node
generates, and say what the transfer cost (GenerationStats, from tinyhet.engine.prefill.transfer_figures)."""
from __future__ import annotations
import time
from tinyhet.kernels.kv_quant import kv_format
from tinyhet.device.memory import LocalNode
from tinyhet.engine.checks import check_compatible
from tinyhet.engine.prefill import GenerationStats, busy_time, prefill_first_token, transfer_figures
from tinyhet.kv.sender import KVSender, Pieces, SendBuffers
from tinyhet.model.llama import Llama
from tinyhet.model.sampling import Sampler
from tinyhet.runtime.control import ControlClient
from tinyhet.runtime.wire import host_id

LOCAL_SUFFIX_SHARE = 0.25   # as the router's: a decode node holding all but this share of a prompt prefills the rest itself

class Reserving:
  """A request's reservation while its prefill runs: decode.reserve was sent before the prefill started (pending, a
  tinyhet.runtime.control.Pending), and its reply is read when the prefill hands over its first layer, by when the embedding
  and layer 0's first half have run: the round trip (~1 ms on two busy cores) overlaps them instead of adding to the TTFT.
  A reservation that fails raises there, out of the prefill."""
  def __init__(self, pending, make_sender):
    self.pending, self.make_sender, self.made = pending, make_sender, None

  def sender(self) -> KVSender:
    if self.made is None: self.made = self.make_sender(self.pending.result())
    return self.made

  def send(self, layer, k, v): self.sender().send(layer, k, v)
  def send_chunk(self, *piece) -> bool: return self.sender().send_chunk(*piece)

class DecodeClient:
  """A prefill node's handle on one decode node: checks the model matches, then runs requests against it."""
  def __init__(self, node: LocalNode, address: str, model: Llama, model_id: str = "", transport: str | None = None,
               staging_buffers: int | None = None, fingerprint: str = "", kv_dtype: str | None = None):
    """kv_dtype: the KV dtype this side packs and expects the decode node to hold (default: this node's configured one); a
    decode node of another one is refused. A benchmark driving decode nodes of several dtypes from one process names each."""
    self.node, self.model = node, model
    self.ctl = ControlClient(node.endpoint, address)
    self.info = self.ctl.call("decode.info")
    check_compatible(model.cfg, model_id, self.info, f"{self.ctl.peer} at {address}", fingerprint, kv_dtype or node.config.kv_dtype)
    self.peer = node.endpoint.connect(address, transport)
    self.endpoint = node.endpoint            # what posts the layer writes (a benchmark may put a slower link in front of it)
    self.kv_dtype = kv_format(self.info["kv_dtype"])
    # layers packed in device memory no transport sends from (a GPU) leave through staging_buffers buffers (tinyhet.device.gpu_staging);
    # 0 copies each one to host memory on the prefill thread (the synchronous baseline)
    self.buffers = SendBuffers(node, node.config.staging_buffers if staging_buffers is None else staging_buffers)

  def generate(self, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0, seed: int | None = 0,
               stop_ids: tuple[int, ...] = (), on_token=None, return_logits: bool = False, progress=None) -> tuple[list[int], GenerationStats]:
    """Prefill here, decode there. on_token(id) sees each token as it arrives (the first one as soon as prefill ends);
    progress(layers done) as each prefill layer finishes."""
    stats = GenerationStats(prompt_tokens=len(prompt_ids), transport=self.peer.transport)
    t0 = time.perf_counter()
    # a decode node holding most of the prompt prefills the rest itself (the prefill node pulling the prefix is not built)
    if self.info.get("prefix_cache") and self.info.get("submit") and not return_logits:
      cached = self.ctl.call("decode.lookup", prompt_ids=list(prompt_ids))["cached_tokens"]
      if cached and len(prompt_ids) - cached <= LOCAL_SUFFIX_SHARE * len(prompt_ids):
        return self._submit(prompt_ids, max_new_tokens, temperature, top_p, seed, stop_ids, on_token, stats, t0)
    # the prefill starts while the decode node reserves: the reply is read as the first layer is handed over (Reserving)
    reserving = Reserving(self.ctl.begin("decode.reserve", prompt_ids=list(prompt_ids), max_new_tokens=max_new_tokens),
                          lambda r: KVSender(self.endpoint, self.peer, r, self.model.cfg, self.kv_dtype, self.buffers))
    done: dict = {}
    try:
      sampler = Sampler(temperature, top_p, seed)
      first, logits = prefill_first_token(self.model, prompt_ids, sampler, self.kv_dtype, reserving.send, progress, reserving.send_chunk)
      t_first = time.perf_counter()
      sender, r = reserving.sender(), reserving.pending.result()
      stats.prefill_s, stats.handoff_s = t_first - t0, sender.handoff_s
      sender.check()                           # a failed write: the decode node would wait for that layer in vain
      if on_token is not None: on_token(first)
      out = [first]
      # the decode node draws from the same (seed, position) stream: the same seed gives the tokens one device would give
      for item in self.ctl.stream("decode.generate", seq_id=r["seq_id"], first_token=first, temperature=temperature, top_p=top_p,
                                  seed=sampler.seed, stop_ids=list(stop_ids), return_logits=return_logits):
        if "token" in item:
          out.append(item["token"])
          if on_token is not None: on_token(item["token"])
        elif item.get("done"):
          done = item
          stats.decode_tokens, stats.decode_tok_s, stats.preemptions = item["decode_tokens"], item["decode_tok_s"], item["preemptions"]
          stats.last_logits = item.get("logits", logits.tolist() if return_logits and len(out) == 1 else None)
    except BaseException:
      try: r = reserving.pending.result()
      except Exception: r = None               # the reservation itself failed: nothing to give back
      if r is not None:
        settled = reserving.made.abort() if reserving.made is not None else True   # the layers it keeps must outlive the writes reading them
        # writes_done only when every posted write finished: otherwise a shm/verbs write may still land, and the node holds the blocks
        try: self.ctl.call("decode.release", seq_id=r["seq_id"], writes_done=settled, reply_timeout=10)
        except Exception: pass
      raise
    transfers = sender.finish(60)
    stats.staging_waits = sender.staging_waits
    stats.kv_writes = sum(len(t.transfers) if isinstance(t, Pieces) else 1 for t in transfers.values())
    # the decode node's notice times are on this clock only on this host (perf_counter is CLOCK_MONOTONIC there)
    theirs = done.get("landed_at") if self.info.get("host") == host_id() else None
    transfer_figures(stats, t0, t_first, sender.computed, sender.posted, {l: t.finished for l, t in transfers.items()},
                     sum(t.nbytes for t in transfers.values()), {int(l): x for l, x in theirs.items()} if theirs else None)
    if stats.kv_writes > len(transfers):    # layers sent in chunks: bytes moved during each piece's write, not between the chunks
      stats.transfer_s = busy_time([(sender.writer.posted[k], t.finished) for k, t in sender.writer.transfers.items()])
      stats.transfer_gbps = stats.kv_bytes / stats.transfer_s / 1e9 if stats.transfer_s > 0 else 0.0
    return out, stats

  def _submit(self, prompt_ids, max_new_tokens, temperature, top_p, seed, stop_ids, on_token, stats, t0):
    """The decode node prefills (the uncached suffix only) and decodes: decode.submit; no KV moves."""
    out: list[int] = []
    sampler = Sampler(temperature, top_p, seed)
    for item in self.ctl.stream("decode.submit", prompt_ids=list(prompt_ids), max_new_tokens=max_new_tokens, temperature=temperature,
                                top_p=top_p, seed=sampler.seed, stop_ids=list(stop_ids)):
      if "token" in item:
        if not out: stats.ttft_s = stats.prefill_s = time.perf_counter() - t0
        out.append(item["token"])
        if on_token is not None: on_token(item["token"])
      elif item.get("done"): stats.preemptions, stats.cached_tokens = item.get("preemptions", 0), item.get("cached_tokens", 0)
    stats.decode_tokens = max(0, len(out) - 1)
    stats.transport = "none (prefilled on the decode node)"
    return out, stats

  def close(self):
    self.ctl.close()
    self.peer.close()
    self.buffers.free()
