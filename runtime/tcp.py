"""tcp transport: for nodes without RDMA. Several parallel streams per peer; the receiver lands every WRITE straight into
the exposed region (recv_into a memoryview of registered memory) after checking the region's bounds, its owner and the
parts of it open to writes (a decode node exposes each reservation's blocks, to the peer that reserved them, and nothing else).

A batch's pieces are spread over the streams in vectored WRITE frames (one header, the piece list, the payloads: one
sendmsg on the writer, one scatter recvmsg_into on the receiver); the batch's last frame carries its total bytes. The
receiver counts bytes landed per batch across all streams of the session, and once all have landed it delivers the
notification and ACKs on the stream that carried the last frame. A peer that breaks the protocol (unknown region, out-of-bounds span, more
bytes than committed, garbage) gets an ERROR frame and loses its whole session; nothing outside the addressed span is
written and the node's other peers are untouched.
"""
from __future__ import annotations
import itertools, queue, secrets, socket, threading
from tinyhet.runtime import wire
from tinyhet.runtime.wire import Frame, WRITE, ACK, READ, DATA, ERROR, CLOSE, NOTIFY, LAST, SINGLE, PIECE, HEADER, MAGIC
from tinyhet.runtime.transfer import Transfer, TransportError, Piece, coalesce, split, local_view

MAX_PIECE = 4 << 20          # a span larger than this is cut so that parallel streams share it
MAX_FRAME_PIECES = 256       # pieces per vectored WRITE frame (the receiver drops a peer that sends more)
MAX_FRAME_BYTES = 8 << 20
INLINE_BYTES = 256 << 10     # batches up to this size are sent by the caller's thread (lowest latency); larger ones by stream threads
MAX_OPEN_BATCHES = 4096      # a session with more uncommitted batches than this is dropped
MAX_ERROR_TEXT = 4096
def _error_frame(batch: int, message: str) -> list:
  text = message.encode()[:MAX_ERROR_TEXT]
  return [Frame(ERROR, batch=batch, nbytes=len(text)).pack(), text]

# ---------------------------------------------------------------- writer side

def _frames(batch: int, pieces: list[Piece], total: int, notify: int | None, closes: bool) -> list[list]:
  """Vectored WRITE frames (header, piece records, payload views) for one stream's share of a batch."""
  flags_last = LAST | (NOTIFY if notify is not None else 0)
  if closes and len(pieces) == 1 and pieces[0].nbytes == total:       # the common small write: one frame, no records
    p = pieces[0]
    return [[HEADER.pack(MAGIC, WRITE, flags_last | SINGLE, notify or 0, batch, 0, p.region_id, p.region_offset, p.nbytes), local_view(p)]]
  groups, cur, cur_bytes = [], [], 0
  for p in pieces:
    if cur and (len(cur) == MAX_FRAME_PIECES or cur_bytes + p.nbytes > MAX_FRAME_BYTES):
      groups.append(cur)
      cur, cur_bytes = [], 0
    cur.append(p)
    cur_bytes += p.nbytes
  if cur or closes: groups.append(cur)
  frames = []
  for i, g in enumerate(groups):
    last = closes and i == len(groups) - 1
    head = HEADER.pack(MAGIC, WRITE, flags_last if last else 0, (notify or 0) if last else 0, batch, len(g), 0, total if last else 0,
                       sum(p.nbytes for p in g))
    frames.append([head, b"".join(PIECE.pack(p.region_id, p.region_offset, p.nbytes) for p in g), *(local_view(p) for p in g)])
  return frames

class Stream:
  """One TCP connection of a link: a send lock, a sender thread for large batches, a reader thread for replies."""
  def __init__(self, link: Link, sock: socket.socket, index: int):
    self.link, self.sock, self.index = link, sock, index
    self.send_lock = threading.Lock()
    self.queue: queue.SimpleQueue = queue.SimpleQueue()
    self.sender = threading.Thread(target=self._send_loop, name=f"tinyhet-tcp-send-{link.peer}-{index}", daemon=True)
    self.reader = threading.Thread(target=self._read_loop, name=f"tinyhet-tcp-recv-{link.peer}-{index}", daemon=True)
    self.sender.start()
    self.reader.start()

  def send(self, buffers: list):
    with self.send_lock: wire.send_all(self.sock, buffers)

  def _send_loop(self):
    while (item := self.queue.get()) is not None:
      batch, buffers = item
      try: self.send(buffers)
      except OSError as e:
        self.link.fail_all(f"sending to {self.link.peer} failed: {e}")
        return

  def _read_loop(self):
    header = bytearray(HEADER.size)
    try:
      while True:
        op, _, _, batch, tag, _, _, nbytes = wire.recv_header(self.sock, header)
        if op == ACK: self.link.finish(batch)
        elif op == DATA: self.link.land_read(self.sock, batch, tag, nbytes)
        elif op == ERROR:
          text = wire.recv_exact(self.sock, min(nbytes, MAX_ERROR_TEXT)).decode(errors="replace")
          self.link.fail_all(f"{self.link.peer} dropped the connection: {text}")
          return
        else: raise wire.ProtocolError(f"unexpected {wire.OP_NAMES[op]} frame from {self.link.peer}")
    except (OSError, wire.ProtocolError) as e:
      self.link.fail_all(f"connection to {self.link.peer} lost: {e}")

class Link:
  """The writer's side of a tcp connection to one peer."""
  @staticmethod
  def connect(ep, address: str, sock: socket.socket, hello: dict) -> Link:
    session, n = secrets.token_hex(8), ep.settings.tcp_streams
    ep.client_auth(sock, hello, "tcp", session=session, stream=0, streams=n)
    sock.settimeout(None)
    socks = [sock]
    try:
      for k in range(1, n): socks.append(ep.open_session(address, "tcp", session=session, stream=k, streams=n)[0])
    except BaseException:
      for s in socks[1:]: s.close()
      raise
    return Link(hello["node"], socks)

  def __init__(self, peer: str, socks: list[socket.socket]):
    self.peer, self.lock, self.broken = peer, threading.Lock(), None
    self.pending: dict[int, Transfer] = {}
    self.reads: dict[tuple[int, int], memoryview] = {}
    self.reads_left: dict[int, int] = {}
    self.batch_ids = itertools.count(1)
    self.streams = [Stream(self, s, k) for k, s in enumerate(socks)]

  def _start(self, kind: str, nbytes: int) -> Transfer:
    with self.lock:
      if self.broken: raise TransportError(f"connection to {self.peer} is broken: {self.broken}")
      t = Transfer(self.peer, kind, next(self.batch_ids), nbytes)
      self.pending[t.batch] = t
    return t

  def write(self, pieces: list[Piece], notify: int | None) -> Transfer: return self.write_many([(pieces, notify)])[0]

  def write_many(self, writes: list[tuple[list[Piece], int | None]]) -> list[Transfer]:
    """Each write a batch of its own (its notice in its last frame), posted in order. All of them together up to
    INLINE_BYTES: sent from this thread, a batch on one stream; larger: queued to the stream threads, each piece to the
    stream with the fewest bytes queued by this call (the caller does not wait on the receiver taking the bytes)."""
    writes = [(split(coalesce(pieces), MAX_PIECE), notify) for pieces, notify in writes]
    inline = sum(p.nbytes for pieces, _ in writes for p in pieces) <= INLINE_BYTES
    loads, out = [0] * len(self.streams), []
    for pieces, notify in writes:
      t = self._start("write", sum(p.nbytes for p in pieces))
      out.append(t)
      per_stream: list[list[Piece]] = [[] for _ in self.streams]
      if inline: per_stream[t.batch % len(self.streams)] = pieces     # a small batch: one frame on one stream, sent from this thread
      else:
        for p in pieces:
          k = loads.index(min(loads))
          per_stream[k].append(p)
          loads[k] += p.nbytes
      closing = max(range(len(self.streams)), key=lambda k: (len(per_stream[k]) > 0, -k))   # a stream that carries pieces closes the batch
      try:
        for k, (stream, mine) in enumerate(zip(self.streams, per_stream)):
          frames = _frames(t.batch, mine, t.nbytes, notify if k == closing else None, closes=k == closing)
          for frame in frames:
            if inline: stream.send(frame)
            else: stream.queue.put((t.batch, frame))
      except OSError as e: self.fail_all(f"sending to {self.peer} failed: {e}")
    return out

  def read(self, pieces: list[Piece]) -> Transfer:
    pieces = split(coalesce(pieces), MAX_PIECE)
    t = self._start("read", sum(p.nbytes for p in pieces))
    with self.lock:
      self.reads_left[t.batch] = len(pieces)
      for tag, p in enumerate(pieces): self.reads[(t.batch, tag)] = local_view(p)
    try:
      for tag, p in enumerate(pieces):
        frame = Frame(READ, batch=t.batch, tag=tag, region=p.region_id, offset=p.region_offset, nbytes=p.nbytes).pack()
        self.streams[tag % len(self.streams)].send([frame])
    except OSError as e: self.fail_all(f"sending to {self.peer} failed: {e}")
    return t

  def land_read(self, sock: socket.socket, batch: int, tag: int, nbytes: int):
    with self.lock: view = self.reads.pop((batch, tag), None)
    if view is None or len(view) != nbytes: raise wire.ProtocolError(f"{self.peer} sent data for no pending read (batch {batch}, tag {tag})")
    wire.recv_into_exact(sock, view)
    with self.lock:
      self.reads_left[batch] -= 1
      last = self.reads_left[batch] == 0
      if last: del self.reads_left[batch]
    if last: self.finish(batch)

  def finish(self, batch: int):
    with self.lock: t = self.pending.pop(batch, None)
    if t is not None: t.finish()

  def fail_all(self, why: str):
    with self.lock:
      self.broken = self.broken or why
      pending, self.pending = list(self.pending.values()), {}
      self.reads.clear()
    for t in pending: t.finish(why)

  def close(self):
    self.fail_all("the link was closed")
    for s in self.streams:
      s.queue.put(None)
      try:
        with s.send_lock: s.sock.sendall(Frame(CLOSE).pack())
      except OSError: pass
      try: s.sock.shutdown(socket.SHUT_RDWR)
      except OSError: pass
    for s in self.streams:
      s.sender.join(timeout=5)
      s.reader.join(timeout=5)
      s.sock.close()

# ---------------------------------------------------------------- receiver side

class Session:
  """The receiver's view of one writer: its streams, and the bytes landed per batch across them."""
  def __init__(self, ep, peer: str, streams: int):
    self.ep, self.peer, self.streams = ep, peer, streams
    self.lock = threading.Lock()
    self.batches: dict[int, list] = {}            # batch -> [landed, committed total or None, notify value or None, reply stream]
    self.socks: dict[socket.socket, threading.Lock] = {}

  def landed(self, batch: int, nbytes: int, total: int | None, value: int | None, reply):
    """nbytes of batch landed; a batch's last frame also brings its total, notification and where to ACK."""
    with self.lock:
      b = self.batches.get(batch)
      if b is None:
        if len(self.batches) >= MAX_OPEN_BATCHES: raise wire.ProtocolError(f"more than {MAX_OPEN_BATCHES} uncommitted batches")
        b = self.batches[batch] = [0, None, None, None]
      b[0] += nbytes
      if total is not None:
        if b[1] is not None: raise wire.ProtocolError(f"batch {batch} committed twice")
        b[1], b[2], b[3] = total, value, reply
      if b[1] is not None and b[0] > b[1]: raise wire.ProtocolError(f"batch {batch}: {b[0]} bytes landed but {b[1]} were committed")
      done = b[1] is not None and b[0] == b[1]
      if done: del self.batches[batch]
    if done:
      sock, lock = b[3]
      with lock: sock.sendall(HEADER.pack(MAGIC, ACK, 0, 0, batch, 0, 0, 0, b[1]))
      if b[2] is not None: self.ep.deliver(self.peer, b[2], batch, b[1])

  def tell_all(self, sent: socket.socket, why: str):
    """The ERROR frame on the session's other streams too, so the writer learns why whichever stream it reads first (never
    blocking on a peer that does not read: a stream busy for 0.5 s, or whose buffer is full, just closes)."""
    frame = b"".join(bytes(b) for b in _error_frame(0, why))
    with self.lock: socks = [(s, lock) for s, lock in self.socks.items() if s is not sent]
    for s, lock in socks:
      if not lock.acquire(timeout=0.5): continue
      try: s.send(frame, socket.MSG_DONTWAIT)
      except OSError: pass
      finally: lock.release()

  def drop(self):
    with self.lock: socks = list(self.socks)
    for s in socks:
      try: s.shutdown(socket.SHUT_RDWR)
      except OSError: pass

def serve(ep, sock: socket.socket, auth: dict):
  """Serve one stream of a writer's session until it closes or breaks the protocol."""
  session_id, index, streams = auth.get("session"), auth.get("stream"), auth.get("streams")
  if not isinstance(session_id, str) or not isinstance(streams, int) or not isinstance(index, int) or not 0 <= index < streams <= 64:
    raise wire.ProtocolError(f"bad tcp session fields {session_id!r} {index!r} {streams!r}")
  key = (auth["node"], session_id)
  with ep.lock: session = ep.tcp_sessions.setdefault(key, Session(ep, auth["node"], streams))
  send_lock = threading.Lock()
  with session.lock: session.socks[sock] = send_lock
  ep.server_ok(sock, auth)
  header = bytearray(wire.HEADER.size)
  try:
    while True:
      op, flags, value, batch, tag, region, offset, nbytes = wire.recv_header(sock, header)
      if op == WRITE and flags & SINGLE:
        (view,), regions = ep.land(sock, ((region, offset, nbytes),), session.peer)
        try: wire.recv_into_exact(sock, view)
        finally: ep.end_landing(sock, regions)
        with send_lock: sock.sendall(HEADER.pack(MAGIC, ACK, 0, 0, batch, 0, 0, 0, nbytes))
        if flags & NOTIFY: ep.deliver(session.peer, value, batch, nbytes)
      elif op == WRITE:
        if tag > MAX_FRAME_PIECES: raise wire.ProtocolError(f"a WRITE frame of {tag} pieces exceeds {MAX_FRAME_PIECES}")
        records = wire.recv_exact(sock, tag * PIECE.size) if tag else b""
        views, regions = ep.land(sock, list(PIECE.iter_unpack(records)), session.peer)     # every piece checked before any lands
        try:
          if (got := sum(len(v) for v in views)) != nbytes: raise wire.ProtocolError(f"frame claims {nbytes} bytes, its pieces hold {got}")
          wire.recv_into_views(sock, views)
        finally: ep.end_landing(sock, regions)
        last = bool(flags & LAST)
        session.landed(batch, nbytes, offset if last else None, value if flags & NOTIFY else None, (sock, send_lock) if last else None)
      elif op == READ:
        (view,), regions = ep.land(sock, ((region, offset, nbytes),), session.peer, "read")    # a released grant's blocks: refused
        try:
          with send_lock: wire.send_all(sock, [Frame(DATA, batch=batch, tag=tag, nbytes=nbytes).pack(), view])
        finally: ep.end_landing(sock, regions)
      elif op == CLOSE: return
      else: raise wire.ProtocolError(f"unexpected {wire.OP_NAMES[op]} frame")
  except wire.ProtocolError as e:
    try:
      with send_lock: wire.send_all(sock, _error_frame(0, str(e)))
    except OSError: pass
    session.tell_all(sock, str(e))
    session.drop()
    raise
  except OSError:
    session.drop()
    raise
  finally:
    with session.lock:
      session.socks.pop(sock, None)
      empty = not session.socks
    if empty:
      with ep.lock: ep.tcp_sessions.pop(key, None)
