"""Remote descriptors: what a peer needs to write into (or read from) a region of another node.

Wire format, version 1, little-endian, 42 + len(node) bytes:
  magic "THD" | version u8 | transports u8 (bit 0 tcp, 1 shm, 2 verbs) | node length u8 | region id u64 | address u64 |
  rkey u32 | offset u64 | length u64 | node (UTF-8)
`address` is the region's virtual address on its node (verbs writes to address+offset with rkey; shm peers translate it
into their mapping of the node's arena); tcp addresses the region by id. `offset`/`length` narrow the descriptor to a
part of the region (a KV block, say). Decoding checks every field and raises DescriptorError with what is wrong.
"""
from __future__ import annotations
import struct
from dataclasses import dataclass, replace

MAGIC, VERSION = b"THD", 1
_FORMAT = struct.Struct("<3sBBBQQIQQ")
TRANSPORT_BITS = {"tcp": 1, "shm": 2, "verbs": 4}

class DescriptorError(ValueError):
  """Bytes that are not a valid region descriptor."""

@dataclass(frozen=True)
class RegionDescriptor:
  node: str                   # name of the node that owns the memory
  region_id: int              # id the owning node gave the region when it exposed it
  addr: int                   # virtual address of the region's first byte on its node
  rkey: int                   # verbs remote key of the region's memory registration; 0 when not registered for verbs
  offset: int                 # start of the described part, relative to the region
  length: int                 # bytes described, from offset
  transports: frozenset[str] = frozenset({"tcp"})

  def __post_init__(self):
    for name, bits in (("region_id", 64), ("addr", 64), ("rkey", 32), ("offset", 64), ("length", 64)):
      if not isinstance(v := getattr(self, name), int) or not 0 <= v < 1 << bits: raise DescriptorError(f"{name} {v!r} is not a u{bits}")
    if self.offset + self.length >= 1 << 64: raise DescriptorError(f"offset {self.offset} + length {self.length} overflows 64 bits")
    if not self.transports or not self.transports <= set(TRANSPORT_BITS): raise DescriptorError(f"unknown transports {set(self.transports)}")
    if not 0 < len(self.node.encode()) < 256: raise DescriptorError(f"node name must be 1..255 bytes of UTF-8, got {self.node!r}")

  def narrow(self, offset: int, length: int) -> RegionDescriptor:
    """The part [offset, offset+length) of what this descriptor describes."""
    if offset < 0 or length < 0 or offset + length > self.length:
      raise DescriptorError(f"part [{offset}, {offset + length}) is outside the {self.length} bytes described")
    return replace(self, offset=self.offset + offset, length=length)

  def encode(self) -> bytes:
    node = self.node.encode()
    bits = sum(TRANSPORT_BITS[t] for t in self.transports)
    return _FORMAT.pack(MAGIC, VERSION, bits, len(node), self.region_id, self.addr, self.rkey, self.offset, self.length) + node

  @staticmethod
  def decode(data: bytes) -> RegionDescriptor:
    if not isinstance(data, (bytes, bytearray, memoryview)): raise DescriptorError(f"expected bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) < _FORMAT.size: raise DescriptorError(f"{len(data)} bytes is shorter than a descriptor's {_FORMAT.size}-byte header")
    magic, version, bits, node_len, region_id, addr, rkey, offset, length = _FORMAT.unpack_from(data)
    if magic != MAGIC: raise DescriptorError(f"bad magic {magic!r} (expected {MAGIC!r}): not a tinyhet descriptor")
    if version != VERSION: raise DescriptorError(f"descriptor version {version} is not supported (this tinyhet reads version {VERSION})")
    if len(data) != _FORMAT.size + node_len: raise DescriptorError(f"length {len(data)} does not match the header's node length {node_len}")
    if bits & ~sum(TRANSPORT_BITS.values()) or not bits: raise DescriptorError(f"bad transport bits {bits:#x}")
    try: node = data[_FORMAT.size:].decode()
    except UnicodeDecodeError: raise DescriptorError("node name is not UTF-8") from None
    return RegionDescriptor(node, region_id, addr, rkey, offset, length, frozenset(t for t, b in TRANSPORT_BITS.items() if bits & b))

  def to_hex(self) -> str: return self.encode().hex()
  @staticmethod
  def from_hex(text: str) -> RegionDescriptor:
    try: return RegionDescriptor.decode(bytes.fromhex(text))
    except (ValueError, TypeError) as e:
      if isinstance(e, DescriptorError): raise
      raise DescriptorError(f"not a hex-encoded descriptor: {e}") from None
