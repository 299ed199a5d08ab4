"""verbs transport. The planning, bookkeeping, connection data and detection run everywhere; traffic needs an RDMA
device (and the GPU test a CUDA GPU too) and skips with the reason verbs gives where there is none."""
import dataclasses, os, pathlib, socket, subprocess, sys
from collections import Counter, deque
import numpy as np, pytest
from hypothesis import given, settings, strategies as st, HealthCheck
from tinyhet.config import load_config
from tinyhet.runtime import verbs, wire
from tinyhet.runtime.arena import Arena
from tinyhet.runtime.descriptor import RegionDescriptor
from tinyhet.runtime.transport import Endpoint, Piece, Span, TransportError, TransportUnavailable
from tinyhet.runtime.memory_node import fill
from tinyhet.runtime.verbs import QPInfo, SendWindow, WorkRequest, plan_work_requests, choose_gid_index, address_route, WRITE, WRITE_IMM, READ
from transport_util import MemoryNode, TOKEN, raw_auth, sha

def pyverbs_or_skip():
  try: return verbs.pyverbs()
  except ImportError as e: pytest.skip(f"pyverbs is not importable: {e}")

# ---------------------------------------------------------------- work-request planning

@pytest.fixture(scope="module")
def arenas():
  a = [Arena(1 << 20, f"plan{i}", hugepages=False) for i in range(2)]
  yield a
  for x in a: x.close()

def piece_bytes(pieces):
  """Multiset of (local address, rkey, remote address) for every byte the pieces move."""
  out = Counter()
  for p in pieces:
    for i in range(p.nbytes): out[(p.arena.base + p.start + i, p.rkey, p.addr + p.region_offset + i)] += 1
  return out

def wr_bytes(wrs):
  out = Counter()
  for w in wrs:
    for i in range(w.length): out[(w.local_addr + i, w.rkey, w.remote_addr + i)] += 1
  return out

@st.composite
def pieces_st(draw, arenas):
  """Pieces over two local arenas and two remote regions; many continue their predecessor on both sides, to coalesce."""
  pieces, prev = [], None
  for _ in range(draw(st.integers(0, 12))):
    a, region, n = draw(st.integers(0, 1)), draw(st.integers(1, 2)), draw(st.integers(1, 64))
    start, roff = draw(st.integers(0, 400)), draw(st.integers(0, 400))
    if prev is not None and draw(st.booleans()): a, region, start, roff = prev[0], prev[1], prev[2] + prev[4], prev[3] + prev[4]
    pieces.append(Piece(arenas[a], start, region, region << 16, 100 + region, roff, n))
    prev = (a, region, start, roff, n)
  return pieces

@settings(max_examples=300, deadline=None)
@given(data=st.data(), max_msg=st.integers(1, 80), signal_every=st.integers(1, 16), notify=st.none() | st.integers(0, 2**32 - 1))
def test_plan_moves_every_byte_once(arenas, data, max_msg, signal_every, notify):
  pieces = data.draw(pieces_st(arenas))
  lkeys = {arenas[0].id: 11, arenas[1].id: 22}
  wrs = plan_work_requests(pieces, lkeys, max_msg, signal_every, notify)
  assert wr_bytes(wrs) == piece_bytes(pieces)
  if not pieces:
    assert wrs == ([] if notify is None else [WorkRequest(WRITE_IMM, 0, 0, 0, 0, 0, True, notify)])
    return
  for w in wrs:
    assert 0 < w.length <= max_msg
    assert w.lkey == lkeys[next(a.id for a in arenas if a.contains(w.local_addr, w.length))]
  # the last request ends the batch: signaled, and it alone carries the notification
  assert wrs[-1].signaled
  assert [w.opcode for w in wrs] == [WRITE] * (len(wrs) - 1) + [WRITE if notify is None else WRITE_IMM]
  assert [w.imm for w in wrs] == [None] * (len(wrs) - 1) + [notify]
  # flow control: never signal_every unsignaled requests in a row, so a full send queue always holds a signaled one
  run = 0
  for w in wrs:
    run = 0 if w.signaled else run + 1
    assert run < signal_every
  # coalesced: neighbours contiguous on both sides were only cut at max_msg
  for a, b in zip(wrs, wrs[1:]):
    if a.local_addr + a.length == b.local_addr and a.remote_addr + a.length == b.remote_addr and (a.lkey, a.rkey) == (b.lkey, b.rkey):
      assert a.length == max_msg

@settings(max_examples=100, deadline=None)
@given(data=st.data(), max_msg=st.integers(1, 80))
def test_plan_reads(arenas, data, max_msg):
  pieces = data.draw(pieces_st(arenas))
  wrs = plan_work_requests(pieces, {arenas[0].id: 1, arenas[1].id: 2}, max_msg, 4, read=True)
  assert wr_bytes(wrs) == piece_bytes(pieces)
  assert all(w.opcode == READ and w.imm is None for w in wrs) and (not wrs or wrs[-1].signaled)

def test_plan_rejects_nonsense(arenas):
  p = [Piece(arenas[0], 0, 1, 0x10000, 5, 0, 10)]
  with pytest.raises(ValueError, match="notification"): plan_work_requests(p, {arenas[0].id: 1}, 8, 4, notify=1, read=True)
  with pytest.raises(ValueError, match="positive"): plan_work_requests(p, {arenas[0].id: 1}, 0, 4)

def test_plan_splits_at_the_message_limit(arenas):
  wrs = plan_work_requests([Piece(arenas[0], 100, 1, 0x10000, 5, 7, 2500)], {arenas[0].id: 9}, 1000, 64, notify=3)
  assert [(w.local_addr - arenas[0].base, w.length, w.remote_addr - 0x10000, w.opcode) for w in wrs] == \
         [(100, 1000, 7, WRITE), (1100, 1000, 1007, WRITE), (2100, 500, 2007, WRITE_IMM)]

# ---------------------------------------------------------------- send window: flow control against a simulated queue

@settings(max_examples=300, deadline=None)
@given(batches=st.lists(st.integers(1, 40), min_size=1, max_size=25), depth=st.integers(1, 64), signal_every=st.integers(1, 64), data=st.data())
def test_send_window_never_overflows_nor_stalls(arenas, batches, depth, signal_every, data):
  signal_every = min(signal_every, depth)           # what Link does
  window, queue, finished = SendWindow(depth), deque(), []
  def hardware_step():
    """The queue pair executes some requests in order; only signaled ones produce a completion."""
    for _ in range(data.draw(st.integers(1, 8))):
      if not queue: return
      seq, signaled = queue.popleft()
      if signaled: finished.extend(window.complete(seq))
  for b, n in enumerate(batches):
    wrs = plan_work_requests([Piece(arenas[0], 0, 1, 0, 1, 0, n)], {arenas[0].id: 1}, 1, signal_every, notify=b if b % 2 else None)
    window.open_batch(len(wrs), b)
    for w in wrs:
      while window.room() == 0:
        assert any(s for _, s in queue), "send queue full of unsignaled requests: nothing can free a slot"
        hardware_step()
      queue.append((window.post(), w.signaled))
      assert 0 <= window.posted - window.reaped <= depth
      if data.draw(st.booleans()): hardware_step()
  while queue: hardware_step()
  assert finished == list(range(len(batches)))      # every batch finished once, in order
  assert window.room() == depth

def test_send_window_checks_its_use():
  w = SendWindow(2)
  w.open_batch(3, "a")
  w.post()
  with pytest.raises(ValueError, match="before the previous one was posted"): w.open_batch(1, "b")
  w.post()
  with pytest.raises(RuntimeError, match="send queue full"): w.post()
  with pytest.raises(ValueError, match="outstanding"): w.complete(5)
  assert w.complete(2) == [] and w.room() == 2
  w.post()
  assert w.complete(3) == ["a"] and w.fail_all() == []

# ---------------------------------------------------------------- connection data

GOOD = {"qpn": 0x1234, "psn": 77, "gid": "0000:0000:0000:0000:0000:ffff:0a00:0001", "lid": 0, "mtu": 4096, "rd_atom": 16, "link_layer": "Ethernet"}

@given(st.builds(QPInfo, qpn=st.integers(2, 2**24 - 1), psn=st.integers(0, 2**24 - 1),
                 gid=st.lists(st.integers(0, 0xFFFF), min_size=8, max_size=8).map(lambda g: ":".join(f"{x:04x}" for x in g)),
                 lid=st.integers(0, 0xFFFF), mtu=st.sampled_from(verbs.MTUS), rd_atom=st.integers(1, 255),
                 link_layer=st.sampled_from(verbs.LINK_LAYERS)))
def test_connection_data_round_trip(info):
  assert QPInfo.decode(info.encode(), "peer") == info
  assert QPInfo.decode({**info.encode(), "gid": info.gid.upper(), "future_field": 1}, "peer") == info

@pytest.mark.parametrize("change, message", [
  ({"qpn": None}, "field 'qpn' is missing"), ({"link_layer": None}, "field 'link_layer' is missing"),
  ({"qpn": 1}, "qpn = '1' must be a queue pair number"), ({"qpn": 2**24}, "qpn"), ({"qpn": True}, "qpn"), ({"qpn": "5"}, "qpn"),
  ({"psn": -1}, "psn"), ({"psn": 2**24}, "psn"), ({"gid": "fe80::1"}, "gid = 'fe80::1' must be 8 groups"), ({"gid": 5}, "gid"),
  ({"lid": 65536}, "lid"), ({"mtu": 1500}, "mtu = '1500' must be one of 256"), ({"rd_atom": 0}, "rd_atom"), ({"rd_atom": 1.5}, "rd_atom"),
  ({"link_layer": "RoCE"}, "link_layer = 'RoCE' must be one of InfiniBand, Ethernet"),
])
def test_bad_connection_data_is_named(change, message):
  obj = {k: v for k, v in {**GOOD, **change}.items() if v is not None}
  with pytest.raises(wire.ProtocolError, match=f"decode0 sent bad verbs connection data: {message}"): QPInfo.decode(obj, "decode0")

@given(st.one_of(st.none(), st.integers(), st.text(max_size=5), st.lists(st.integers(), max_size=3),
                 st.dictionaries(st.sampled_from([*GOOD, "x"]), st.one_of(st.none(), st.booleans(), st.integers(-5, 2**25), st.text(max_size=40)))))
def test_random_connection_data_decodes_or_is_refused(obj):
  try: info = QPInfo.decode(obj, "p")
  except wire.ProtocolError as e: assert str(e).startswith("p sent bad verbs connection data: ")
  else: assert QPInfo.decode(info.encode(), "p") == info

# ---------------------------------------------------------------- GID choice and addressing

V1, V2 = "IB/RoCE v1", "RoCE v2"
ZERO = verbs.ZERO_GID
LINK6, IPV4, GLOBAL6 = "fe80:0000:0000:0000:0e42:a1ff:fe2b:3c4d", "0000:0000:0000:0000:0000:ffff:0a00:0102", "2001:0db8:0000:0000:0000:0000:0000:0007"

@pytest.mark.parametrize("table, link_layer, wanted, expected", [
  ([(LINK6, V1), (LINK6, V2), (IPV4, V1), (IPV4, V2)], "Ethernet", -1, 3),           # the usual mlx5 RoCE table
  ([(LINK6, V1), (LINK6, V2), (GLOBAL6, V1), (GLOBAL6, V2)], "Ethernet", -1, 3),     # IPv6 only: global before link-local
  ([(LINK6, V1), (LINK6, V2)], "Ethernet", -1, 1),
  ([(ZERO, V2), None, (LINK6, V1)], "Ethernet", -1, 2),                              # RoCE v1 only as a last resort
  ([(LINK6, V1), (LINK6, V2), (IPV4, V1), (IPV4, V2)], "Ethernet", 2, 2),            # a configured index wins
  ([("fe80:0000:0000:0000:0002:c903:0000:1234", V1), (ZERO, V1)], "InfiniBand", -1, 0),
])
def test_gid_choice(table, link_layer, wanted, expected):
  assert choose_gid_index(table, link_layer, wanted) == expected

@pytest.mark.parametrize("table, wanted, message", [
  ([], -1, "no GID .*IP address"), ([(ZERO, V2), None], -1, "no GID"), ([(IPV4, V2)], 4, "outside the port's table of 1"),
  ([(IPV4, V2), (ZERO, V2)], 1, "GID index 1 is empty"), ([(IPV4, V2), None], 1, "GID index 1 is empty"),
])
def test_gid_choice_says_why_not(table, wanted, message):
  with pytest.raises(ValueError, match=message): choose_gid_index(table, "Ethernet", wanted)

@given(st.lists(st.none() | st.tuples(st.sampled_from([ZERO, LINK6, IPV4, GLOBAL6]), st.sampled_from([V1, V2])), max_size=12))
def test_gid_choice_prefers_ipv4_mapped_roce_v2(table):
  usable = [i for i, e in enumerate(table) if e is not None and e[0] != ZERO]
  if not usable:
    with pytest.raises(ValueError): choose_gid_index(table, "Ethernet")
    return
  i = choose_gid_index(table, "Ethernet")
  assert i in usable
  if any(table[j][1] == V2 for j in usable): assert table[i][1] == V2
  if any(table[j] == (IPV4, V2) for j in usable): assert table[i] == (IPV4, V2) and i == table.index((IPV4, V2))

def test_address_route():
  roce = QPInfo(**GOOD)
  assert address_route("Ethernet", 3, roce) == verbs.Route(1, 0, roce.gid, 3, verbs.HOP_LIMIT)
  ib = dataclasses.replace(roce, link_layer="InfiniBand", lid=17)
  assert address_route("InfiniBand", 0, ib) == verbs.Route(0, 17, None, 0, 0)
  with pytest.raises(TransportError, match="no unicast LID"): address_route("InfiniBand", 0, dataclasses.replace(ib, lid=0))
  with pytest.raises(TransportError, match="cannot connect them"): address_route("Ethernet", 0, ib)
  with pytest.raises(TransportError, match="IP address"): address_route("Ethernet", 0, dataclasses.replace(roce, gid=ZERO))

def test_mtu_matches_pyverbs():
  e = pyverbs_or_skip().e
  for nbytes in verbs.MTUS:
    enum = getattr(e.ibv_mtu, f"IBV_MTU_{nbytes}")
    assert verbs.mtu_enum(nbytes) == enum and verbs.mtu_bytes(enum) == nbytes

# ---------------------------------------------------------------- what is handed to pyverbs

def test_send_wr_carries_the_plan():
  pv = pyverbs_or_skip()
  op, signaled = pv.e.ibv_wr_opcode, pv.e.ibv_send_flags.IBV_SEND_SIGNALED
  w = verbs.send_wr(pv, WorkRequest(WRITE_IMM, 0x7000, 5, 4096, 0x9000, 0xABCD, True, 0x01020304), 42)
  assert (w.wr_id, w.opcode, w.send_flags, w.num_sge) == (42, op.IBV_WR_RDMA_WRITE_WITH_IMM, signaled, 1)   # (pyverbs cannot read back rdma.rkey)
  assert w.imm_data == socket.htonl(0x01020304)        # big-endian on the wire, as the receiver's ntohl expects
  w = verbs.send_wr(pv, WorkRequest(WRITE, 0x7000, 5, 64, 0x9000, 7, False, None), 43)
  assert (w.opcode, w.send_flags, w.imm_data) == (op.IBV_WR_RDMA_WRITE, 0, 0)
  assert verbs.send_wr(pv, WorkRequest(READ, 0x7000, 5, 64, 0x9000, 7, True, None), 44).opcode == op.IBV_WR_RDMA_READ
  assert verbs.send_wr(pv, WorkRequest(WRITE_IMM, 0, 0, 0, 0, 0, True, 9), 45).num_sge == 0

def test_wc_status_text():
  pv = pyverbs_or_skip()
  text = verbs.wc_status_text(pv.e.ibv_wc_status.IBV_WC_REM_ACCESS_ERR, 0x88)
  assert "remote access error" in text and "IBV_WC_REM_ACCESS_ERR" in text and "0x88" in text and "stale" in text
  assert "transport retry counter exceeded" in verbs.wc_status_text(pv.e.ibv_wc_status.IBV_WC_RETRY_EXC_ERR)

# ---------------------------------------------------------------- detection

def run_python(code: str, **env) -> str:
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env={**os.environ, **env})
  assert out.returncode == 0, out.stderr
  return out.stdout.strip()

def test_detection_here():
  pyverbs_or_skip()
  if pathlib.Path("/sys/class/infiniband_verbs").exists(): pytest.skip("this kernel has RDMA (uverbs): the no-kernel-support reason cannot show here")
  reason = verbs.unavailable_reason(load_config(env={}))
  assert reason.startswith("no RDMA support in this kernel (") and "driver" in reason
  before = verbs.probe.cache_info().hits
  assert verbs.unavailable_reason(load_config(env={})) == reason and verbs.probe.cache_info().hits == before + 1   # looked up once

def test_detection_without_pyverbs():
  code = "import sys; sys.modules['pyverbs'] = None\nfrom tinyhet.runtime import verbs; print(verbs.unavailable_reason())"
  reason = run_python(code)
  assert reason.startswith("pyverbs is not importable (") and "python3-pyverbs" in reason

def test_detection_without_devices(tmp_path):
  pyverbs_or_skip()
  (tmp_path / "class" / "infiniband").mkdir(parents=True)           # uverbs present, no device: libibverbs reads SYSFS_PATH
  (tmp_path / "class" / "infiniband_verbs").mkdir(parents=True)
  (tmp_path / "class" / "infiniband_verbs" / "abi_version").write_text("6\n")
  reason = run_python("from tinyhet.runtime import verbs; print(verbs.unavailable_reason())", SYSFS_PATH=str(tmp_path))
  assert reason.startswith("no RDMA device found")

def test_endpoint_without_verbs_never_offers_it():
  reason = verbs.unavailable_reason(verbs_config())
  if reason is None: pytest.skip("this host has a usable RDMA port")
  cfg = verbs_config()
  with Endpoint("target", token=TOKEN, config=cfg) as target, Endpoint("writer", token=TOKEN, config=cfg) as writer:
    assert target.verbs is None and "verbs" not in target.transports
    address = target.listen()
    with pytest.raises(TransportUnavailable, match="verbs is unavailable here: " + reason[:20]): writer.connect(address, "verbs")
    assert writer.connect(address).transport == "shm"                # auto
    # a client that asks for verbs anyway is refused before anything is set up
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    hello = wire.recv_json(sock)
    assert "verbs" not in hello["transports"]
    wire.send_json(sock, raw_auth(hello, "raw", "verbs", verbs=GOOD))
    assert "is not served" in wire.recv_json(sock)["error"]
    sock.close()

# ---------------------------------------------------------------- traffic (needs an RDMA device)

def rxe_device() -> str:
  """A Soft-RoCE device (bench/softroce.sh adds rxe0 where the rdma_rxe module loads), or "" where there is none."""
  sysfs = pathlib.Path("/sys/class/infiniband")
  return min((d.name for d in sysfs.glob("rxe*")), default="") if sysfs.is_dir() else ""

def verbs_config():
  """The traffic tests' configuration: an rxe device where one exists (a real verbs device without an RDMA NIC), else the
  first device with an active port."""
  return load_config(env={"TINYHET_RDMA_DEVICE": rxe} if (rxe := rxe_device()) else {})

def serving(cfg):
  """A node that serves verbs: only one whose own transport setting is verbs does (Endpoint.served; the README's trust notes)."""
  return dataclasses.replace(cfg, transport="verbs")

def skip_without_verbs():
  if (reason := verbs.unavailable_reason(verbs_config())) is not None:
    pytest.skip(f"verbs is unavailable: {reason} (no Soft-RoCE device either: bench/softroce.sh adds one where the rdma_rxe module loads)")

@pytest.fixture
def rdma(): skip_without_verbs()

def test_loopback_write_read_notify_and_errors(rdma):
  cfg = verbs_config()
  target_arena, writer_arena = Arena(16 << 20, "target", hugepages=False), Arena(16 << 20, "writer", hugepages=False)
  region, local, back = target_arena.alloc(8 << 20, 4096), writer_arena.alloc(8 << 20), writer_arena.alloc(4 << 20)
  fill(local.view(), 3)
  try:
    with Endpoint("target", token=TOKEN, config=serving(cfg)) as target, Endpoint("writer", token=TOKEN, config=cfg) as writer:
      desc = target.expose(region)
      assert desc.rkey and "verbs" in desc.transports
      peer = writer.connect(target.listen(), "verbs")
      assert peer.transport == "verbs"
      spans = [(0, 0, 1 << 20), ((1 << 20) + 5, (2 << 20) + 7, 999), (3 << 20, 3 << 20, 4096)]
      writer.write(peer, [Span(local, lo, desc, ro, n) for lo, ro, n in spans], notify=0xDEADBEEF).wait(10)
      n = target.wait_notice(10)
      assert (n.peer, n.value, n.batch, n.nbytes) == ("writer", 0xDEADBEEF, 0, 0)
      for lo, ro, k in spans: assert bytes(region.view(ro, k)) == bytes(local.view(lo, k))
      writer.read(peer, [Span(back, 0, desc, 0, 1 << 20)]).wait(10)
      assert bytes(back.view(0, 1 << 20)) == bytes(local.view(0, 1 << 20))
      # one batch of 5,000 separate pieces: more work requests than the send queue holds (flow control)
      many = [Span(local, 128 * i, desc, (4 << 20) + 128 * i, 64) for i in range(5000)]
      writer.write(peer, many, notify=7).wait(30)
      assert target.wait_notice(10).value == 7
      view = np.frombuffer(region.view(4 << 20, 128 * 5000), np.uint8).reshape(5000, 128)[:, :64]
      assert (view == np.frombuffer(local.view(0, 128 * 5000), np.uint8).reshape(5000, 128)[:, :64]).all()
      # a wrong key fails the batch with the completion's status, and the link stays broken
      bad = dataclasses.replace(desc, rkey=desc.rkey ^ 0x5A5A)
      with pytest.raises(TransportError, match="remote access error"): writer.write(peer, [Span(local, 0, bad, 0, 64)]).wait(10)
      with pytest.raises(TransportError, match="broken"): writer.write(peer, [Span(local, 0, desc, 0, 64)])
      assert writer.connect(target.listen(), "verbs").transport == "verbs"    # a fresh link works
  finally:
    for r in (region, local, back): r.free()
    target_arena.close()
    writer_arena.close()

REMOTE_BYTES = 4 << 20

@pytest.fixture(scope="module")
def verbs_node():
  skip_without_verbs()
  # serves verbs (a node must ask to); takes the first device with an active port: under bench/softroce.sh, rxe0 (or rxe1, its peer)
  n = MemoryNode(extra=("--transport", "verbs"))
  n.desc, n.region = n.expose(REMOTE_BYTES)
  n.ask(cmd="fill", region=n.region, seed=1)
  n.image = np.empty(REMOTE_BYTES, np.uint8)
  fill(memoryview(n.image), 1)
  ep = Endpoint("writer", token=TOKEN, config=verbs_config())
  ep.arena = Arena(32 << 20, "writer", hugepages=False)
  ep.local = ep.arena.alloc(8 << 20)
  fill(ep.local.view(), 2)
  ep.peer = ep.connect(n.address, "verbs")
  yield n, ep
  ep.close()
  ep.local.free()
  ep.arena.close()
  n.close()

@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_two_process_verbs_is_byte_exact(verbs_node, data):
  from test_transport import disjoint_spans
  node, writer = verbs_node
  assert writer.peer.transport == "verbs"
  max_len = data.draw(st.sampled_from([64, 4096, 300_000, 2 << 20]))
  spans = disjoint_spans(data.draw, data.draw(st.integers(1, 24)), REMOTE_BYTES, writer.local.nbytes, max_len)
  value = data.draw(st.integers(0, 2**32 - 1))
  writer.write(writer.peer, [Span(writer.local, lo, node.desc, ro, n) for lo, ro, n in spans], notify=value).wait(30)
  for lo, ro, n in spans: node.image[ro:ro + n] = writer.local.numpy()[lo:lo + n]
  assert node.ask(cmd="notices", count=1, timeout=10)["notices"] == [["writer", value, 0]]    # verbs cannot tell batch size
  assert node.sha(node.region) == sha(node.image)
  back = writer.arena.alloc(REMOTE_BYTES)
  try:
    writer.read(writer.peer, [Span(back, 0, node.desc, 0, REMOTE_BYTES)]).wait(30)
    assert sha(back.view()) == sha(node.image)
  finally: back.free()

def test_gpu_memory_takes_rdma_writes(rdma):
  try:
    from tinygrad import Device as TinygradDevice, dtypes
    from tinygrad.device import Buffer
    TinygradDevice["CUDA"]
  except Exception as e: pytest.skip(f"no CUDA device for tinygrad: {e}")
  cfg = verbs_config()
  arena = Arena(4 << 20, "writer", hugepages=False)
  local = arena.alloc(1 << 20)
  fill(local.view(), 5)
  buf = Buffer("CUDA", 1 << 20, dtypes.uint8).ensure_allocated()
  try:
    with Endpoint("gpu", token=TOKEN, config=serving(cfg)) as target, Endpoint("writer", token=TOKEN, config=cfg) as writer:
      reg = verbs.register_gpu_buffer(target.verbs, buf)
      assert reg.via in ("dma-buf", "nvidia-peermem") and reg.rkey
      desc = RegionDescriptor("gpu", 1, reg.addr, reg.rkey, 0, reg.nbytes, frozenset({"verbs"}))
      peer = writer.connect(target.listen(), "verbs")
      writer.write(peer, [Span(local, 0, desc, 0, 1 << 20)], notify=1).wait(10)
      assert target.wait_notice(10).value == 1
      assert bytes(buf.as_buffer()) == bytes(local.view())
  finally:
    local.free()
    arena.close()
