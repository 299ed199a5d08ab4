"""The control channel against bad input, with a real node in another process (tinyhet.serve())."""
import os, socket, struct, subprocess, sys
import pytest
from tinyhet.config import load_config
from tinyhet.runtime import wire
from tinyhet.runtime.control import ControlClient, ControlError
from tinyhet.runtime.transport import Endpoint, TransportError
from transport_util import raw_auth

TOKEN = "ctl-token"

@pytest.fixture(scope="module")
def node():
  env = {**os.environ, "TINYHET_TOKEN": TOKEN, "TINYHET_NODE": "ctlnode", "TINYHET_ARENA_BYTES": "64M"}
  proc = subprocess.Popen([sys.executable, "-c", "import sys, tinyhet; print(tinyhet.serve(), flush=True); sys.stdin.read()"],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
  yield proc.stdout.readline().strip()
  proc.stdin.close()
  proc.wait(30)

@pytest.fixture
def ep():
  with Endpoint("ctl-client", token=TOKEN, config=load_config(env={})) as e: yield e

def raw_ctl(address: str) -> socket.socket:
  host, _, port = address.rpartition(":")
  s = socket.create_connection((host, int(port)), timeout=10)
  wire.send_json(s, raw_auth(wire.recv_json(s), "raw", "ctl", TOKEN))
  assert "error" not in wire.recv_json(s)
  return s

@pytest.mark.parametrize("garbage", [struct.pack("<I", 2**31), struct.pack("<I", 5) + b"\xff\xfe{[(", struct.pack("<I", 2) + b"[]",
                                     struct.pack("<I", 8) + b"12345678", b"\x01"])
def test_garbage_drops_only_that_connection(node, ep, garbage):
  s = raw_ctl(node)
  s.sendall(garbage)
  if len(garbage) > 1:
    s.settimeout(10)
    assert s.recv(1 << 16) == b""                      # dropped
  s.close()
  c = ControlClient(ep, node)                          # the node still serves
  assert "desc" in c.call("mem.alloc", nbytes=4096)
  c.close()

def test_bad_requests_get_error_replies_and_the_connection_stays(node, ep):
  c = ControlClient(ep, node)
  try:
    with pytest.raises(ControlError, match="unknown request 'nope'"): c.call("nope")
    with pytest.raises(ControlError, match="positive integer"): c.call("mem.alloc", nbytes=-5)
    with pytest.raises(ControlError, match="positive integer"): c.call("mem.alloc", nbytes="lots")
    with pytest.raises(ControlError, match="TypeError"): c.call("mem.alloc", nbytes=1, color="red")
    with pytest.raises(ControlError, match=r"cannot allocate .* bytes free.*TINYHET_ARENA_BYTES"): c.call("mem.alloc", nbytes=1 << 40)
    with pytest.raises(ControlError, match="was not allocated by"): c.call("mem.free", region_id=999999)
    assert "desc" in c.call("mem.alloc", nbytes=100)   # still usable
  finally: c.close()

def test_a_peer_that_leaves_gives_its_memory_back(node, ep):
  big = 48 << 20                                        # of a 64 MiB arena: two at once do not fit
  a = ControlClient(ep, node)
  a.call("mem.alloc", nbytes=big)
  b = ControlClient(ep, node)
  with pytest.raises(ControlError, match="cannot allocate"): b.call("mem.alloc", nbytes=big)
  a.close()
  for _ in range(50):                                   # the node frees a's regions once it sees the connection close
    try:
      b.call("mem.alloc", nbytes=big)
      break
    except ControlError: __import__("time").sleep(0.1)
  else: pytest.fail("the departed peer's memory was not freed")
  b.close()

def test_wrong_token_gets_no_control(node):
  with Endpoint("intruder", token="wrong", config=load_config(env={})) as e:
    with pytest.raises(TransportError, match="authentication failed"): ControlClient(e, node)

def test_an_allocation_is_writable_only_by_the_peer_that_made_it(node, ep):
  from tinyhet.runtime.arena import Arena
  from tinyhet.runtime.descriptor import RegionDescriptor
  from tinyhet.runtime.transport import Span
  c = ControlClient(ep, node)
  desc = RegionDescriptor.from_hex(c.call("mem.alloc", nbytes=4096)["desc"])
  arena = Arena(1 << 20, "other", hugepages=False)
  src = arena.alloc(4096)
  try:
    with Endpoint("other-peer", token=TOKEN, config=load_config(env={})) as other:
      other.register(arena)
      peer = other.connect(node, "tcp")
      with pytest.raises(TransportError): other.write(peer, [Span(src, 0, desc, 0, 4096)]).wait(10)
    peer = ep.connect(node, "tcp")                      # the allocating peer itself may
    ep.register(arena)
    ep.write(peer, [Span(src, 0, desc, 0, 4096)]).wait(10)
  finally:
    c.close()
    src.free()
    arena.close()

def test_a_request_begun_now_is_answered_when_its_reply_is_read(node, ep):
  """begin sends a request and returns at once; result() reads its reply (the same as call's, read once, kept); a failed
  request raises from result(), every time; another thread's call meanwhile waits for it, then gets its own reply."""
  import threading
  c = ControlClient(ep, node)
  try:
    pending = c.begin("mem.alloc", nbytes=4096)
    assert c.lock.locked()                              # no other request until its reply is read
    other = {}
    t = threading.Thread(target=lambda: other.setdefault("reply", c.call("mem.alloc", nbytes=8192)))
    t.start()
    reply = pending.result()
    assert "desc" in reply and pending.result() is reply
    t.join(10)
    assert "desc" in other["reply"]
    bad = c.begin("mem.alloc", nbytes=-1)
    for _ in range(2):
      with pytest.raises(ControlError, match="positive integer"): bad.result()
    assert "desc" in c.call("mem.alloc", nbytes=100)    # still in step
  finally: c.close()
