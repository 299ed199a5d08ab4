"""A disk hit read back while the suffix is prefilled: a reservation's blocks that the disk tier holds are taken at
decode.reserve, and the tier's reader thread fills them layer by layer, all the chain's blocks' layer 0 first, then layer 1,
...; a prefill node pulls layer l of them as soon as layer l is in (decode.restored, tinyhet.kv.pull's gate), so the read of
layer l + 1.. overlaps the suffix's compute of layer l, as a pull overlaps it.

  job = RestoreJob(cache, store, [(block, hash, entry), ...])   # queued on the tier's reader (DiskTier.start)
  job.wait_layer(l, timeout)   # layers in so far (> l), once layer l of every block is in; raises RestoreFailed
  job.finished                 # an Event: read, checked (or failed, or cancelled); job.failed says why it failed
  job.cancel()                 # the sequence leaves: no write after this returns (its blocks may be reused)

A record is its layers' bytes one after another (tinyhet.kv.disk_tier), so layer l of a block is one pread at a known offset;
its checksum (BLAKE2b over key digest, hash and every layer, tinyhet.kv.disk_store) is computed as the layers come in and
checked before the last layer is released: the last layer's pull, and so the first token, waits for it. A record that fails
(torn, foreign, short) fails the job: its hash leaves the index, the decode node refuses to decode the sequence (its prefix
blocks hold unchecked bytes) and the router starts the request over, where the chain now ends before that block. Until the
decode node commits the sequence its restored blocks have no hash, so no other sequence shares bytes not yet checked.
"""
from __future__ import annotations
import os, threading
from tinyhet.kv.disk_store import HEADER_BYTES, checksum_start

class RestoreFailed(RuntimeError):
  """A block read back from the disk tier did not check out: the sequence's prefix cannot be trusted."""

class RestoreJob:
  def __init__(self, cache, store, pairs: list):
    self.cache, self.store, self.pairs = cache, store, pairs     # pairs: (block, hash, disk_store.Entry) in chain order
    self.cond = threading.Condition()
    self.layers, self.failed, self.cancelled, self.started = 0, None, False, False
    self.finished, self.writing_over = threading.Event(), threading.Event()

  @property
  def tokens(self) -> int: return len(self.pairs) * self.cache.block_size

  def wait_layer(self, layer: int, timeout: float = 60.0) -> int:
    with self.cond:
      if not self.cond.wait_for(lambda: self.layers > layer or self.failed or self.cancelled, timeout):
        raise TimeoutError(f"layer {layer} of a disk hit was not read back within {timeout} s")
      if self.failed: raise RestoreFailed(self.failed)
      if self.cancelled: raise RestoreFailed("the sequence left before its disk hit was read back")
      return self.layers

  def cancel(self) -> None:
    """No pool write of this job happens after this returns."""
    with self.cond:
      self.cancelled = True
      self.cond.notify_all()
      if not self.started: self.writing_over.set()
    self.writing_over.wait()
    self.finished.set()

  def run(self) -> None:
    """On the tier's reader thread."""
    with self.cond:
      if self.cancelled: return
      self.started = True
    fds: dict[int, int] = {}
    try: self._read(fds)
    except OSError as e: self._fail(f"the disk tier could not be read ({e.strerror or e})")
    finally:
      for fd in fds.values(): os.close(fd)
      self.writing_over.set()
      self.finished.set()

  def _read(self, fds: dict[int, int]):
    cache, store, nb, L = self.cache, self.store, self.cache.block_nbytes, self.cache.n_layers
    for _, _, e in self.pairs:                  # open now: a segment the size bound deletes meanwhile stays readable
      if e.segment not in fds: fds[e.segment] = os.open(store._path(e.segment), os.O_RDONLY)
    hashers = [checksum_start(store.kd, h) for _, h, _ in self.pairs]
    for layer in range(L):
      for (b, h, e), c in zip(self.pairs, hashers):
        if self.cancelled: return
        if layer == 0:                          # the header first: a foreign or torn record never reaches the pool
          raw = os.pread(fds[e.segment], HEADER_BYTES + nb, e.offset)
          if not store.header_ok(raw, h, e):
            return self._fail(f"block {h:016x} on disk has another header than its index entry (torn or foreign)", h, e)
          data = raw[HEADER_BYTES:]
        else: data = os.pread(fds[e.segment], nb, e.offset + HEADER_BYTES + layer * nb)
        if len(data) != nb: return self._fail(f"block {h:016x} on disk is short (torn)", h, e)
        cache.write_block_bytes(layer, b, data, sync=False)   # a block held by this sequence only, no kernel reads it yet
        c.update(data)
      if layer == L - 1:                        # every byte in: the checksums before the last layer is given out
        for (_, h, e), c in zip(self.pairs, hashers):
          if c.digest() != e.checksum: return self._fail(f"block {h:016x} on disk fails its checksum (torn)", h, e)
        store.count_read(len(self.pairs) * L * nb)
      with self.cond:
        self.layers = layer + 1
        self.cond.notify_all()

  def _fail(self, why: str, h: int | None = None, e=None):
    if h is not None: self.store.drop_bad(h, e)
    with self.cond:
      self.failed = why
      self.cond.notify_all()
