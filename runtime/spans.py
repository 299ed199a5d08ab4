"""Sub-allocation of one arena into aligned spans: plain integers, no memory touched.

Invariants (tested with hypothesis): free spans are sorted, never overlap, never touch (neighbours coalesce on free), and
together with the allocated spans cover [0, size) exactly; every allocated offset is a multiple of its alignment.
"""
import bisect

class OutOfMemory(MemoryError):
  """An arena has no free span large enough; the message names the arena, the bytes asked and the bytes free."""

class SpanAllocator:
  def __init__(self, size: int, name: str = "arena"):
    if size <= 0: raise ValueError(f"{name}: size must be positive, got {size}")
    self.size, self.name = size, name
    self.free_starts: list[int] = [0]        # sorted starts of free spans
    self.free_sizes: dict[int, int] = {0: size}
    self.used: dict[int, int] = {}           # offset -> size of each allocated span
    self.in_use = 0

  def alloc(self, nbytes: int, align: int = 64) -> int:
    """First fit: the lowest free span that holds nbytes at an aligned start. Returns the offset."""
    if nbytes <= 0: raise ValueError(f"{self.name}: allocation size must be positive, got {nbytes}")
    if align <= 0 or align & (align - 1): raise ValueError(f"{self.name}: alignment must be a power of two, got {align}")
    for start in self.free_starts:
      size = self.free_sizes[start]
      offset = (start + align - 1) & ~(align - 1)
      if offset + nbytes <= start + size: break
    else:
      raise OutOfMemory(f"{self.name}: cannot allocate {nbytes} bytes (aligned to {align}): {self.size - self.in_use} of {self.size} bytes free, "
                        f"largest free span {self.largest_free()} bytes. Raise the arena size (TINYHET_ARENA_BYTES) or free memory.")
    self._remove_free(start)
    if offset > start: self._add_free(start, offset - start)
    if (end := offset + nbytes) < start + size: self._add_free(end, start + size - end)
    self.used[offset] = nbytes
    self.in_use += nbytes
    return offset

  def free(self, offset: int):
    if (nbytes := self.used.pop(offset, None)) is None: raise ValueError(f"{self.name}: offset {offset} is not an allocated span")
    self.in_use -= nbytes
    start, end = offset, offset + nbytes
    i = bisect.bisect_left(self.free_starts, start)
    if i > 0 and (prev := self.free_starts[i - 1]) + self.free_sizes[prev] == start:   # merge with the free span before
      start = prev
      self._remove_free(prev)
    if end in self.free_sizes:                                                        # merge with the free span after
      end += self.free_sizes[end]
      self._remove_free(offset + nbytes)
    self._add_free(start, end - start)

  def largest_free(self) -> int: return max(self.free_sizes.values(), default=0)
  def free_spans(self) -> list[tuple[int, int]]: return [(s, self.free_sizes[s]) for s in self.free_starts]

  def _add_free(self, start: int, size: int):
    bisect.insort(self.free_starts, start)
    self.free_sizes[start] = size

  def _remove_free(self, start: int):
    del self.free_starts[bisect.bisect_left(self.free_starts, start)]
    del self.free_sizes[start]
