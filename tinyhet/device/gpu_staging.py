"""Staging: how a layer packed in device memory that no transport can send from (HET on a GPU without GPUDirect RDMA)
leaves the device without stalling prefill. Three calls, on two threads:

  buf = ring.take(layer, writer)       prefill thread: a staging buffer (registered host memory) whose last write has
                                       landed; it waits for a write only when all N buffers are in flight (ring.waits counts it)
  copy = start_copy(packed, buf, n)    prefill thread, right after the pack kernel was queued: marks where the copy must
                                       start in the device's queue; never waits for the device
  copy()                               writer thread (tinyhet.engine.prefill.LayerWriter), before it posts the layer's write from
                                       buf: waits for the pack kernel alone, then copies device -> host

So the prefill thread goes on to layer l+1's kernels while layer l is copied out and sent. How the copy runs per backend:
  CUDA                 a second, non-blocking stream that waits on an event recorded after the pack (the copy engine); the
                       staging buffer is page-locked (cuMemHostRegister) at its first copy, so the copy engine writes it
                       directly (pageable memory would go through the driver's bounce buffer); unpin() before freeing it
  CPU (tinygrad's)     its worker threads' progress counters, then a memcpy: memory the host can read
  PYTHON (emulator)    a memcpy: its kernels have run by the time realize() returns
  others (NV, AMD, ..) on the prefill thread (tinygrad's HCQ queues are not safe to submit to from a second thread): a
                       synchronous copy, as before, but the write is still posted from the staging buffer by the writer
"""
from __future__ import annotations
import ctypes, time
from tinygrad.device import Buffer, Device
from tinygrad.runtime.support.hcq import HCQBuffer
from tinyhet.runtime.arena import Region

class StagingRing:
  """N staging buffers (registered host memory, one layer each) for one request. A buffer is in flight from take() until
  the write that reads it has landed."""
  def __init__(self, regions: list[Region], timeout: float = 60.0):
    if not regions: raise ValueError("a staging ring needs at least one buffer")
    self.regions, self.timeout = regions, timeout
    self.user: list[int | None] = [None] * len(regions)    # the layer whose write reads each buffer
    self.waits = 0                                          # times take() waited for a write to land

  def take(self, layer: int, writer) -> Region:
    """A buffer for layer's bytes: a free one if any (never waiting then), else the oldest once its write has landed."""
    free = [i for i, u in enumerate(self.user) if u is None or writer.landed(u)]
    if free: i = free[0]
    else:
      i = min(range(len(self.user)), key=lambda j: self.user[j])     # layers are posted in order: the oldest lands first
      self.waits += 1
      writer.wait_landed(self.user[i], self.timeout)
    self.user[i] = layer
    return self.regions[i]

def _cuda_stream(dev):
  """One non-blocking stream per CUDA device for device -> host copies: it does not serialize with tinygrad's default
  stream, so the copy engine moves layer l while layer l+1's kernels run."""
  if (s := getattr(dev, "tinyhet_copy_stream", None)) is None:
    from tinygrad.runtime.autogen import cuda
    from tinygrad.runtime.ops_cuda import check
    check(cuda.cuCtxSetCurrent(dev.context))
    check(cuda.cuStreamCreate(ctypes.byref(s := cuda.CUstream()), 1))      # 1: CU_STREAM_NON_BLOCKING
    dev.tinyhet_copy_stream = s
  return s

_pinned: dict[tuple[int, int, int], tuple] = {}   # (arena id, offset, id of the CUDA device) -> (device, address, page-locked)

def _pin(dev, dest: Region) -> bool:
  """Page-lock dest for this CUDA context, once; False where the driver refuses (the copy still works, through the driver's
  bounce buffer)."""
  key = (dest.arena.id, dest.offset, id(dev))
  if key not in _pinned:
    from tinygrad.runtime.autogen import cuda
    ok = dest.addr % 4096 == 0 and dest.nbytes % 4096 == 0 and \
      cuda.cuMemHostRegister_v2(ctypes.c_void_p(dest.addr), dest.nbytes, 1) == 0      # 1: CU_MEMHOSTREGISTER_PORTABLE
    _pinned[key] = (dev, dest.addr, ok)
  return _pinned[key][2]

def unpin(regions: list[Region]):
  """Undo _pin for staging buffers about to be freed (their pages go back to the arena for other uses)."""
  mine = {(r.arena.id, r.offset) for r in regions}
  for key in [k for k in _pinned if k[:2] in mine]:
    dev, addr, ok = _pinned.pop(key)
    if ok:
      from tinygrad.runtime.autogen import cuda
      from tinygrad.runtime.ops_cuda import check
      check(cuda.cuCtxSetCurrent(dev.context))
      check(cuda.cuMemHostUnregister(ctypes.c_void_p(addr)))

def start_copy(buf: Buffer, dest: Region, nbytes: int):
  """Mark, on the prefill thread, the copy of buf's first nbytes (buf realized, its kernels queued) into dest; returns the
  call that does the copy on another thread. On a backend where that is unsafe, copies here and returns a call that does nothing."""
  if not 0 < nbytes <= min(buf.nbytes, dest.nbytes):
    raise ValueError(f"cannot stage {nbytes} bytes of a {buf.nbytes}-byte layer in a {dest.nbytes}-byte staging buffer")
  dev, opaque, out = Device[buf.device], buf._buf, dest.view(0, nbytes)
  if hasattr(dev, "context") and hasattr(opaque, "value"):              # CUDA: an event after the pack, a copy on a second stream
    from tinygrad.runtime.autogen import cuda
    from tinygrad.runtime.ops_cuda import check
    stream = _cuda_stream(dev)
    check(cuda.cuCtxSetCurrent(dev.context))
    _pin(dev, dest)
    check(cuda.cuEventCreate(ctypes.byref(ready := cuda.CUevent()), 0))
    check(cuda.cuEventRecord(ready, None))
    def copy_cuda():
      check(cuda.cuCtxSetCurrent(dev.context))                           # a context is current per thread
      check(cuda.cuStreamWaitEvent(stream, ready, 0))
      check(cuda.cuMemcpyDtoHAsync_v2(dest.addr, opaque, nbytes, stream))
      check(cuda.cuStreamSynchronize(stream))
      check(cuda.cuEventDestroy_v2(ready))
    return copy_cuda
  if isinstance(opaque, HCQBuffer) and opaque.view is not None and hasattr(dev, "workers"):   # tinygrad's CPU device: worker threads
    # the pack kernel has run once each worker has done every command queued so far (what its synchronize() waits for,
    # up to now rather than up to whatever the prefill thread queues next)
    marks = [(w.done._buf.cpu_view().view(fmt="Q"), w.put._buf.cpu_view().view(fmt="Q")[0]) for w in dev.workers]
    def copy_host_visible():
      for done, queued in marks:
        while done[0] < queued: time.sleep(1e-4)        # not tinygrad's spin: it would hold the GIL the prefill thread needs
      ctypes.memmove(dest.addr, int(opaque.va_addr), nbytes)
    return copy_host_visible
  if isinstance(opaque, memoryview):                                     # PYTHON: kernels ran inside realize()
    def copy_memory(): out[:] = opaque[:nbytes]
    return copy_memory
  dev.allocator._copyout(out, opaque)                                    # NV, AMD, ...: see the module's docstring
  return lambda: None

def pinned_buffers() -> int:
  """How many staging buffers a CUDA driver has page-locked in this process (the GPU check reports it)."""
  return sum(ok for _, _, ok in _pinned.values())
