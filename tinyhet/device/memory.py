"""This process as a node: the registered arenas behind HET and MESH, the transport endpoint, and the peers.

Everything is created on first use: importing tinyhet allocates nothing and opens no socket.
"""
from __future__ import annotations
import ctypes, os, socket, threading
from tinyhet.config import Config, load_config
from tinyhet.runtime.arena import Arena, Region
from tinyhet.runtime.descriptor import RegionDescriptor
from tinyhet.runtime.transport import Endpoint, Peer, Span, TransportError

class LocalNode:
  """Arenas by device name ("HET", "MESH", "CPU"), the endpoint that exposes them, and named peers."""
  def __init__(self, config: Config | None = None):
    self.config = config or load_config()
    self.name = self.config.node or f"{socket.gethostname()}-{os.getpid()}"
    self.arenas: dict[str, Arena] = {}
    self.addresses: dict[str, str] = dict(self.config.peers)     # peer name -> host:port
    self.peers: dict[str, Peer] = {}
    self.controls: dict = {}
    self.exposed: dict[tuple[int, int], list[RegionDescriptor]] = {}   # (arena id, offset) -> exposures, withdrawn when freed
    self.lock = threading.RLock()
    self._endpoint: Endpoint | None = None

  def arena(self, name: str) -> Arena:
    with self.lock:
      if name not in self.arenas:
        self.arenas[name] = arena = Arena(self.config.arena_bytes, f"{self.name}-{name}", self.config.hugepages)
        if self._endpoint is not None: self._endpoint.register(arena)
      return self.arenas[name]

  @property
  def endpoint(self) -> Endpoint:
    with self.lock:
      if self._endpoint is None:
        self._endpoint = ep = Endpoint(self.name, config=self.config)
        for arena in self.arenas.values(): ep.register(arena)
        ep.handle("mem.alloc", self._serve_alloc)
        ep.handle("mem.free", self._serve_free)
      return self._endpoint

  def serve(self, host: str = "127.0.0.1", port: int = 0) -> str:
    """Let peers reach this node's memory (and control handlers) at host:port; returns the address."""
    return self.endpoint.address or self.endpoint.listen(host, port)

  # ---- exposing local memory
  def expose(self, region: Region, offset: int = 0, nbytes: int | None = None, owner: str | None = None) -> RegionDescriptor:
    """A descriptor of region[offset:offset+nbytes] for peers (owner: that peer only; tcp enforces it, see README)."""
    desc = self.endpoint.expose(region, owner=owner)
    with self.lock: self.exposed.setdefault((region.arena.id, region.offset), []).append(desc)
    return desc.narrow(offset, region.nbytes - offset if nbytes is None else nbytes)

  def forget(self, region: Region):
    """Withdraw every exposure of a region before its memory is reused."""
    with self.lock: descs = self.exposed.pop((region.arena.id, region.offset), [])
    for d in descs: self._endpoint.withdraw(d)

  def region_at(self, addr: int, nbytes: int) -> Region | None:
    """A region-shaped view of registered memory at addr, if an arena of this node holds [addr, addr+nbytes)."""
    for arena in list(self.arenas.values()):
      if arena.mapping is not None and arena.contains(addr, nbytes): return Region(arena, addr - arena.base, nbytes)
    return None

  def allocation_at(self, addr: int, nbytes: int) -> tuple[Region, int] | None:
    """The allocated region that holds [addr, addr+nbytes), and addr's offset in it."""
    for arena in list(self.arenas.values()):
      if arena.mapping is not None and arena.contains(addr, nbytes):
        with arena.lock: spans = list(arena.spans.used.items())
        for start, size in spans:
          if arena.base + start <= addr and addr + nbytes <= arena.base + start + size: return Region(arena, start, size), addr - arena.base - start
    return None

  def _serve_alloc(self, conn, nbytes: int) -> dict:
    """A peer's allocation in this node's MESH memory (device MESH:<this node> on the peer); freed when the peer leaves."""
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0: raise ValueError(f"nbytes must be a positive integer, got {nbytes!r}")
    region = self.arena("MESH").alloc(nbytes, align=4096)
    desc = self.expose(region, owner=conn.peer)
    if (regions := conn.state.get("regions")) is None:      # one cleanup per connection: a long-lived peer's bookkeeping stays flat
      regions = conn.state["regions"] = {}
      conn.on_close(lambda: [self._release(rid, r) for rid, r in list(regions.items())])
    regions[desc.region_id] = region
    return {"desc": desc.to_hex()}

  def _serve_free(self, conn, region_id: int) -> dict:
    region = conn.state.get("regions", {}).pop(region_id, None)
    if region is None: raise ValueError(f"region {region_id} was not allocated by {conn.peer} on this connection")
    self._release(region_id, region)
    return {}

  def _release(self, region_id: int, region: Region):
    if region.arena.spans.used.get(region.offset) != region.nbytes: return    # freed already
    self.forget(region)
    region.free()

  # ---- peers
  def add_peer(self, name: str, address: str):
    with self.lock: self.addresses[name] = address

  def peer(self, name: str) -> Peer:
    """The transport link to a named peer, connected on first use."""
    with self.lock:
      if name not in self.peers:
        self.peers[name] = self.endpoint.connect(self._address(name))
      return self.peers[name]

  def control(self, name: str):
    from tinyhet.runtime.control import ControlClient
    with self.lock:
      if name not in self.controls: self.controls[name] = ControlClient(self.endpoint, self._address(name))
      return self.controls[name]

  def _address(self, name: str) -> str:
    if name not in self.addresses:
      raise TransportError(f"unknown peer {name!r}: name it with tinyhet.connect({name!r}, 'host:port'), TINYHET_PEERS or [peers] in the config "
                           f"file (known peers: {', '.join(self.addresses) or 'none'})")
    return self.addresses[name]

  # ---- moving bytes between local memory and a peer
  def write(self, peer: str, src: memoryview, dest: RegionDescriptor, timeout: float = 600):
    """Copy local bytes to a peer's region: zero-copy when src is registered memory, else through a bounce region."""
    with _Bounce(self, src, copy_in=True) as region:
      self.endpoint.write(self.peer(peer), [Span(region, 0, dest, 0, len(src))]).wait(timeout)

  def read(self, peer: str, dest: memoryview, src: RegionDescriptor, timeout: float = 600):
    with _Bounce(self, dest, copy_in=False) as region:
      self.endpoint.read(self.peer(peer), [Span(region, 0, src, 0, len(dest))]).wait(timeout)

def address_of(view: memoryview) -> int:
  try: return ctypes.addressof(ctypes.c_char.from_buffer(view))
  except TypeError:                 # read-only buffer
    import numpy as np
    return np.frombuffer(view, np.uint8).ctypes.data

class _Bounce:
  """Registered memory for a transfer: the view itself when it lies in an arena, else a bounce region of the MESH arena,
  copied in before or out after (not tinyhet.device.gpu_staging's ring, which moves a GPU's packed layers)."""
  def __init__(self, node: LocalNode, view: memoryview, copy_in: bool):
    self.node, self.view, self.copy_in, self.bounce = node, memoryview(view).cast("B"), copy_in, None

  def __enter__(self) -> Region:
    if len(self.view) and (region := self.node.region_at(address_of(self.view), len(self.view))) is not None: return region
    self.bounce = self.node.arena("MESH").alloc(max(1, len(self.view)))
    if self.copy_in: self.bounce.view()[:len(self.view)] = self.view
    return self.bounce

  def __exit__(self, exc_type, *_):
    if self.bounce is None: return
    if not self.copy_in and exc_type is None: self.view[:] = self.bounce.view(0, len(self.view))
    self.bounce.free()

_node: LocalNode | None = None
_node_lock = threading.Lock()

def local_node() -> LocalNode:
  """This process's node (created on first use from the configuration)."""
  global _node
  with _node_lock:
    if _node is None: _node = LocalNode()
    return _node
