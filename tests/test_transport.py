import contextlib, json, os, pathlib, signal, socket, subprocess, sys, time
import numpy as np, pytest
from hypothesis import given, settings, strategies as st, HealthCheck
from tinyhet.config import load_config
from tinyhet.runtime import wire
from tinyhet.runtime.arena import Arena
from tinyhet.runtime.descriptor import RegionDescriptor
from tinyhet.runtime.transport import Endpoint, Span, Piece, TransportError, TransportUnavailable, coalesce, split, to_pieces, available_transports
from tinyhet.runtime.memory_node import fill
from transport_util import MemoryNode, TOKEN, raw_tcp_session, sha

REMOTE_BYTES = 4 << 20

# ---------------------------------------------------------------- coalescing and splitting (pure)

def byte_map(pieces):
  """(arena id, local byte) -> (region, remote byte) for every byte the pieces move."""
  out = {}
  for p in pieces:
    for i in range(p.nbytes): out[(id(p.arena), p.start + i)] = (p.region_id, p.region_offset + i)
  return out

@settings(max_examples=200)
@given(st.lists(st.tuples(st.integers(0, 1), st.integers(0, 300), st.integers(1, 2), st.integers(0, 300), st.integers(1, 40)), max_size=12),
       st.integers(1, 50))
def test_coalesce_and_split_keep_every_byte(raw, limit):
  arenas = [object(), object()]
  # build pieces that often touch their predecessor on both sides
  pieces, prev = [], None
  for arena_i, start, region, roff, n in raw:
    if prev is not None and start % 3 == 0: arena_i, region, start, roff = prev[0], prev[1], prev[2] + prev[4], prev[3] + prev[4]
    pieces.append(Piece(arenas[arena_i], start, region, 0, 0, roff, n))
    prev = (arena_i, region, start, roff, n)
  merged = coalesce(pieces)
  assert sum(p.nbytes for p in merged) == sum(p.nbytes for p in pieces)
  assert byte_map(merged) == byte_map(pieces)
  for a, b in zip(merged, merged[1:]):
    assert not (a.arena is b.arena and a.region_id == b.region_id and a.start + a.nbytes == b.start and a.region_offset + a.nbytes == b.region_offset)
  cut = split(merged, limit)
  assert all(0 < p.nbytes <= limit for p in cut) and byte_map(cut) == byte_map(pieces)

def test_spans_are_checked_before_anything_moves():
  arena = Arena(1 << 20, "local", hugepages=False)
  r = arena.alloc(4096)
  d = RegionDescriptor("far", 3, 0x10000, 0, 0, 8192).narrow(4096, 4096)
  assert to_pieces([Span(r, 0, d, 0, 4096)], "far")[0].region_offset == 4096
  with pytest.raises(TransportError, match="targets node 'far'"): to_pieces([Span(r, 0, d, 0, 10)], "other")
  with pytest.raises(TransportError, match="local span"): to_pieces([Span(r, 100, d, 0, 4096)], "far")
  with pytest.raises(TransportError, match="remote span"): to_pieces([Span(r, 0, d, 1, 4096)], "far")
  with pytest.raises(TransportError, match="at least one byte"): to_pieces([Span(r, 0, d, 0, 0)], "far")
  r.free()

# ---------------------------------------------------------------- two processes

@pytest.fixture(scope="module")
def node():
  n = MemoryNode()
  desc, region = n.expose(REMOTE_BYTES)
  n.ask(cmd="fill", region=region, seed=1)
  n.desc, n.region = desc, region
  n.image = np.empty(REMOTE_BYTES, np.uint8)      # what the remote region must hold
  fill(memoryview(n.image), 1)
  yield n
  n.close()

@pytest.fixture(scope="module")
def writer():
  ep = Endpoint("writer", token=TOKEN, config=load_config(env={}))
  arena = Arena(32 << 20, "writer", hugepages=False)
  ep.local = arena.alloc(8 << 20)
  fill(ep.local.view(), 2)
  yield ep
  ep.close()

def disjoint_spans(draw, n_spans, remote_bytes, local_bytes, max_len):
  """Random spans whose remote parts do not overlap (tcp lands pieces of one batch in any order); some touch, to coalesce."""
  cuts = sorted(draw(st.lists(st.integers(0, remote_bytes), min_size=2 * n_spans, max_size=2 * n_spans, unique=True)))
  spans = []
  for i in range(n_spans):
    lo, hi = cuts[2 * i], cuts[2 * i + 1]
    if draw(st.booleans()) and spans: lo = spans[-1][1] + spans[-1][2] if spans[-1][1] + spans[-1][2] < hi else lo
    n = min(hi - lo, max_len)
    if n <= 0: continue
    local = draw(st.integers(0, local_bytes - n))
    spans.append((local, lo, n))
  return spans

@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_notice_times_are_on_the_writers_clock(node, writer, transport):
  """bench transfer's latency and the prefill node's transfer figures time a write to the receiver's notice, read in another
  process: on one host the clocks agree (perf_counter is CLOCK_MONOTONIC), so each notice falls after its post. (Over tcp
  notices of writes sent on different streams may be delivered out of order: match them by value.)"""
  desc, _ = node.expose(4096)
  peer = writer.connect(node.address, transport)
  posted = []
  try:
    for i in range(5):
      posted.append(time.perf_counter())
      writer.write(peer, [Span(writer.local, 0, desc, 0, 4096)], notify=i).wait(10)
    got = node.ask(cmd="notices", count=5, timeout=10, times=True)
  finally: peer.close()
  now = time.perf_counter()
  noticed = {n[1]: t for n, t in zip(got["notices"], got["times"])}
  assert sorted(noticed) == list(range(5))
  assert all(posted[i] < noticed[i] < now for i in range(5)), (posted, noticed)
  assert "times" not in node.ask(cmd="notices", count=0)

@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_held_notices_go_out_together_in_order_after_their_bytes(node, writer, transport):
  """hold_notices (the KV sender's, for a request's layers): over shm each write's bytes land at once, its notice is kept
  (none is sent before send_notices: the link holds their frames) and all go out in order, in one call, once asked;
  tcp sends each notice with its write (hold_notices says it cannot hold)."""
  desc, region = node.expose(3 * 4096)
  peer = writer.connect(node.address, transport)
  try:
    held = writer.hold_notices(peer)
    assert held == (transport == "shm")
    for i in range(3): writer.write(peer, [Span(writer.local, 4096 * i, desc, 4096 * i, 4096)], notify=100 + i).wait(10)
    assert node.sha(region) == sha(bytes(writer.local.view()[:3 * 4096]))      # every byte landed, notices held or not
    if held: assert len(peer.link.held) == 3                                    # not sent: in the link's hand
    before = time.perf_counter()
    writer.send_notices(peer)
    got = node.ask(cmd="notices", count=3, timeout=10, times=True)
    values = [n[1] for n in got["notices"]]
    assert (values if held else sorted(values)) == [100, 101, 102]     # tcp: streams may deliver out of order
    if held: assert all(t > before for t in got["times"]) and peer.link.held is None
    writer.write(peer, [Span(writer.local, 0, desc, 0, 4096)], notify=7).wait(10)         # no longer held: sent with its write
    assert node.ask(cmd="notices", count=1, timeout=10)["notices"][0][1] == 7
  finally: peer.close()

@pytest.mark.parametrize("transport", ["tcp", "shm"])
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_two_process_writes_and_reads_are_byte_exact(node, writer, transport, data):
  peer = writer.__dict__.setdefault(f"peer_{transport}", None) or writer.connect(node.address, transport)
  writer.__dict__[f"peer_{transport}"] = peer
  assert peer.transport == transport
  max_len = data.draw(st.sampled_from([64, 4096, 300_000, 2 << 20]))
  spans = disjoint_spans(data.draw, data.draw(st.integers(1, 24)), REMOTE_BYTES, writer.local.nbytes, max_len)
  local = writer.local.numpy()
  value = data.draw(st.integers(0, 2**32 - 1))
  t = writer.write(peer, [Span(writer.local, lo, node.desc, ro, n) for lo, ro, n in spans], notify=value)
  t.wait(30)
  for lo, ro, n in spans: node.image[ro:ro + n] = local[lo:lo + n]
  assert node.ask(cmd="notices", count=1, timeout=10)["notices"] == [["writer", value, sum(n for _, _, n in spans)]]
  assert node.sha(node.region) == sha(node.image)
  # read a few spans back, to local offsets equal to the remote ones so that no two reads land on the same bytes
  back = [(ro, ro, n) for _, ro, n in disjoint_spans(data.draw, 4, REMOTE_BYTES, writer.local.nbytes, 1 << 20)]
  if back:
    scratch = Arena(8 << 20, "scratch", hugepages=False)
    r = scratch.alloc(8 << 20)
    writer.read(peer, [Span(r, lo, node.desc, ro, n) for lo, ro, n in back]).wait(30)
    for lo, ro, n in back: assert (r.numpy()[lo:lo + n] == node.image[ro:ro + n]).all()
    r.free()
    scratch.close()

@pytest.mark.parametrize("transport", ["tcp", "shm"])
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_write_many_lands_as_its_writes_one_by_one(node, writer, transport, data):
  """write_many (a chunked prefill's group of pieces) is as many writes: every byte lands, each write's notice arrives with
  its own value and byte count (shm: in order; tcp: a batch per write, its streams may deliver out of order), and the
  Transfers finish. Small groups go from the caller's thread, large ones through the stream threads (tcp) or as one pass."""
  peer = writer.__dict__.setdefault(f"peer_{transport}", None) or writer.connect(node.address, transport)
  writer.__dict__[f"peer_{transport}"] = peer
  max_len = data.draw(st.sampled_from([64, 4096, 300_000, 2 << 20]))
  spans = disjoint_spans(data.draw, data.draw(st.integers(1, 24)), REMOTE_BYTES, writer.local.nbytes, max_len)
  cuts = sorted(data.draw(st.lists(st.integers(1, max(1, len(spans) - 1)), max_size=6, unique=True))) if len(spans) > 1 else []
  groups = [spans[a:b] for a, b in zip([0, *cuts], [*cuts, len(spans)]) if b > a]
  values = data.draw(st.lists(st.integers(0, 2**32 - 1), min_size=len(groups), max_size=len(groups), unique=True))
  local = writer.local.numpy()
  ts = writer.write_many(peer, [([Span(writer.local, lo, node.desc, ro, n) for lo, ro, n in g], v) for g, v in zip(groups, values)])
  assert len(ts) == len(groups)
  for t in ts: t.wait(30)
  for lo, ro, n in spans: node.image[ro:ro + n] = local[lo:lo + n]
  got = node.ask(cmd="notices", count=len(groups), timeout=10)["notices"]
  want = [["writer", v, sum(n for _, _, n in g)] for g, v in zip(groups, values)]
  assert (got if transport == "shm" else sorted(got)) == (want if transport == "shm" else sorted(want))
  assert node.sha(node.region) == sha(node.image)

@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_write_many_checks_every_span_before_anything_moves(node, writer, transport):
  """A group whose last write has a span outside the remote region is refused whole: no byte lands, no notice comes."""
  desc, region = node.expose(2 * 4096)
  peer = writer.connect(node.address, transport)
  try:
    before = node.sha(region)
    with pytest.raises(TransportError, match="outside"):
      writer.write_many(peer, [([Span(writer.local, 0, desc, 0, 4096)], 1), ([Span(writer.local, 0, desc, 4096, 8192)], 2)])
    assert node.sha(region) == before
    writer.write(peer, [Span(writer.local, 0, desc, 0, 64)], notify=3).wait(10)   # the next notice is this one's: 1 never went
    assert [n[1] for n in node.ask(cmd="notices", count=1, timeout=10)["notices"]] == [3]
    with pytest.raises(TransportError, match="u32"): writer.write_many(peer, [([Span(writer.local, 0, desc, 0, 64)], -1)])
  finally: peer.close()

def test_auto_picks_shm_on_this_host(node, writer):
  peer = writer.connect(node.address)
  assert peer.transport == "shm"
  peer.close()

def test_wrong_token_is_refused(node):
  with Endpoint("intruder", token="wrong", config=load_config(env={})) as ep:
    with pytest.raises(TransportError, match="authentication failed"): ep.connect(node.address, "tcp")
    with pytest.raises(TransportError, match="authentication failed"): ep.connect(node.address, "shm")
  with pytest.raises(ConnectionRefusedError, match="authentication failed"): raw_tcp_session(node.address, token="nope")

def test_unknown_transport_and_verbs_unavailable(node, writer):
  with pytest.raises(TransportUnavailable, match="unknown transport"): writer.connect(node.address, "pigeon")
  if available_transports()["verbs"] is not None:
    with pytest.raises(TransportUnavailable, match="verbs is unavailable"): writer.connect(node.address, "verbs")

def test_connect_to_nothing_says_so():
  with Endpoint("lonely", token=TOKEN, config=load_config(env={})) as ep:
    with pytest.raises(TransportError, match="cannot connect.*listening"): ep.connect("127.0.0.1:1", "tcp")
    with pytest.raises(TransportError, match="not host:port"): ep.connect("nonsense", "tcp")

def hostile(node, frames: list[bytes], expect_error: str | None, lands: tuple[int, bytes] | None = None):
  """Send frames over a fresh authenticated session; the node must drop it (with an ERROR frame when it can), and no byte
  may change but those of `lands` (offset, bytes): what a truncated frame delivered inside its own span."""
  if lands is not None: node.image[lands[0]:lands[0] + len(lands[1])] = np.frombuffer(lands[1], np.uint8)
  sock = raw_tcp_session(node.address)
  try:
    for f in frames: sock.sendall(f)
    if expect_error is not None:
      f = wire.recv_frame(sock)
      assert f.op == wire.ERROR
      assert expect_error in wire.recv_exact(sock, f.nbytes).decode()
    else: sock.shutdown(socket.SHUT_WR)
    sock.settimeout(10)
    assert sock.recv(1 << 16) == b""          # the node closed the session
  finally: sock.close()
  assert node.sha(node.region) == sha(node.image)

def write_frame(batch, pieces, last_total=None, flags=0):
  """A vectored WRITE frame by hand: header, piece records; the caller appends payload."""
  F = wire.Frame
  head = F(wire.WRITE, flags=flags | (wire.LAST if last_total is not None else 0), batch=batch, tag=len(pieces), offset=last_total or 0,
           nbytes=sum(n for _, _, n in pieces)).pack()
  return head + b"".join(wire.PIECE.pack(*p) for p in pieces)

def test_bad_frames_drop_only_that_peer(node, writer):
  rid, F = node.desc.region_id, wire.Frame
  hostile(node, [write_frame(1, [(rid, REMOTE_BYTES - 10, 11)])], "outside region")
  hostile(node, [write_frame(1, [(rid, 0, 8), (rid, REMOTE_BYTES, 1)])], "outside region")     # one bad piece: none of the frame lands
  hostile(node, [write_frame(1, [(rid + 1000, 0, 1)])], "not exposed")
  single = lambda region, offset, n: wire.HEADER.pack(wire.MAGIC, wire.WRITE, wire.SINGLE | wire.LAST, 0, 1, 0, region, offset, n)
  hostile(node, [single(rid, REMOTE_BYTES - 4, 5)], "outside region")           # the one-piece fast path checks bounds too
  hostile(node, [single(rid + 7, 0, 5)], "not exposed")
  hostile(node, [single(rid, 16, 64) + b"\x02" * 20], None, lands=(16, b"\x02" * 20))
  hostile(node, [write_frame(1, [(rid, 2**63, 2**63)])], "outside region")
  hostile(node, [F(wire.WRITE, batch=1, tag=1, nbytes=99).pack() + wire.PIECE.pack(rid, 0, 8)], "claims 99 bytes")
  hostile(node, [F(wire.WRITE, batch=1, tag=10**6, nbytes=1).pack()], "exceeds")
  hostile(node, [b"\x00" * wire.HEADER.size], "bad frame magic")
  hostile(node, [wire.HEADER.pack(wire.MAGIC, 99, 0, 0, 0, 0, 0, 0, 0)], "unknown frame op")
  hostile(node, [F(wire.ACK, batch=1).pack()], "unexpected ACK")
  hostile(node, [b"th\x01"], None)                                           # truncated header, then the peer leaves
  hostile(node, [write_frame(1, [(rid, 0, 64)]) + b"\x01" * 10], None, lands=(0, b"\x01" * 10))   # truncated payload stays in its span
  # lying about lengths: 16 bytes land, the batch's last frame claims 8 in all
  hostile(node, [write_frame(7, [(rid, 0, 16)], last_total=8) + node.image[:16].tobytes()], "were committed")
  hostile(node, [write_frame(3, [], last_total=5), write_frame(3, [], last_total=5)], "committed twice")
  # the node still serves a well-behaved peer
  peer = writer.connect(node.address, "tcp")
  writer.write(peer, [Span(writer.local, 0, node.desc, 100, 1000)], notify=1).wait(10)
  node.image[100:1100] = writer.local.numpy()[:1000]
  assert node.ask(cmd="notices", count=1)["notices"][0][1] == 1
  assert node.sha(node.region) == sha(node.image)
  peer.close()

KILLER = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from transport_util import raw_tcp_session
from tinyhet.runtime import wire
sock = raw_tcp_session({address!r})
sock.sendall(wire.Frame(wire.WRITE, batch=1, tag=1, nbytes={nbytes}).pack() + wire.PIECE.pack({rid}, {offset}, {nbytes}))
sock.sendall(b"\\xab" * ({nbytes} // 2))
os.kill(os.getpid(), signal.SIGKILL)
"""

def test_peer_killed_mid_write(node, writer):
  offset, nbytes = 1 << 20, 1 << 20
  before_head, before_tail = node.sha(node.region, 0, offset), node.sha(node.region, offset + nbytes, REMOTE_BYTES - offset - nbytes)
  code = KILLER.format(tests=str(pathlib.Path(__file__).parent), address=node.address, rid=node.desc.region_id, offset=offset, nbytes=nbytes)
  proc = subprocess.run([sys.executable, "-c", code], timeout=60)
  assert proc.returncode == -signal.SIGKILL
  # nothing outside the addressed span changed; the half that arrived is inside it
  assert node.sha(node.region, 0, offset) == before_head
  assert node.sha(node.region, offset + nbytes, REMOTE_BYTES - offset - nbytes) == before_tail
  node.image[offset:offset + nbytes // 2] = 0xAB
  assert node.sha(node.region, offset, nbytes // 2) == sha(node.image[offset:offset + nbytes // 2])
  # and the node keeps serving
  peer = writer.connect(node.address, "tcp")
  writer.write(peer, [Span(writer.local, 0, node.desc, offset, nbytes)], notify=9).wait(10)
  node.image[offset:offset + nbytes] = writer.local.numpy()[:nbytes]
  assert node.ask(cmd="notices", count=1)["notices"][0][1] == 9
  assert node.sha(node.region) == sha(node.image)
  peer.close()

def test_writer_sees_a_dead_receiver():
  n = MemoryNode(name="doomed")
  desc, _ = n.expose(1 << 20)
  with Endpoint("w", token=TOKEN, config=load_config(env={})) as ep:
    arena = Arena(4 << 20, "w", hugepages=False)
    r = arena.alloc(1 << 20)
    peer = ep.connect(n.address, "tcp")
    os.kill(n.pid, signal.SIGKILL)
    n.proc.wait(10)
    with pytest.raises((TransportError, TimeoutError), match="lost|broken|failed|closed"):
      for _ in range(50):
        ep.write(peer, [Span(r, 0, desc, 0, 1 << 20)]).wait(5)
        time.sleep(0.05)
  n.close()

# ---------------------------------------------------------------- two hosts: network namespaces joined by a veth pair

def netns_available() -> str | None:
  if os.geteuid() != 0: return "needs root to create network namespaces"
  if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0: return "the ip command (iproute2) cannot manage network namespaces"
  return None

@contextlib.contextmanager
def veth_hosts(tag: str, subnet: str):
  """Two network namespaces {tag}a and {tag}b joined by a veth pair, addresses {subnet}.1 and {subnet}.2; removed after.
  Skips the test (with the command that failed) where the pair cannot be built."""
  a, b = f"{tag}a", f"{tag}b"
  cmds = [f"ip netns add {a}", f"ip netns add {b}", f"ip link add {tag}x netns {a} type veth peer name {tag}y netns {b}",
          f"ip -n {a} addr add {subnet}.1/24 dev {tag}x", f"ip -n {b} addr add {subnet}.2/24 dev {tag}y",
          f"ip -n {a} link set {tag}x up", f"ip -n {b} link set {tag}y up", f"ip -n {a} link set lo up", f"ip -n {b} link set lo up"]
  try:
    for c in cmds:
      if (p := subprocess.run(c.split(), capture_output=True, text=True)).returncode != 0:
        pytest.skip(f"cannot build the veth pair ({c}): {p.stderr.strip()}")
    yield a, b
  finally:
    subprocess.run(["ip", "netns", "del", a], capture_output=True)
    subprocess.run(["ip", "netns", "del", b], capture_output=True)

@pytest.fixture
def two_hosts():
  if (why := netns_available()): pytest.skip(why)
  with veth_hosts(f"th{os.getpid() % 100000}", "10.203.0") as hosts: yield hosts

WRITER_IN_NETNS = """
import json, sys
sys.path.insert(0, {tests!r})
from tinyhet.config import load_config
from tinyhet.runtime.arena import Arena
from tinyhet.runtime.descriptor import RegionDescriptor
from tinyhet.runtime.memory_node import fill
from tinyhet.runtime.transport import Endpoint, Span
ep = Endpoint("hostA", token={token!r}, config=load_config(env={{}}))
arena = Arena(16 << 20, "a", hugepages=False)
r = arena.alloc(8 << 20)
fill(r.view(), 5)
peer = ep.connect({address!r})
d = RegionDescriptor.from_hex({desc!r})
t = ep.write(peer, [Span(r, 0, d, 0, 4 << 20), Span(r, 5 << 20, d, 4 << 20, 3 << 20)], notify=42).wait(60)
back = arena.alloc(1 << 20)
ep.read(peer, [Span(back, 0, d, 4 << 20, 1 << 20)]).wait(60)
assert bytes(back.view()) == bytes(r.view(5 << 20, 1 << 20))
print(json.dumps({{"transport": peer.transport, "seconds": t.seconds}}))
ep.close()
"""

@pytest.mark.netns
def test_two_hosts_over_veth(two_hosts):
  a, b = two_hosts
  node = MemoryNode(name="hostB", listen="10.203.0.2:7471", netns=b)
  try:
    desc, region = node.expose(8 << 20)
    code = WRITER_IN_NETNS.format(tests=str(pathlib.Path(__file__).parent), token=TOKEN, address=node.address, desc=desc.to_hex())
    out = subprocess.run(["ip", "netns", "exec", a, sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["transport"] == "tcp"      # another network namespace is another host: auto picks tcp
    assert node.ask(cmd="notices", count=1)["notices"] == [["hostA", 42, 7 << 20]]
    expect = np.empty(8 << 20, np.uint8)
    fill(memoryview(expect), 5)
    image = np.concatenate([expect[:4 << 20], expect[5 << 20:8 << 20], np.zeros(1 << 20, np.uint8)])
    assert node.sha(region, 0, 7 << 20) == sha(image[:7 << 20])
  finally: node.close()

def test_transfer_types_stand_alone_and_are_the_ones_transport_exports():
  """transfer.py (split from transport.py) imports nothing of tinyhet above runtime/, and transport.py's names are its own."""
  import ast
  from tinyhet.runtime import transfer, transport
  tree = ast.parse(pathlib.Path(transfer.__file__).read_text())
  imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
  imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
  assert all(not m.startswith("tinyhet") or m.startswith("tinyhet.runtime") for m in imported if m), imported
  for name in ("Span", "Piece", "Transfer", "Notice", "TransportError", "TransportUnavailable", "coalesce", "split", "to_pieces", "local_view"):
    assert getattr(transport, name) is getattr(transfer, name)

# ---------------------------------------------------------------- runtime/ stands alone: settings in, no tinyhet above it

def imports_above_runtime(source: str) -> list[str]:
  """The tinyhet modules outside tinyhet.runtime that source imports: import statements at any depth (module level,
  inside functions), relative imports that climb out of runtime/, and importlib.import_module / __import__ of a literal."""
  import ast
  def above(m: str) -> bool: return (m == "tinyhet" or m.startswith("tinyhet.")) and not (m == "tinyhet.runtime" or m.startswith("tinyhet.runtime."))
  found = []
  for n in ast.walk(ast.parse(source)):
    if isinstance(n, ast.Import): found += [a.name for a in n.names if above(a.name)]
    elif isinstance(n, ast.ImportFrom):
      if n.level > 1: found.append("." * n.level + (n.module or ""))         # from .. import x: the package above runtime
      elif n.level == 0 and n.module == "tinyhet": found += [f"tinyhet.{a.name}" for a in n.names if above(f"tinyhet.{a.name}")]
      elif n.level == 0 and above(n.module or ""): found.append(n.module)
    elif isinstance(n, ast.Call) and n.args and (getattr(n.func, "attr", None) or getattr(n.func, "id", None)) in ("import_module", "__import__"):
      arg = n.args[0]
      if isinstance(arg, ast.JoinedStr) and arg.values: arg = arg.values[0]      # f"tinyhet.{name}": its literal start
      if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and (above(arg.value) or arg.value == "tinyhet."): found.append(arg.value)
  return found

def test_runtime_imports_nothing_of_tinyhet_above_it():
  """runtime/ takes its settings as arguments (runtime/settings.py): no module of it may import tinyhet.config or any
  other module above it, at module level or inside a function (STYLE.md)."""
  import tinyhet.runtime
  files = sorted(pathlib.Path(tinyhet.runtime.__file__).parent.glob("*.py"))
  assert len(files) > 10, files
  assert {f.name: imports_above_runtime(f.read_text()) for f in files} == {f.name: [] for f in files}
  # the check finds each way of reaching up, so an empty answer above means something
  for bad, want in [("from tinyhet.config import load_config", ["tinyhet.config"]),
                    ("def f():\n  import tinyhet.device.memory", ["tinyhet.device.memory"]),
                    ("from tinyhet import config, runtime", ["tinyhet.config"]), ("from .. import config", [".."]),
                    ("import importlib\nimportlib.import_module('tinyhet.service.http_api')", ["tinyhet.service.http_api"]),
                    ("__import__(f'tinyhet.{x}')", ["tinyhet."]),
                    ("from tinyhet.runtime.wire import Frame\nfrom . import tcp\nimport tinyhet.runtime.spans", [])]:
    assert imports_above_runtime(bad) == want, bad

def test_endpoint_takes_its_settings_as_arguments(monkeypatch):
  from tinyhet.runtime.settings import TransportSettings
  # the environment is tinyhet.config's business: an Endpoint given nothing has the defaults, whatever TINYHET_* say
  monkeypatch.setenv("TINYHET_TRANSPORT", "pigeon")
  monkeypatch.setenv("TINYHET_TOKEN", "from-env")
  with Endpoint("plain") as ep: assert ep.settings == TransportSettings() and ep.token not in ("", "from-env")
  monkeypatch.delenv("TINYHET_TRANSPORT")
  cfg = load_config(env={"TINYHET_TOKEN": "shared", "TINYHET_TCP_STREAMS": "2", "TINYHET_TRANSPORT": "tcp"})
  with Endpoint("a", config=cfg) as a, Endpoint("b", settings=TransportSettings(token="shared", transport="tcp")) as b:
    assert a.settings == TransportSettings(token="shared", tcp_streams=2, transport="tcp") and a.token == b.token == "shared"
    peer = a.connect(b.listen())                     # the configured transport and token: tcp, with 2 streams, authenticated
    assert peer.transport == "tcp" and len(peer.link.streams) == 2
  with Endpoint("c", token="given", settings=TransportSettings(token="shared")) as c: assert c.token == "given"
  with pytest.raises(TypeError, match="settings or config, not both"): Endpoint("d", settings=TransportSettings(), config=cfg)
  with pytest.raises(TypeError, match="has no transport, token, tcp_streams"): Endpoint("e", settings=object())
  with pytest.raises(ValueError, match="tcp_streams = 0 must be between 1 and 64"): TransportSettings(tcp_streams=0)
  with pytest.raises(ValueError, match="transport = 'pigeon' is not one of auto, verbs, tcp, shm"): TransportSettings(transport="pigeon")

def test_memory_node_takes_rdma_settings_from_its_flags():
  out = subprocess.run([sys.executable, "-m", "tinyhet.runtime.memory_node", "--token", "t", "--rdma-port", "300"],
                       capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
  assert out.returncode == 2 and "rdma_port = 300 must be a port number between 1 and 255" in out.stderr and "Traceback" not in out.stderr
