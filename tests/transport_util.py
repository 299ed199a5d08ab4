"""Helpers for transport tests: a real memory node in another process, and a raw client that speaks the handshake."""
import hashlib, os, socket
from tinyhet.runtime import wire
from tinyhet.runtime.memory_node import MemoryNodeProcess

TOKEN = "test-token"

class MemoryNode(MemoryNodeProcess):
  """A memory node with the tests' token."""
  def __init__(self, name="memnode", listen="127.0.0.1:0", netns=None, arena_bytes=64 << 20, token=TOKEN, extra=()):
    super().__init__(token, name, listen, arena_bytes, netns, extra=tuple(extra))

def sha(data) -> str: return hashlib.sha256(data).hexdigest()

def raw_tcp_session(address: str, token: str = TOKEN, node: str = "raw", streams: int = 1) -> socket.socket:
  """A TCP socket past the handshake as stream 0 of a tcp session: the caller then sends frames by hand."""
  host, _, port = address.rpartition(":")
  sock = socket.create_connection((host, int(port)), timeout=10)
  hello = wire.recv_json(sock)
  nonce = wire.new_nonce()
  wire.send_json(sock, {"node": node, "transport": "tcp", "nonce": nonce, "proof": wire.proof(token, hello["nonce"], "client", node),
                        "session": os.urandom(8).hex(), "stream": 0, "streams": streams})
  ok = wire.recv_json(sock)
  if "error" in ok: raise ConnectionRefusedError(ok["error"])
  return sock
