"""numa = replicate: the weights copied once per NUMA node, each worker thread of the CPU pool reading the copy on its own
node (tinyhet.runtime.cpu_pool: a kernel part's arguments that point into a replicated buffer are moved to the thread's copy
before the part runs), so no weight read crosses a socket. Copies are anonymous mappings bound to their node (mbind
MPOL_BIND) before they are filled; copy 0 is the buffer itself, wherever its pages are. The weights must not be written
while replicated (they are read-only once loaded).

  reps = replicate(buffers)               every node with memory gets a copy; thread i reads its pinned CPU's node's
  reps.close()                            the pool reads the originals again; the copies are unmapped
"""
from __future__ import annotations
import ctypes, mmap
from tinygrad.device import Buffer
from tinyhet.device.cpu_threads import pool
from tinyhet.runtime import numa

PAGE = mmap.PAGESIZE

def _address(buf: Buffer) -> int:
  buf.ensure_allocated()
  base = buf.base if buf._base is not None else buf
  return int(base._buf.va_addr) + (buf.offset if buf._base is not None else 0)

class Replicas:
  """Copies of host buffers per NUMA node, installed in the CPU pool."""
  def __init__(self, buffers: list[Buffer], nodes: list[int], thread_copy: list[int]):
    if not buffers or not nodes: raise ValueError("replicate: no buffers or no nodes")
    self.nodes, self.maps, ranges = list(nodes), [], []
    sizes = [-(-b.nbytes // PAGE) * PAGE for b in buffers]
    for node in self.nodes[1:]:                  # one mapping per extra node, each buffer at a page boundary in it
      m = mmap.mmap(-1, sum(sizes), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
      numa.bind(ctypes.addressof(ctypes.c_char.from_buffer(m)), len(m), node)    # before any page is touched
      self.maps.append(m)
    self.copies: list[list[int]] = []
    self.spans: list[tuple[int, int]] = []       # each buffer's (offset, bytes) in every copy's mapping
    offset = 0
    for buf, size in zip(buffers, sizes):
      src = buf.as_memoryview(force_zero_copy=True)
      addrs = [_address(buf)]
      for m in self.maps:
        m[offset:offset + buf.nbytes] = src                     # first touch of the copy's pages: on its bound node
        addrs.append(ctypes.addressof(ctypes.c_char.from_buffer(m, offset)))
      ranges.append((addrs[0], buf.nbytes, addrs))
      self.copies.append(addrs)
      self.spans.append((offset, buf.nbytes))
      offset += size
    self.thread_copy = list(thread_copy)         # thread -> the copy it reads (index into nodes)
    pool().set_replicas(ranges, self.thread_copy)

  def copy_view(self, i: int, k: int) -> memoryview:
    """Copy k (1..) of buffer i, as bytes (tests change one to see which copy a thread read)."""
    offset, nbytes = self.spans[i]
    return memoryview(self.maps[k - 1])[offset:offset + nbytes]

  def close(self):
    pool().set_replicas([], [])
    self.maps.clear()        # unmapped once nothing refers to them

def replicate(buffers: list[Buffer], nodes: list[int] | None = None, thread_copy: list[int] | None = None) -> Replicas:
  """Copy these host buffers to every node (default: those with memory; the first keeps the originals) and let each pool
  thread read a copy: thread_copy[thread] (default: the copy on the node of the CPU the thread is pinned to, else copy 0;
  the caller, thread 0, reads the originals)."""
  p, nodes = pool(), numa.online_nodes() if nodes is None else nodes
  if thread_copy is None:
    where = numa.cpu_nodes()
    on = [None] + [where.get(p.pinned_cpu(i)) for i in range(1, p.threads)]
    thread_copy = [nodes.index(n) if n in nodes else 0 for n in on]
  return Replicas(buffers, nodes, thread_copy)

def replicate_weights(model) -> Replicas | None:
  """numa = replicate for a loaded model on a host device: its weight buffers (None where there is one node)."""
  nodes = numa.online_nodes()
  if len(nodes) < 2: return None
  return replicate([t.uop.base.buffer for t in model.w.tensors()], nodes)
