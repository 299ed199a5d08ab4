"""A request's layer writes posted in order (LayerWriter), from the prefill thread or from a writer thread of its own, and a
layer packed on the prefill device posted from where its bytes lie (post_packed). tinyhet.kv.sender's KVSender drives both;
their names are importable from there too."""
from __future__ import annotations
import queue, threading, time
from tinygrad import Tensor
from tinyhet.device.backend import NotRegistered, region_of
from tinyhet.device.gpu_staging import StagingRing, start_copy
from tinyhet.runtime.transport import Span, Transfer

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

  def post_many(self, writes: list[tuple], final: bool = False):
    """Post several writes (key, spans, notify) in one transport call (Endpoint.write_many), here on the caller's thread:
    a chunked prefill's pieces, kept back until a group is worth the call (tinyhet.kv.sender). Behind writes queued to
    the writer thread they are queued one by one, in order. final: the last of them is the request's final write."""
    if self.error is not None: raise self.error
    if self.thread is not None:
      for i, (key, spans, notify) in enumerate(writes): self.post(key, spans, notify, final=final and i == len(writes) - 1)
      return
    for key, _, _ in writes: self.settled[key] = threading.Event()
    self.inlined += len(writes)
    try:
      if self.cancelled: return
      if self.before_post is not None: self.before_post()
      self.hold()
      if final: self.release()
      t0 = time.perf_counter()
      many = getattr(self.endpoint, "write_many", None)     # an endpoint stand-in of a test or benchmark may have none
      ts = many(self.peer, [(spans, notify) for _, spans, notify in writes]) if many is not None else \
        [self.endpoint.write(self.peer, spans, notify=notify) for _, spans, notify in writes]
      for (key, _, _), t in zip(writes, ts): self.posted[key], self.transfers[key] = t0, t
    except BaseException as e: self.error = e
    finally:
      for key, _, _ in writes: self.settled[key].set()

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
