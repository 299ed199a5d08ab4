"""shm transport: a peer on the same host maps the receiver's arenas (memfds passed over a unix socket) and a write is
one memcpy into the destination. The unix socket carries only control: ARENA frames (with the memfd attached) from the
receiver, COMMIT frames (notifications, sent after the copy is done) from the writer.

The writer checks every span against the descriptor it was given and the arena it maps; the receiver cannot check a
one-sided copy, which is why only peers that proved the shared token and their name, and that run as this process's
user (SO_PEERCRED on the unix socket: such a process could read this one's memory anyway), get the memfds. Such a peer can write anywhere in
the arenas it maps: a reservation's narrowed descriptor is advice to a correct writer, not a fence against a hostile one.
The receiver counts its open shm connections per peer (Endpoint.one_sided) so that it knows when a peer's copies can
no longer land (its connections are closed).
"""
from __future__ import annotations
import ctypes, itertools, queue, socket, threading, time
from tinyhet.runtime import wire
from tinyhet.runtime.arena import Arena, Mapping
from tinyhet.runtime.wire import Frame, COMMIT, CLOSE, ARENA, NOTIFY
from tinyhet.runtime.transfer import Transfer, TransportError, Piece, coalesce

INLINE_BYTES = 8 << 20       # a call's writes up to this size in all are copied by the caller's thread (a memcpy of 8 MiB takes < 1 ms: cheaper
                             # than waking the copy thread, which needs the GIL from a busy caller); larger ones by the copy thread
ARENA_WAIT = 2.0             # seconds a write waits for the announcement of an arena it does not map yet

def _recv_frame_with_fd(sock: socket.socket) -> tuple[Frame, int | None]:
  data, fds, _, _ = socket.recv_fds(sock, wire.HEADER.size, 1)
  if not data: raise ConnectionError("peer closed the connection")
  if len(data) < wire.HEADER.size: data += wire.recv_exact(sock, wire.HEADER.size - len(data))
  return Frame.unpack(data), (fds[0] if fds else None)

class Link:
  """The writer's side: the receiver's arenas mapped into this process."""
  @staticmethod
  def connect(ep, address: str, tcp_sock: socket.socket, hello: dict) -> Link:
    tcp_sock.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
      sock.settimeout(10)
      sock.connect(hello["unix"])
      unix_hello = ep.recv_hello(sock, address)
      if (unix_hello["node"], unix_hello["key"]) != (hello["node"], hello["key"]):    # another process listening under that name
        raise TransportError(f"the shared-memory socket of {hello['node']} is held by {unix_hello['node']!r} under another key: refused")
      ep.client_auth(sock, unix_hello, "shm")
      sock.settimeout(None)
    except OSError as e:
      sock.close()
      raise TransportError(f"cannot reach {hello['node']}'s shared-memory socket: {e}") from None
    except BaseException:
      sock.close()
      raise
    return Link(hello["node"], sock)

  def __init__(self, peer: str, sock: socket.socket):
    self.peer, self.sock, self.broken = peer, sock, None
    self.lock, self.send_lock = threading.Condition(), threading.Lock()
    self.maps: dict[int, tuple[int, Mapping]] = {}      # receiver's arena id -> (its base address there, our mapping)
    self.batch_ids = itertools.count(1)
    self.queue: queue.SimpleQueue = queue.SimpleQueue()
    self.queued = 0
    self.held: list[bytes] | None = None                 # hold_notices(): COMMIT frames of landed copies, sent by send_notices
    self.reader = threading.Thread(target=self._read_loop, name=f"tinyhet-shm-recv-{peer}", daemon=True)
    self.copier = threading.Thread(target=self._copy_loop, name=f"tinyhet-shm-copy-{peer}", daemon=True)
    self.reader.start()
    self.copier.start()

  def _read_loop(self):
    try:
      while True:
        f, fd = _recv_frame_with_fd(self.sock)
        if f.op != ARENA or fd is None: raise wire.ProtocolError(f"unexpected {wire.OP_NAMES[f.op]} frame from {self.peer}")
        try: mapping = Mapping(fd, f.nbytes)
        finally: socket.close(fd)
        with self.lock:
          if f.tag in self.maps: mapping.close()    # announced twice (registered while we connected)
          else: self.maps[f.tag] = (f.offset, mapping)
          self.lock.notify_all()
    except (OSError, wire.ProtocolError) as e:
      with self.lock:
        self.broken = self.broken or f"connection to {self.peer} lost: {e}"
        self.lock.notify_all()

  def _resolve(self, pieces: list[Piece]) -> list[int]:
    """Our addresses of the pieces' remote bytes (the mapping that held the last piece is tried first)."""
    out, hit = [], None
    deadline = time.monotonic() + ARENA_WAIT
    with self.lock:
      for p in pieces:
        addr = p.addr + p.region_offset
        while hit is None or not (hit[0] <= addr and addr + p.nbytes <= hit[0] + hit[1].size):
          hit = next(((base, m) for base, m in self.maps.values() if base <= addr and addr + p.nbytes <= base + m.size), None)
          if hit is not None: break
          if self.broken: raise TransportError(f"connection to {self.peer} is broken: {self.broken}")
          if (left := deadline - time.monotonic()) <= 0 or not self.lock.wait(left):
            raise TransportError(f"{self.peer}: no shared arena holds [{addr:#x}, {addr + p.nbytes:#x}): the descriptor does not match its memory")
        out.append(hit[1].addr + (addr - hit[0]))
    return out

  def _run(self, jobs: list[tuple[Transfer, list[Piece], int | None]], to_remote: bool):
    """Copy each job's pieces, in order, then send their notices in one call (or keep them: hold_notices) and finish them:
    a notice goes out only once every copy of the call is done. A failure fails that job and every one after it."""
    memmove, frames, done = ctypes.memmove, [], 0
    try:
      remotes = iter(self._resolve([p for _, pieces, _ in jobs for p in pieces]))
      for t, pieces, notify in jobs:
        for p, remote in zip(pieces, remotes):
          local = p.arena.base + p.start
          if to_remote: memmove(remote, local, p.nbytes)
          else: memmove(local, remote, p.nbytes)
        if notify is not None: frames.append(Frame(COMMIT, flags=NOTIFY, value=notify, batch=t.batch, nbytes=t.nbytes).pack())
      if frames:
        with self.send_lock:
          if self.held is not None: self.held.extend(frames)
          else: self.sock.sendall(b"".join(frames))
      for t, _, _ in jobs:
        t.finish()
        done += 1
    except (OSError, TransportError) as e:
      for t, _, _ in jobs[done:]: t.finish(str(e))

  def _submit(self, kind: str, writes: list[tuple[list[Piece], int | None]]) -> list[Transfer]:
    if self.broken: raise TransportError(f"connection to {self.peer} is broken: {self.broken}")
    jobs = []
    for pieces, notify in writes:
      pieces = coalesce(pieces)
      jobs.append((Transfer(self.peer, kind, next(self.batch_ids), sum(p.nbytes for p in pieces)), pieces, notify))
    with self.lock:
      inline = sum(t.nbytes for t, _, _ in jobs) <= INLINE_BYTES and self.queued == 0     # keep batches in order behind queued ones
      if not inline: self.queued += 1
    if inline: self._run(jobs, kind == "write")
    else: self.queue.put((jobs, kind == "write"))
    return [t for t, _, _ in jobs]

  def _copy_loop(self):
    while (item := self.queue.get()) is not None:
      self._run(*item)
      with self.lock: self.queued -= 1

  def write(self, pieces: list[Piece], notify: int | None) -> Transfer: return self._submit("write", [(pieces, notify)])[0]
  def write_many(self, writes: list[tuple[list[Piece], int | None]]) -> list[Transfer]:
    """Several writes in one pass: one lookup of the mappings, the copies back to back, their notices in one send."""
    return self._submit("write", writes)
  def read(self, pieces: list[Piece]) -> Transfer: return self._submit("read", [(pieces, None)])[0]

  def hold_notices(self):
    """Keep the COMMIT frames of the copies that finish from now on until send_notices: a copy's notice still goes out
    only after its bytes are in place, but many go in one sendall (one syscall, one wake of the receiver's thread, not one
    per write: ~0.1 ms each on a busy 2-core host, where the receiver shares the cores the writer's prefill computes on)."""
    with self.send_lock:
      if self.held is None: self.held = []

  def send_notices(self):
    """Send the held COMMIT frames, in order, in one call, and stop holding."""
    with self.send_lock:
      held, self.held = self.held, None
      if held:
        try: self.sock.sendall(b"".join(held))
        except OSError as e:
          with self.lock:
            self.broken = self.broken or f"connection to {self.peer} lost: {e}"
          raise TransportError(f"sending notices to {self.peer} failed: {e}") from None

  def close(self):
    self.queue.put(None)
    self.copier.join(timeout=30)
    try:
      with self.send_lock:
        if self.held: self.sock.sendall(b"".join(self.held))    # their bytes landed: the receiver learns so before CLOSE
        self.held = None
        self.sock.sendall(Frame(CLOSE).pack())
      self.sock.shutdown(socket.SHUT_RDWR)
    except OSError: pass
    self.reader.join(timeout=5)
    self.sock.close()
    with self.lock:
      for _, m in self.maps.values(): m.close()
      self.maps.clear()

class Server:
  """The receiver's side of one shm peer: announces arenas, delivers notifications."""
  def __init__(self, ep, sock: socket.socket, peer: str):
    self.ep, self.sock, self.peer, self.send_lock = ep, sock, peer, threading.Lock()

  def announce(self, arena: Arena):
    try:
      with self.send_lock: socket.send_fds(self.sock, [Frame(ARENA, tag=arena.id, offset=arena.base, nbytes=arena.size).pack()], [arena.fd])
    except OSError: pass      # the peer is gone; its serving thread cleans up

def serve(ep, sock: socket.socket, auth: dict):
  server = Server(ep, sock, auth["node"])
  ep.server_ok(sock, auth)
  with ep.lock:
    ep.shm_listeners.append(server)
    ep.one_sided[server.peer] += 1
    arenas = list(ep.arenas.values())
  try:
    for arena in arenas: server.announce(arena)
    while True:
      f = wire.recv_frame(sock)
      if f.op == COMMIT and f.flags & NOTIFY: ep.deliver(server.peer, f.value, f.batch, f.nbytes)
      elif f.op == CLOSE: return
      else: raise wire.ProtocolError(f"unexpected {wire.OP_NAMES[f.op]} frame")
  finally:
    with ep.lock:
      ep.shm_listeners.remove(server)
      if (n := ep.one_sided[server.peer] - 1) > 0: ep.one_sided[server.peer] = n
      else: del ep.one_sided[server.peer]
