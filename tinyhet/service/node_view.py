"""The router's view of one node (tinyhet.service.router): its last figures (heartbeats, node.status), what this router's
own requests hold there, its cache's block hashes, and the admissions its figures may not show yet (Admission): room
for a request is the node's free blocks less those, and never more than its pool less what this router holds there.
"""
from __future__ import annotations
import time
from dataclasses import dataclass, field
from tinyhet.service.cache_view import DISK_WEIGHT, chain_tokens

@dataclass(eq=False)
class Admission:
  """One request's blocks on a node as this router counts them (Cluster._admit), and how long the node's own figures may
  miss them: until one made after they landed there (_beat, _ask), and never once the request has ended (_release)."""
  blocks: int
  at: float = field(default_factory=time.monotonic)    # admitted
  landed: float | None = None                          # when the node surely held them: decode.reserve answered, or a token came

@dataclass(eq=False)
class Node:
  address: str
  role: str                                   # prefill | decode | both
  up: bool = False
  reason: str = "no heartbeat yet"
  status: dict = field(default_factory=dict)  # the last heartbeat
  reserved_blocks: int = 0                    # KV blocks this router's requests were admitted with here (prompt + headroom)
  inflight_tokens: int = 0                    # prompt tokens this router sent here to prefill, not yet answered
  assigned: int = 0                           # this router's requests decoding here (heartbeats lag; this does not)
  recent: list = field(default_factory=list)  # Admissions the node's last figures may not show yet
  changed: bool = False                       # one of this router's requests here landed or ended since the node's figures
  asking: bool = False                        # a node.status call to it is in flight (Cluster._ask)
  no_status: bool = False                     # it does not serve node.status (an older node): its heartbeats only
  status_client: object = None                # the ControlClient _ask reuses
  asked_at: float | None = None               # the node's time of the figures _ask brought, until a later beat's
  clients: set = field(default_factory=set)   # requests' control connections to this node
  cached: set = field(default_factory=set)    # block hashes of its prefix cache, as its heartbeats tell them (_beat)
  disk: set = field(default_factory=set)      # block hashes of its disk tier, likewise (tinyhet.service.cache_view)
  @property
  def can_decode(self) -> bool: return self.role in ("decode", "both")
  @property
  def can_prefill(self) -> bool: return self.role in ("prefill", "both")
  def blocks_for(self, tokens: int) -> int: return -(-tokens // self.status.get("block_size", 16))
  def free_blocks(self) -> int:
    s = self.status
    return min(s.get("free_blocks", 0) - sum(a.blocks for a in self.recent), s.get("kv_blocks", 0) - self.reserved_blocks)
  def cached_tokens(self, ids: list[int], salt: str = "") -> int:
    """Prompt tokens this node's RAM cache would give ids under this salt (its heartbeat's summary, hashed with its cache key)."""
    return chain_tokens(self.status, self.cached, set(), ids, salt)[0]
  def overlap(self, ids: list[int], salt: str = "") -> float:
    """The KV-aware score's cached tokens: RAM hits, and the disk tier's blocks after them at DISK_WEIGHT."""
    ram, disk = chain_tokens(self.status, self.cached, self.disk, ids, salt)
    return ram + DISK_WEIGHT * disk
  def decode_load(self) -> float:
    s = self.status
    return max(s.get("running", 0) + s.get("waiting", 0) + s.get("incoming", 0), self.assigned) / max(1, s.get("max_seqs", 1))
  def prefill_load(self) -> int:
    """Prompt tokens ahead of a new prefill here; a `both` node's decode batch counts as a block's worth per sequence."""
    s = self.status
    busy = (s.get("running", 0) + s.get("waiting", 0)) * s.get("block_size", 16) if self.can_decode and self.role == "both" else 0
    return s.get("queued_tokens", 0) + self.inflight_tokens + busy
