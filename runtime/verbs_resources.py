"""RDMA resources for the verbs transport, in the shape of rdma-core's pyverbs tests (tests/base.py): pyverbs loaded on
first use, the port detection (which device and port, which GID), an opened Device (context, protection domain, one
memory registration per arena, GPU memory registrations) and QueuePair (an RC queue pair with its own completion queue,
INIT -> RTR -> RTS in connect()), plus the plain records that cross them: WorkRequest (posted by send_wr), QPInfo (the
connection data a peer sends), Route, and failed completions in words. No connection is made here: the transport on
top (the send window, Link, serve) is verbs.py, which re-exports these names.

pyverbs is imported only when first used (pyverbs()), so this module imports on a machine without it; every function
that needs it raises ImportError there, and probe() turns that into the reason verbs is unavailable.
"""
from __future__ import annotations
import ctypes, dataclasses, functools, mmap, os, re, secrets, select, socket, threading
from dataclasses import dataclass
from types import SimpleNamespace
from tinyhet.runtime import wire
from tinyhet.runtime.settings import TransportSettings
from tinyhet.runtime.transfer import TransportError, TransportUnavailable

MAX_SGE_BYTES = 1 << 31      # an SGE's length is a u32; pieces are split at min(port max_msg_sz, this)
RD_ATOM = 16                 # outstanding RDMA READs per queue pair (clipped to the device's limits)
POLL_BATCH = 64
SPIN_POLLS = 64              # empty polls before the poller starts to sleep (no completion channel fd)
MAX_BACKOFF = 1e-3           # longest sleep between polls while work is outstanding (no completion channel fd)
IDLE_WAIT = 0.5              # sleep when nothing is outstanding; a post or the socket wakes the thread sooner
HOP_LIMIT = 64
MTUS = (256, 512, 1024, 2048, 4096)
LINK_LAYERS = ("InfiniBand", "Ethernet")

# ---------------------------------------------------------------- pyverbs, imported on first use

@functools.cache
def pyverbs():
  """pyverbs' classes and enums in one namespace. rdma-core >= 59 names the enums module libibverbs_enums, older ones enums;
  class-qualified names (e.ibv_wr_opcode.IBV_WR_RDMA_WRITE) work in both, flat ones vanish with Cython >= 3.1."""
  try: import pyverbs.libibverbs_enums as e
  except ImportError: import pyverbs.enums as e
  from pyverbs.device import Context, get_device_list
  from pyverbs.pd import PD
  from pyverbs.mr import MR
  from pyverbs.cq import CQ, CompChannel
  from pyverbs.qp import QP, QPCap, QPInitAttr, QPAttr
  from pyverbs.addr import GID, GlobalRoute, AHAttr
  from pyverbs.wr import SGE, SendWR, RecvWR
  from pyverbs.pyverbs_error import PyverbsError, PyverbsRDMAError
  try: from pyverbs.mr import DmaBufMR
  except ImportError: DmaBufMR = None
  return SimpleNamespace(e=e, Context=Context, get_device_list=get_device_list, PD=PD, MR=MR, DmaBufMR=DmaBufMR, CQ=CQ, CompChannel=CompChannel,
                         QP=QP, QPCap=QPCap, QPInitAttr=QPInitAttr, QPAttr=QPAttr, GID=GID, GlobalRoute=GlobalRoute, AHAttr=AHAttr,
                         SGE=SGE, SendWR=SendWR, RecvWR=RecvWR, PyverbsError=PyverbsError, PyverbsRDMAError=PyverbsRDMAError)

def _enum_name(enum, value: int, prefix: str) -> str:
  for name in dir(enum):
    if name.startswith(prefix) and int(getattr(enum, name)) == value: return name
  return f"{prefix}?{value}"

# ---------------------------------------------------------------- work requests (plain records, no device)

WRITE, WRITE_IMM, READ = "write", "write_imm", "read"

@dataclass(frozen=True)
class WorkRequest:
  """One RDMA work request as plain integers; posted as a pyverbs SendWR by send_wr()."""
  opcode: str            # WRITE | WRITE_IMM | READ
  local_addr: int
  lkey: int
  length: int
  remote_addr: int
  rkey: int
  signaled: bool
  imm: int | None        # the notification (host order) on the WRITE_IMM that ends a batch

# ---------------------------------------------------------------- connection data and addressing (no device)

_GID = re.compile(r"[0-9a-fA-F]{4}(:[0-9a-fA-F]{4}){7}")
ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"
IPV4_MAPPED = "0000:0000:0000:0000:0000:ffff:"

@dataclass(frozen=True)
class QPInfo:
  """What a peer needs to connect its RC queue pair to ours. Exchanged as a JSON object in the TCP handshake."""
  qpn: int               # queue pair number (u24)
  psn: int               # first packet sequence number we send (u24)
  gid: str               # our source GID, 8 groups of 4 hex digits (RoCE addressing)
  lid: int               # our port's LID (InfiniBand addressing; 0 on RoCE)
  mtu: int               # our port's active MTU in bytes
  rd_atom: int           # RDMA READs we accept outstanding as responder (and may issue as initiator)
  link_layer: str        # "InfiniBand" | "Ethernet" (RoCE)

  def encode(self) -> dict: return dataclasses.asdict(self)

  @staticmethod
  def decode(obj, peer: str) -> QPInfo:
    """Check every field a peer sent; raises wire.ProtocolError naming the peer, the field and what is wrong."""
    def bad(what): return wire.ProtocolError(f"{peer} sent bad verbs connection data: {what}")
    if not isinstance(obj, dict): raise bad(f"expected a JSON object, got {type(obj).__name__}")
    checks = {"qpn": (lambda v: _u(v) and 2 <= v < 1 << 24, "must be a queue pair number 2..2^24-1"),
              "psn": (lambda v: _u(v) and v < 1 << 24, "must be a 24-bit packet sequence number"),
              "gid": (lambda v: isinstance(v, str) and _GID.fullmatch(v) is not None, "must be 8 groups of 4 hex digits"),
              "lid": (lambda v: _u(v) and v < 1 << 16, "must be a 16-bit LID"),
              "mtu": (lambda v: _u(v) and v in MTUS, f"must be one of {', '.join(map(str, MTUS))}"),
              "rd_atom": (lambda v: _u(v) and 1 <= v <= 255, "must be between 1 and 255"),
              "link_layer": (lambda v: v in LINK_LAYERS, f"must be one of {', '.join(LINK_LAYERS)}")}
    for name, (ok, rule) in checks.items():
      if name not in obj: raise bad(f"field {name!r} is missing")
      if not ok(obj[name]): raise bad(f"{name} = {str(obj[name])[:80]!r} {rule}")
    return QPInfo(**{k: obj[k].lower() if k == "gid" else obj[k] for k in checks})

def _u(v) -> bool: return isinstance(v, int) and not isinstance(v, bool) and v >= 0

def is_zero_gid(gid: str) -> bool: return int(gid.replace(":", ""), 16) == 0

def choose_gid_index(table: list[tuple[str, str] | None], link_layer: str, wanted: int = -1) -> int:
  """The source GID index for a port, from its table of (gid, type) entries ("IB/RoCE v1" | "RoCE v2"; None where the
  entry could not be read). wanted >= 0 is taken if that entry is usable. On RoCE: RoCE v2 with an IPv4-mapped GID, then
  RoCE v2 with a global IPv6 GID, then RoCE v2 link-local, then RoCE v1; lowest index first. On InfiniBand: the port GID
  (index 0). Raises ValueError saying why no entry is usable."""
  usable = {i: e for i, e in enumerate(table) if e is not None and not is_zero_gid(e[0])}
  if wanted >= 0:
    if wanted >= len(table): raise ValueError(f"GID index {wanted} is outside the port's table of {len(table)} entries")
    if wanted not in usable: raise ValueError(f"GID index {wanted} is empty (no address behind it)")
    return wanted
  if not usable: raise ValueError("the port has no GID (on RoCE: give its network interface an IP address)")
  if link_layer == "InfiniBand": return min(usable)
  def rank(i):
    gid, kind = usable[i]
    if kind != "RoCE v2": return 3
    return 0 if gid.lower().startswith(IPV4_MAPPED) else 2 if gid.lower().startswith("fe80:") else 1
  return min(usable, key=lambda i: (rank(i), i))

@dataclass(frozen=True)
class Route:
  """The address-vector fields that reach a peer's port."""
  is_global: int
  dlid: int
  dgid: str | None
  sgid_index: int
  hop_limit: int

def address_route(link_layer: str, sgid_index: int, remote: QPInfo) -> Route:
  """InfiniBand: by LID, no global route header. RoCE: by GID (is_global=1). Raises TransportError when the peer's port
  cannot be reached this way."""
  if remote.link_layer != link_layer:
    raise TransportError(f"the peer's RDMA port is {remote.link_layer} but this node's is {link_layer}: verbs cannot connect them (use tcp)")
  if link_layer == "InfiniBand":
    if not 0 < remote.lid < 0xC000: raise TransportError(f"the peer's InfiniBand port has no unicast LID ({remote.lid}): is a subnet manager up?")
    return Route(0, remote.lid, None, sgid_index, 0)
  if is_zero_gid(remote.gid): raise TransportError("the peer's RoCE port has no GID: give its RDMA network interface an IP address")
  return Route(1, remote.lid, remote.gid, sgid_index, HOP_LIMIT)

def mtu_enum(nbytes: int) -> int: return nbytes.bit_length() - 8        # 256 -> IBV_MTU_256 (1) ... 4096 -> IBV_MTU_4096 (5)
def mtu_bytes(enum: int) -> int: return 128 << int(enum)

_WC_HINTS = {
  "IBV_WC_REM_ACCESS_ERR": "the remote address and key are not inside a memory registration of the peer (a stale or foreign descriptor?)",
  "IBV_WC_LOC_PROT_ERR": "a local address is not inside a registered arena",
  "IBV_WC_RETRY_EXC_ERR": "the peer did not answer: its process or queue pair is gone, or the network path is broken",
  "IBV_WC_RNR_RETRY_EXC_ERR": "the peer had no receive posted for a write with immediate",
  "IBV_WC_WR_FLUSH_ERR": "flushed because the queue pair had already failed",
}

@functools.cache
def _status_str():
  f = ctypes.CDLL("libibverbs.so.1").ibv_wc_status_str
  f.restype, f.argtypes = ctypes.c_char_p, [ctypes.c_int]
  return f

def wc_status_text(status: int, vendor_err: int = 0) -> str:
  """A failed work completion in words: libibverbs' text, the status name, the vendor error and what it usually means."""
  name = _enum_name(pyverbs().e.ibv_wc_status, status, "IBV_WC_")
  try: text = _status_str()(status).decode()
  except (OSError, AttributeError): text = f"status {status}"
  hint = _WC_HINTS.get(name)
  return f"{text} ({name}, vendor error {vendor_err:#x})" + (f": {hint}" if hint else "")

def send_wr(pv, w: WorkRequest, wr_id: int):
  """The pyverbs SendWR for a planned work request."""
  op = pv.e.ibv_wr_opcode
  opcode = {WRITE: op.IBV_WR_RDMA_WRITE, WRITE_IMM: op.IBV_WR_RDMA_WRITE_WITH_IMM, READ: op.IBV_WR_RDMA_READ}[w.opcode]
  flags = pv.e.ibv_send_flags.IBV_SEND_SIGNALED if w.signaled else 0
  wr = pv.SendWR(wr_id=wr_id, opcode=opcode, num_sge=1, sg=[pv.SGE(w.local_addr, w.length, w.lkey)], send_flags=flags)
  if w.length == 0: wr.num_sge = 0          # the constructor insists on an SGE; a zero-byte write with immediate has none
  wr.set_wr_rdma(w.rkey, w.remote_addr)
  if w.imm is not None: wr.imm_data = socket.htonl(w.imm)
  return wr

# ---------------------------------------------------------------- detection

@dataclass(frozen=True)
class PortChoice:
  device: str
  port: int
  gid_index: int
  link_layer: str

def unavailable_reason(settings=None) -> str | None:
  """None when verbs can be used here (pyverbs imports, an RDMA device has the chosen port ACTIVE with a usable GID);
  else one sentence saying why not. settings: a TransportSettings or an object with its rdma_* fields (tinyhet's
  Config); None: the defaults (the first device with port 1 active). Cached: see probe()."""
  s = TransportSettings.of(settings)
  found = probe(s.rdma_device, s.rdma_port, s.rdma_gid_index)
  return found if isinstance(found, str) else None

@functools.cache
def probe(device: str = "", port: int = 1, gid_index: int = -1) -> PortChoice | str:
  """The device port verbs would use, or why there is none. Looked up once per process (probe.cache_clear() to look again)."""
  try: pv = pyverbs()
  except ImportError as e:
    return f"pyverbs is not importable ({e}); install Debian's python3-pyverbs (make setup does) or a pyverbs built from the system's rdma-core"
  try: names = [d.name.decode() for d in pv.get_device_list()]
  except pv.PyverbsError as e: return f"no RDMA support in this kernel ({e}): no InfiniBand/RoCE driver is loaded"
  if not names: return "no RDMA device found: rdma-core lists none (is the NIC's driver and its rdma-core provider installed? try `ibv_devices`)"
  if device and device not in names:
    return f"RDMA device {device!r} (rdma_device / TINYHET_RDMA_DEVICE) does not exist here; this host has {', '.join(names)}"
  problems = []
  for name in [device] if device else names:
    try:
      ctx = pv.Context(name=name)
      try: found = _check_port(pv, ctx, name, port, gid_index)
      finally: ctx.close()
    except pv.PyverbsError as e: found = f"{name} cannot be opened ({e})"
    if isinstance(found, PortChoice): return found
    problems.append(found)
  return f"no usable RDMA port: {'; '.join(problems)} (see `ibv_devinfo`; choose with TINYHET_RDMA_DEVICE / TINYHET_RDMA_PORT)"

def _check_port(pv, ctx, name: str, port: int, gid_index: int) -> PortChoice | str:
  try: attr = ctx.query_port(port)
  except pv.PyverbsError: return f"{name} has no port {port}"
  if attr.state != pv.e.ibv_port_state.IBV_PORT_ACTIVE:
    return f"{name} port {port} is {_enum_name(pv.e.ibv_port_state, attr.state, 'IBV_PORT_')[9:]}, not ACTIVE"
  link_layer = "Ethernet" if attr.link_layer == pv.e.IBV_LINK_LAYER_ETHERNET else "InfiniBand"
  try: return PortChoice(name, port, choose_gid_index(_gid_table(pv, ctx, port, attr.gid_tbl_len, link_layer), link_layer, gid_index), link_layer)
  except ValueError as e: return f"{name} port {port}: {e}"

def _gid_table(pv, ctx, port: int, size: int, link_layer: str) -> list[tuple[str, str] | None]:
  table = []
  for i in range(size):
    try:
      if link_layer == "InfiniBand": kind = "IB/RoCE v1"     # GID types are a RoCE matter; an IB port need not report them
      else:                                                     # the sysfs enum: ROCE_V2 is 1 here, 2 in query_gid_table's enum
        kind = "RoCE v2" if ctx.query_gid_type(port, i) == pv.e.ibv_gid_type_sysfs.IBV_GID_TYPE_SYSFS_ROCE_V2 else "IB/RoCE v1"
      table.append((str(ctx.query_gid(port, i)), kind))
    except pv.PyverbsError: table.append(None)
  return table

# ---------------------------------------------------------------- device, registrations, queue pairs

class Device:
  """An opened RDMA port: context, protection domain, one memory registration per arena, and the queue pairs made on it."""

  @staticmethod
  def open(settings) -> Device:
    """The port the settings' rdma_device / rdma_port / rdma_gid_index choose (TransportSettings, or tinyhet's Config)."""
    s = TransportSettings.of(settings)
    found = probe(s.rdma_device, s.rdma_port, s.rdma_gid_index)
    if isinstance(found, str): raise TransportUnavailable(f"verbs is unavailable here: {found}")
    return Device(found)

  def __init__(self, choice: PortChoice):
    self.pv = pv = pyverbs()
    self.name, self.port, self.gid_index, self.link_layer = choice.device, choice.port, choice.gid_index, choice.link_layer
    A = pv.e.ibv_access_flags
    self.access = A.IBV_ACCESS_LOCAL_WRITE | A.IBV_ACCESS_REMOTE_WRITE | A.IBV_ACCESS_REMOTE_READ
    self.lock = threading.Lock()
    self.mrs: dict[int, tuple] = {}          # arena id -> (arena, MR): the arena stays referenced while its pages are registered
    self.gpu: list[GpuRegistration] = []
    self.qps: set[QueuePair] = set()
    self.ctx = pv.Context(name=self.name)
    try:
      self.pd = pv.PD(self.ctx)
      port, attr = self.ctx.query_port(self.port), self.ctx.query_device()
      self.lid, self.mtu = port.lid, mtu_bytes(port.active_mtu)
      self.gid = str(self.ctx.query_gid(self.port, self.gid_index))
      self.max_msg = min(port.max_msg_sz, MAX_SGE_BYTES)
      self.max_qp_wr, self.max_cqe = attr.max_qp_wr, attr.max_cqe
      self.rd_atom = max(1, min(attr.max_qp_rd_atom, attr.max_qp_init_rd_atom, RD_ATOM))
    except BaseException:
      self.ctx.close()
      raise

  def register(self, arena):
    """Register an arena's memory once (LOCAL_WRITE | REMOTE_WRITE | REMOTE_READ). Its MAP_SHARED pages are not copied on
    fork, so child processes cannot break the registration."""
    with self.lock:
      if arena.id in self.mrs: return
      try: mr = self.pv.MR(self.pd, arena.size, self.access, address=arena.base)
      except self.pv.PyverbsError as e:
        raise TransportError(f"registering arena {arena.name!r} ({arena.size} bytes) with {self.name} failed: {e}. If it is ENOMEM or EPERM, "
                             "raise the locked-memory limit (ulimit -l unlimited; containers: --ulimit memlock=-1)") from None
      self.mrs[arena.id] = (arena, mr)

  def _mr(self, arena):
    with self.lock: entry = self.mrs.get(arena.id)
    if entry is None: raise TransportError(f"arena {arena.name!r} is not registered with {self.name}: call Endpoint.register(arena) first")
    return entry[1]

  def rkey(self, arena) -> int: return self._mr(arena).rkey
  def lkey(self, arena) -> int: return self._mr(arena).lkey

  def queue_pair(self, send_depth: int, recv_depth: int) -> QueuePair:
    qp = QueuePair(self, send_depth, recv_depth)
    with self.lock: self.qps.add(qp)
    return qp

  def info(self, qp: QueuePair) -> QPInfo: return QPInfo(qp.qp.qp_num, qp.psn, self.gid, self.lid, self.mtu, self.rd_atom, self.link_layer)

  def close(self):
    """Queue pairs (each before its CQ), then memory registrations, then the protection domain, then the context."""
    with self.lock: qps, self.qps = list(self.qps), set()
    for qp in qps: qp.close()
    with self.lock: mrs, self.mrs, gpu, self.gpu = list(self.mrs.values()), {}, list(self.gpu), []
    for _, mr in mrs: mr.close()
    for g in gpu: g.close()
    if self.ctx is not None:
      self.pd.close()
      self.ctx.close()
      self.ctx = None

  def __repr__(self): return f"<verbs.Device {self.name} port {self.port} {self.link_layer} gid[{self.gid_index}] {self.gid}>"

class QueuePair:
  """One RC queue pair with its own completion queue. poll, post and close are serialized: a pyverbs object must not be
  used after close (its C pointer is gone)."""
  def __init__(self, dev: Device, send_depth: int, recv_depth: int):
    pv = dev.pv
    self.dev, self.lock, self.closed, self.armed = dev, threading.Lock(), False, False
    self.send_depth, self.recv_depth = max(1, min(send_depth, dev.max_qp_wr)), max(1, min(recv_depth, dev.max_qp_wr))
    self.channel = pv.CompChannel(dev.ctx) if hasattr(pv.CompChannel, "fd") else None   # rdma-core >= 61 exposes the fd
    self.cq = self.qp = None
    try:
      self.cq = pv.CQ(dev.ctx, min(self.send_depth + self.recv_depth, dev.max_cqe), None, self.channel, 0)
      init = pv.QPAttr(port_num=dev.port)
      init.qp_access_flags = dev.access       # default 0 would refuse every remote write and read
      cap = pv.QPCap(max_send_wr=self.send_depth, max_recv_wr=self.recv_depth, max_send_sge=1, max_recv_sge=1)
      self.qp = pv.QP(dev.pd, pv.QPInitAttr(qp_type=pv.e.ibv_qp_type.IBV_QPT_RC, scq=self.cq, rcq=self.cq, sq_sig_all=0, cap=cap), init)  # -> INIT
    except BaseException:
      self._release()
      raise
    self.psn = secrets.randbits(24)
    self.recv_wr = pv.RecvWR(wr_id=0, num_sge=1, sg=[pv.SGE(0, 0, 0)])
    self.recv_wr.num_sge = 0                  # receives only consume immediates: no bytes, no SGE

  def connect(self, remote: QPInfo):
    """INIT -> RTR -> RTS towards the peer's queue pair."""
    dev, pv = self.dev, self.dev.pv
    route = address_route(dev.link_layer, dev.gid_index, remote)
    a = pv.QPAttr(port_num=dev.port)
    a.qp_access_flags = dev.access
    a.path_mtu = mtu_enum(min(dev.mtu, remote.mtu))
    a.dest_qp_num, a.rq_psn, a.sq_psn = remote.qpn, remote.psn, self.psn
    a.max_dest_rd_atomic, a.max_rd_atomic = dev.rd_atom, min(dev.rd_atom, remote.rd_atom)
    a.min_rnr_timer, a.timeout, a.retry_cnt, a.rnr_retry = 12, 14, 7, 7      # rnr_retry 7: wait for receives forever
    gr = pv.GlobalRoute(dgid=pv.GID(route.dgid), sgid_index=route.sgid_index, hop_limit=route.hop_limit) if route.is_global else None
    a.ah_attr = pv.AHAttr(port_num=dev.port, is_global=route.is_global, dlid=route.dlid, gr=gr)
    with self.lock:
      self._check_open()
      self.qp.to_rts(a)

  def post_send(self, w: WorkRequest, wr_id: int):
    wr = send_wr(self.dev.pv, w, wr_id)
    with self.lock:
      self._check_open()
      self.qp.post_send(wr)

  def post_recv(self, wr_id: int):
    with self.lock:
      self._check_open()
      self.recv_wr.wr_id = wr_id
      self.qp.post_recv(self.recv_wr)

  def poll(self) -> list:
    with self.lock: return [] if self.closed else self.cq.poll(POLL_BATCH)[1]

  def wait(self, fds: list, empty_polls: int, busy: bool) -> list:
    """Sleep until a completion may be there, one of fds is readable, or the backoff ran out; returns the readable fds.
    The caller polls again before sleeping after this returns [] with a freshly armed channel."""
    if self.channel is not None:
      with self.lock:
        if self.closed: return []
        if not self.armed:                    # arm, then let the caller poll once more: a completion may have come before
          self.cq.req_notify()
          self.armed = True
          return []
      ready = select.select([*fds, self.channel.fd], [], [], IDLE_WAIT)[0]
      if self.channel.fd in ready:
        with self.lock:
          if not self.closed:
            self.channel.get_cq_event(self.cq)
            self.cq.ack_events(1)
            self.armed = False
      return [f for f in ready if f != self.channel.fd]
    timeout = IDLE_WAIT if not busy else 0.0 if empty_polls < SPIN_POLLS else min(MAX_BACKOFF, 20e-6 * 2 ** min(empty_polls - SPIN_POLLS, 10))
    return select.select(fds, [], [], timeout)[0]

  def _check_open(self):
    if self.closed: raise TransportError("the queue pair was closed")

  def _release(self):
    for obj in (self.qp, self.cq, self.channel):
      if obj is not None: obj.close()

  def close(self):
    with self.lock:
      if self.closed: return
      self.closed = True
      self._release()
    with self.dev.lock: self.dev.qps.discard(self)

# ---------------------------------------------------------------- GPU memory (GPUDirect RDMA)

@dataclass
class GpuRegistration:
  """GPU memory registered for RDMA. Local SGEs and remote descriptors use `addr` (+ offset) with lkey/rkey; `owner`
  (the tinygrad Buffer) stays referenced so the memory is not freed while it is registered."""
  mr: object
  addr: int
  nbytes: int
  lkey: int
  rkey: int
  via: str            # "dma-buf" | "nvidia-peermem"
  owner: object = None
  def close(self): self.mr.close()

def register_gpu_buffer(dev: Device, buf) -> GpuRegistration:
  """Register the device memory of a tinygrad CUDA Buffer for GPUDirect RDMA: through dma-buf where the kernel, the NIC
  driver and the CUDA driver support it, else through nvidia-peermem. Raises TransportUnavailable saying what failed."""
  buf.ensure_allocated()
  if buf.device.split(":")[0] != "CUDA": raise TransportUnavailable(f"GPU memory registration supports tinygrad CUDA buffers, not {buf.device}")
  from tinygrad.device import Device as TinygradDevice
  return register_gpu_memory(dev, buf._buf.value, buf.nbytes, TinygradDevice[buf.device].context, owner=buf)

def register_gpu_memory(dev: Device, ptr: int, nbytes: int, cuda_context=None, owner=None) -> GpuRegistration:
  pv, failures = dev.pv, []
  if pv.DmaBufMR is not None:
    try:
      fd, offset = _cuda_dmabuf(ptr, nbytes, cuda_context)
      try: mr = pv.DmaBufMR(dev.pd, nbytes, dev.access, dmabuf=fd, offset=offset)
      finally: os.close(fd)                 # the registration holds its own reference to the dma-buf
      # pyverbs registers with iova = offset: this MR's addresses start at `offset`, not at the GPU pointer
      reg = GpuRegistration(mr, offset, nbytes, mr.lkey, mr.rkey, "dma-buf", owner)
    except (OSError, pv.PyverbsError) as e: failures.append(f"dma-buf: {e}")
  else: failures.append("dma-buf: this pyverbs has no DmaBufMR")
  if failures:
    try: reg = GpuRegistration(mr := pv.MR(dev.pd, nbytes, dev.access, address=ptr), ptr, nbytes, mr.lkey, mr.rkey, "nvidia-peermem", owner)
    except pv.PyverbsError as e:
      failures.append(f"nvidia-peermem: {e}")
      raise TransportUnavailable(f"cannot register {nbytes} bytes of GPU memory at {ptr:#x} with {dev.name}: {'; '.join(failures)}. GPUDirect RDMA "
                                 "needs dma-buf (Linux >= 5.12, a dma-buf capable NIC driver, CUDA >= 11.7 open kernel modules) or the "
                                 "nvidia-peermem module (modprobe nvidia-peermem)") from None
  with dev.lock: dev.gpu.append(reg)
  return reg

def _cuda_dmabuf(ptr: int, nbytes: int, context) -> tuple[int, int]:
  """A dma-buf fd for the pages holding [ptr, ptr+nbytes), and ptr's offset in it."""
  from tinygrad.runtime.autogen import cuda
  def check(status, what):
    if status != 0:
      name = ctypes.POINTER(ctypes.c_char)()
      cuda.cuGetErrorName(status, ctypes.byref(name))
      raise OSError(f"{what} failed with {ctypes.string_at(name).decode() if name else status}")
  if context is not None: check(cuda.cuCtxSetCurrent(context), "cuCtxSetCurrent")
  start, end = ptr & ~(mmap.PAGESIZE - 1), -(-(ptr + nbytes) // mmap.PAGESIZE) * mmap.PAGESIZE
  check(cuda.cuPointerSetAttribute(ctypes.byref(ctypes.c_int(1)), cuda.CU_POINTER_ATTRIBUTE_SYNC_MEMOPS, ptr), "cuPointerSetAttribute(SYNC_MEMOPS)")
  fd = ctypes.c_int(-1)
  check(cuda.cuMemGetHandleForAddressRange(ctypes.byref(fd), start, end - start, cuda.CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0), "dma-buf export")
  return fd.value, ptr - start
