"""The tinygrad devices HET and MESH, whose every allocation comes from registered memory.

  HET          the node's prefill accelerator: a configured tinygrad backend (CUDA, NV, ... or CPU) whose buffers are
               carved from one registered arena (for a GPU: one big device allocation, registered once for GPUDirect RDMA)
  HET:1, ...   further local accelerators of that backend
  MESH         the decode node's CPU device; its buffers are carved from the node's registered host arena
  MESH:<peer>  memory of another node: memory-only; .to() it is a transport write, reading it back a transport read

tinyhet/__init__.py registers these classes with tinygrad (as modules tinygrad.runtime.ops_het and ops_mesh); nothing in
tinygrad is changed.
"""
from __future__ import annotations
import sys, threading
from tinygrad.device import Allocator, BufferSpec, Compiled, Device
from tinygrad.renderer import Renderer
from tinygrad.runtime.ops_cpu import CPUAllocator, CPUDevice
from tinygrad.runtime.support.hcq import HCQBuffer, MMIOInterface
from tinyhet.device.cpu_threads import use_pool
from tinyhet.device.memory import local_node
from tinyhet.runtime.descriptor import RegionDescriptor
from tinyhet.runtime.spans import SpanAllocator
from tinyhet.runtime.arena import Region
from tinyhet.device import program_cache

program_cache.install()   # generated kernel code kept across processes (tinyhet.device.program_cache)

GPU_BACKENDS = ("CUDA", "NV", "AMD", "METAL", "CL")
GPU_ALIGN = 256

# ---------------------------------------------------------------- CPU-backed: HET on a CPU, and MESH

class ArenaAllocator(CPUAllocator):
  """tinygrad's CPU allocator, with every buffer a region of a registered arena (and no LRU cache in front of it:
  a freed buffer's bytes go straight back to the arena, so the arena's figures are the truth)."""
  def __init__(self, dev, arena_name: str):
    super().__init__(dev)
    self.arena_name = arena_name

  def _alloc(self, size: int, options: BufferSpec) -> HCQBuffer:
    if options.external_ptr is not None: return super()._alloc(size, options)
    region = local_node().arena(self.arena_name).alloc(size, align=64)
    return HCQBuffer(region.addr, size, meta=region, view=MMIOInterface(region.addr, size, fmt="B"), owner=self.dev)

  def _free(self, buf: HCQBuffer, options: BufferSpec | None = None):
    if options is not None and options.external_ptr is not None: return
    self.dev.synchronize()
    local_node().forget(buf.meta)
    buf.meta.free()

  def free(self, opaque, size: int, options: BufferSpec | None = None): Allocator.free(self, opaque, size, options)

def arena_free_bytes(device: str) -> int | None:
  """The largest buffer `device` (HET or MESH on a CPU) can still allocate out of its registered arena; None where
  tinyhet's arena does not hold its buffers (a GPU's, a plain CPU)."""
  from tinygrad import Device
  alloc = Device[device].allocator
  if not isinstance(alloc, ArenaAllocator): return None
  return local_node().arena(alloc.arena_name).figures()["largest_free"]

def _arena_name(kind: str, device: str) -> str: return kind if ":" not in device else f"{kind}{device.split(':', 1)[1]}"

class MeshCPUDevice(CPUDevice):
  def __init__(self, device: str = "MESH"):
    super().__init__(device)
    self.allocator = ArenaAllocator(self, _arena_name("MESH", device))
    use_pool(self)       # kernels split over every core (tinyhet.device.cpu_threads)
    Device["CPU"]        # opened now: tinygrad's exit hook finalizes these devices, which open CPU, while it iterates the open set

class HetCPUDevice(CPUDevice):
  def __init__(self, device: str = "HET"):
    super().__init__(device)
    self.allocator = ArenaAllocator(self, _arena_name("HET", device))
    use_pool(self)
    Device["CPU"]

# ---------------------------------------------------------------- GPU-backed HET

def arena_allocator(base: Allocator, arena_bytes: int) -> Allocator:
  """Wrap a backend's own allocator: one allocation of arena_bytes made through it, handed out as views of itself (the
  backend's _offset), so every buffer of the device lies inside one registrable span. Host and CPU-visible buffers the
  backend uses for itself (staging, signals) stay with the backend."""
  class GPUArenaAllocator(type(base)):
    def _alloc(self, size: int, options: BufferSpec):
      if options.external_ptr is not None or options.host or options.cpu_access or options.uncached: return super()._alloc(size, options)
      with self.arena_lock:
        if self.arena_buf is None:
          self.arena_buf = super()._alloc(self.arena_bytes, BufferSpec())
          self.spans = SpanAllocator(self.arena_bytes, f"arena {self.dev.device!r}")
          self.rdma_registration = register_gpu_arena(self)
        offset = self.spans.alloc(size, GPU_ALIGN)
      buf = self._offset(self.arena_buf, size, offset)
      self.arena_offsets[id(buf)] = (offset, buf)
      return buf

    def _free(self, buf, options: BufferSpec | None = None):
      if (entry := self.arena_offsets.pop(id(buf), None)) is None: return super()._free(buf, options)
      self.dev.synchronize()
      with self.arena_lock: self.spans.free(entry[0])

    def free(self, opaque, size: int, options: BufferSpec | None = None):
      if id(opaque) in self.arena_offsets: Allocator.free(self, opaque, size, options)
      else: super().free(opaque, size, options)

  alloc = GPUArenaAllocator.__new__(GPUArenaAllocator)
  alloc.__dict__.update(base.__dict__)
  alloc.arena_bytes, alloc.arena_buf, alloc.spans, alloc.arena_offsets, alloc.arena_lock = arena_bytes, None, None, {}, threading.Lock()
  return alloc

def register_gpu_arena(alloc):
  """On a node with an RDMA device, register HET's GPU arena once for GPUDirect RDMA (dma-buf, else nvidia-peermem).
  Returns the registration, or None without RDMA or for a backend other than CUDA. The transports do not yet write from
  GPU memory: a prefill node copies each packed layer into registered host memory first (tinyhet.engine.prefill)."""
  from tinyhet.runtime.transport import available_transports, TransportUnavailable
  if available_transports(local_node().config).get("verbs") is not None: return None
  if not hasattr(alloc.dev, "context") or not hasattr(alloc.arena_buf, "value"): return None
  from tinyhet.runtime import verbs
  try: return verbs.register_gpu_memory(local_node().endpoint.verbs, alloc.arena_buf.value, alloc.arena_bytes, alloc.dev.context, owner=alloc)
  except TransportUnavailable as e:
    print(f"tinyhet: HET's GPU memory is not registered for RDMA ({e}); KV leaves through host memory", file=sys.stderr)
    return None

def resolve_backend(wanted: str) -> str:
  """HET's backend: the configured one, or for auto the first GPU backend that opens, else CPU."""
  if wanted.upper() != "AUTO": return wanted.upper()
  for backend in GPU_BACKENDS:
    try:
      Device[backend]
      return backend
    except Exception: continue
  return "CPU"

class HetDevice:
  """Device["HET"]: an instance of the configured backend's device class, allocating from registered memory."""
  def __new__(cls, device: str = "HET"):
    backend = resolve_backend(local_node().config.het_backend)
    if backend == "CPU": return HetCPUDevice(device)
    try: base_cls = Device.get_class(backend)
    except Exception as e: raise RuntimeError(f"HET_BACKEND={backend}: tinygrad has no usable {backend} device here ({e})") from e
    # Keep the backend's class name: tinygrad selects interfaces and renderers by it.
    het_cls = type(base_cls.__name__, (base_cls,), {"het_backend": backend})
    dev = het_cls(device)
    dev.allocator = arena_allocator(dev.allocator, local_node().config.arena_bytes)
    return dev

# ---------------------------------------------------------------- memory of another node

class RemoteBuffer:
  __slots__ = ("desc", "owned")
  def __init__(self, desc: RegionDescriptor, owned: bool): self.desc, self.owned = desc, owned

def no_kernels(device: str) -> type[Renderer]:
  class NoKernels(Renderer):
    def __init__(self, target):
      raise RuntimeError(f"{device} is memory on node {device.split(':', 1)[1]!r}: kernels cannot run there. "
                         "Move the tensor to a local device first (.to('MESH') or .to('HET')).")
  return NoKernels

class RemoteAllocator(Allocator):
  """Buffers in a peer's MESH memory, allocated through its control channel and filled/read by transport writes/reads."""
  def __init__(self, dev: RemoteMemoryDevice):
    super().__init__(dev, supports_copy_from_disk=False, supports_transfer=True)
    self.peer = dev.peer

  def _alloc(self, size: int, options: BufferSpec) -> RemoteBuffer:
    if options.external_ptr is not None: raise RuntimeError(f"{self.dev.device}: external pointers cannot name another node's memory")
    return RemoteBuffer(RegionDescriptor.from_hex(local_node().control(self.peer).call("mem.alloc", nbytes=size)["desc"]), owned=True)

  def _free(self, buf: RemoteBuffer, options: BufferSpec | None = None):
    if not buf.owned: return
    try: local_node().control(self.peer).call("mem.free", region_id=buf.desc.region_id, reply_timeout=10)
    except (OSError, RuntimeError): pass      # the peer is gone: it freed everything this connection allocated

  def _offset(self, buf: RemoteBuffer, size: int, offset: int) -> RemoteBuffer: return RemoteBuffer(buf.desc.narrow(offset, size), owned=False)
  def _copyin(self, dest: RemoteBuffer, src: memoryview): local_node().write(self.peer, src, dest.desc)
  def _copyout(self, dest: memoryview, src: RemoteBuffer): local_node().read(self.peer, dest, src.desc)

  def _transfer(self, dest: RemoteBuffer, src, sz: int, src_dev, dest_dev):
    # MESH -> MESH:peer (tinygrad routes copies between devices of one name here): a zero-copy write from the arena
    if isinstance(src, RemoteBuffer):
      data = memoryview(bytearray(sz))
      src_dev.allocator._copyout(data, src)
      return self._copyin(dest, data)
    src_dev.synchronize()
    self._copyin(dest, src.cpu_view().mv if isinstance(src, HCQBuffer) else src)

class RemoteMemoryDevice(Compiled):
  def __init__(self, device: str):
    self.peer = device.split(":", 1)[1]
    local_node()._address(self.peer)           # an unknown peer fails here, with how to name it
    super().__init__(device, RemoteAllocator(self), [no_kernels(device)], None)

class MeshDevice:
  """Device["MESH"] is this node's MESH; Device["MESH:<peer>"] is a peer's memory; MESH:1, ... further local arenas."""
  def __new__(cls, device: str = "MESH"):
    suffix = device.split(":", 1)[1] if ":" in device else ""
    return MeshCPUDevice(device) if suffix == "" or suffix.isdigit() else RemoteMemoryDevice(device)

class NotRegistered(RuntimeError):
  """A buffer that is not in registered host memory (a GPU buffer without GPUDirect registration, a plain CPU buffer)."""

def region_of(buf) -> tuple[Region, int]:
  """The registered region behind a realized tinygrad Buffer of HET (on a CPU) or MESH, and the buffer's offset in it."""
  hb = buf.base._buf if buf._base is not None else buf._buf
  if not isinstance(hb, HCQBuffer) or not isinstance(hb.meta, Region):
    raise NotRegistered(f"a buffer on {buf.device} does not live in registered host memory; use tinyhet.register() to move it there")
  return hb.meta, (buf.offset if buf._base is not None else 0)
