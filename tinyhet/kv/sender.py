"""A request's K, V on their way from the prefill device into the decode node's reserved blocks, one layer at a time, while
the next layer computes. Both prefill clients use it: DecodeClient (tinyhet run, tinyhet.engine.prefill) and PrefillNode (the
service). The prefill thread only queues, or, for a layer of at most INLINE_LAYER_BYTES (a short prompt) not leaving through
the staging ring, and for every piece of a chunked prefill (INLINE_CHUNKS), posts it itself (LayerWriter.post: cheaper than
waking the writer thread; a slow write then holds up the next layer). Over shm a request's notices are held and sent in
one call before its final write (LayerWriter.hold), not one a write. A short prompt's writes to a decode node on this host
are kept back and posted together after its last layer (DEFER_SHORT):

  sender = KVSender(endpoint, peer, reservation, cfg, kv_dtype, buffers)
  sender.send(layer, k, v)     prefill thread, as each layer's K, V exist; never raises a write's failure
  sender.send_chunk(layer, pool, b0, b1, piece, n_pieces)   or, where the prefill packs K, V into blocks itself (a chunked
                               prefill's chunks, a short prompt's layers on a CPU), each piece of a layer's blocks as soon
                               as it exists (False: cannot, send the layer whole); each piece has its own notice
  sender.check()               raises the first write's failure, if one has failed so far
  sender.finish(timeout)       every write posted and landed: {layer: Transfer}; raises the first failure
  sender.abort()               after a failure: waits for what was posted; buffers a write may still read are never reused

Where a layer's K, V lie decides how it leaves:
  registered host memory (HET on the CPU)   the writer thread packs it (numpy, GIL released) into a host region and writes it
  device memory no transport sends from     packed on the device, copied out through N staging buffers by the writer thread
  (a GPU without GPUDirect RDMA)            (tinyhet.device.gpu_staging); with N = 0, copied on the prefill thread (the baseline)
  registered device memory                  packed on the device, written from there
"""
from __future__ import annotations
import functools, math, time
import numpy as np
from tinygrad import Tensor
from tinygrad.uop.ops import Ops
from tinyhet.kv.notices import MAX_PIECES, notice_value
from tinyhet.device.backend import NotRegistered, region_of
from tinyhet.kernels.kv_pack import pack_kv, pack_kv_host
from tinyhet.kernels.kv_quant import code_of, is_q8, np_storage, tile_len
from tinyhet.runtime.arena import Region
from tinyhet.runtime.descriptor import RegionDescriptor
from tinyhet.runtime.transport import Span, Transfer
from tinyhet.device.gpu_staging import StagingRing, unpin
from tinyhet.kv.layer_writer import LayerWriter, post_packed  # noqa: F401  (importable from here, as they always were)

def host_array(t: Tensor) -> np.ndarray | None:
  """A realized tensor's bytes in registered host memory as a numpy array (no copy), or None where they are elsewhere (a GPU)
  or numpy has no such dtype."""
  base = t.uop.base
  if base.op is not Ops.BUFFER or t.dtype.fmt is None: return None
  buf, shape = base.buffer, t.shape       # plain attributes: Tensor.nbytes() and a second .buffer cost ~25 us of tinygrad's Python
  try: region, offset = region_of(buf)
  except NotRegistered: return None
  if buf.nbytes != (nbytes := math.prod(shape) * t.dtype.itemsize): return None
  return np.frombuffer(region.view(offset, nbytes), dtype=np.dtype(t.dtype.fmt)).reshape(shape)

class SendBuffers:
  """Registered host memory a prefill client's requests send from, kept from one request to the next: one region for every
  layer packed on the host, and n_staging buffers of one layer each for layers packed in device memory (0: none, the
  synchronous copy)."""
  def __init__(self, node, n_staging: int):
    self.node, self.n_staging = node, n_staging
    self.host_region: Region | None = None
    self.staging: list[Region] = []

  def host(self, nbytes: int) -> Region:
    if self.host_region is None or self.host_region.nbytes < nbytes:
      if self.host_region is not None: self.host_region.free()
      self.host_region = self.node.arena("MESH").alloc(nbytes, align=4096)
    return self.host_region

  def ring(self, nbytes: int) -> StagingRing | None:
    if self.n_staging == 0: return None
    if not self.staging or self.staging[0].nbytes < nbytes:
      self._free_staging()
      pages = -(-nbytes // 4096) * 4096          # whole pages: a GPU driver pins them for its copy engine (tinyhet.device.gpu_staging)
      self.staging = [self.node.arena("MESH").alloc(pages, align=4096) for _ in range(self.n_staging)]
    return StagingRing(self.staging)

  def forget(self):
    """A write may still read these buffers (it neither landed nor failed in time): never hand them out again. Their arena
    space stays taken; that is the price of not letting a late write read bytes of another request."""
    self.host_region, self.staging = None, []

  def _free_staging(self):
    unpin(self.staging)
    for r in self.staging: r.free()
    self.staging = []

  def free(self):
    if self.host_region is not None: self.host_region.free()
    self.host_region = None
    self._free_staging()

INLINE_LAYER_BYTES = 256 * 1024   # a request's layers up to this size are packed and posted on the prefill thread (LayerWriter.post):
                                  # SmolLM2's up to ~340 tokens; longer prompts keep the writer thread's overlap with the next layer

def block_spans(region: Region, offset: int, pool: RegionDescriptor, blocks: list[int], block_bytes: int) -> list[Span]:
  """Spans writing consecutive blocks of local bytes (from offset on) into a pool's blocks `blocks`, one span a run of
  consecutive destination blocks: a reservation's blocks mostly are one run (the free queue hands them out in order), and
  every span costs the transport Python work (checks, pieces, a memmove or a frame record): 32 a 512-token chunk, not 1."""
  spans, i, n = [], 0, len(blocks)
  while i < n:
    j = i + 1
    while j < n and blocks[j] == blocks[j - 1] + 1: j += 1
    spans.append(Span(region, offset + i * block_bytes, pool, blocks[i] * block_bytes, (j - i) * block_bytes))
    i = j
  return spans

DEFER_SHORT = True   # a short prompt's writes to a decode node on this host are posted together after its last layer (KVSender._defers).
                     # Posted between layers, each hand-off ran with caches the prefill's kernels had just filled with weights: ~180 us
                     # a layer where the same steps back to back take ~50 us (SmolLM2, 100 tokens, two cores: 5.5 ms -> 2 ms a
                     # request); over tcp the receiving threads woke once, not per write. Nothing moves later that could have moved
                     # sooner: the posting thread's shm copy overlaps nothing, and the decode node waits for every layer anyway

INLINE_CHUNKS = True   # a chunked prefill's pieces (send_chunk) are posted on the prefill thread whatever their size: they lie packed
                       # in registered host memory, so the prefill runs on this host's CPU, whose kernels keep every core busy; a writer
                       # thread overlaps nothing there, and its wake-up and GIL hand-offs (~1 ms each on two cores) came per piece:
                       # 240 at 4,096 tokens. What is left is a memcpy (shm) or queueing for the transport's stream threads (tcp)

GROUP_BYTES = 8 << 20  # a chunked prefill's pieces are kept back and posted together at the chunk's last layer (or the request's final
                       # write), one transport call a group (Endpoint.write_many), a group at most this many bytes: shm copies up to 8 MiB
                       # on the caller's thread (runtime/shm.py INLINE_BYTES). Posted one by one, each piece cost ~0.1 ms of Python and
                       # lookups on caches the layer's kernels had just filled (240 a 4,096-token prompt), more than a 209 KB q8_0 piece's
                       # copy, and tcp sent each piece of up to 256 KB on the prefill thread. At 4K tokens, 4 MiB groups moved float16 in
                       # ~130 ms over tcp, 8 MiB ~115 ms; a group waits for at most one chunk's compute, and the last chunk's last group is
                       # posted as its last layer is stored, as its last piece was. A short prompt's layers kept back (_defers) still go
                       # one by one: each is small enough for tcp to send at once from the prefill thread, with nothing left to overlap

def _layer(key) -> int: return key[0] if isinstance(key, tuple) else key   # a writer's key: a layer, or (layer, piece)

class Pieces:
  """A layer's chunk writes as one: its bytes, when the first started and the last finished."""
  def __init__(self, transfers: list[Transfer]):
    self.transfers, self.nbytes = transfers, sum(t.nbytes for t in transfers)
    self.started = min(t.started for t in transfers)
    self.finished = max(t.finished for t in transfers) if all(t.done() for t in transfers) else None
  def done(self) -> bool: return self.finished is not None

class KVSender:
  """One request's layers into the blocks a decode node reserved for it (decode.reserve's reply: seq_id, blocks, pools,
  block_bytes, block_size). Each write notifies tinyhet.kv.notices.notice_value(seq_id, layer, piece, last)."""
  def __init__(self, endpoint, peer, reservation: dict, cfg, kv_dtype, buffers: SendBuffers, before_post=None):
    r = reservation
    self.seq_id, self.blocks, self.block_bytes, self.block_size = r["seq_id"], list(r["blocks"]), r["block_bytes"], r["block_size"]
    self.pools = [RegionDescriptor.from_hex(h) for h in r["pools"]]
    self.kv_dtype, self.buffers = kv_dtype, buffers
    self.layer_bytes = len(self.blocks) * self.block_bytes
    self.writer = LayerWriter(endpoint, peer, before_post, INLINE_LAYER_BYTES)
    # host region and stage: made on the first layer whose K, V are in host memory (HET on a CPU), never where the layers
    # are in device memory and leave through the staging ring (that region is n_layers x layer bytes: 10 GiB for 32K tokens of 70B)
    self.cfg, self.host, self.stage = cfg, None, None
    self.ring = buffers.ring(self.layer_bytes)
    self.keep: list[Tensor] = []              # K, V or packed layers stay alive until their writes have landed
    self.computed: dict[int, float] = {}      # when each layer's K, V were handed over (perf_counter; chunked: its last piece)
    self.cached = r.get("cached_tokens", 0)   # the reservation's blocks start past a cached prefix (chunk pieces: from there)
    self.pieces: list[tuple] = []             # send_chunk's arguments, in order
    self.handoff_s = 0.0                      # time the prefill thread spent in send()
    self.ended: set[int] = set()              # layers whose last write is posted: the n_layers-th is the request's final write
    self.defer: bool | None = None            # writes kept back until the final one (_defers): decided at the first
    self.later: list[tuple] = []              # (post, its arguments) kept back, posted by post_later
    self.later_bytes = 0                      # the chunk pieces' bytes among them (_group)

  def host_stage(self) -> Region:
    """The host region every layer packed on the host goes to, (layers, blocks, 2, KVH, block_size*D): the pools' bytes
    (self.stage, a numpy view), made on first use. Rows past the prompt (pads) only reach the slack of the last block, which
    the decode node masks until its own tokens overwrite it."""
    if self.host is None:
      cfg, nbytes = self.cfg, self.cfg.n_layers * self.layer_bytes
      self.host = self.buffers.host(nbytes)
      tile = tile_len(self.kv_dtype, self.block_size, cfg.head_dim)
      self.stage = np.frombuffer(self.host.view(0, nbytes), np_storage(self.kv_dtype)) \
        .reshape(cfg.n_layers, len(self.blocks), 2, cfg.n_kv_heads, tile)    # the region may be larger (kept)
    return self.host

  @property
  def staging_waits(self) -> int: return self.ring.waits if self.ring is not None else 0

  def _spans(self, layer: int, region: Region, offset: int) -> list[Span]:
    return block_spans(region, offset, self.pools[layer], self.blocks, self.block_bytes)

  def send(self, layer: int, k: Tensor, v: Tensor, first_row: int = 0):
    """Queue layer's K, V (T, KVH, D), realized on the prefill device, from row first_row on (a whole prompt computed again
    over a cached prefix sends the suffix's rows: in host memory a numpy view of them, not a slice realized per layer).
    After a write has failed, nothing more is posted: check() or finish() raises that failure (the caller may send every
    layer again over a new link)."""
    self.computed[layer] = t0 = time.perf_counter()
    try: self._hand_off(layer, k, v, first_row)
    except Exception:
      if self.writer.error is None: raise
    finally: self.handoff_s += time.perf_counter() - t0

  def _hand_off(self, layer: int, k: Tensor, v: Tensor, first_row: int):
    if self.writer.error is not None: return
    final = self._ends(layer)
    if self._defers(k, v): return self._keep_back(self._post_layer, (layer, k, v, first_row), final)
    self.post_later()
    self._post_layer(layer, k, v, first_row, final)

  def _post_layer(self, layer: int, k: Tensor, v: Tensor, first_row: int, final: bool):
    if self.writer.error is not None: return
    notify = notice_value(self.seq_id, layer)
    if np_storage(self.kv_dtype) is not None and (ka := host_array(k)) is not None and (va := host_array(v)) is not None:
      self.keep.extend((k, v))              # K, V in host memory: the writer thread packs them into the host region
      self.writer.post(layer, self._spans(layer, self.host_stage(), layer * self.layer_bytes), notify,
                       functools.partial(pack_kv_host, ka[first_row:], va[first_row:], self.stage[layer], is_q8(self.kv_dtype),
                                         code_of(self.kv_dtype)), final=final)
      return
    if first_row: k, v = k[first_row:].contiguous().realize(), v[first_row:].contiguous().realize()
    packed = pack_kv(k, v, self.block_size, self.kv_dtype).contiguous().realize()
    self.keep.append(post_packed(self.writer, layer, packed, self.layer_bytes, functools.partial(self._spans, layer), notify, self.ring,
                                 final))

  def send_chunk(self, layer: int, pool: Tensor, b0: int, b1: int, piece: int, n_pieces: int) -> bool:
    """Queue blocks b0..b1-1 of a layer whose K, V lie packed in `pool` (on_chunk: a chunked prefill's chunk of it,
    tinyhet.model.chunked_prefill, or a short prompt's whole layer, tinyhet.model.layer_jit), the prefill's own pool on
    HET (its block i is the prompt's block i, in the decode node's layout): written from there into this reservation's
    blocks b0..b1-1 (clipped to them) with the notice of this piece of the layer (the last of n_pieces: the decode node
    counts the layer once every piece has landed). False, with nothing sent, where that cannot be (the pool is not in
    registered host memory, or has another block size or dtype; more pieces than a notice counts; the reservation starts
    past a cached prefix and the pieces do not start there): the caller then sends the layer whole (send). Past a cached
    prefix of c blocks (a pulled prefix's suffix) the pool's block c + i goes to the reservation's block i."""
    t0 = time.perf_counter()
    try:
      if piece == 0 and not self._can_send_from(pool, n_pieces, b0): return False
      self.pieces.append((layer, pool, b0, b1, piece, n_pieces))         # for a resend over a new link (resend_pieces)
      if self.writer.error is not None: return True
      self.keep.append(pool)                                            # the writer reads it after the prefill has returned
      last = piece == n_pieces - 1
      if last: self.computed[layer] = t0
      final = last and self._ends(layer)
      try:
        if self._defers(pool): self._keep_back(self._post_piece, (layer, pool, b0, b1, piece, n_pieces), final)
        else: self._group((layer, pool, b0, b1, piece, n_pieces), final)
      except Exception:
        if self.writer.error is None: raise
      return True
    finally: self.handoff_s += time.perf_counter() - t0

  def _group(self, args: tuple, final: bool):
    """Keep a chunk's piece back (layer, pool, b0, b1, piece, n_pieces) until the chunk's last layer or the request's final
    write, then post the pieces kept in one call (post_later); the pieces kept go first where this one would take them past
    GROUP_BYTES."""
    nbytes = (args[3] - args[2]) * self.block_bytes
    if self.later and self.later_bytes + nbytes > GROUP_BYTES: self.post_later()
    self.later.append((self._post_piece, args))
    self.later_bytes += nbytes
    if final or args[0] == self.cfg.n_layers - 1: self.post_later(final)

  def _piece_write(self, layer: int, pool: Tensor, b0: int, b1: int, piece: int, n_pieces: int) -> tuple:
    """(key, spans, notice) of a chunk's piece: blocks b0..b1-1 of the layer's pool into the reservation's blocks."""
    region, offset = region_of(pool.uop.base.buffer)
    first, bb = self.cached // self.block_size, self.block_bytes       # the pool's block `first` is the reservation's block 0
    blocks = range(max(b0, first), min(b1, first + len(self.blocks)))
    spans = block_spans(region, offset + blocks.start * bb, self.pools[layer], self.blocks[blocks.start - first:blocks.stop - first], bb) \
      if len(blocks) else []
    return (layer, piece), spans, notice_value(self.seq_id, layer, piece, piece == n_pieces - 1)

  def _post_piece(self, layer: int, pool: Tensor, b0: int, b1: int, piece: int, n_pieces: int, final: bool):
    if self.writer.error is not None: return
    self.writer.post(*self._piece_write(layer, pool, b0, b1, piece, n_pieces), final=final, any_size=INLINE_CHUNKS)

  def _defers(self, *tensors: Tensor) -> bool:
    """Whether this request's writes wait to be posted until its final one (post_later), decided at its first: a short
    prompt's layers (at most the writer's inline bytes each) in host memory (DEFER_SHORT), to a decode node on this host:
    over shm, whose write is a copy by the posting thread and whose notices are held till the final write anyway
    (LayerWriter.hold), or over tcp to this host, whose receiving threads take this host's cores whenever bytes move."""
    if self.defer is None:
      w = self.writer
      self.defer = DEFER_SHORT and w.thread is None and self.layer_bytes <= w.inline_bytes and all(host_array(t) is not None for t in tensors)
      if self.defer:
        w.hold()
        self.defer = bool(w.holding) or bool(getattr(w.peer, "same_host", False))
    return self.defer

  def _keep_back(self, post, args: tuple, final: bool):
    """Keep a write back (defer) until the final one, which posts them all; what before_post would have raised at this
    write (the service: its caller gave the reservation up) stops the request now, as it would have."""
    self.later.append((post, args))
    if (check := self.writer.before_post) is not None:
      try: check()
      except BaseException as e:
        self.writer.error = e
        self.later = []
        return
    if final: self.post_later(final=True)

  def post_later(self, final: bool = False):
    """Post the writes kept back (_defers, _group), in order; final: the last of them is the request's final write.
    A group of chunk pieces (_group) goes in one transport call (LayerWriter.post_many)."""
    later, self.later, self.later_bytes = self.later, [], 0
    if later and self.writer.error is None and not self.defer and all(post == self._post_piece for post, _ in later):
      return self.writer.post_many([self._piece_write(*args) for _, args in later], final=final)
    for i, (post, args) in enumerate(later): post(*args, final=final and i == len(later) - 1)

  def _ends(self, layer: int) -> bool:
    """Layer's last write is being posted: True when that makes every layer's (the request's final write)."""
    self.ended.add(layer)
    return len(self.ended) == self.cfg.n_layers

  def _can_send_from(self, pool: Tensor, n_pieces: int, b0: int) -> bool:
    cfg = self.cfg
    if b0 * self.block_size != self.cached or not 0 < n_pieces <= MAX_PIECES or pool.dtype != self.kv_dtype: return False
    if tuple(pool.shape[1:]) != (2, cfg.n_kv_heads, tile_len(self.kv_dtype, self.block_size, cfg.head_dim)): return False
    if pool.uop.base.op is not Ops.BUFFER: return False
    try: region_of(pool.uop.base.buffer)
    except NotRegistered: return False
    return True

  def resend_pieces(self, other: KVSender) -> None:
    """Send every chunk piece another sender of this reservation queued (a resend after its link broke)."""
    for p in other.pieces: self.send_chunk(*p)

  @property
  def posted(self) -> dict[int, float]:
    """When each layer's first write was posted."""
    out: dict[int, float] = {}
    for key, t in self.writer.posted.items(): out[_layer(key)] = min(t, out.get(_layer(key), t))
    return out

  def check(self):
    """Raise the first write's failure, if one has failed so far; the prefill is over (its caller's next step is the
    decode node's), so notices still held go out now (LayerWriter.hold: normally the final write has sent them)."""
    self.post_later()
    if self.writer.error is not None: raise self.writer.error
    self.writer.release()

  def finish(self, timeout: float = 60.0) -> dict[int, Transfer | Pieces]:
    """Every write landed: per layer its Transfer, or the Pieces of a layer sent in chunks."""
    self.post_later()
    by_layer: dict[int, list[Transfer]] = {}
    for key, t in self.writer.finish(timeout).items(): by_layer.setdefault(_layer(key), []).append(t)
    return {l: ts[0] if len(ts) == 1 else Pieces(ts) for l, ts in by_layer.items()}

  def abort(self, timeout: float = 30.0) -> bool:
    """Stop after a failure, dropping the writes not posted yet; True when every posted write has finished (none can still
    land in the decode node's blocks)."""
    self.writer.cancelled, self.later = True, []      # what was kept back was never posted
    self.writer.finish(timeout, check=False)
    settled = all(t.done() for t in self.writer.transfers.values())
    if not settled: self.buffers.forget()
    return settled
