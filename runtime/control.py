"""The control channel: small JSON requests between nodes, over the same authenticated handshake as the transports.

A node registers handlers (`ep.handle("alloc", fn)`); a peer calls them (`ControlClient(ep, address).call("alloc", nbytes=N)`).
A handler returns a dict (the reply) or yields dicts (a stream, e.g. generated tokens; the client iterates them with
`stream()`); an exception in a handler becomes an {"error": ...} reply and the connection stays up. Bytes that are not
the protocol drop the connection. Cleanups a handler registers on its connection (`conn.on_close`) run when the peer
goes away, so a crashed peer does not leak what it allocated.
"""
from __future__ import annotations
import json, socket, struct, threading
from tinyhet.runtime import wire

MESSAGE_LIMIT = 16 << 20

class ControlError(RuntimeError):
  """A control request failed on the remote node; the message is the remote node's."""

def send_message(sock: socket.socket, obj: dict):
  _send(sock, obj)

def _send(sock: socket.socket, obj: dict):
  data = json.dumps(obj, separators=(",", ":")).encode()
  if len(data) > MESSAGE_LIMIT: raise ValueError(f"control message of {len(data)} bytes exceeds {MESSAGE_LIMIT}")
  sock.sendall(struct.pack("<I", len(data)) + data)

def recv_message(sock: socket.socket) -> dict:
  (n,) = struct.unpack("<I", wire.recv_exact(sock, 4))
  if n > MESSAGE_LIMIT: raise wire.ProtocolError(f"control message of {n} bytes exceeds {MESSAGE_LIMIT}")
  try: obj = json.loads(wire.recv_exact(sock, n))
  except (UnicodeDecodeError, json.JSONDecodeError) as e: raise wire.ProtocolError(f"control message is not JSON: {e}") from None
  if not isinstance(obj, dict): raise wire.ProtocolError("control message is not a JSON object")
  return obj

class Connection:
  """The server's side of one control connection, passed to handlers."""
  def __init__(self, peer: str, sock: socket.socket):
    self.peer, self.sock, self.cleanups = peer, sock, []
  def on_close(self, fn): self.cleanups.append(fn)

class _SendFailed(ConnectionError):
  """The peer is gone while we answered: drop the connection (a handler's own errors only become error replies)."""

def serve(ep, sock: socket.socket, auth: dict):
  conn = Connection(auth["node"], sock)
  def send_message(sock, obj):
    try: _send(sock, obj)
    except OSError as e: raise _SendFailed(str(e)) from e
  ep.server_ok(sock, auth)
  try:
    while True:
      req = recv_message(sock)
      op, args = req.get("op"), req.get("args", {})
      handler = ep.handlers.get(op) if isinstance(op, str) else None
      if handler is None or not isinstance(args, dict):
        send_message(sock, {"error": f"unknown request {op!r} (this node serves: {', '.join(sorted(ep.handlers))})", "final": True})
        continue
      try:
        result = handler(conn, **args)
        items = [result] if isinstance(result, dict) else result
        for item in items:
          reply = {**item, "final": isinstance(result, dict)}
          send_message(sock, reply)
        if not isinstance(result, dict): send_message(sock, {"final": True})
      except _SendFailed: raise
      except Exception as e: send_message(sock, {"error": f"{type(e).__name__}: {e}", "final": True})
  finally:
    for fn in reversed(conn.cleanups):
      try: fn()
      except Exception as e: print(f"tinyhet: cleanup after {conn.peer} failed: {e}")

class ControlClient:
  """Calls a node's control handlers. One request at a time per client; open several for concurrency."""
  def __init__(self, ep, address: str):
    self.ep, self.address, self.lock = ep, address, threading.Lock()
    self.sock, hello = ep.open_session(address, "ctl")
    self.peer = hello["node"]

  def call(self, op: str, reply_timeout: float | None = 600, **args) -> dict:
    """One request and its reply; args go to the handler (a handler's own `timeout` argument included)."""
    with self.lock:
      self.sock.settimeout(reply_timeout)
      send_message(self.sock, {"op": op, "args": args})
      reply = recv_message(self.sock)
    if "error" in reply: raise ControlError(f"{self.peer}: {op}: {reply['error']}")
    reply.pop("final", None)
    return reply

  def stream(self, op: str, reply_timeout: float | None = 600, **args):
    """Yield each streamed item of a request until the final one (reply_timeout: the most seconds between two items)."""
    with self.lock:
      self.sock.settimeout(reply_timeout)
      send_message(self.sock, {"op": op, "args": args})
      while True:
        item = recv_message(self.sock)
        if "error" in item: raise ControlError(f"{self.peer}: {op}: {item['error']}")
        if item.pop("final"):
          if item: yield item
          return
        yield item

  def close(self):
    try: self.sock.shutdown(socket.SHUT_RDWR)
    except OSError: pass
    self.sock.close()
