"""One transport interface for moving KV bytes between nodes, whatever carries them (verbs, tcp, shm).

A node opens an Endpoint, registers its arenas once and exposes regions (each exposure gives a RegionDescriptor a peer
can use). A peer connects and moves bytes with a few flat calls:

  ep = Endpoint("prefill0", token=...)            # server side: ep.listen("0.0.0.0", 7470); ep.expose(region)
  peer = ep.connect("decode0-host:7470")          # transport: auto | verbs | tcp | shm
  t = ep.write(peer, [Span(local, 0, remote_desc, 0, n), ...], notify=7)
  t.wait(timeout=10)                              # every byte landed; the receiver's ep.wait_notice() returns Notice(value=7)
  ts = ep.write_many(peer, [(spans, 8), (more, 9)])   # several writes in one hand-off, each with its own notice
  ep.read(peer, spans).wait()

A write is one-sided: the receiver's code does not take part (tcp's receiving thread lands bytes straight into the
registered region after checking its bounds). Neighbouring spans coalesce; spans over a transport's message limit split.
`auto` picks shm when the peer shares this host (and network namespace) and runs as the same user, verbs when the peer
serves it (a node serves verbs only when its own transport setting is "verbs": a verbs peer reaches whole arenas), tcp
otherwise. Who a peer is: every handshake proves the shared token and, by a signature, the node's name (identity.py);
guarantees() says in words what each served transport can and cannot enforce. What a transfer is made of (Span, Piece,
Transfer, Notice, the errors) is in transfer.py; its names are importable from this module as well.
"""
from __future__ import annotations
import errno, importlib, os, queue, secrets, socket, struct, threading, time
from collections import Counter
from dataclasses import dataclass
from tinyhet.runtime.arena import Arena, Region
from tinyhet.runtime.descriptor import RegionDescriptor
from tinyhet.runtime.exposure import Exposure, Landings
from tinyhet.runtime import wire
from tinyhet.runtime.identity import Identity, Names, transcript, verify
from tinyhet.runtime.settings import TRANSPORTS, TransportSettings
# the data of a transfer lives in transfer.py; its names are importable from here too, as callers always have
from tinyhet.runtime.transfer import (Notice, Piece, Span, Transfer, TransportError, TransportUnavailable, coalesce,  # noqa: F401
                                      local_view, split, to_pieces)

HANDSHAKE_TIMEOUT = 10.0      # one deadline for a whole server-side handshake (a client trickling bytes is dropped at it)
MAX_NAME_BYTES = 200         # a node name in a handshake
MAX_UNAUTHENTICATED = 64      # connections still in their handshake; more are closed at once so that they cannot use up the fds
ACCEPT_BACKOFF = (0.01, 1.0)  # seconds the accept loop sleeps after EMFILE / no thread (doubling up to the maximum), then retries
KEEPALIVE = (10, 5, 3)        # idle s, probe interval s, probes: a peer gone without a FIN frees its name within ~25 s (identity.Names)

def keep_alive(sock: socket.socket):
  sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
  for opt, value in zip(("TCP_KEEPIDLE", "TCP_KEEPINTVL", "TCP_KEEPCNT"), KEEPALIVE):
    if hasattr(socket, opt): sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)

@dataclass
class Peer:
  """A connection from this endpoint to another node, over one transport."""
  name: str
  address: str
  transport: str
  link: object
  key: str = ""              # the public key it proved its name with at the handshake
  same_host: bool = False    # it said it runs on this host (its hello's host id): its receiving threads share this host's cores
  def close(self): self.link.close()

def transport_module(name: str):
  if name not in ("tcp", "shm", "verbs"): raise TransportUnavailable(f"unknown transport {name!r} (choose one of {', '.join(TRANSPORTS)})")
  return importlib.import_module(f"tinyhet.runtime.{name}")

def available_transports(settings=None) -> dict[str, str | None]:
  """transport -> None if usable here, else the reason it is not. settings (TransportSettings, or an object with its
  fields such as tinyhet's Config) pick the RDMA device; None: the defaults (the first device with an active port 1)."""
  from tinyhet.runtime import verbs
  return {"tcp": None, "shm": None if hasattr(os, "memfd_create") else "no memfd_create on this OS", "verbs": verbs.unavailable_reason(settings)}

class Endpoint:
  """This node's end of every transport: registered arenas, exposed regions, listeners, peers and received notices.

  settings: a TransportSettings, or any object with its fields (tinyhet passes its whole Config, read from tinyhet.toml
  and TINYHET_* variables, and this layer takes only its part); config= is the same argument under the name tinyhet's
  callers have always used. Without either, the defaults: this layer reads no file and no environment, so a caller that
  wants the user's configuration passes it. token, when given, wins over the settings' token; with neither, a random one.
  identity: this node's key pair (default: settings.key_file's, else a new one); its name proves itself with it."""
  def __init__(self, name: str | None = None, token: str | None = None, settings=None, config=None, identity: Identity | None = None):
    if settings is not None and config is not None: raise TypeError("Endpoint takes settings or config, not both")
    self.settings = TransportSettings.of(settings if settings is not None else config)
    self.name = name or f"{socket.gethostname()}-{os.getpid()}"
    self.token = token or self.settings.token or secrets.token_hex(16)
    self.host = wire.host_id()
    self.identity = identity or (Identity.load(self.settings.key_file) if self.settings.key_file else Identity.generate())
    self.names = Names(self.settings.peer_keys, (self.name, self.identity.public))   # peer name -> the key holding it now
    self.arenas: dict[int, Arena] = {}
    self.exposed: dict[int, Region] = {}
    self.exposed_views: dict[int, Exposure] = {}       # region id -> its bytes and who may write where, for the receive path
    self.landings = Landings()                         # frames being received into exposed regions now (tcp)
    self.one_sided: Counter = Counter()                # peer -> its open shm / verbs connections (writes the receiver cannot see)
    self.unauthenticated = 0
    self.handshake_timeout, self.max_unauthenticated = HANDSHAKE_TIMEOUT, MAX_UNAUTHENTICATED
    self.notices: queue.SimpleQueue[Notice] = queue.SimpleQueue()
    self.lock = threading.Lock()
    self.closed = False
    self.address: str | None = None
    self.unix_name: str | None = None
    self._threads: list[threading.Thread] = []
    self._sockets: set[socket.socket] = set()
    self._peers: list[Peer] = []
    self._listeners: list[socket.socket] = []
    self.verbs = None                     # tinyhet.runtime.verbs.Device when this node has an RDMA device
    self.transports = [t for t, why in available_transports(self.settings).items() if why is None]
    # what this endpoint serves to peers: verbs only when asked for by name, since a verbs peer reaches whole arenas
    self.served = [t for t in self.transports if t != "verbs" or self.settings.transport == "verbs"]
    if "verbs" in self.transports: self.verbs = transport_module("verbs").Device.open(self.settings)
    self.shm_listeners: list = []         # shm peers served by this endpoint, told about arenas registered later
    self.tcp_sessions: dict = {}          # (peer, session id) -> tinyhet.runtime.tcp.Session
    self.handlers: dict = {}              # control request name -> handler (tinyhet.runtime.control)

  # ---- memory
  def register(self, arena: Arena):
    """Register an arena once with every transport that needs it (verbs: one memory registration; shm: peers map it)."""
    with self.lock:
      if arena.id in self.arenas: return
      self.arenas[arena.id] = arena
      if self.verbs is not None: self.verbs.register(arena)
      listeners = list(self.shm_listeners)
    for serve in listeners: serve.announce(arena)

  def expose(self, region: Region, owner: str | None = None, allowed: list[tuple[int, int]] | None = None,
             access: str = "rw") -> RegionDescriptor:
    """Make a region writable/readable by authenticated peers; returns its descriptor. owner: only that peer (its
    authenticated node name) may use it; allowed: only these (offset, nbytes) parts of it; access: "rw", "read" (a read
    grant) or "write" (a write grant). tcp enforces all three on every frame; shm and verbs cannot (a mapped memfd and an
    rkey reach the whole arena; see the README's isolation notes)."""
    self.register(region.arena)
    exposure = Exposure(region.view(), owner, allowed, access)
    with self.lock:
      while (region_id := secrets.randbits(63)) in self.exposed or region_id == 0: pass    # not guessable from another peer's ids
      self.exposed[region_id] = region
      self.exposed_views[region_id] = exposure
    rkey = self.verbs.rkey(region.arena) if self.verbs is not None else 0
    return RegionDescriptor(self.name, region_id, region.addr, rkey, 0, region.nbytes, frozenset(self.served))

  def withdraw(self, desc: RegionDescriptor):
    """Stop serving a region (before freeing it): later writes to it are refused, and writes already landing in it (tcp)
    have finished when this returns; a writer that stalls mid-frame loses its connection (Landings.drain)."""
    with self.landings.lock, self.lock:     # atomic with land(): a frame either started landing before this or is refused
      self.exposed.pop(desc.region_id, None)
      self.exposed_views.pop(desc.region_id, None)
    self.landings.drain(desc.region_id)

  def lookup(self, region_id: int, offset: int, nbytes: int, peer: str | None = None, op: str = "write") -> memoryview:
    """The bytes a peer addresses to write (op "write") or read ("read"), after checking them against the exposed region's
    bounds, owner, allowed parts and access (raises ProtocolError)."""
    e = self.exposed_views.get(region_id)
    if e is None: raise wire.ProtocolError(f"region {region_id} is not exposed by {self.name}")
    if nbytes <= 0 or offset < 0 or offset + nbytes > len(e.view):
      raise wire.ProtocolError(f"span [{offset}, {offset + nbytes}) is outside region {region_id} ({len(e.view)} bytes)")
    if e.owner is not None and peer != e.owner: raise wire.ProtocolError(f"region {region_id} is not exposed to {peer}")
    if not e.allows(offset, nbytes, op):
      raise wire.ProtocolError(f"span [{offset}, {offset + nbytes}) of region {region_id} is not open to {op}s"
                               + ("" if e.access in ("rw", op) else f" (a {e.access} grant)"))
    return e.view[offset:offset + nbytes]

  def land(self, sock: socket.socket, pieces, peer: str, op: str = "write") -> tuple[list[memoryview], set[int]]:
    """Check a frame's (region, offset, nbytes) pieces (lookup) and mark them landing (or, op "read", being read) until
    end_landing(sock, regions): withdraw() waits for that, so no byte lands in or leaves a region after it was withdrawn."""
    return self.landings.begin(sock, pieces, lambda r, o, n: self.lookup(r, o, n, peer, op))

  def end_landing(self, sock: socket.socket, region_ids): self.landings.end(sock, region_ids)

  # ---- connections
  def listen(self, host: str = "127.0.0.1", port: int = 0) -> str:
    """Accept peers on host:port (TCP: handshakes, tcp and verbs) and on an abstract unix socket (shm). Returns host:port."""
    srv = socket.create_server((host, port), reuse_port=False, backlog=64)
    self._listeners.append(srv)
    self.address = f"{host}:{srv.getsockname()[1]}"
    self._spawn(f"tinyhet-accept-{self.address}", self._accept_loop, srv)
    if "shm" in self.transports:
      self.unix_name = f"\0tinyhet-{self.name}-{secrets.token_hex(6)}"
      usrv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
      usrv.bind(self.unix_name)
      usrv.listen(64)
      self._listeners.append(usrv)
      self._spawn("tinyhet-accept-unix", self._accept_loop, usrv)
    return self.address

  def connect(self, address: str, transport: str | None = None, timeout: float = HANDSHAKE_TIMEOUT) -> Peer:
    """Connect to a node's listen address; transport None takes the configured one (auto by default)."""
    wanted = transport or self.settings.transport
    if wanted not in TRANSPORTS: raise TransportUnavailable(f"unknown transport {wanted!r} (choose one of {', '.join(TRANSPORTS)})")
    sock = self.dial(address, timeout)
    try:
      hello = self.recv_hello(sock, address)
      chosen = self._choose(wanted, hello, address)
      link = transport_module(chosen).Link.connect(self, address, sock, hello)
    except BaseException:
      sock.close()
      raise
    peer = Peer(hello["node"], address, chosen, link, hello["key"], hello.get("host") == self.host)   # a name and key the server proved (client_auth)
    with self.lock: self._peers.append(peer)
    return peer

  def dial(self, address: str, timeout: float = HANDSHAKE_TIMEOUT) -> socket.socket:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit(): raise TransportError(f"address {address!r} is not host:port")
    try: sock = socket.create_connection((host, int(port)), timeout=timeout)
    except OSError as e: raise TransportError(f"cannot connect to {address}: {e.strerror or e}. Is a tinyhet node listening there?") from None
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock

  def recv_hello(self, sock: socket.socket, address: str) -> dict:
    """The server's first message, checked: its node name, nonce, key, host and transports."""
    hello = wire.recv_json(sock)
    if hello.get("tinyhet") != wire.PROTOCOL or not isinstance(hello.get("node"), str) or not isinstance(hello.get("nonce"), str) \
       or not isinstance(hello.get("key"), str):
      raise TransportError(f"{address} is not a tinyhet node speaking protocol {wire.PROTOCOL} (got {str(hello)[:100]!r})")
    return hello

  def open_session(self, address: str, transport: str, **extra) -> tuple[socket.socket, dict]:
    """A new authenticated connection for one transport (an extra tcp stream, a control channel): (socket, server hello)."""
    sock = self.dial(address)
    try:
      hello = self.recv_hello(sock, address)
      self.client_auth(sock, hello, transport, **extra)
      sock.settimeout(None)
    except BaseException:
      sock.close()
      raise
    return sock, hello

  def _choose(self, wanted: str, hello: dict, address: str) -> str:
    theirs = set(hello.get("transports") or [])
    same_host = hello.get("host") == self.host and bool(hello.get("unix")) and hello.get("uid") == os.geteuid()   # shm: same user too
    if wanted == "auto":      # a peer on this host shares memory: one memcpy beats a trip through the NIC
      if same_host and "shm" in self.transports and "shm" in theirs: return "shm"
      return "verbs" if "verbs" in self.transports and "verbs" in theirs else "tcp"
    if wanted == "verbs" and "verbs" not in self.transports:
      raise TransportUnavailable(f"verbs is unavailable here: {available_transports(self.settings)['verbs']}")
    if wanted not in theirs:
      raise TransportUnavailable(f"{hello['node']} at {address} does not offer {wanted} (it offers {', '.join(sorted(theirs))})")
    if wanted == "shm" and not same_host:
      raise TransportUnavailable(f"{hello['node']} at {address} is on another host or network namespace, or runs as another user: "
                                 "shm needs the same host and user; use tcp")
    return wanted

  def client_auth(self, sock: socket.socket, hello: dict, transport: str, **extra) -> dict:
    """Prove the token and this node's name to the server, check the server's proofs of both, return its OK message."""
    auth = auth_message(self.identity, self.token, self.name, hello, transport, **extra)
    wire.send_json(sock, auth)
    ok = wire.recv_json(sock)
    node, key = hello["node"], hello["key"]
    if "error" in ok: raise TransportError(f"{node} refused the connection: {ok['error']}")
    if not wire.check_proof(self.token, auth["nonce"], "server", node, ok.get("proof")):
      raise TransportError(f"{node} did not prove the shared token: check TINYHET_TOKEN on both nodes")
    if not verify(key, transcript("server", node, key, self.name, auth["nonce"], ""), ok.get("sig")):
      raise TransportError(f"{node} did not prove its name: it signed nothing with the key it presented")
    if (bound := self.settings.peer_keys.get(node)) is not None and bound != key:
      raise TransportError(f"the node answering as {node!r} holds another key than the one peer_keys binds to that name: refused")
    return ok

  def server_ok(self, sock: socket.socket, auth: dict, **extra):
    sig = self.identity.sign(transcript("server", self.name, self.identity.public, auth["node"], auth["nonce"], ""))
    wire.send_json(sock, {"proof": wire.proof(self.token, auth["nonce"], "server", self.name), "sig": sig, **extra})

  def _check_auth(self, auth: dict, nonce: str, unix_sock: socket.socket | None) -> str | None:
    """Why a client's handshake message is refused, or None: it must prove the token, sign this challenge with the key it
    presents, use a name that key may hold (Names.claim, which then holds it), and for shm run as this process's user."""
    peer, key = auth.get("node"), auth.get("key")
    if not isinstance(peer, str) or not 0 < len(peer.encode()) <= MAX_NAME_BYTES or not isinstance(auth.get("nonce"), str) \
       or not wire.check_proof(self.token, nonce, "client", peer, auth.get("proof")):
      return "authentication failed: the peer did not prove the shared token (TINYHET_TOKEN)"
    transport = auth.get("transport")
    if not isinstance(key, str) or not verify(key, transcript("client", peer, key, self.name, nonce, auth["nonce"], str(transport)), auth.get("sig")):
      return f"authentication failed: {peer!r} did not sign this challenge with the key it presented"
    if unix_sock is not None and transport == "shm":       # a mapped arena is no fence: only a peer that could read this process anyway
      _, uid, _ = struct.unpack("3i", unix_sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
      if uid != os.geteuid(): return f"shm is served to processes of user {os.geteuid()} only (the peer runs as {uid}): use tcp"
    if (why := self.names.claim(peer, key)) is not None: return f"authentication failed: {why}"
    return None

  def guarantees(self) -> list[str]:
    """One line per transport this endpoint serves: what it proves and enforces against a peer that proved the token."""
    bound = sorted(n for n in self.settings.peer_keys)
    lines = [f"identity: every peer proves the token and signs for its name; names bound to keys: {', '.join(bound) or 'none'} "
             "(an unbound name is held by whichever key proved it first, while its connections live)"]
    say = {"tcp": "tcp: write and read grants enforced on every frame (region, owner, blocks, access); bytes are not encrypted",
           "shm": "shm: served only to processes of this user on this host (SO_PEERCRED); they map whole arenas, so grants are not enforced",
           "verbs": "verbs: the peer's name is proven, but its rkey reaches whole arenas: grants are not enforced (transport = verbs chose this)"}
    return lines + [say[t] for t in self.served]

  def _accept_loop(self, srv: socket.socket):
    """Accept until the endpoint closes. Running out of fds or threads is a pause, not the end: the loop backs off and
    retries, so a peer that opens connections until the limit cannot leave a node that accepts nobody."""
    backoff = 0.0
    while not self.closed:
      if backoff: time.sleep(backoff)
      try: sock, _ = srv.accept()
      except OSError as e:
        if self.closed or e.errno in (errno.EBADF, errno.EINVAL): return      # the listener was closed
        backoff = min(max(2 * backoff, ACCEPT_BACKOFF[0]), ACCEPT_BACKOFF[1])   # EMFILE, ENFILE, ENOBUFS, ENOMEM, ECONNABORTED...
        continue
      with self.lock:
        if self.unauthenticated >= self.max_unauthenticated:
          sock.close()
          continue
        self.unauthenticated += 1
        self._sockets.add(sock)
      try:
        if srv.family == socket.AF_INET or srv.family == socket.AF_INET6: keep_alive(sock)
        self._spawn("tinyhet-serve", self._serve_connection, sock)
        backoff = 0.0
      except (RuntimeError, OSError):           # no thread could be started: drop this peer, retry later
        with self.lock:
          self.unauthenticated -= 1
          self._sockets.discard(sock)
        sock.close()
        backoff = min(max(2 * backoff, ACCEPT_BACKOFF[0]), ACCEPT_BACKOFF[1])

  def _authenticated(self, counted: list):
    if counted:
      counted.clear()
      with self.lock: self.unauthenticated -= 1

  def _serve_connection(self, sock: socket.socket):
    """Handshake, then hand the connection to the transport the client asked for. A bad client only loses its connection."""
    unix = sock.family == socket.AF_UNIX
    peer, counted, holds = "?", [True], []
    try:
      deadline = time.monotonic() + self.handshake_timeout
      sock.settimeout(self.handshake_timeout)
      nonce = wire.new_nonce()
      wire.send_json(sock, {"tinyhet": wire.PROTOCOL, "node": self.name, "host": self.host, "nonce": nonce, "key": self.identity.public,
                            "transports": self.served, "unix": self.unix_name, "uid": os.geteuid()})
      auth = wire.recv_json(sock, deadline)
      transport = auth.get("transport")
      if (why := self._check_auth(auth, nonce, sock if unix else None)) is not None:
        wire.send_json(sock, {"error": why})
        return
      peer = auth["node"]                 # proven, and held by this connection until it closes
      holds.append(peer)
      self._authenticated(counted)
      if transport == "ctl":
        threading.current_thread().name = f"tinyhet-ctl-serve-{peer}"
        sock.settimeout(None)
        return importlib.import_module("tinyhet.runtime.control").serve(self, sock, auth)
      if transport not in self.served or (transport == "shm") != unix:
        wire.send_json(sock, {"error": f"transport {transport!r} is not served on this socket (offered: {', '.join(self.served)})"})
        return
      sock.settimeout(None)
      threading.current_thread().name = f"tinyhet-{transport}-serve-{peer}"
      transport_module(transport).serve(self, sock, auth)
    except (OSError, wire.ProtocolError, ValueError) as e:
      if not self.closed and os.environ.get("TINYHET_DEBUG"): print(f"tinyhet: {self.name}: dropped peer {peer}: {e}")
    finally:
      self._authenticated(counted)
      for name in holds: self.names.release(name)
      with self.lock: self._sockets.discard(sock)
      sock.close()

  def _spawn(self, name: str, target, *args) -> threading.Thread:
    t = threading.Thread(target=target, args=args, name=name, daemon=True)
    t.start()
    with self.lock:
      self._threads = [x for x in self._threads if x.is_alive()]
      self._threads.append(t)
    return t

  def handle(self, op: str, fn):
    """Serve control requests named op (see tinyhet.runtime.control)."""
    self.handlers[op] = fn

  # ---- the flat transfer calls
  def write(self, peer: Peer, spans: list[Span], notify: int | None = None) -> Transfer:
    """Post a one-sided write of spans to peer. notify (u32) reaches the receiver only after every byte has landed."""
    if notify is not None and not 0 <= notify < 1 << 32: raise TransportError(f"notify value {notify} is not a u32")
    return peer.link.write(to_pieces(spans, peer.name), notify)

  def write_many(self, peer: Peer, writes: list[tuple[list[Span], int | None]]) -> list[Transfer]:
    """Post several writes (spans, notify) to peer in one call, in order: what as many write calls would do, with one hand-off
    to the transport (shm: the copies back to back, their notices in one send; tcp: queued to its streams together where
    they are large). Each notify still reaches the receiver only after its own write's bytes have landed."""
    for _, notify in writes:
      if notify is not None and not 0 <= notify < 1 << 32: raise TransportError(f"notify value {notify} is not a u32")
    pieces = [(to_pieces(spans, peer.name), notify) for spans, notify in writes]
    if (many := getattr(peer.link, "write_many", None)) is None: return [peer.link.write(p, n) for p, n in pieces]
    return many(pieces)

  def hold_notices(self, peer: Peer) -> bool:
    """From now on, where peer's transport can (shm), keep the notices of writes whose bytes have landed and send them
    together at send_notices; a notice never reaches the receiver before its bytes. False where the transport sends each
    notice with its write (tcp: in the write's last frame; verbs: the write's immediate)."""
    if (hold := getattr(peer.link, "hold_notices", None)) is None: return False
    hold()
    return True

  def send_notices(self, peer: Peer):
    """Send the notices hold_notices kept, and stop holding (nothing where none are held)."""
    if (send := getattr(peer.link, "send_notices", None)) is not None: send()

  def read(self, peer: Peer, spans: list[Span]) -> Transfer:
    """Post a one-sided read: the remote parts of spans are copied into the local parts."""
    return peer.link.read(to_pieces(spans, peer.name))

  def wait_notice(self, timeout: float | None = 60.0) -> Notice:
    try: return self.notices.get(timeout=timeout)
    except queue.Empty: raise TimeoutError(f"{self.name}: no notification arrived within {timeout} s") from None

  def deliver(self, peer: str, value: int, batch: int, nbytes: int):
    self.notices.put(Notice(peer, value, batch, nbytes, time.perf_counter()))

  def close(self):
    """Close listeners, peers and served connections; stop this endpoint's threads."""
    if self.closed: return
    self.closed = True
    for s in self._listeners:
      try: s.shutdown(socket.SHUT_RDWR)      # wakes the thread blocked in accept(); close() alone does not
      except OSError: pass
      s.close()
    with self.lock: peers, socks = list(self._peers), list(self._sockets)
    for p in peers: p.close()
    for s in socks:
      try: s.shutdown(socket.SHUT_RDWR)
      except OSError: pass
    for t in self._threads:
      if t is not threading.current_thread(): t.join(timeout=5)
    if self.verbs is not None: self.verbs.close()

  def __enter__(self): return self
  def __exit__(self, *exc): self.close()

def auth_message(identity: Identity, token: str, name: str, hello: dict, transport: str, **extra) -> dict:
  """A client's handshake answer to a server's hello: the token's proof and a signature of the challenge for name."""
  nonce = wire.new_nonce()
  sig = identity.sign(transcript("client", name, identity.public, hello["node"], hello["nonce"], nonce, transport))
  return {"node": name, "transport": transport, "nonce": nonce, "key": identity.public, "sig": sig,
          "proof": wire.proof(token, hello["nonce"], "client", name), **extra}
