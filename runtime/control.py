"""The control channel: small JSON requests between nodes, over the same authenticated handshake as the transports.

A node registers handlers (`ep.handle("alloc", fn)`); a peer calls them (`ControlClient(ep, address).call("alloc", nbytes=N)`).
A handler returns a dict (the reply) or yields dicts (a stream, e.g. generated tokens; the client iterates them with
`stream()`); an exception in a handler becomes an {"error": ...} reply and the connection stays up. Bytes that are not
the protocol drop the connection. Cleanups a handler registers on its connection (`conn.on_close`) run when the peer
goes away, so a crashed peer does not leak what it allocated.

Every request carries an id that each of its replies repeats, so a reply never answers the wrong request. While a
stream runs, the only message a client may send is {"op": "cancel"}: the handler's generator is closed (its `finally`
undoes what the request started) and the stream ends with {"cancelled": true}. A client that goes away mid-stream is
noticed within a tick: a streaming handler yields None while it waits, which lets the channel look at the socket.
"""
from __future__ import annotations
import json, select, socket, struct, threading
from tinyhet.runtime import wire

MESSAGE_LIMIT = 16 << 20
USER_ERRORS = (ValueError, LookupError, TimeoutError, MemoryError)   # said in the handler's own words; others name their type

class ControlError(RuntimeError):
  """A control request failed on the remote node; the message is the remote node's own. peer, op and kind (the remote
  exception's type name) are attributes, for logs."""
  def __init__(self, message: str, peer: str = "", op: str = "", kind: str = ""):
    super().__init__(message)
    self.peer, self.op, self.kind = peer, op, kind

class ChannelBroken(ConnectionError):
  """The control connection itself failed (the node went away, or answered out of protocol); it cannot be used again."""

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
  """The server's side of one control connection, passed to handlers. `state` holds what handlers keep per connection."""
  def __init__(self, peer: str, sock: socket.socket):
    self.peer, self.sock, self.cleanups, self.state = peer, sock, [], {}
  def on_close(self, fn): self.cleanups.append(fn)

class _SendFailed(ConnectionError):
  """The peer is gone while we answered: drop the connection (a handler's own errors only become error replies)."""

def _error_text(e: Exception) -> str:
  return str(e) if isinstance(e, USER_ERRORS) and str(e) else f"{type(e).__name__}: {e}"

def serve(ep, sock: socket.socket, auth: dict):
  conn = Connection(auth["node"], sock)
  def send_message(sock, obj):
    try: _send(sock, obj)
    except OSError as e: raise _SendFailed(str(e)) from e
  ep.server_ok(sock, auth)
  try:
    while True:
      req = recv_message(sock)
      op, args, rid = req.get("op"), req.get("args", {}), req.get("id")
      tag = {"id": rid} if isinstance(rid, int) and not isinstance(rid, bool) else {}
      handler = ep.handlers.get(op) if isinstance(op, str) else None
      if op == "cancel":                        # a cancel that crossed its stream's end: nothing left to cancel
        send_message(sock, {"cancelled": False, "final": True, **tag})
        continue
      if handler is None or not isinstance(args, dict):
        send_message(sock, {"error": f"unknown request {op!r} (this node serves: {', '.join(sorted(ep.handlers))})", "final": True, **tag})
        continue
      try:
        result = handler(conn, **args)
        if isinstance(result, dict): send_message(sock, {**result, "final": True, **tag})
        else: _stream(sock, result, tag, send_message)
      except _SendFailed: raise
      except Exception as e: send_message(sock, {"error": _error_text(e), "kind": type(e).__name__, "final": True, **tag})
  finally:
    for fn in reversed(conn.cleanups):
      try: fn()
      except Exception as e: print(f"tinyhet: cleanup after {conn.peer} failed: {e}")

def _stream(sock: socket.socket, items, tag: dict, send_message):
  close = getattr(items, "close", lambda: None)
  try:
    for item in items:
      if select.select([sock], [], [], 0)[0]:      # the client spoke mid-stream: a cancel, or it is gone
        msg = recv_message(sock)                   # EOF raises ConnectionError: the connection closes, cleanups run
        if msg.get("op") != "cancel": raise wire.ProtocolError(f"request {msg.get('op')!r} sent while a stream was running")
        close()                                    # the handler's finally undoes the request
        send_message(sock, {"cancelled": True, "final": True, **tag})
        return
      if item is not None: send_message(sock, {**item, "final": False, **tag})
    send_message(sock, {"final": True, **tag})
  finally: close()

class ControlClient:
  """Calls a node's control handlers. One request at a time per client; open several for concurrency."""
  def __init__(self, ep, address: str):
    self.ep, self.address, self.lock = ep, address, threading.Lock()
    self.sock, hello = ep.open_session(address, "ctl")
    self.peer = hello["node"]
    self.next_id, self.broken = 1, None

  def _request(self, op: str, args: dict, reply_timeout: float | None) -> int:
    if self.broken: raise ChannelBroken(f"the control connection to {self.peer} is unusable: {self.broken}")
    rid, self.next_id = self.next_id, self.next_id + 1
    self.sock.settimeout(reply_timeout)
    try: send_message(self.sock, {"op": op, "args": args, "id": rid})
    except OSError as e: self._break(str(e))
    return rid

  def _reply(self, rid: int) -> dict:
    try:
      while True:
        item = recv_message(self.sock)
        if item.get("id") == rid: return item
        if not isinstance(item.get("id"), int) or item["id"] > rid: raise wire.ProtocolError(f"{self.peer} answered request {item.get('id')!r}")
    except (OSError, wire.ProtocolError) as e: self._break(str(e))

  def _break(self, why: str):
    self.broken = why
    self.close()
    raise ChannelBroken(f"the connection to {self.peer} broke: {why}")

  def _check(self, op: str, item: dict) -> dict:
    if "error" in item: raise ControlError(str(item["error"]), self.peer, op, str(item.get("kind", "")))
    item.pop("id", None)
    return item

  def call(self, op: str, reply_timeout: float | None = 600, **args) -> dict:
    """One request and its reply; args go to the handler (a handler's own `timeout` argument included)."""
    with self.lock:
      reply = self._check(op, self._reply(self._request(op, args, reply_timeout)))
    reply.pop("final", None)
    return reply

  def begin(self, op: str, reply_timeout: float | None = 600, **args) -> Pending:
    """Send a request now and read its reply later (Pending.result), so that the caller works meanwhile (a prefill starts
    while the decode node reserves its blocks: the round trip left the TTFT). Until the reply is read the client serves no
    other request: a call from another thread waits for it; Pending.result (or close) must be called, once."""
    self.lock.acquire()
    try: rid = self._request(op, args, reply_timeout)
    except BaseException:
      self.lock.release()
      raise
    return Pending(self, op, rid)

  def stream(self, op: str, reply_timeout: float | None = 600, **args):
    """Yield each streamed item of a request until the final one (reply_timeout: the most seconds between two items).
    Leaving the loop early (break, an exception, closing the generator) cancels the request on the node and reads its
    replies up to the end, so the next request starts in step."""
    with self.lock:
      rid, done = self._request(op, args, reply_timeout), False
      try:
        while True:
          item = self._reply(rid)
          done = bool(item.get("final")) or "error" in item
          self._check(op, item)
          if item.pop("final"):
            if item: yield item
            return
          yield item
      finally:
        if not done and not self.broken: self._cancel(rid, reply_timeout)

  def _cancel(self, rid: int, reply_timeout: float | None):
    try:
      self.sock.settimeout(reply_timeout)
      send_message(self.sock, {"op": "cancel", "id": rid})
      while not self._reply(rid).get("final"): pass
    except (OSError, wire.ProtocolError) as e:
      if not self.broken:
        self.broken = str(e)
        self.close()

  def close(self):
    try: self.sock.shutdown(socket.SHUT_RDWR)
    except OSError: pass
    self.sock.close()

class Pending:
  """A request sent by ControlClient.begin whose reply has not been read yet."""
  def __init__(self, client: ControlClient, op: str, rid: int):
    self.client, self.op, self.rid, self.reply, self.error = client, op, rid, None, None

  def result(self) -> dict:
    """The reply (as call's), read on the first call; raises the request's failure (ControlError, ChannelBroken), every time."""
    if self.rid is not None:
      rid, self.rid = self.rid, None
      try:
        self.reply = self.client._check(self.op, self.client._reply(rid))
        self.reply.pop("final", None)
      except BaseException as e: self.error = e
      finally: self.client.lock.release()
    if self.error is not None: raise self.error
    return self.reply
