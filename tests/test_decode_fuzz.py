"""Fuzz and chaos against a live decode node (small random model), bounded in time: hypothesis over the control requests
and over raw wire frames, then random cancellations and disconnects mid-transfer. After each: the node holds nothing
(blocks, descriptors, registered memory back where they started), no byte outside a reservation changed, and a clean
request still gets the reference tokens."""
import time
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings, strategies as st
from tinyhet.kv.notices import notice_value
from tinyhet.runtime import wire
from tinyhet.runtime.control import ChannelBroken, ControlClient, ControlError
from tinyhet.runtime.wire import HEADER, MAGIC, PIECE
from decode_util import Writer, clean_request, kv_bytes
from transport_util import raw_tcp_session
from test_e2e import SMALL, TOKEN

# no shrinking: each example costs real round trips, and a failing one is printed as found (bounded time over minimal examples)
FUZZ = settings(max_examples=150, deadline=None, phases=(Phase.explicit, Phase.reuse, Phase.generate),
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

@pytest.fixture(scope="module")
def checker(guarded_node):
  w = Writer("checker", guarded_node.address)
  idle = w.ctl.call("decode.info")
  state = {"free_blocks": idle["kv_blocks"], "open_sequences": 0, "held_for_writers": 0, "exposed_regions": 0}
  w.reference, w.idle, w.arena_in_use = clean_request(w), state, w.ctl.call("test.digest")["arena_in_use"]
  yield w
  w.close()

def assert_back_to_idle(w: Writer, within: float = 60.0):
  """Everything a request held is given back (the node frees a closed connection's sequences in the background)."""
  deadline = time.monotonic() + within
  while True:
    info = w.ctl.call("decode.info")
    now = {k: info[k] for k in w.idle}
    if now == w.idle and w.ctl.call("test.digest")["arena_in_use"] == w.arena_in_use: return
    if time.monotonic() > deadline: pytest.fail(f"the node did not go back to idle: {now}, expected {w.idle}")
    time.sleep(0.05)

def outside(digest: dict, blocks) -> list:
  mine = set(blocks)
  return [[h for b, h in enumerate(layer) if b not in mine] for layer in digest["blocks"]]

# ---------------------------------------------------------------- control requests

json_values = st.recursive(st.none() | st.booleans() | st.integers(-3, 300) | st.integers() | st.floats() | st.text(max_size=6),
                           lambda c: st.lists(c, max_size=5) | st.dictionaries(st.text(max_size=4), c, max_size=3), max_leaves=10)
ARG_NAMES = ["prompt_ids", "max_new_tokens", "timeout", "seq_id", "first_token", "temperature", "top_p", "seed", "stop_ids",
             "return_logits", "writes_done", "nbytes", "region_id", "color"]
requests = st.tuples(st.sampled_from(["decode.info", "decode.reserve", "decode.generate", "decode.release", "mem.alloc", "mem.free",
                                      "cancel", "nope", 7, None]),
                     st.dictionaries(st.sampled_from(ARG_NAMES), json_values, max_size=6))
plausible_reserve = st.fixed_dictionaries({"prompt_ids": st.lists(st.integers(-1, 300), min_size=0, max_size=12),
                                           "max_new_tokens": st.integers(-1, 130)}).map(lambda a: ("decode.reserve", a))

def bounded(op, args: dict) -> dict:
  # a valid timeout is cut to 0.3 s so that a request that waits (for layers never written) ends quickly; invalid ones stay
  t = args.get("timeout", 1.0)
  if op in ("decode.reserve", "decode.generate") and isinstance(t, (int, float)) and not isinstance(t, bool) and 0 < t <= 3600:
    args["timeout"] = 0.3
  return args

@FUZZ
@given(st.lists(st.one_of(requests, plausible_reserve), min_size=1, max_size=4))
def test_fuzzed_control_requests_never_break_the_node(guarded_node, checker, reqs):
  c = ControlClient(checker.ep, guarded_node.address)
  try:
    for op, args in reqs:
      try: c.call(op, reply_timeout=10, **bounded(op, dict(args)))
      except ControlError: pass               # an error reply: fine; ChannelBroken (the connection died) fails the test
      except ChannelBroken as e: pytest.fail(f"{op} {args}: the node dropped the control connection: {e}")
  finally: c.close()
  assert_back_to_idle(checker)

def test_after_control_fuzz_a_clean_request_gets_the_reference(checker):
  assert clean_request(checker) == checker.reference

# ---------------------------------------------------------------- wire frames

@pytest.fixture(scope="module")
def fuzzer(guarded_node):
  w = Writer("fuzzer", guarded_node.address)
  w.r = w.reserve(new=4)
  yield w
  w.close()

OPS = [wire.WRITE, wire.COMMIT, wire.ACK, wire.READ, wire.DATA, wire.ERROR, wire.CLOSE, wire.ARENA, 0, 99]

@st.composite
def frames(draw, region_ids, block_bytes, blocks):
  def offset():
    return draw(st.one_of(st.integers(0, 70 * block_bytes), st.sampled_from(blocks).map(lambda b: b * block_bytes + draw(st.integers(-8, 8))),
                          st.integers(0, 2**64 - 1)))
  def nbytes(): return draw(st.one_of(st.integers(0, 2 * block_bytes), st.sampled_from([block_bytes]), st.integers(0, 2**64 - 1)))
  def region(): return draw(st.one_of(st.sampled_from(region_ids), st.integers(0, 2**64 - 1)))
  op, flags = draw(st.sampled_from(OPS)), draw(st.integers(0, 7))
  tag = draw(st.integers(0, 4)) if op == wire.WRITE and not flags & wire.SINGLE else draw(st.integers(0, 2**64 - 1))
  records = b"".join(PIECE.pack(region(), offset(), nbytes()) for _ in range(tag if op == wire.WRITE and not flags & wire.SINGLE else 0))
  head = HEADER.pack(draw(st.sampled_from([MAGIC, MAGIC, 0])), op, flags, draw(st.integers(0, 2**32 - 1)), draw(st.integers(0, 2**64 - 1)),
                     tag, region(), offset(), nbytes())
  return head + records + draw(st.binary(max_size=2 * block_bytes))

def test_fuzzed_wire_frames_change_nothing_outside_the_senders_blocks(guarded_node, checker, fuzzer):
  r = fuzzer.r
  ids = [p.region_id for p in r["pools"]]
  before = outside(checker.ctl.call("test.digest"), r["blocks"])

  @FUZZ
  @given(st.lists(frames(ids, r["block_bytes"], r["blocks"]), min_size=1, max_size=4))
  def run(sent):
    s = raw_tcp_session(guarded_node.address, TOKEN, node="fuzzer", identity=fuzzer.ep.identity)
    try:
      for f in sent: s.sendall(f)
      s.settimeout(0.2)
      try:
        while s.recv(1 << 16): pass         # until the node drops us, or has nothing more to say
      except (TimeoutError, OSError): pass
    except OSError: pass                     # dropped mid-send
    finally: s.close()
    assert outside(checker.ctl.call("test.digest"), r["blocks"]) == before, "a frame changed bytes outside its sender's blocks"
  run()
  fuzzer.ctl.call("decode.release", seq_id=r["seq_id"])
  assert_back_to_idle(checker)
  assert clean_request(checker) == checker.reference

# ---------------------------------------------------------------- cancellations and disconnects mid-transfer

def half_frame(w: Writer, r: dict):
  """A WRITE of one whole block of which only half the bytes arrive before the writer vanishes."""
  s = raw_tcp_session(w.address, TOKEN, node=w.ep.name, identity=w.ep.identity)
  bb = r["block_bytes"]
  s.sendall(HEADER.pack(MAGIC, wire.WRITE, wire.SINGLE | wire.NOTIFY, notice_value(r["seq_id"], 0), 1, 0, r["pools"][0].region_id,
                        r["blocks"][0] * bb, bb) + b"\x55" * (bb // 2))
  s.close()

ACTIONS = ["release_partial", "close_control", "cancel_stream", "close_link_mid_write", "half_frame", "shm_release_then_close",
           "client_gone_mid_stream"]

@pytest.mark.parametrize("seed", range(14))
def test_random_cancels_and_disconnects_leave_nothing_behind(guarded_node, checker, seed):
  rng = np.random.default_rng(seed)
  action = ACTIONS[seed % len(ACTIONS)]
  bystander = checker.reserve(new=2)           # another peer's sequence, its KV landed, while the chaos goes on
  checker.fill(kv_bytes(4096, seed=99))
  checker.write_layers(bystander, range(SMALL["n_layers"]))
  theirs = [[layer[b] for b in bystander["blocks"]] for layer in checker.ctl.call("test.digest")["blocks"]]
  w = Writer(f"chaos{seed}", guarded_node.address, "shm" if action.startswith("shm") else "tcp")
  try:
    r = w.reserve(prompt=[int(t) for t in rng.integers(0, SMALL["vocab_size"], int(rng.integers(1, 30)))], new=int(rng.integers(2, 60)))
    before = outside(checker.ctl.call("test.digest"), r["blocks"] + bystander["blocks"])
    w.fill(kv_bytes(len(r["blocks"]) * r["block_bytes"], seed=seed))
    layers = [int(x) for x in rng.permutation(SMALL["n_layers"])[:int(rng.integers(0, SMALL["n_layers"] + 1))]]
    if action in ("release_partial", "shm_release_then_close"):
      w.write_layers(r, layers)
      w.ctl.call("decode.release", seq_id=r["seq_id"])
    elif action == "close_control":
      w.write_layers(r, layers)
      w.ctl.close()
    elif action == "close_link_mid_write":
      w.write(r["pools"][0], r["blocks"], r["block_bytes"], notice_value(r["seq_id"], 0))   # not waited for
      w.peer.close()
      w.ctl.call("decode.release", seq_id=r["seq_id"])
    elif action == "half_frame":
      half_frame(w, r)
      w.ctl.call("decode.release", seq_id=r["seq_id"])
    else:                                    # a stream cut short: by a cancel, or by the client vanishing
      w.write_layers(r, range(SMALL["n_layers"]))
      stream = w.ctl.stream("decode.generate", seq_id=r["seq_id"], first_token=1, temperature=0.8, timeout=10)
      next(stream)
      if action == "cancel_stream": stream.close()
      else: w.ctl.sock.close()
  finally: w.close()
  after = checker.ctl.call("test.digest")
  assert [[layer[b] for b in bystander["blocks"]] for layer in after["blocks"]] == theirs, f"{action}: another sequence's KV changed"
  if "stream" not in action:                 # a decoding sequence takes (and writes) free blocks as it grows: only then
    assert outside(after, r["blocks"] + bystander["blocks"]) == before, f"{action}: bytes outside the reservation changed"
  checker.ctl.call("decode.release", seq_id=bystander["seq_id"], writes_done=True)
  assert_back_to_idle(checker)
  assert clean_request(checker) == checker.reference, f"{action}: the node's answer to a clean request changed"
