"""What a transport moves and reports, with no connection in it: spans (local bytes to a part of a remote region), the
pieces a transport sends them as (coalesced, split at its message limit), the Transfer handle a write or read returns,
the Notice a receiver gets, and the errors. Each backend (tcp, shm, verbs) and the Endpoint (transport.py) build on these.
"""
from __future__ import annotations
import threading, time
from typing import NamedTuple
from tinyhet.runtime.arena import Arena, Region
from tinyhet.runtime.descriptor import RegionDescriptor

class TransportError(RuntimeError):
  """A transfer or connection failed; the message names the peer and what was outstanding."""

class TransportUnavailable(TransportError):
  """A transport cannot be used here; the message says why and what to use instead."""

class Span(NamedTuple):
  """nbytes from local[local_offset:] to the part of a remote region that `remote` describes, at remote_offset within it."""
  local: Region
  local_offset: int
  remote: RegionDescriptor
  remote_offset: int
  nbytes: int

class Piece(NamedTuple):   # a NamedTuple, not a dataclass: several are made per write, on the latency path
  """A span resolved to what a transport needs: local arena bytes, and the remote region's id, address, key and offset."""
  arena: Arena
  start: int            # offset of the local bytes in their arena
  region_id: int
  addr: int
  rkey: int
  region_offset: int
  nbytes: int

def to_pieces(spans: list[Span], node: str) -> list[Piece]:
  pieces = []
  for s in spans:
    if s.remote.node != node: raise TransportError(f"span targets node {s.remote.node!r}, but this peer is {node!r}")
    if s.nbytes <= 0: raise TransportError(f"span of {s.nbytes} bytes: a span must move at least one byte")
    if s.local_offset < 0 or s.local_offset + s.nbytes > s.local.nbytes:
      raise TransportError(f"local span [{s.local_offset}, {s.local_offset + s.nbytes}) is outside its {s.local.nbytes}-byte region")
    if s.remote_offset < 0 or s.remote_offset + s.nbytes > s.remote.length:
      raise TransportError(f"remote span [{s.remote_offset}, {s.remote_offset + s.nbytes}) is outside the {s.remote.length} bytes described "
                           f"(region {s.remote.region_id} of {node})")
    pieces.append(Piece(s.local.arena, s.local.offset + s.local_offset, s.remote.region_id, s.remote.addr, s.remote.rkey,
                        s.remote.offset + s.remote_offset, s.nbytes))
  return pieces

def coalesce(pieces: list[Piece]) -> list[Piece]:
  """Merge neighbours that are contiguous on both sides (same local arena, same remote region)."""
  out: list[Piece] = []
  for p in pieces:
    if out and (q := out[-1]).region_id == p.region_id and q.arena is p.arena and q.start + q.nbytes == p.start \
       and q.region_offset + q.nbytes == p.region_offset:
      out[-1] = q._replace(nbytes=q.nbytes + p.nbytes)
    else: out.append(p)
  return out

def split(pieces: list[Piece], limit: int) -> list[Piece]:
  """Cut pieces larger than a transport's message limit."""
  out = []
  for p in pieces:
    if p.nbytes <= limit:
      out.append(p)
      continue
    for off in range(0, p.nbytes, limit):
      out.append(p._replace(start=p.start + off, region_offset=p.region_offset + off, nbytes=min(limit, p.nbytes - off)))
  return out

_finishing = threading.Lock()

class Transfer:
  """A batch in flight. wait() returns once every byte has landed (or been read), and raises with context otherwise."""
  def __init__(self, peer: str, kind: str, batch: int, nbytes: int):
    self.peer, self.kind, self.batch, self.nbytes = peer, kind, batch, nbytes
    self.started, self.finished, self.error = time.perf_counter(), None, None
    self._pending = threading.Lock()      # held until the transfer finishes: cheaper to wake on than an Event
    self._pending.acquire()

  def finish(self, error: str | None = None):
    with _finishing:
      if self.finished is not None: return
      self.error, self.finished = error, time.perf_counter()
    self._pending.release()

  def done(self) -> bool: return self.finished is not None

  def wait(self, timeout: float | None = 60.0) -> Transfer:
    if self.finished is None:
      if not self._pending.acquire(timeout=-1 if timeout is None else timeout):
        raise TimeoutError(f"{self.kind} batch {self.batch} with {self.peer}: {self.nbytes} bytes not confirmed after {timeout} s")
      self._pending.release()
    if self.error is not None: raise TransportError(f"{self.kind} batch {self.batch} with {self.peer} failed: {self.error}")
    return self

  @property
  def seconds(self) -> float: return (self.finished or time.perf_counter()) - self.started
  def __repr__(self): return f"<Transfer {self.kind} #{self.batch} {self.peer} {self.nbytes}B {'done' if self.done() else 'in flight'}>"

class Notice(NamedTuple):
  """A writer's notification: delivered only after every byte of its batch has landed."""
  peer: str
  value: int
  batch: int
  nbytes: int
  time: float

def local_view(p: Piece) -> memoryview: return p.arena.view(p.start, p.nbytes)
