"""A request's K, V on their way from the prefill device into the decode node's reserved blocks, one layer at a time, while
the next layer computes. Both prefill clients use it: DecodeClient (tinyhet run, tinyhet.engine.prefill) and PrefillNode (the
service). The prefill thread only queues, or, for a layer of at most INLINE_LAYER_BYTES (a short prompt) not leaving through
the staging ring, and for every piece of a chunked prefill (INLINE_CHUNKS), posts it itself (LayerWriter.post: cheaper than
waking the writer thread; a slow write then holds up the next layer). Over shm a request's notices are held and sent in
one call before its final write (LayerWriter.hold), not one a write:

  sender = KVSender(endpoint, peer, reservation, cfg, kv_dtype, buffers)
  sender.send(layer, k, v)     prefill thread, as each layer's K, V exist; never raises a write's failure
  sender.send_chunk(layer, pool, b0, b1, piece, n_pieces)   or, in a chunked prefill, each chunk's blocks of a layer as soon
                               as they exist (False: cannot, send the layer whole); each piece has its own notice
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
import functools, math, queue, threading, time
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
from tinyhet.device.gpu_staging import StagingRing, start_copy, unpin

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

class LayerWriter:
  """Fills and posts a request's layer writes from its own thread, so that prefill computes layer l+1 while layer l is
  packed (numpy, which releases the GIL) or copied out of device memory (tinyhet.device.gpu_staging), and handed to the transport (a
  shm write is a memcpy by the posting thread; a small tcp write is sent by it): the prefill thread only queues.
  before_post(), if given, runs on the writer thread before each write is posted; what it raises fails the request there
  (the service's prefill node checks that its caller still holds the reservation)."""
  def __init__(self, endpoint, peer, before_post=None, inline_bytes: int = 0):
    self.endpoint, self.peer, self.before_post = endpoint, peer, before_post
    self.inline_bytes = inline_bytes                  # a write of at most this many bytes is posted by the caller (see post)
    self.cancelled = False                            # abort(): queued writes are dropped, not posted
    self.queue: queue.SimpleQueue = queue.SimpleQueue()
    self.transfers: dict[int, Transfer] = {}
    self.posted: dict[int, float] = {}
    self.settled: dict[int, threading.Event] = {}     # set once a layer's write is posted, or failed to be
    self.error: BaseException | None = None
    self.inlined = 0                                  # writes posted on the caller's thread
    self.holding: bool | None = None                  # notices held (hold): None until the first write, False once released
    self.thread: threading.Thread | None = None       # started by the first write that is queued

  def post(self, layer: int, spans: list[Span], notify: int, fill=None, may_inline: bool = True, final: bool = False,
           any_size: bool = False):
    """Write spans with notify once fill(), if given, has filled their bytes. Until a write has been queued, one of at
    most inline_bytes (and may_inline: not a staging copy, which overlaps a GPU's next layer) is filled and posted here,
    on the caller's thread: waking the writer thread costs ~1 ms a layer on two cores, more than packing and posting a
    short prompt's layer. The rest go to the writer thread, in order. final: the request's last write (every layer's last
    piece is posted with it): the notices held since the first write go out before it (hold). any_size: inline whatever
    its size (a chunk's blocks already packed in host memory: INLINE_CHUNKS)."""
    if self.error is not None: raise self.error
    self.settled[layer] = threading.Event()
    if may_inline and self.thread is None and (any_size or sum(s.nbytes for s in spans) <= self.inline_bytes):
      self.inlined += 1
      return self._write(layer, spans, notify, fill, final)
    if self.thread is None:
      self.thread = threading.Thread(target=self._loop, name="tinyhet-kv-writer", daemon=True)
      self.thread.start()
    self.queue.put((layer, spans, notify, fill, final))

  def hold(self):
    """At the request's first write: where the transport can (shm), its notices are kept and sent together before the
    final write (release), not one syscall and one wake of the decode node's threads per write. The decode node waits
    for every layer before its first step anyway; each write's bytes are still in place before its notice is sent, and
    the final write's own notice follows the others, so the last layer lands (the TTFT's end) after every notice is out."""
    if self.holding is None:
      hold = getattr(self.endpoint, "hold_notices", None)     # an endpoint stand-in of a test or benchmark may have none
      self.holding = bool(hold is not None and hold(self.peer))

  def release(self):
    """Send the held notices (once; later writes send their own)."""
    if self.holding:
      self.holding = False
      self.endpoint.send_notices(self.peer)
    self.holding = False

  def landed(self, layer: int) -> bool:
    """Whether layer's write has landed (False while it waits to be posted). Raises a failure."""
    if self.error is not None: raise self.error
    if (t := self.transfers.get(layer)) is None or not t.done(): return False
    t.wait(0)                                        # raises the write's failure
    return True

  def wait_landed(self, layer: int, timeout: float = 60.0):
    """Wait until layer's write has been posted and has landed; raises its failure, or TimeoutError saying which layer."""
    if not self.settled[layer].wait(timeout): raise TimeoutError(f"the write of layer {layer} was not posted after {timeout} s")
    if self.error is not None: raise self.error
    self.transfers[layer].wait(timeout)

  def _loop(self):
    while (item := self.queue.get()) is not None: self._write(*item)

  def _write(self, layer, spans: list[Span], notify: int, fill, final: bool = False):
    try:
      if self.error is not None or self.cancelled: return       # a write failed: post nothing more, finish() raises it
      if self.before_post is not None: self.before_post()
      if fill is not None: fill()
      self.hold()
      if final: self.release()
      self.posted[layer] = time.perf_counter()
      self.transfers[layer] = self.endpoint.write(self.peer, spans, notify=notify)
    except BaseException as e: self.error = e
    finally: self.settled[layer].set()

  def finish(self, timeout: float = 60.0, check: bool = True) -> dict[int, Transfer]:
    """Stop the thread once every queued write is posted, then wait for each write to land. Raises the first failure."""
    if self.thread is not None:
      self.queue.put(None)
      self.thread.join(timeout)
    try: self.release()                              # every queued write is posted: what was held goes out (a failure: not final)
    except Exception as e:
      if self.error is None: self.error = e
    for t in self.transfers.values():
      try: t.wait(timeout)
      except Exception as e:
        if self.error is None: self.error = e
    if check and self.error is not None: raise self.error
    return self.transfers

def post_packed(writer: LayerWriter, layer: int, packed: Tensor, nbytes: int, spans_from, notify: int, ring: StagingRing | None,
                final: bool = False) -> Tensor:
  """Post the first nbytes of a layer packed on HET (realized): straight from its memory where that is registered; else, with a ring, through a
  staging buffer the writer thread copies it into (tinyhet.device.gpu_staging); with no ring, copied to registered host memory here, on
  the prefill thread (the synchronous baseline). spans_from(region, offset) gives the layer's spans from where its bytes
  lie. final: the request's last write (LayerWriter.post). Returns what must stay alive until the write has landed."""
  try: region, offset = region_of(packed.uop.buffer)
  except NotRegistered:
    if ring is not None:
      region = ring.take(layer, writer)
      writer.post(layer, spans_from(region, 0), notify, start_copy(packed.uop.buffer, region, nbytes), may_inline=False, final=final)
      return packed
    packed = packed.to("MESH").realize()
    region, offset = region_of(packed.uop.buffer)
  writer.post(layer, spans_from(region, offset), notify, final=final)
  return packed

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

INLINE_CHUNKS = True   # a chunked prefill's pieces (send_chunk) are posted on the prefill thread whatever their size: they lie packed
                       # in registered host memory, so the prefill runs on this host's CPU, whose kernels keep every core busy; a writer
                       # thread overlaps nothing there, and its wake-up and GIL hand-offs (~1 ms each on two cores) came per piece:
                       # 240 at 4,096 tokens. What is left is a memcpy (shm) or queueing for the transport's stream threads (tcp)

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
    notify, final = notice_value(self.seq_id, layer), self._ends(layer)
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
    """Queue blocks b0..b1-1 of a layer prefilled in chunks (tinyhet.model.chunked_prefill, on_chunk): they lie in `pool`,
    the prefill's own pool on HET (its block i is the prompt's block i, in the decode node's layout), and are written from
    there into this reservation's blocks b0..b1-1 (clipped to them) with the notice of this piece of the layer (the last of
    n_pieces: the decode node counts the layer once every piece has landed). False, with nothing sent, where that cannot
    be (the pool is not in registered host memory, or has another block size or dtype; more pieces than a notice counts;
    the reservation starts past a cached prefix and the pieces do not start there): the caller then sends the layer whole
    (send). Past a cached prefix of c blocks (a pulled prefix's suffix) the pool's block c + i goes to the reservation's block i."""
    t0 = time.perf_counter()
    try:
      if piece == 0 and not self._can_send_from(pool, n_pieces, b0): return False
      self.pieces.append((layer, pool, b0, b1, piece, n_pieces))         # for a resend over a new link (resend_pieces)
      if self.writer.error is not None: return True
      region, offset = region_of(pool.uop.base.buffer)
      first, bb = self.cached // self.block_size, self.block_bytes     # the pool's block `first` is the reservation's block 0
      blocks = range(max(b0, first), min(b1, first + len(self.blocks)))
      spans = block_spans(region, offset + blocks.start * bb, self.pools[layer], self.blocks[blocks.start - first:blocks.stop - first], bb) \
        if len(blocks) else []
      self.keep.append(pool)                                            # the writer reads it after the prefill has returned
      if piece == n_pieces - 1: self.computed[layer] = t0
      last = piece == n_pieces - 1
      try: self.writer.post((layer, piece), spans, notice_value(self.seq_id, layer, piece, last), final=last and self._ends(layer),
                            any_size=INLINE_CHUNKS)
      except Exception:
        if self.writer.error is None: raise
      return True
    finally: self.handoff_s += time.perf_counter() - t0

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
    if self.writer.error is not None: raise self.writer.error
    self.writer.release()

  def finish(self, timeout: float = 60.0) -> dict[int, Transfer | Pieces]:
    """Every write landed: per layer its Transfer, or the Pieces of a layer sent in chunks."""
    by_layer: dict[int, list[Transfer]] = {}
    for key, t in self.writer.finish(timeout).items(): by_layer.setdefault(_layer(key), []).append(t)
    return {l: ts[0] if len(ts) == 1 else Pieces(ts) for l, ts in by_layer.items()}

  def abort(self, timeout: float = 30.0) -> bool:
    """Stop after a failure, dropping the writes not posted yet; True when every posted write has finished (none can still
    land in the decode node's blocks)."""
    self.writer.cancelled = True
    self.writer.finish(timeout, check=False)
    settled = all(t.done() for t in self.writer.transfers.values())
    if not settled: self.buffers.forget()
    return settled
