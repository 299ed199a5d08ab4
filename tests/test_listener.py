"""The listener against peers that try to use it up, with a real node process: file descriptors run out, a client
trickles its handshake, unauthenticated connections pile up. After each, a normal client is served."""
import socket, time
import pytest
from tinyhet.config import load_config
from tinyhet.runtime import wire
from tinyhet.runtime.control import ControlClient
from tinyhet.runtime.transport import Endpoint
from transport_util import MemoryNode, TOKEN, raw_auth

def raw_ctl(address: str, timeout: float) -> socket.socket:
  """An authenticated control connection, or TimeoutError when the node does not get to it in time."""
  host, _, port = address.rpartition(":")
  s = socket.create_connection((host, int(port)), timeout=timeout)
  try:
    wire.send_json(s, raw_auth(wire.recv_json(s), "hog", "ctl"))
    assert "error" not in wire.recv_json(s)
  except BaseException:
    s.close()
    raise
  return s

def served(address: str, within: float) -> bool:
  """Whether a normal client gets a control connection within `within` seconds (retrying: the node may be backing off)."""
  deadline = time.monotonic() + within
  with Endpoint("normal", token=TOKEN, config=load_config(env={})) as ep:
    while time.monotonic() < deadline:
      try:
        ControlClient(ep, address).close()
        return True
      except Exception: time.sleep(0.2)
  return False

def exhaust_then_recover(node, attempts: int, timeout: float, errors: tuple, refusals: int, what: str):
  """Open authenticated connections until `refusals` of them fail with `errors` (the node out of some resource), which must
  happen within `attempts`; the node must stay up, and serve again once they are closed."""
  hogs, refused = [], 0
  try:
    for _ in range(attempts):
      try: hogs.append(raw_ctl(node.address, timeout=timeout))
      except errors:
        refused += 1
        if refused == refusals: break
    else: pytest.fail(f"the node accepted {attempts} connections {what}")
    assert node.proc.poll() is None
    for s in hogs: s.close()
    assert served(node.address, 10), f"after running out ({what}) the node never accepted again"
  finally:
    for s in hogs: s.close()
    node.close()

def test_running_out_of_fds_is_a_pause_not_the_end():
  # authenticated connections until the node cannot accept (EMFILE)
  exhaust_then_recover(MemoryNode(extra=("--max-fds", "48")), 100, 1.0, (TimeoutError, OSError), 1, "under a 48-fd limit")

def test_no_thread_to_serve_a_peer_is_a_pause_not_the_end():
  # room for a few 8 MiB thread stacks, no more: connections until the node cannot start a thread for the next one
  exhaust_then_recover(MemoryNode(extra=("--spare-address-space", str(48 << 20))), 60, 2.0, (TimeoutError, OSError, wire.ProtocolError), 3,
                       "in 48 MiB of spare address space")

def test_a_trickled_handshake_is_dropped_at_one_deadline():
  node = MemoryNode(extra=("--handshake-timeout", "2"))
  try:
    host, _, port = node.address.rpartition(":")
    s = socket.create_connection((host, int(port)), timeout=10)
    wire.recv_json(s)
    t0, dropped = time.monotonic(), False
    for byte in b"\x40\x00\x00\x00" + b"{" * 60:    # a byte every 0.5 s: each recv is quick, the handshake never ends
      try: s.sendall(bytes([byte]))
      except OSError:
        dropped = True
        break
      s.settimeout(0.5)
      try:
        if s.recv(1) == b"":
          dropped = True
          break
      except TimeoutError: pass
      if time.monotonic() - t0 > 8: break
    s.close()
    assert dropped and time.monotonic() - t0 < 5, "a client trickling its handshake was not dropped at the deadline"
    assert served(node.address, 5)
  finally: node.close()

def test_unauthenticated_connections_are_capped():
  node = MemoryNode(extra=("--max-unauthenticated", "4", "--handshake-timeout", "3"))
  idle = []
  try:
    host, _, port = node.address.rpartition(":")
    for _ in range(4):                         # these take the four handshake places and say nothing
      idle.append(socket.create_connection((host, int(port)), timeout=5))
      wire.recv_json(idle[-1])
    extra = socket.create_connection((host, int(port)), timeout=5)
    assert extra.recv(1) == b"", "a connection past the cap got a handshake"
    extra.close()
    assert served(node.address, 8), "once the idle ones hit the deadline, a normal client is served"
  finally:
    for s in idle: s.close()
    node.close()
