"""Peer identity: a node's name is proven by its key (tinyhet.runtime.identity), against a memory node in another process.
A second peer using a bound name is refused, so is a peer that cannot sign for the key it presents, and while a name's
connections live no other key takes it; grants (an exposure's owner) hold against a peer that only claims the name;
region ids are random; bad handshake bytes are refused and the node serves the next peer."""
import json, os, socket, struct, subprocess, sys, time
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, example, given, settings, strategies as st
from tinyhet.config import ConfigError, load_config
from tinyhet.runtime import wire
from tinyhet.runtime.arena import Arena
from tinyhet.runtime.identity import Identity, transcript
from tinyhet.runtime.settings import TransportSettings
from tinyhet.runtime.transport import Endpoint, Span, TransportError, auth_message
from transport_util import MemoryNode, TOKEN

PREFILL = Identity.generate()          # the prefill node's key pair: the memory node binds "prefill0" to it

@pytest.fixture(scope="module")
def node():
  n = MemoryNode("decode0", extra=("--peer-key", f"prefill0={PREFILL.public}"))
  yield n
  n.close()

def endpoint(name: str, identity: Identity | None = None, **settings) -> Endpoint:
  return Endpoint(name, settings=TransportSettings(token=TOKEN, **settings), identity=identity)

def handshake(address: str, message) -> dict | None:
  """Send one handshake answer (a dict, or raw bytes) after the node's hello; the node's reply, or None when it hung up."""
  host, _, port = address.rpartition(":")
  with socket.create_connection((host, int(port)), timeout=10) as s:
    hello = wire.recv_json(s)
    s.sendall(message(hello) if callable(message) else message)
    try: s.shutdown(socket.SHUT_WR)       # all of it: a message cut short is dropped at once, not at the handshake deadline
    except OSError: pass                  # the node hung up already
    try: return wire.recv_json(s)
    except (ConnectionError, wire.ProtocolError, struct.error, TimeoutError): return None

def framed(obj: dict) -> bytes:
  data = json.dumps(obj).encode()
  return struct.pack("<I", len(data)) + data

def test_a_second_peer_with_the_prefill_nodes_name_is_refused(node):
  with endpoint("prefill0", PREFILL) as real, endpoint("prefill0") as impostor:
    assert real.connect(node.address, "tcp").name == "decode0"           # the key bound to the name: in
    with pytest.raises(TransportError, match="not the one bound to that name"): impostor.connect(node.address, "tcp")
    with pytest.raises(TransportError, match="not the one bound to that name"): impostor.connect(node.address, "shm")

def test_a_peer_without_the_right_key_cannot_complete_the_handshake(node):
  other = Identity.generate()
  def signed_by_another_key(hello):      # presents prefill0's public key, but signs with a key it holds
    m = auth_message(PREFILL, TOKEN, "prefill0", hello, "ctl")
    m["sig"] = other.sign(transcript("client", "prefill0", PREFILL.public, hello["node"], hello["nonce"], m["nonce"], "ctl"))
    return framed(m)
  def replayed(hello):                   # a signature of another challenge (another nonce) of the same node
    m = auth_message(PREFILL, TOKEN, "prefill0", {**hello, "nonce": wire.new_nonce()}, "ctl")
    m["proof"] = wire.proof(TOKEN, hello["nonce"], "client", "prefill0")
    return framed(m)
  for forge in (signed_by_another_key, replayed):
    assert "did not sign this challenge" in handshake(node.address, forge)["error"]
  assert "error" not in handshake(node.address, lambda hello: framed(auth_message(PREFILL, TOKEN, "prefill0", hello, "ctl")))

def test_a_node_answering_under_a_bound_name_with_another_key_is_refused(node):
  # the client side of the same rule: a writer that binds "decode0" to a key refuses a node that cannot sign with it
  with endpoint("w", peer_keys={"decode0": Identity.generate().public}) as ep:
    with pytest.raises(TransportError, match="another key than the one peer_keys binds"): ep.connect(node.address, "tcp")
  with endpoint("w2", peer_keys={"decode0": node.public_key}) as ep: assert ep.connect(node.address, "tcp").name == "decode0"

def test_two_live_connections_cannot_hold_one_name(node):
  with endpoint("writer-a") as first:
    peer = first.connect(node.address, "tcp")
    with endpoint("writer-a") as second:
      with pytest.raises(TransportError, match="held by another live connection"): second.connect(node.address, "tcp")
      peer.close()                          # the name is free once its connections are gone (the node notices the close)
      deadline = time.monotonic() + 10
      while True:
        try:
          second.connect(node.address, "tcp")
          break
        except TransportError as e:
          if "held by another" not in str(e) or time.monotonic() > deadline: raise

def test_a_grant_for_one_peer_is_refused_to_another(node):
  desc, region = node.expose(1 << 16, owner="prefill0", allowed=[[4096, 8192]], access="write")
  arena = Arena(1 << 20, "grant-writer", hugepages=False)
  src = arena.alloc(1 << 16)
  np.frombuffer(src.view(), np.uint8)[:] = 7
  before = node.sha(region)
  with endpoint("prefill0", PREFILL) as owner, endpoint("mallory") as other:
    for ep in (owner, other): ep.register(arena)
    mallory = other.connect(node.address, "tcp")
    with pytest.raises(TransportError, match="not exposed to mallory"): other.write(mallory, [Span(src, 0, desc, 4096, 8192)]).wait(10)
    assert node.sha(region) == before                                    # no byte of it landed
    owner.write(owner.connect(node.address, "tcp"), [Span(src, 0, desc, 4096, 8192)]).wait(10)
    assert node.sha(region, 4096, 8192) != node.sha(region, 0, 8192)   # the owner's did

AS_NOBODY = """
import encodings.idna, json, os, socket, sys  # noqa: F401
from tinyhet.runtime import shm, tcp, wire  # noqa: F401  (imported while this process can still read the venv)
from tinyhet.runtime.settings import TransportSettings
from tinyhet.runtime.transport import Endpoint, TransportError, auth_message
address, token = sys.argv[1:]
ep = Endpoint("nobody-writer", settings=TransportSettings(token=token))
os.setegid(65534)
os.seteuid(65534)
out = {}
try: out["shm"] = ep.connect(address, "shm").transport
except TransportError as e: out["shm"] = str(e)
host, _, port = address.rpartition(":")
with socket.create_connection((host, int(port)), timeout=10) as s: hello = wire.recv_json(s)
with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as u:     # a client that asks for shm anyway
  u.connect(hello["unix"])
  unix_hello = wire.recv_json(u)
  wire.send_json(u, auth_message(ep.identity, token, "nobody-writer", unix_hello, "shm"))
  out["asked"] = wire.recv_json(u).get("error")
out["auto"] = ep.connect(address).transport
print(json.dumps(out), flush=True)
os._exit(0)
"""

@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another user (nobody)")
def test_shm_is_refused_to_another_user_and_auto_takes_tcp(node):
  """shm hands a peer the arenas' memfds, a fence no grant can narrow: only a process of the same user (which could read
  this one's memory anyway) gets them. The same host and another user: refused with the fix, and auto picks tcp."""
  got = json.loads(subprocess.run([sys.executable, "-c", AS_NOBODY, node.address, TOKEN], capture_output=True, text=True, timeout=60,
                                  check=True).stdout)
  assert "same host and user" in got["shm"] and got["auto"] == "tcp"
  assert got["asked"] == "shm is served to processes of user 0 only (the peer runs as 65534): use tcp"
  with endpoint("root-writer") as ep:
    assert ep.connect(node.address).transport == "shm"
    assert any(line.startswith("shm: served only to processes of this user") for line in ep.guarantees())

def test_region_ids_are_not_guessable(node):
  ids = [node.expose(4096)[0].region_id for _ in range(32)]
  assert len(set(ids)) == len(ids) and all(0 < i < 1 << 63 for i in ids)
  assert not any(b - a == 1 for a, b in zip(ids, ids[1:]))               # not a counter
  assert max(ids) - min(ids) > 1 << 48                                   # spread over the 63-bit space, not a small range

JSONISH = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=20), lambda c: st.lists(c, max_size=3)
                       | st.dictionaries(st.text(max_size=8), c, max_size=3), max_leaves=8)
AUTH_KEYS = ("node", "transport", "nonce", "key", "sig", "proof", "session", "stream", "streams")
FIELDS = st.fixed_dictionaries({}, optional={k: JSONISH for k in AUTH_KEYS})

@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(garbage=st.one_of(st.binary(max_size=64), FIELDS.map(framed), st.binary(max_size=32).map(lambda b: struct.pack("<I", len(b)) + b)))
def test_bad_handshake_bytes_are_refused_and_the_node_goes_on(node, garbage):
  reply = handshake(node.address, garbage)
  assert reply is None or "error" in reply                                # never an OK
  assert "error" not in handshake(node.address, lambda hello: framed(auth_message(PREFILL, TOKEN, "prefill0", hello, "ctl")))

@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(AUTH_KEYS[:6]), value=JSONISH)
@example(field="proof", value="\x80")              # non-ASCII: hmac.compare_digest raised TypeError on it, the node dropped the link
@example(field="proof", value="\ud800")            # a lone surrogate, as JSON can carry
def test_a_good_handshake_with_any_one_field_changed_is_refused(node, field, value):
  def changed(hello):
    good = auth_message(PREFILL, TOKEN, "prefill0", hello, "ctl")
    assume(good[field] != value)
    return framed({**good, field: value})
  assert "authentication failed" in handshake(node.address, changed)["error"]

def test_key_files_and_peer_keys_in_the_config(tmp_path):
  path = str(tmp_path / "node.key")
  made = subprocess.run([sys.executable, "-m", "tinyhet", "keygen", "--out", path], capture_output=True, text=True, timeout=60)
  me = Identity.load(path)                                   # `tinyhet keygen`: the private key to the file, the public key printed
  assert made.returncode == 0 and made.stdout.strip() == me.public and os.stat(path).st_mode & 0o777 == 0o600
  again = subprocess.run([sys.executable, "-m", "tinyhet", "keygen", "--out", path], capture_output=True, text=True, timeout=60)
  assert again.returncode == 2 and "is never overwritten" in again.stderr and Identity.load(path).public == me.public
  os.chmod(path, 0o644)
  with pytest.raises(ValueError, match="readable by others: chmod 600"): Identity.load(path)
  with pytest.raises(ConfigError, match="peer_keys"): load_config(env={"TINYHET_PEER_KEYS": "a=nothex"})
  assert load_config(env={"TINYHET_PEER_KEYS": f"a={me.public}"}).peer_keys == {"a": me.public}
  cluster = tmp_path / "cluster.toml"
  cluster.write_text(f'[nodes.spark]\ndevice = "dgx-spark"\nrole = "prefill"\naddress = "10.0.0.1:7471"\npublic_key = "{me.public}"\n'
                     '[nodes.mac]\ndevice = "m3-ultra"\nrole = "decode"\naddress = "10.0.0.2:7470"\n'
                     '[[links]]\nnodes = ["spark", "mac"]\nbandwidth_gbit_s = 10\n')
  cfg = load_config(env={"TINYHET_CLUSTER": str(cluster)})
  assert cfg.peer_keys == {"spark": me.public} and cfg.trusted_writers == ("spark",)
  assert load_config(env={"TINYHET_CLUSTER": str(cluster), "TINYHET_TRUSTED_WRITERS": ""}).trusted_writers == ()
  assert load_config(env={}).trusted_writers is None
  from tinyhet.planner.catalog import ClusterFileError
  from tinyhet.planner.cluster_file import load_cluster
  assert {n.name for n in load_cluster(cluster).nodes} == {"spark", "mac"}                # the planner and the router read it too
  cluster.write_text(cluster.read_text().replace(me.public, "abc"))
  with pytest.raises(ClusterFileError, match="nodes.spark.public_key"): load_cluster(cluster)
  with pytest.raises(ConfigError, match="nodes.spark.public_key"): load_config(env={"TINYHET_CLUSTER": str(cluster)})

# ---------------------------------------------------------------- on a decode node (tests/decode_util.py) and a prefill node

def test_an_intruder_under_a_writers_name_is_refused_while_the_writer_is_connected(guarded_node):
  from decode_util import TOKEN as DECODE_TOKEN, Writer
  w = Writer("kv-owner", guarded_node.address)
  try:
    r = w.reserve()
    with Endpoint("kv-owner", token=DECODE_TOKEN) as intruder:       # today's name check alone would let it write into r's blocks
      with pytest.raises(TransportError, match="held by another live connection"): intruder.connect(guarded_node.address, "tcp")
    w.ctl.call("decode.release", seq_id=r["seq_id"])
  finally: w.close()

def test_a_prefill_node_writes_only_what_the_decode_node_granted_it_for_this_prompt(guarded_node):
  """A reservation the router passes on is signed by the decode node (tinyhet.kv.grants): for one writer, one prompt and its
  own descriptors. A caller that hands a prefill node another prompt, another reservation's descriptors or grant, or a
  reservation for another writer is refused before any byte is written, and the node serves the next job."""
  import threading
  from decode_util import TOKEN as DECODE_TOKEN
  from test_e2e import SMALL
  from tinyhet.device.memory import LocalNode
  from tinyhet.kv.grants import check_grant
  from tinyhet.model.llama import Llama, random_weights, small_config
  from tinyhet.runtime.control import ControlClient, ControlError
  from tinyhet.service.prefill_node import PrefillNode
  node = LocalNode(load_config(env={}, token=DECODE_TOKEN, node="identity-prefill", arena_bytes=64 << 20))
  cfg = small_config(**SMALL)
  prefill = PrefillNode(Llama(cfg, random_weights(cfg, device="CPU", seed=7), "CPU"), node, "small-random", "tcp", staging_buffers=0)
  address = node.serve()
  with Endpoint("identity-router", token=DECODE_TOKEN) as router:
    decode, asked = ControlClient(router, guarded_node.address), ControlClient(router, address)
    try:
      prompt, other_prompt = [3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8]
      r = decode.call("decode.reserve", prompt_ids=prompt, max_new_tokens=2, timeout=10, writer="identity-prefill")
      other = decode.call("decode.reserve", prompt_ids=other_prompt, max_new_tokens=2, timeout=10, writer="identity-prefill")
      for_someone_else = decode.call("decode.reserve", prompt_ids=prompt, max_new_tokens=2, timeout=10, writer="another-prefill")
      decode_key = router.connect(guarded_node.address, "tcp").key
      check_grant("guarded-decode", decode_key, "identity-prefill", r, prompt)              # the real one holds
      forged = [(r, prompt[::-1]), ({**r, "pools": other["pools"]}, prompt), ({**other, "grant": r["grant"]}, other_prompt),
                (for_someone_else, prompt)]
      for reservation, ids in forged:
        reply = {}
        def ask():
          try: asked.call("prefill.run", prompt_ids=ids, decode=guarded_node.address, reservation=reservation, timeout=60)
          except ControlError as e: reply["error"] = str(e)
        t = threading.Thread(target=ask)
        t.start()
        prefill.run_one(timeout=30)                     # this thread is the model's, as a node's main thread is
        t.join(30)
        assert "was not granted" in reply.get("error", ""), reply
      assert decode.call("decode.info")["open_sequences"] == 3                             # nothing was written or released by them
    finally:
      decode.close()
      asked.close()
      prefill.close()
      node.endpoint.close()

def test_the_reservation_keeps_its_proven_writer_and_whether_it_is_trusted(guarded_node):
  """What the prefix cache reads: a sequence's extra["writer"] is the proven name of the only peer whose writes land in
  its blocks (the reserver, or the writer it names), extra["trusted_writer"] whether the node's trusted_writers (here
  TINYHET_TRUSTED_WRITERS; default the cluster file's prefill nodes) names it."""
  from decode_util import TRUSTED_WRITER, Writer
  w = Writer("writers-router", guarded_node.address)
  try:
    own = w.reserve(prompt=(1, 2, 3))["seq_id"]
    named = w.ctl.call("decode.reserve", prompt_ids=[1, 2], max_new_tokens=1, writer=TRUSTED_WRITER)["seq_id"]
    assert w.ctl.call("test.writer", seq_id=named) == {"writer": TRUSTED_WRITER, "trusted_writer": True}
    assert w.ctl.call("test.writer", seq_id=own) == {"writer": "writers-router", "trusted_writer": False}
  finally: w.close()
