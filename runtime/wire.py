"""Bytes on the wire: the handshake (length-prefixed JSON, mutual token proof) and the fixed 48-byte data frame header.

Data frame header, little-endian: magic u16 "th" | op u8 | flags u8 | value u32 | batch u64 | tag u64 | region u64 |
offset u64 | nbytes u64. A WRITE frame is vectored: `tag` piece records (region u64 | offset u64 | nbytes u64) follow the
header, then the pieces' payloads back to back (nbytes in all); with the LAST flag it also closes its batch, whose total
is `offset`; with the SINGLE flag it is a whole one-piece batch at (region, offset, nbytes), with no records. A DATA
frame is followed by nbytes of payload. Anything else a peer sends is a protocol error and drops that peer.
"""
from __future__ import annotations
import hashlib, hmac, json, os, socket, struct, time
from dataclasses import dataclass

PROTOCOL = 1
MAGIC = 0x6874
HEADER = struct.Struct("<HBBIQQQQQ")
JSON_LIMIT = 1 << 16
IOV_MAX = 1024

# ops
WRITE, COMMIT, ACK, READ, DATA, ERROR, CLOSE, ARENA = 1, 2, 3, 4, 5, 6, 7, 8
OP_NAMES = {WRITE: "WRITE", COMMIT: "COMMIT", ACK: "ACK", READ: "READ", DATA: "DATA", ERROR: "ERROR", CLOSE: "CLOSE", ARENA: "ARENA"}
NOTIFY = 1   # flag: value is a notification for the receiver
LAST = 2     # WRITE flag: the frame closes its batch (COMMIT folded into the last WRITE)
SINGLE = 4   # WRITE flag: the frame is a whole batch of one piece, described by the header's region/offset/nbytes (no records)
PIECE = struct.Struct("<QQQ")

class ProtocolError(ConnectionError):
  """A peer sent bytes that do not follow the protocol; the connection is dropped."""

@dataclass(frozen=True)
class Frame:
  op: int
  flags: int = 0
  value: int = 0
  batch: int = 0
  tag: int = 0
  region: int = 0
  offset: int = 0
  nbytes: int = 0

  def pack(self) -> bytes: return HEADER.pack(MAGIC, self.op, self.flags, self.value, self.batch, self.tag, self.region, self.offset, self.nbytes)

  @staticmethod
  def unpack(data: bytes) -> Frame:
    magic, op, flags, value, batch, tag, region, offset, nbytes = HEADER.unpack(data)
    if magic != MAGIC: raise ProtocolError(f"bad frame magic {magic:#06x}")
    if op not in OP_NAMES: raise ProtocolError(f"unknown frame op {op}")
    return Frame(op, flags, value, batch, tag, region, offset, nbytes)

def recv_into_exact(sock: socket.socket, view: memoryview):
  """Fill view from sock; a peer that closes midway raises ConnectionError."""
  n = len(view)
  if (got := sock.recv_into(view, n, socket.MSG_WAITALL)) == n: return       # one syscall, unless a signal or EOF cuts it short
  while got < n:
    k = sock.recv_into(view[got:], n - got)
    if k == 0: raise ConnectionError(f"peer closed the connection after {got} of {n} bytes")
    got += k

def recv_into_views(sock: socket.socket, views: list[memoryview]):
  """Fill several buffers from sock in as few syscalls as the kernel allows (scatter receive, no staging copy)."""
  views = [v for v in views if len(v)]
  while views:
    k = sock.recvmsg_into(views[:IOV_MAX], 0, socket.MSG_WAITALL)[0]   # one wakeup when all has arrived, not one per segment
    if k == 0: raise ConnectionError(f"peer closed the connection with {sum(len(v) for v in views)} bytes outstanding")
    while views and k >= len(views[0]):
      k -= len(views[0])
      views.pop(0)
    if views and k: views[0] = views[0][k:]

def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
  buf = bytearray(n)
  if deadline is None:
    recv_into_exact(sock, memoryview(buf))
    return bytes(buf)
  got, view = 0, memoryview(buf)
  while got < n:      # the socket's timeout would restart with every byte: a deadline bounds the whole message
    if (left := deadline - time.monotonic()) <= 0: raise TimeoutError(f"the peer sent {got} of {n} bytes before the handshake deadline")
    sock.settimeout(left)
    if (k := sock.recv_into(view[got:], n - got)) == 0: raise ConnectionError(f"peer closed the connection after {got} of {n} bytes")
    got += k
  return bytes(buf)

def recv_frame(sock: socket.socket) -> Frame: return Frame.unpack(recv_exact(sock, HEADER.size))

def recv_header(sock: socket.socket, buf: bytearray) -> tuple[int, int, int, int, int, int, int, int]:
  """The hot path's recv_frame: into a reused buffer, as a plain tuple (op, flags, value, batch, tag, region, offset, nbytes)."""
  if sock.recv_into(buf, HEADER.size, socket.MSG_WAITALL) != HEADER.size: recv_into_exact(sock, memoryview(buf))
  magic, op, flags, value, batch, tag, region, offset, nbytes = HEADER.unpack_from(buf)
  if magic != MAGIC: raise ProtocolError(f"bad frame magic {magic:#06x}")
  if op not in OP_NAMES: raise ProtocolError(f"unknown frame op {op}")
  return op, flags, value, batch, tag, region, offset, nbytes

def send_all(sock: socket.socket, buffers: list):
  """sendmsg until every byte of buffers is out: one syscall for a header and its payload, no copy of the payload."""
  sent = sock.sendmsg(buffers) if len(buffers) <= IOV_MAX else 0
  if sent == sum(len(b) for b in buffers): return             # the usual case: all of it in one call
  views = [memoryview(b).cast("B") for b in buffers if len(b)]
  while True:
    while views and sent >= len(views[0]):
      sent -= len(views[0])
      views.pop(0)
    if not views: return
    if sent: views[0], sent = views[0][sent:], 0
    sent = sock.sendmsg(views[:IOV_MAX])

def send_json(sock: socket.socket, obj: dict):
  data = json.dumps(obj).encode()
  if len(data) > JSON_LIMIT: raise ValueError(f"handshake message of {len(data)} bytes exceeds {JSON_LIMIT}")
  sock.sendall(struct.pack("<I", len(data)) + data)

def recv_json(sock: socket.socket, deadline: float | None = None) -> dict:
  """One handshake message; with a deadline (time.monotonic()), the whole message must arrive by then, however it trickles."""
  (n,) = struct.unpack("<I", recv_exact(sock, 4, deadline))
  if n > JSON_LIMIT: raise ProtocolError(f"handshake message of {n} bytes exceeds {JSON_LIMIT}")
  try: obj = json.loads(recv_exact(sock, n, deadline))
  except (UnicodeDecodeError, json.JSONDecodeError) as e: raise ProtocolError(f"handshake message is not JSON: {e}") from None
  if not isinstance(obj, dict): raise ProtocolError("handshake message is not a JSON object")
  return obj

def proof(token: str, nonce_hex: str, role: str, node: str) -> str:
  """HMAC-SHA256 of the peer's nonce: proves the token without sending it."""
  return hmac.new(token.encode(), f"{PROTOCOL}|{role}|{node}|{nonce_hex}".encode(), hashlib.sha256).hexdigest()

def check_proof(token: str, nonce_hex: str, role: str, node: str, given) -> bool:
  # as bytes: compare_digest refuses a str with non-ASCII characters (TypeError), and a peer chooses what it sends
  return isinstance(given, str) and hmac.compare_digest(proof(token, nonce_hex, role, node).encode(), given.encode("utf-8", "surrogatepass"))

def new_nonce() -> str: return os.urandom(16).hex()

def host_id() -> str:
  """Same value for two processes iff they share memory and a network namespace: then shm can reach the peer."""
  parts = []
  for path in ("/etc/machine-id", "/proc/sys/kernel/random/boot_id"):
    try: parts.append(open(path).read().strip())
    except OSError: parts.append(socket.gethostname())
  try: parts.append(str(os.stat("/proc/self/ns/net").st_ino))
  except OSError: pass
  return hashlib.sha256("|".join(parts).encode()).hexdigest()[:32]
