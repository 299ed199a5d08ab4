"""Exposed regions as the receive path sees them: which peer may use a region and which parts of it (Exposure), and
the frames that are landing in regions right now (Landings), so that withdrawing a region can wait until no byte of an
accepted frame is still on its way into it. Used by transport.Endpoint; tcp is the transport that lands bytes itself
and so the one where both are enforced.
"""
from __future__ import annotations
import bisect, socket, threading, time
from collections import Counter

ACCESS = ("rw", "read", "write")
DRAIN_TIMEOUT = 2.0           # seconds withdraw waits for writes landing in a region before it drops the writers' connections

class Exposure:
  """An exposed region as the receive path sees it: its bytes, which peer may use it (None: any authenticated peer), which
  parts of it (sorted, non-overlapping (start, end) byte ranges; None: all of it) and how: access is "rw", "read" (a read
  grant: writes refused) or "write" (a write grant: reads refused)."""
  __slots__ = ("view", "owner", "starts", "ends", "access")
  def __init__(self, view: memoryview, owner: str | None, allowed: list[tuple[int, int]] | None, access: str = "rw"):
    if access not in ACCESS: raise ValueError(f"access must be one of {', '.join(ACCESS)}, got {access!r}")
    self.view, self.owner, self.access = view, owner, access
    runs: list[list[int]] = []
    for off, n in sorted(allowed or []):
      if off < 0 or n <= 0 or off + n > len(view): raise ValueError(f"allowed part [{off}, {off + n}) is outside the {len(view)}-byte region")
      if runs and off <= runs[-1][1]: runs[-1][1] = max(runs[-1][1], off + n)     # touching parts merge: one write may cross them
      else: runs.append([off, off + n])
    self.starts, self.ends = ([r[0] for r in runs], [r[1] for r in runs]) if allowed is not None else (None, None)

  def allows(self, offset: int, nbytes: int, op: str = "write") -> bool:
    if self.access != "rw" and self.access != op: return False
    if self.starts is None: return True
    i = bisect.bisect_right(self.starts, offset) - 1
    return i >= 0 and offset + nbytes <= self.ends[i]

class Landings:
  """(region id, socket) -> frames being received into that region on that socket now."""
  def __init__(self):
    self.lock = threading.Condition(threading.Lock())
    self.count: Counter = Counter()

  def begin(self, sock: socket.socket, pieces, lookup) -> tuple[list[memoryview], set[int]]:
    """lookup(region, offset, nbytes) -> view for each piece, under the lock that withdrawal takes too; then mark them landing."""
    with self.lock:
      views = [lookup(r, o, n) for r, o, n in pieces]
      regions = {r for r, _, _ in pieces}
      for r in regions: self.count[(r, sock)] += 1
    return views, regions

  def end(self, sock: socket.socket, region_ids):
    with self.lock:
      for r in region_ids:
        if (n := self.count[(r, sock)] - 1) > 0: self.count[(r, sock)] = n
        else: del self.count[(r, sock)]
      self.lock.notify_all()

  def drain(self, region_id: int, timeout: float = DRAIN_TIMEOUT):
    """Wait until no frame is landing in region_id. A writer stalled mid-frame for `timeout` has its socket shut down:
    its receive fails, the frame ends, and the peer's session is dropped."""
    deadline = time.monotonic() + timeout
    with self.lock:
      while socks := [s for (r, s), n in self.count.items() if r == region_id and n > 0]:
        if (left := deadline - time.monotonic()) <= 0:
          for s in socks:
            try: s.shutdown(socket.SHUT_RDWR)
            except OSError: pass
          deadline, left = time.monotonic() + timeout, timeout
        self.lock.wait(left)
