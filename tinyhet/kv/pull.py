"""A cached prefix's K, V pulled out of a decode node's blocks into a prefill's own pools (tinyhet.model.chunked_prefill's
layout, the decode node's too: (blocks, 2, n_kv_heads, block_size * head_dim) per layer), one one-sided read per layer,
all posted at once; the prefill waits for layer l's read just before layer l first needs it, so the read of layer l
overlaps the compute of the layers before it. The reads go through the read grant decode.reserve(use_cache) returned
(read_pools: per layer the pool, open to this peer at the prefix's blocks only, until the reservation ends).

  pull = PrefixPull(endpoint, peer, reservation, pools)   # posts every layer's read into pools[l][0:len(prefix_blocks)]
  pull.wait(l)                                            # layer l's prefix is in pools[l]; raises the read's failure
  pull.finish()                                           # every read done: the figures (bytes, seconds in flight, stall)
  pull.abort()                                            # a failed prefill: wait out every read, free the host staging

A prefix the decode node is still reading back from its disk tier (the reservation's `restoring`, tinyhet.kv.disk_restore)
comes with a gate: gate(l) returns once layer l of those blocks is in the decode node's pool (decode.restored). Then a
thread of the pull posts layer l's read as soon as gate(l) returns, in layer order, and wait(l) waits for that post too:
the disk read of the later layers overlaps the pull and the compute of the earlier ones.

A read that fails raises PullFailed from wait(l) (the prefill node then computes the prefix itself, tinyhet.service.prefill_node);
the pools it was filling are not handed to another job (tinyhet.engine.prefill.pull_pools).

Where a pool lies decides how it fills: a pool in registered host memory (HET on a CPU) is read into in place; elsewhere (a
GPU) the bytes land in a host region of this node first and wait(l) copies layer l in.

PullCost is the per-request choice between pulling and recomputing: pull when the prefix's bytes over the link rate cost
less than computing the prefix again at the prefill rate (both measured on this node as requests run: its writes to
decode nodes, its pulls, its prefills); until both are measured, pull.
"""
from __future__ import annotations
import threading, time
from tinygrad import Tensor, dtypes
from tinygrad.device import Buffer
from tinyhet.device.backend import NotRegistered, region_of
from tinyhet.runtime.arena import Region
from tinyhet.runtime.descriptor import RegionDescriptor
from tinyhet.kv.sender import block_spans
from tinyhet.runtime.transport import TransportError

class PullFailed(TransportError):
  """A prefix read failed (the holder withdrew its grant, the link broke, it timed out): compute the prefix instead."""

def pull_spec(reservation: dict) -> tuple[list[int], list[RegionDescriptor]]:
  """The prefix blocks and per-layer read descriptors of a reservation (empty where nothing was cached); a malformed one raises."""
  blocks, pools = reservation.get("prefix_blocks") or [], reservation.get("read_pools") or []
  if not isinstance(blocks, list) or not all(isinstance(b, int) and b >= 0 for b in blocks) or not isinstance(pools, list):
    raise ValueError("the reservation's prefix_blocks / read_pools are malformed")
  if bool(blocks) != bool(pools): raise ValueError("the reservation has prefix blocks without read descriptors, or the reverse")
  return blocks, [RegionDescriptor.from_hex(h) for h in pools]

class PrefixPull:
  def __init__(self, node, peer, reservation: dict, pools: list[Tensor], gate=None):
    blocks, descs = pull_spec(reservation)
    if len(descs) != len(pools): raise ValueError(f"the reservation has read descriptors for {len(descs)} layers, the prefill {len(pools)}")
    bb = self.block_bytes = reservation["block_bytes"]
    self.pools, self.nbytes = pools, len(blocks) * bb       # per layer
    if pools[0].nbytes() < self.nbytes: raise ValueError(f"a {pools[0].nbytes()}-byte pool cannot hold a {self.nbytes}-byte prefix")
    self.host: Region | None = None
    self.t0 = time.perf_counter()
    self.transfers, self.waited, self.copied = [], 0.0, set()
    self.posted, self.error, self.poster = threading.Condition(), None, None
    self.spans = []
    for l, pool in enumerate(pools):
      try: region, off = region_of(pool.uop.buffer)            # the pool is registered host memory: read straight into it
      except NotRegistered:
        if self.host is None: self.host = node.arena("MESH").alloc(len(pools) * self.nbytes, align=4096)
        region, off = self.host, l * self.nbytes
      self.spans.append(block_spans(region, off, descs[l], blocks, bb))   # one span a run of consecutive blocks
    if gate is not None:
      self.poster = threading.Thread(target=self._post_gated, args=(node, peer, gate), name="tinyhet-pull-gate", daemon=True)
      self.poster.start()
      return
    try:
      for spans in self.spans: self.transfers.append(node.endpoint.read(peer, spans))
    except Exception as e:                 # the reads posted so far end before the caller forgets the pools
      self.abort()
      raise PullFailed(f"the pull of a cached prefix could not be posted: {type(e).__name__}: {e}") from e

  def _post_gated(self, node, peer, gate):
    try:
      for l, spans in enumerate(self.spans):
        gate(l)
        if self.error is not None: return   # abort(): nothing more is posted
        t = node.endpoint.read(peer, spans)
        with self.posted:
          self.transfers.append(t)
          self.posted.notify_all()
    except Exception as e:
      with self.posted:
        self.error = e
        self.posted.notify_all()

  def _transfer(self, layer: int, timeout: float):
    if self.poster is None: return self.transfers[layer]
    with self.posted:
      if not self.posted.wait_for(lambda: len(self.transfers) > layer or self.error is not None, timeout):
        raise TimeoutError(f"layer {layer} of the prefix was not read back from the decode node's disk within {timeout} s")
      if len(self.transfers) > layer: return self.transfers[layer]
      raise self.error

  def wait(self, layer: int, timeout: float = 60.0):
    t = time.perf_counter()
    try: self._transfer(layer, timeout).wait(timeout)
    except Exception as e: raise PullFailed(f"the pull of layer {layer}'s cached prefix failed: {type(e).__name__}: {e}") from e
    if self.host is not None and layer not in self.copied:    # landed in host memory: into the device pool's first blocks
      data = self.host.view(layer * self.nbytes, self.nbytes)
      dst = self.pools[layer].uop.buffer.view(self.nbytes, dtypes.uint8, 0).ensure_allocated()
      dst.copy_from(Buffer("PYTHON", self.nbytes, dtypes.uint8, opaque=data))
      self.copied.add(layer)
    self.waited += time.perf_counter() - t

  def finish(self, timeout: float = 60.0) -> dict:
    """Wait for every read (a failed prefill must not free pools a read may still fill); the pull's figures."""
    if self.poster is not None: self.poster.join(timeout)
    for t in self.transfers: t.wait(timeout)
    end = max((t.finished for t in self.transfers), default=self.t0)
    if self.host is not None: self.host.free()
    self.host = None
    return {"pulled_bytes": self.nbytes * len(self.pools), "pull_s": max(0.0, end - self.t0), "pull_wait_s": self.waited}

  def abort(self, timeout: float = 30.0) -> bool:
    """Wait for every read to end, landed or failed; then the host staging is freed. False where a read did not end within
    timeout: its staging is kept (a late byte must land in memory nobody else was given), and the caller drops the pools."""
    settled = True
    if self.poster is not None:
      with self.posted: self.error = self.error or PullFailed("aborted")   # its gate returns within its timeout; nothing posted after
      self.poster.join(timeout)
      settled = not self.poster.is_alive()
    for t in list(self.transfers):
      try: t.wait(timeout)
      except TimeoutError: settled = False
      except Exception: pass               # failed: it writes nothing more
    if settled and self.host is not None:
      self.host.free()
      self.host = None
    return settled

class RestoreGate:
  """PrefixPull's gate for a prefix the decode node reads back from disk: gate(l) returns once layer l is in its pool
  (decode.restored, asked on a control connection of its own, opened at the first call); raises where the read-back
  failed or the sequence left (the pull fails: PullFailed)."""
  def __init__(self, endpoint, address: str, seq_id: int, timeout: float = 60.0):
    self.endpoint, self.address, self.seq_id, self.timeout = endpoint, address, seq_id, timeout
    self.ctl, self.have = None, 0

  def __call__(self, layer: int) -> None:
    if self.have > layer: return
    from tinyhet.runtime.control import ControlClient
    if self.ctl is None: self.ctl = ControlClient(self.endpoint, self.address)
    self.have = int(self.ctl.call("decode.restored", reply_timeout=self.timeout + 10, seq_id=self.seq_id, layer=layer,
                                  timeout=self.timeout)["layers"])

  def close(self) -> None:
    if self.ctl is not None: self.ctl.close()
    self.ctl = None

class PullCost:
  """Measured rates, kept as running averages: the link's (bytes/s of this node's writes and pulls) and the prefill's
  (prompt tokens/s). should_pull(prefix bytes, prefix tokens): bytes / link rate < tokens / prefill rate."""
  def __init__(self):
    self.link_bps = self.prefill_tok_s = 0.0

  @staticmethod
  def _avg(old: float, new: float) -> float: return new if old <= 0 else 0.7 * old + 0.3 * new

  def saw_transfer(self, nbytes: int, seconds: float):
    if nbytes > 0 and seconds > 0: self.link_bps = self._avg(self.link_bps, nbytes / seconds)

  def saw_prefill(self, tokens: int, seconds: float):
    if tokens > 0 and seconds > 0: self.prefill_tok_s = self._avg(self.prefill_tok_s, tokens / seconds)

  def estimate(self, nbytes: int, tokens: int) -> tuple[float, float] | None:
    """(seconds to pull, seconds to recompute), or None until both rates are measured."""
    if self.link_bps <= 0 or self.prefill_tok_s <= 0: return None
    return nbytes / self.link_bps, tokens / self.prefill_tok_s

  def should_pull(self, nbytes: int, tokens: int) -> bool:
    return (e := self.estimate(nbytes, tokens)) is None or e[0] < e[1]
