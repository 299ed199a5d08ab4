"""verbs transport: RDMA over pyverbs (rdma-core). One RC queue pair per peer; a write is RDMA WRITE work requests, the
last one WRITE_WITH_IMM when it carries a notification; a read is RDMA READ. Neither side's CPU touches the bytes.

Connection: the writer dials the node's TCP address and authenticates as for tcp (transport.Endpoint.client_auth); its
queue pair's connection data (QPInfo: qpn, psn, gid, lid, mtu, rd_atom, link_layer) rides in the auth message, and the
server's comes back in the OK message after the server's queue pair is ready to receive (RTR/RTS, receives posted), so
the writer may post at once. Each region's address and rkey travel in its RegionDescriptor. The TCP socket stays open
for teardown: when either side closes it, the other side destroys its queue pair.

The receiver's node learns of a batch only through the immediate (a 32-bit value) of its last work request, so a
Notice delivered by verbs has batch = 0 and nbytes = 0: RDMA cannot tell the receiver which batch or how many bytes.
RC executes a queue pair's work requests in order, so the immediate's completion means every byte of the batch landed.

Completions: a writer signals every SIGNAL_EVERY-th work request and the last of each batch; SendWindow keeps posted but
unreaped work requests within the send queue's depth (a slot frees only when a later signaled request completes).
Each link (and each served peer) has its own completion queue and one thread that polls it. With rdma-core >= 61 the
thread sleeps on the completion channel's fd; older pyverbs offers no fd and its blocking wait would hold the GIL, so
there the thread polls with a backoff (spin, then sleeps growing to MAX_BACKOFF while work is outstanding).

Trust: what verbs proves is who connected: only peers that proved the shared token and their name (a signature,
identity.py) get a queue pair connected to this node, and an rkey is useless without one; and a node serves verbs only
when its own transport setting is "verbs" (Endpoint.served), since what verbs cannot prove is which peer's bytes land where.
Verbs writes are one-sided and unchecked by the receiver's CPU. Each arena has one memory registration, so a
connected peer holding a descriptor's rkey can write anywhere in that arena: narrowing a reservation to its own blocks
would need a memory window or an MR per reservation, which this transport does not make (yet). The receiver counts open
verbs connections per peer (Endpoint.one_sided): once they are closed, their queue pairs are destroyed and no write lands.

This module is the transport: planning work requests, the send window, Link (writer) and serve (receiver). The RDMA
resources it stands on (detection, Device, QueuePair, memory registrations, QPInfo) are in verbs_resources.py.
"""
from __future__ import annotations
import itertools, os, socket, threading
from collections import deque
from tinyhet.runtime import wire
from tinyhet.runtime.transfer import Transfer, TransportError, Piece, coalesce, split
# the resources under the transport (device, queue pairs, registrations, detection, connection data) are in
# verbs_resources.py; their names are importable from this module as well, as callers always have
from tinyhet.runtime.verbs_resources import (HOP_LIMIT, IDLE_WAIT, IPV4_MAPPED, LINK_LAYERS, MAX_BACKOFF, MAX_SGE_BYTES, MTUS, POLL_BATCH,  # noqa: F401
                                             RD_ATOM, READ, SPIN_POLLS, WRITE, WRITE_IMM, ZERO_GID, Device, GpuRegistration, PortChoice, QPInfo,
                                             QueuePair, Route, WorkRequest, address_route, choose_gid_index, is_zero_gid, mtu_bytes, mtu_enum,
                                             probe, pyverbs, register_gpu_buffer, register_gpu_memory, send_wr, unavailable_reason, wc_status_text)

SIGNAL_EVERY = 64            # signal one write in this many (and the last of every batch)
SEND_DEPTH = 1024            # send queue depth of a writer's queue pair (clipped to the device's max_qp_wr)
RECV_DEPTH = 256             # receives a served peer keeps posted for immediates

# ---------------------------------------------------------------- work requests and the send window (plain integers, no device)

def plan_work_requests(pieces: list[Piece], lkeys: dict[int, int], max_msg: int, signal_every: int,
                       notify: int | None = None, read: bool = False) -> list[WorkRequest]:
  """The work requests that move pieces (coalesced, split at max_msg): every signal_every-th and the last one signaled;
  for a write with notify the last is a WRITE_IMM carrying it (a zero-byte one when there are no pieces).
  lkeys maps an arena id to the lkey of its memory registration."""
  if signal_every < 1 or max_msg < 1: raise ValueError(f"signal_every {signal_every} and max_msg {max_msg} must be positive")
  if read and notify is not None: raise ValueError("a read carries no notification")
  chunks = split(coalesce(pieces), max_msg)
  wrs = []
  for i, p in enumerate(chunks):
    last = i == len(chunks) - 1
    imm = notify if last and not read else None
    wrs.append(WorkRequest(READ if read else WRITE_IMM if imm is not None else WRITE, p.arena.base + p.start, lkeys[p.arena.id], p.nbytes,
                           p.addr + p.region_offset, p.rkey, last or (i + 1) % signal_every == 0, imm))
  if not chunks and notify is not None:
    wrs.append(WorkRequest(WRITE_IMM, 0, 0, 0, 0, 0, True, notify))
  return wrs

class SendWindow:
  """Send-queue bookkeeping for one queue pair, in plain integers. Work requests get sequence numbers 1, 2, ... (their
  wr_id); a queue pair completes them in order, so the completion of signaled request s frees every slot up to s and
  finishes every batch whose last request is <= s. post() is allowed only while room() > 0."""
  def __init__(self, depth: int):
    if depth < 1: raise ValueError(f"send queue depth must be positive, got {depth}")
    self.depth, self.posted, self.reaped = depth, 0, 0
    self.batches: deque = deque()            # (sequence number of the batch's last request, handle), in order

  def room(self) -> int: return self.depth - (self.posted - self.reaped)

  def open_batch(self, count: int, handle):
    """Reserve the next count sequence numbers for one batch; its handle is returned by complete() when the last completes."""
    if count < 1: raise ValueError(f"a batch needs at least one work request, got {count}")
    if self.batches and self.batches[-1][0] > self.posted: raise ValueError("a batch is opened before the previous one was posted")
    self.batches.append((self.posted + count, handle))

  def post(self) -> int:
    if self.room() <= 0: raise RuntimeError(f"send queue full: {self.posted - self.reaped} of {self.depth} slots unreaped")
    self.posted += 1
    return self.posted

  def complete(self, seq: int) -> list:
    """A signaled request completed: free slots up to it; return the handles of the batches that are now complete."""
    if not self.reaped < seq <= self.posted: raise ValueError(f"completion for request {seq}, but {self.reaped + 1}..{self.posted} are outstanding")
    self.reaped = seq
    done = []
    while self.batches and self.batches[0][0] <= seq: done.append(self.batches.popleft()[1])
    return done

  def fail_all(self) -> list:
    handles = [h for _, h in self.batches]
    self.batches.clear()
    return handles

# ---------------------------------------------------------------- writer side

class Link:
  """The writer's side of a verbs connection: one RC queue pair to the peer and the thread that reaps its completions."""

  @staticmethod
  def connect(ep, address: str, sock: socket.socket, hello: dict) -> Link:
    peer = hello["node"]
    qp = ep.verbs.queue_pair(SEND_DEPTH, 1)
    try:
      ok = ep.client_auth(sock, hello, "verbs", verbs=ep.verbs.info(qp).encode())
      try: remote = QPInfo.decode(ok.get("verbs"), peer)
      except wire.ProtocolError as e: raise TransportError(str(e)) from None
      try: qp.connect(remote)
      except ep.verbs.pv.PyverbsError as e: raise TransportError(f"connecting a queue pair to {peer} at {address} failed: {e}") from None
      sock.settimeout(None)
      return Link(ep, peer, sock, qp)
    except BaseException:
      qp.close()
      raise

  def __init__(self, ep, peer: str, sock: socket.socket, qp: QueuePair):
    self.ep, self.peer, self.sock, self.qp = ep, peer, sock, qp
    self.window = SendWindow(qp.send_depth)
    self.signal_every = min(SIGNAL_EVERY, qp.send_depth)
    self.cond = threading.Condition()
    self.post_lock = threading.Lock()          # a batch's requests are posted together and in order
    self.broken: str | None = None
    self.stopping = False
    self.batch_ids = itertools.count(1)
    self.wake_r, self.wake_w = os.pipe()
    os.set_blocking(self.wake_w, False)
    self.poller = threading.Thread(target=self._poll_loop, name=f"tinyhet-verbs-poll-{peer}", daemon=True)
    self.poller.start()

  def write(self, pieces: list[Piece], notify: int | None) -> Transfer: return self._submit("write", pieces, notify)
  def read(self, pieces: list[Piece]) -> Transfer: return self._submit("read", pieces, None)

  def _submit(self, kind: str, pieces: list[Piece], notify: int | None) -> Transfer:
    for p in pieces:
      if not p.rkey: raise TransportError(f"region {p.region_id} of {self.peer} has no verbs key (rkey 0): its descriptor was made without verbs")
    lkeys = {}
    for p in pieces:
      if p.arena.id not in lkeys:
        self.ep.register(p.arena)             # once per arena; later calls return at once
        lkeys[p.arena.id] = self.ep.verbs.lkey(p.arena)
    wrs = plan_work_requests(pieces, lkeys, self.ep.verbs.max_msg, self.signal_every, notify, read=kind == "read")
    t = Transfer(self.peer, kind, next(self.batch_ids), sum(w.length for w in wrs))
    if not wrs:
      t.finish()
      return t
    with self.post_lock:
      with self.cond:
        if self.broken: raise TransportError(f"connection to {self.peer} is broken: {self.broken}")
        self.window.open_batch(len(wrs), t)
      try: os.write(self.wake_w, b"\0")       # the poller may be in its long idle sleep
      except BlockingIOError: pass
      for w in wrs:
        with self.cond:
          while self.window.room() == 0 and not self.broken: self.cond.wait(1.0)
          if self.broken: return t            # failed (and finished) by _fail
          seq = self.window.post()
        try: self.qp.post_send(w, seq)
        except (self.ep.verbs.pv.PyverbsError, TransportError) as e:
          self._fail(f"posting a work request to {self.peer} failed: {e}")
          return t
    return t

  def _poll_loop(self):
    empty = 0
    try:
      while not self.stopping:
        if wcs := self.qp.poll():
          empty = 0
          self._complete(wcs)
          continue
        with self.cond: busy = bool(self.window.batches)
        ready = self.qp.wait([self.sock, self.wake_r], empty, busy)
        empty += 1
        if self.wake_r in ready:
          os.read(self.wake_r, 4096)
          empty = 0
        if self.sock in ready and not self.stopping:
          self.sock.recv(4096)                # the server sends nothing after its OK: readable means it closed
          self._complete(self.qp.poll())
          self._fail(f"{self.peer} closed the connection")
          return
    except (OSError, ValueError, TransportError, self.ep.verbs.pv.PyverbsError) as e:
      self._fail(f"reaping completions from {self.peer} failed: {e}")

  def _complete(self, wcs: list):
    done, error = [], None
    ok = self.ep.verbs.pv.e.ibv_wc_status.IBV_WC_SUCCESS
    with self.cond:
      for wc in wcs:
        if wc.status != ok: error = error or wc_status_text(wc.status, wc.vendor_err)
        elif self.broken is None: done += self.window.complete(wc.wr_id)
      self.cond.notify_all()
    for t in done: t.finish()
    if error: self._fail(f"RDMA to {self.peer} failed: {error}")

  def _fail(self, why: str):
    """The queue pair is unusable (an error completion moves it to ERROR): fail everything outstanding, refuse new work."""
    with self.cond:
      self.broken = self.broken or why
      failed = self.window.fail_all()
      self.cond.notify_all()
    for t in failed: t.finish(why)

  def close(self):
    self.stopping = True
    try: os.write(self.wake_w, b"\0")
    except BlockingIOError: pass
    self.poller.join(timeout=5)
    self._fail("the link was closed")
    with self.post_lock: self.qp.close()      # no post is in flight now
    try:
      self.sock.sendall(wire.Frame(wire.CLOSE).pack())
      self.sock.shutdown(socket.SHUT_RDWR)
    except OSError: pass
    self.sock.close()
    os.close(self.wake_r)
    os.close(self.wake_w)

# ---------------------------------------------------------------- receiver side

def serve(ep, sock: socket.socket, auth: dict):
  """Serve one writer: connect a queue pair to it, keep receives posted for its immediates and deliver each as a Notice
  (batch 0, nbytes 0: see the module docstring), until the writer closes the TCP socket; then destroy the queue pair."""
  peer = auth["node"]
  def refuse(why: str):
    wire.send_json(sock, {"error": why})
    return ConnectionError(why)
  if ep.verbs is None: raise refuse(f"{ep.name} has no RDMA device")
  try: remote = QPInfo.decode(auth.get("verbs"), peer)
  except wire.ProtocolError as e: raise refuse(str(e)) from None
  try: qp = ep.verbs.queue_pair(1, RECV_DEPTH)
  except ep.verbs.pv.PyverbsError as e: raise refuse(f"{ep.name} could not create a queue pair: {e}") from None
  try:
    try:
      qp.connect(remote)
      for i in range(qp.recv_depth): qp.post_recv(i)
    except (TransportError, ep.verbs.pv.PyverbsError) as e: raise refuse(f"{ep.name} could not connect a queue pair to {peer}: {e}") from None
    ep.server_ok(sock, auth, verbs=ep.verbs.info(qp).encode())
    with ep.lock: ep.one_sided[peer] += 1
    try: _receive(ep, peer, sock, qp)
    finally:
      with ep.lock:
        if (n := ep.one_sided[peer] - 1) > 0: ep.one_sided[peer] = n
        else: del ep.one_sided[peer]
  finally: qp.close()

def _receive(ep, peer: str, sock: socket.socket, qp: QueuePair):
  ok, with_imm = ep.verbs.pv.e.ibv_wc_status.IBV_WC_SUCCESS, ep.verbs.pv.e.ibv_wc_opcode.IBV_WC_RECV_RDMA_WITH_IMM
  def drain() -> int:
    wcs = qp.poll()
    for wc in wcs:
      if wc.status != ok: raise ConnectionError(f"verbs session with {peer} failed: {wc_status_text(wc.status, wc.vendor_err)}")
      if wc.opcode != with_imm: raise wire.ProtocolError(f"{peer} sent a verbs message other than a write with immediate")
      ep.deliver(peer, socket.ntohl(wc.imm_data), 0, 0)
      qp.post_recv(wc.wr_id)
    return len(wcs)
  empty = 0
  while True:
    if drain():
      empty = 0
      continue
    if qp.wait([sock], empty, True):
      while drain(): pass                      # notices that landed before the writer closed still count
      try: f = wire.recv_frame(sock)
      except ConnectionError: return
      if f.op != wire.CLOSE: raise wire.ProtocolError(f"unexpected {wire.OP_NAMES[f.op]} frame on a verbs connection")
      return
    empty += 1
