"""Helpers for transport tests: a real memory node in another process, and a raw client that speaks the handshake."""
import hashlib, os, socket
from tinyhet.runtime import wire
from tinyhet.runtime.identity import Identity
from tinyhet.runtime.memory_node import MemoryNodeProcess
from tinyhet.runtime.transport import auth_message

TOKEN = "test-token"

class MemoryNode(MemoryNodeProcess):
  """A memory node with the tests' token."""
  def __init__(self, name="memnode", listen="127.0.0.1:0", netns=None, arena_bytes=64 << 20, token=TOKEN, extra=()):
    super().__init__(token, name, listen, arena_bytes, netns, extra=tuple(extra))

def sha(data) -> str: return hashlib.sha256(data).hexdigest()

KEYS: dict[str, Identity] = {}     # one key pair per raw client name, as a node has: a name's connections share it

def raw_auth(hello: dict, node: str, transport: str, token: str = TOKEN, identity: Identity | None = None, **extra) -> dict:
  """A raw client's handshake message: the token's proof and node's signature of the hello's challenge (with identity, or
  the key this module keeps for that name)."""
  return auth_message(identity or KEYS.setdefault(node, Identity.generate()), token, node, hello, transport, **extra)

def raw_tcp_session(address: str, token: str = TOKEN, node: str = "raw", streams: int = 1, identity: Identity | None = None) -> socket.socket:
  """A TCP socket past the handshake as stream 0 of a tcp session: the caller then sends frames by hand. identity: the key
  to prove node with (an endpoint's, to speak as that endpoint's node while it is connected)."""
  host, _, port = address.rpartition(":")
  sock = socket.create_connection((host, int(port)), timeout=10)
  hello = wire.recv_json(sock)
  wire.send_json(sock, raw_auth(hello, node, "tcp", token, identity, session=os.urandom(8).hex(), stream=0, streams=streams))
  ok = wire.recv_json(sock)
  if "error" in ok: raise ConnectionRefusedError(ok["error"])
  return sock
