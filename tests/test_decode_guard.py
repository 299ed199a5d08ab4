"""A decode node that no single peer or request can stop, with a real node process (small random model): reservations
isolated from each other, notices checked, blocks reused only when no write can land, bad sampling refused at the request,
cancellation, and a long-lived connection whose bookkeeping stays flat."""
import math, time
import pytest
from tinyhet.kv.notices import notice_value
from tinyhet.runtime.control import ControlError
from tinyhet.runtime.transport import TransportError
from decode_util import Writer, clean_request, generate, kv_bytes, writer_when_free
from test_e2e import SMALL

@pytest.fixture
def node(guarded_node): return guarded_node

@pytest.fixture
def alice(node):
  w = writer_when_free("alice", node.address)      # the last test's alice (another key) may still be let go of
  yield w
  w.close()

def settle(w: Writer, within: float = 60.0, **want) -> dict:
  """decode.info once it shows `want` (the node frees what a closed connection held in the background)."""
  deadline = time.monotonic() + within
  while True:
    info = w.ctl.call("decode.info")
    if all(info[k] == v for k, v in want.items()) or time.monotonic() > deadline: return info
    time.sleep(0.05)

def test_a_reservation_is_writable_only_by_its_peer_and_only_in_its_blocks(node, alice):
  mallory = writer_when_free("mallory", node.address)
  try:
    ra, rm = alice.reserve(), mallory.reserve()
    bb, before = ra["block_bytes"], alice.ctl.call("test.digest")["blocks"]
    mallory.fill(b"\xee" * bb)
    with pytest.raises(TransportError):                                   # its own descriptor, at alice's block: refused
      mallory.write(rm["pools"][0], [ra["blocks"][0]], bb).wait(10)
    mallory.reconnect()                                                   # a protocol breach costs the breaker its session
    with pytest.raises(TransportError):                                   # alice's descriptor, stolen: refused
      mallory.write(ra["pools"][0], ra["blocks"][:1], bb).wait(10)
    mallory.reconnect()
    assert alice.ctl.call("test.digest")["blocks"] == before, "bytes outside mallory's reservation changed"
    mallory.write(rm["pools"][1], rm["blocks"], bb).wait(10)              # its own blocks: fine
    alice.ctl.call("decode.release", seq_id=ra["seq_id"])
    alice.fill(b"\x11" * bb)
    with pytest.raises(TransportError):                                   # released: its descriptors are withdrawn
      alice.write(ra["pools"][0], ra["blocks"][:1], bb).wait(10)
  finally: mallory.close()

def test_notices_count_only_real_layers_from_the_reserving_peer(node, alice):
  mallory = writer_when_free("mallory", node.address)
  try:
    alice.fill(kv_bytes(4096))
    rejected = alice.ctl.call("decode.info")["rejected_notices"]
    r = alice.reserve()
    alice.write_layers(r, [0])
    alice.write(r["pools"][0], r["blocks"][:1], r["block_bytes"], notice_value(r["seq_id"], 200)).wait(10)   # no layer 200
    with pytest.raises(ControlError, match="1 of 2 layers"): generate(alice, r, timeout=1)
    r = alice.reserve()
    alice.write_layers(r, [0])
    rm = mallory.reserve()                                                # mallory's notice names alice's sequence
    mallory.write(rm["pools"][1], rm["blocks"], rm["block_bytes"], notice_value(r["seq_id"], 1)).wait(10)
    with pytest.raises(ControlError, match="1 of 2 layers"): generate(alice, r, timeout=1)
    assert alice.ctl.call("decode.info")["rejected_notices"] == rejected + 2
  finally: mallory.close()

def test_a_layer_sent_in_pieces_lands_once_every_piece_has_and_bad_pieces_are_refused(node, alice):
  # format-2 notices (tinyhet.kv.notices): a chunked prefill sends a layer's blocks piece by piece. Refused: a piece past
  # the layer's last one, a second, different last one; the sequence waits while a piece is missing. Then the reference
  # request with each layer in two pieces (last first) gives the tokens of the same request sent layer by layer
  want = clean_request(alice)
  rejected = alice.ctl.call("decode.info")["rejected_notices"]
  r = alice.reserve(prompt=(5, 4, 3, 2, 1, 9, 8), new=6)
  sid, b, bb = r["seq_id"], r["blocks"], r["block_bytes"]
  assert len(b) == 2
  alice.fill(kv_bytes(len(b) * bb, seed=1))
  alice.write(r["pools"][0], b[1:], bb, notice_value(sid, 0, 1, True), first=1).wait(10)   # the last piece may come first
  alice.write(r["pools"][0], b[1:], bb, notice_value(sid, 0, 2, False), first=1).wait(10)  # past the last piece: refused
  alice.write(r["pools"][0], b[:1], bb, notice_value(sid, 0, 0, True)).wait(10)         # a second, different last: refused
  alice.write_layers(r, [1])
  with pytest.raises(ControlError, match="1 of 2 layers"): generate(alice, r, timeout=1)   # layer 0's piece 0 never came
  assert alice.ctl.call("decode.info")["rejected_notices"] == rejected + 2
  r = alice.reserve(prompt=(5, 4, 3, 2, 1, 9, 8), new=6)
  sid, b = r["seq_id"], r["blocks"]
  for layer in range(SMALL["n_layers"]):
    alice.write(r["pools"][layer], b[1:], bb, notice_value(sid, layer, 1, True), first=1).wait(10)
    alice.write(r["pools"][layer], b[:1], bb, notice_value(sid, layer, 0, False)).wait(10)
  assert generate(alice, r, timeout=10) == want
  assert alice.ctl.call("decode.info")["rejected_notices"] == rejected + 2

def test_shm_blocks_come_back_only_when_the_writer_is_done(node):
  w = Writer("shm-writer", node.address, "shm")
  try:
    total = w.ctl.call("decode.info")["kv_blocks"]
    w.fill(kv_bytes(4096))
    r = w.reserve()
    w.write_layers(r, [0])                   # a writer that the node cannot fence might still be copying layer 1
    w.ctl.call("decode.release", seq_id=r["seq_id"])
    info = w.ctl.call("decode.info")
    assert info["held_for_writers"] == 1 and info["free_blocks"] == total - len(r["blocks"])
    w.peer.close()                           # its shm connection closes: nothing more can land
    assert settle(w, held_for_writers=0, free_blocks=total)["free_blocks"] == total
    w.peer = w.ep.connect(node.address, "shm")
    r = w.reserve()
    w.write_layers(r, [0])
    w.ctl.call("decode.release", seq_id=r["seq_id"], writes_done=True)   # the writer waited for its writes: reused at once
    assert w.ctl.call("decode.info")["free_blocks"] == total
  finally: w.close()

@pytest.mark.parametrize("temperature, top_p", [(math.nan, 1.0), (math.inf, 1.0), (-0.5, 1.0), (1e-320, 1.0), (0.7, 0.0), (0.7, 1.5),
                                                (0.7, math.nan), ("hot", 1.0)])
def test_bad_sampling_is_refused_at_the_request(node, alice, temperature, top_p):
  alice.fill(kv_bytes(4096))
  r = alice.reserve()
  alice.write_layers(r, range(SMALL["n_layers"]))
  with pytest.raises(ControlError, match="temperature|top_p") as e: generate(alice, r, temperature=temperature, top_p=top_p, timeout=5)
  assert str(e.value).startswith(("temperature", "top_p")), f"not in the user's words: {e.value}"   # no node name, request or type
  assert len(clean_request(alice)) == 6    # the node still decodes (max_new_tokens 6, the first one included)

def test_non_finite_logits_fail_that_sequence_not_the_node(node, alice):
  want = clean_request(alice)
  r = alice.reserve()
  alice.fill(b"\x7e" * 4096)                 # float16 0x7e7e: NaN keys and values, so NaN logits
  alice.write_layers(r, range(SMALL["n_layers"]))
  with pytest.raises(ControlError, match="non-finite logits"): generate(alice, r, temperature=0.7, timeout=10)
  assert clean_request(alice) == want

def test_cancelling_a_stream_frees_it_and_keeps_the_connection_in_step(node, alice):
  total = alice.ctl.call("decode.info")["kv_blocks"]
  alice.fill(kv_bytes(4096))
  r = alice.reserve(new=100)
  alice.write_layers(r, range(SMALL["n_layers"]))
  stream = alice.ctl.stream("decode.generate", seq_id=r["seq_id"], first_token=7, timeout=10)
  assert "token" in next(stream) and "token" in next(stream)
  stream.close()                             # the client walks away: a cancel, and the rest of the stream is read
  info = alice.ctl.call("decode.info")       # the next reply answers this request, not a stale token
  assert "kv_blocks" in info and info["connection_sequences"] == 0
  assert settle(alice, free_blocks=total, open_sequences=0)["free_blocks"] == total
  bob = Writer("bob", node.address)          # a client that is simply gone mid-stream
  try:
    bob.fill(kv_bytes(4096))
    r = bob.reserve(new=100)
    bob.write_layers(r, range(SMALL["n_layers"]))
    stream = bob.ctl.stream("decode.generate", seq_id=r["seq_id"], first_token=7, timeout=10)
    next(stream)
    bob.ctl.sock.close()
    assert settle(alice, free_blocks=total, open_sequences=0)["free_blocks"] == total
  finally: bob.close()

def test_two_thousand_requests_on_one_connection_keep_memory_flat(node, alice):
  alice.fill(kv_bytes(4096))
  t0, rss = time.monotonic(), {}
  for i in range(2000):
    r = alice.reserve(prompt=(1, 2, 3), new=2)
    alice.write_layers(r, range(SMALL["n_layers"]))
    assert len(generate(alice, r, timeout=10)) == 2
    if i + 1 in (200, 2000): rss[i + 1] = node.rss()
    assert time.monotonic() - t0 < 120, f"only {i} requests in 120 s"
  info = alice.ctl.call("decode.info")
  assert info["connection_sequences"] == 0 and info["connection_cleanups"] == 1 and info["open_sequences"] == 0
  assert rss[2000] - rss[200] < 4 << 20, f"RSS grew by {(rss[2000] - rss[200]) >> 10} KiB over 1,800 requests"
