"""Registered memory: an arena of host memory allocated once and sub-allocated into regions.

The arena is a memfd mapped MAP_SHARED, so that a peer process on the same host can map the very same pages (the shm
transport) and an RDMA NIC can register it once (the verbs transport). It asks for 2 MiB hugepages first (hugetlbfs,
then transparent hugepages) and says which it got. Regions are plain (offset, nbytes) spans of it: a region's bytes are
reachable as a memoryview, a numpy array or a tinygrad Tensor without a copy.
"""
from __future__ import annotations
import ctypes, mmap, os, secrets, threading
from tinyhet.runtime.spans import SpanAllocator, OutOfMemory

__all__ = ["Arena", "Region", "Mapping", "OutOfMemory"]

HUGEPAGE = 2 << 20
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype, _libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
MAP_FAILED = ctypes.c_void_p(-1).value

class Mapping:
  """An mmap of a file descriptor at a fixed address, unmapped on close."""
  def __init__(self, fd: int, size: int, offset: int = 0):
    addr = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, offset)
    if addr in (None, MAP_FAILED): raise OSError(ctypes.get_errno(), f"mmap of {size} bytes failed: {os.strerror(ctypes.get_errno())}")
    self.addr, self.size = addr, size
    self.mv = memoryview((ctypes.c_char * size).from_address(addr)).cast("B")    # sliced per span: no ctypes object per view

  def view(self, offset: int, nbytes: int) -> memoryview:
    if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
      raise IndexError(f"span [{offset}, {offset + nbytes}) outside mapping of {self.size} bytes")
    return self.mv[offset:offset + nbytes]

  def close(self):
    if self.addr is not None:
      self.mv.release()
      _libc.munmap(self.addr, self.size)
    self.addr = None

def _thp_shmem_mode() -> str:
  try: text = open("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read()
  except OSError: return "unknown"
  return text[text.index("[") + 1:text.index("]")] if "[" in text else text.strip()

class Arena:
  """One block of host memory, allocated once, shareable with local peers, sub-allocated into aligned regions."""

  def __init__(self, size: int, name: str = "arena", hugepages: bool = True):
    self.name, self.id = name, secrets.randbits(63)
    self.fd, self.mapping, self.pages = -1, None, ""
    if hugepages:
      try:
        size_huge = -(-size // HUGEPAGE) * HUGEPAGE
        self.fd = os.memfd_create(f"tinyhet-{name}", os.MFD_CLOEXEC | os.MFD_HUGETLB | getattr(os, "MFD_HUGE_2MB", 21 << 26))
        os.ftruncate(self.fd, size_huge)
        self.mapping, size, self.pages = Mapping(self.fd, size_huge), size_huge, "2 MiB hugepages (hugetlbfs)"
      except OSError:
        if self.fd >= 0: os.close(self.fd)
        self.fd = -1
    if self.mapping is None:
      self.fd = os.memfd_create(f"tinyhet-{name}", os.MFD_CLOEXEC)
      os.ftruncate(self.fd, size)
      self.mapping = Mapping(self.fd, size)
      if hugepages and _thp_shmem_mode() in ("always", "within_size", "advise"):
        _libc.madvise(self.mapping.addr, size, 14)  # MADV_HUGEPAGE
        self.pages = f"transparent hugepages (shmem_enabled={_thp_shmem_mode()}); no hugetlbfs pages were free"
      else:
        self.pages = "normal 4 KiB pages" + (f" (no hugetlbfs pages free, transparent hugepages for shmem: {_thp_shmem_mode()})" if hugepages else "")
    self.size, self.base = size, self.mapping.addr
    self.spans = SpanAllocator(size, f"arena {name!r}")
    self.lock = threading.Lock()        # tinygrad allocates from any thread; transports read the span table

  def alloc(self, nbytes: int, align: int = 64) -> Region:
    """A region of nbytes at an aligned offset; raises OutOfMemory naming the arena, the bytes asked and the bytes free."""
    with self.lock: return Region(self, self.spans.alloc(nbytes, align), nbytes)

  def free(self, region: Region):
    if region.arena is not self: raise ValueError(f"region at {region.offset} belongs to arena {region.arena.name!r}, not {self.name!r}")
    with self.lock: self.spans.free(region.offset)

  def view(self, offset: int, nbytes: int) -> memoryview: return self.mapping.view(offset, nbytes)
  def contains(self, addr: int, nbytes: int = 0) -> bool: return self.base <= addr and addr + nbytes <= self.base + self.size

  @property
  def in_use(self) -> int: return self.spans.in_use
  def figures(self) -> dict[str, int]:
    with self.lock: return {"reserved": self.size, "in_use": self.spans.in_use, "largest_free": self.spans.largest_free()}

  def close(self):
    """Unmap the arena. Every region view dies with it, so this refuses while regions are still allocated."""
    if self.mapping is None: return
    if self.spans.used: raise RuntimeError(f"arena {self.name!r}: {len(self.spans.used)} regions ({self.spans.in_use} bytes) are still allocated")
    self.mapping.close()
    os.close(self.fd)
    self.mapping, self.fd = None, -1

  def __repr__(self): return f"<Arena {self.name!r} {self.size} bytes, {self.spans.in_use} in use, {self.pages}>"

class Region:
  """A span of an arena: the unit that is exposed to peers and written into by transports."""
  __slots__ = ("arena", "offset", "nbytes")
  def __init__(self, arena: Arena, offset: int, nbytes: int): self.arena, self.offset, self.nbytes = arena, offset, nbytes

  @property
  def addr(self) -> int: return self.arena.base + self.offset

  def view(self, offset: int = 0, nbytes: int | None = None) -> memoryview:
    nbytes = self.nbytes - offset if nbytes is None else nbytes
    if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
      raise IndexError(f"span [{offset}, {offset + nbytes}) outside region of {self.nbytes} bytes in arena {self.arena.name!r}")
    return self.arena.view(self.offset + offset, nbytes)

  def numpy(self, dtype="uint8", shape=None):
    import numpy as np
    arr = np.frombuffer(self.view(), dtype=dtype)
    return arr if shape is None else arr.reshape(shape)

  def free(self): self.arena.free(self)
  def __repr__(self): return f"<Region {self.arena.name}+{self.offset} {self.nbytes} bytes>"
