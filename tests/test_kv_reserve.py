"""decode.reserve with the prefix cache (use_cache) and decode.lookup, on a real decode node process (tests/decode_util.py):
a reservation that hits gets the cached length and descriptors of its suffix's blocks only, so a write into a shared
block is refused like any write outside the reservation, and the cached bytes stay as they were; bad lookups are refused
and the node keeps serving. Only KV the node vouches for is cached: a token holder that is not a trusted writer cannot
plant KV for later requests (the poisoning attack), and a failed prefill or decode step caches nothing past the tokens
whose KV is known complete."""
import dataclasses, itertools
import pytest
from tinyhet.runtime.control import ControlError
from tinyhet.runtime.descriptor import RegionDescriptor
from tinyhet.runtime.transport import TransportError
from tinyhet.runtime.transport import Span
from decode_util import Writer, generate, kv_bytes, submit, writer_when_free
from test_e2e import SMALL

def reserve(w: Writer, prompt: list[int], new: int = 2) -> dict:
  r = w.ctl.call("decode.reserve", prompt_ids=prompt, max_new_tokens=new, timeout=10, use_cache=True)
  r["pools"] = [RegionDescriptor.from_hex(h) for h in r["pools"]]
  return r

def test_a_hit_reserves_and_exposes_only_the_suffix(guarded_node):
  w = writer_when_free("kv-writer", guarded_node.address)
  try:
    prompt = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]        # 13 tokens: 3 full blocks of 4 and one more
    r = reserve(w, prompt)
    assert r["cached_tokens"] == 0 and len(r["blocks"]) == 4
    w.fill(kv_bytes(len(r["blocks"]) * r["block_bytes"], seed=5))
    w.write_layers(r, range(SMALL["n_layers"]))
    out = generate(w, r, timeout=10)                                     # 2 tokens; its full blocks stay cached
    longer = prompt + out + [5, 6]                                       # the next turn: KV of 14 tokens is stored, 3 blocks full
    assert w.ctl.call("decode.lookup", prompt_ids=longer)["cached_tokens"] == 12
    before = w.ctl.call("test.digest")["blocks"]
    r2 = reserve(w, longer)
    assert r2["cached_tokens"] == 12 and len(r2["blocks"]) == 2 and not set(r2["blocks"]) & set(r["blocks"][:3])
    bb = r2["block_bytes"]
    w.fill(b"\xee" * bb)
    with pytest.raises(TransportError):                                  # its own descriptor, at a shared block: refused
      w.write(r2["pools"][0], [r["blocks"][0]], bb).wait(10)
    w.reconnect()
    assert w.ctl.call("test.digest")["blocks"] == before, "a shared block changed"
    w.write(r2["pools"][0], r2["blocks"], bb).wait(10)                   # its own blocks: fine
    w.ctl.call("decode.release", seq_id=r2["seq_id"])
    for bad in ([], "x", [-1], [1 << 40], [1.5]):
      with pytest.raises(ControlError): w.ctl.call("decode.lookup", prompt_ids=bad)
    with pytest.raises(ControlError, match="use_cache"):
      w.ctl.call("decode.reserve", prompt_ids=[1, 2], max_new_tokens=1, use_cache="yes")
    assert w.ctl.call("decode.info")["open_sequences"] == 0
  finally: w.close()

def read(w: Writer, pool: RegionDescriptor, blocks: list[int], bb: int, at: int = 0):
  """Read these blocks of a remote pool into w's memory from offset `at` (the transfer: wait on it)."""
  return w.ep.read(w.peer, [Span(w.src, at + i * bb, pool, b * bb, bb) for i, b in enumerate(blocks)])

def test_a_hit_gets_a_read_grant_for_its_prefix_only_and_hostile_pulls_are_refused(guarded_node):
  """The prefill node's pull, by hand: a reservation that hits may read its prefix's shared blocks (tcp READ through its
  read descriptors) and gets exactly the bytes stored there; every other read is refused with a reason (a suffix block, a
  block outside the reservation, another request's shared block or its grant, past the pool, through the write grant,
  by another peer, after the release), so is a write
  through the read grant, and the node keeps serving."""
  w, intruder = writer_when_free("kv-writer", guarded_node.address), writer_when_free("kv-intruder", guarded_node.address)
  try:
    prompt = [31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43]
    r = reserve(w, prompt)
    bb = r["block_bytes"]
    assert r["cached_tokens"] == 0 and r["prefix_blocks"] == [] and r["read_pools"] == []
    stored = kv_bytes(len(r["blocks"]) * bb, seed=9)
    w.fill(stored)
    w.write_layers(r, range(SMALL["n_layers"]))
    out = generate(w, r, timeout=10)
    rb = reserve(intruder, [p + 20 for p in prompt])                        # another request, whose prefix is cached and shared too
    intruder.fill(kv_bytes(len(rb["blocks"]) * bb, seed=10))
    intruder.write_layers(rb, range(SMALL["n_layers"]))
    rb2 = reserve(intruder, [p + 20 for p in prompt] + generate(intruder, rb, timeout=10) + [1])
    assert rb2["cached_tokens"] == 12
    r2 = reserve(w, prompt + out + [5, 6])
    prefix, reads = r2["prefix_blocks"], [RegionDescriptor.from_hex(h) for h in r2["read_pools"]]
    assert r2["cached_tokens"] == 12 and prefix == r["blocks"][:3] and len(reads) == SMALL["n_layers"]
    w.fill(b"\0" * (len(prefix) * bb))
    read(w, reads[SMALL["n_layers"] - 1], prefix, bb).wait(10)               # the legitimate pull: the prefix's bytes, as stored
    assert bytes(w.src.view(0, len(prefix) * bb)) == stored[:len(prefix) * bb]
    before = w.ctl.call("test.digest")["blocks"]
    other = next(b for b in range(guarded_node.blocks) if b not in prefix and b not in r2["blocks"])
    hostile = [(reads[0], [r2["blocks"][0]], "not open to reads"),             # its own suffix block, through the read grant
               (reads[0], [other], "not open to reads"),                       # a block outside the reservation
               (reads[0], rb2["prefix_blocks"][:1], "not open to reads"),      # another request's shared block
               (RegionDescriptor.from_hex(rb2["read_pools"][0]), rb2["prefix_blocks"], "not exposed to kv-writer"),   # its grant
               (dataclasses.replace(reads[0], length=1 << 40), [guarded_node.blocks + 5], "outside region"),   # past the pool (forged)
               (r2["pools"][0], [r2["blocks"][0]], "a write grant")]           # through the write grant
    for pool, blocks, why in hostile:
      with pytest.raises(TransportError, match=why): read(w, pool, blocks, bb).wait(10)
      w.reconnect()
    with pytest.raises(TransportError, match="a read grant"): w.write(reads[0], prefix[:1], bb).wait(10)
    w.reconnect()
    with pytest.raises(TransportError, match="not exposed to kv-intruder"): read(intruder, reads[0], prefix, bb).wait(10)
    w.ctl.call("decode.release", seq_id=r2["seq_id"])
    intruder.ctl.call("decode.release", seq_id=rb2["seq_id"])
    with pytest.raises(TransportError, match="is not exposed"): read(w, reads[0], prefix, bb).wait(10)
    w.reconnect()
    assert w.ctl.call("test.digest")["blocks"] == before, "a block changed"
    r3 = reserve(w, prompt + out + [5, 6])                                   # the node still serves, and the prefix is still there
    assert r3["cached_tokens"] == 12
    read(w, RegionDescriptor.from_hex(r3["read_pools"][0]), r3["prefix_blocks"], bb).wait(10)
    w.ctl.call("decode.release", seq_id=r3["seq_id"])
    assert w.ctl.call("decode.info")["open_sequences"] == 0
  finally:
    w.close()
    intruder.close()

def clean_answer(w: Writer, prompt: list[int], n: int) -> list[int]:
  """A clean node's greedy tokens: the node's own prefill of the whole prompt, under a salt no request used before (so
  nothing cached can be shared with it)."""
  got, done = submit(w, prompt, n, cache_salt=f"clean-{next(CLEAN)}")
  assert done["cached_tokens"] == 0
  return got

CLEAN = itertools.count()

def test_a_token_holder_cannot_plant_kv_for_other_requests(guarded_node):
  """The poisoning attack: a peer holding the cluster token (not a trusted writer) reserves prompt P, writes bytes of its
  choosing, decodes a token, and leaves. A later request whose prompt starts with P finds nothing cached and decodes the
  tokens a clean node gives; a trusted writer's KV for the same P is cached and shared."""
  attacker, victim = Writer("kv-attacker", guarded_node.address), Writer("kv-victim", guarded_node.address)
  try:
    prompt = [61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73]               # 3 full blocks of 4, and one more token
    r = reserve(attacker, prompt)
    assert r["cached_tokens"] == 0
    attacker.fill(kv_bytes(len(r["blocks"]) * r["block_bytes"], seed=66))
    attacker.write_layers(r, range(SMALL["n_layers"]))
    generate(attacker, r, timeout=10)                                            # the sequence ran on its bytes and left
    longer = [*prompt, 5, 6, 7]
    assert victim.ctl.call("decode.lookup", prompt_ids=longer)["cached_tokens"] == 0
    got, done = submit(victim, longer, 5)
    assert done["cached_tokens"] == 0
    assert got == clean_answer(victim, longer, 5)
    # the same attack through a trusted writer's name would be cached: kv-writer is one (the node's configuration)
    w = writer_when_free("kv-writer", guarded_node.address)
    try:
      r = reserve(w, [p + 100 for p in prompt])
      w.fill(kv_bytes(len(r["blocks"]) * r["block_bytes"], seed=67))
      w.write_layers(r, range(SMALL["n_layers"]))
      generate(w, r, timeout=10)
      assert victim.ctl.call("decode.lookup", prompt_ids=[p + 100 for p in longer])["cached_tokens"] == 12
    finally: w.close()
  finally:
    attacker.close()
    victim.close()

def test_a_failed_prefill_caches_nothing_and_its_retry_gives_the_clean_tokens(guarded_node):
  """The node's own prefill (decode.submit) fails after its first layer: the retry (the router's, on the same node) finds
  nothing cached, reports cached_tokens 0 and gives a clean node's tokens."""
  w = writer_when_free("kv-router", guarded_node.address)
  try:
    prompt = [81 + i for i in range(13)]
    w.ctl.call("test.fail", what="prefill")
    with pytest.raises(ControlError, match="decode step failed"): submit(w, prompt, 4)
    assert w.ctl.call("decode.lookup", prompt_ids=prompt)["cached_tokens"] == 0
    got, done = submit(w, prompt, 4)
    assert done["cached_tokens"] == 0 and got == clean_answer(w, prompt, 4)
    assert w.ctl.call("decode.info")["open_sequences"] == 0
  finally: w.close()

def test_a_failed_decode_step_caches_only_the_tokens_whose_kv_was_stored(guarded_node):
  """A 7-token prompt prefills, its first token is sampled, and the decode step that would store that token's KV (the
  eighth slot, filling the second block) fails: only the first block is cached, and the next turn gives clean tokens."""
  w = writer_when_free("kv-router", guarded_node.address)
  try:
    prompt = [101, 102, 103, 104, 105, 106, 107]
    w.ctl.call("test.fail", what="step")
    first = []
    with pytest.raises(ControlError, match="decode step failed"):
      for item in w.ctl.stream("decode.submit", prompt_ids=prompt, max_new_tokens=4, reply_timeout=10):
        if "token" in item: first.append(item["token"])
    assert len(first) == 1                                                     # sampled after the prefill, before the step
    turn = prompt + first + [9, 10]
    assert w.ctl.call("decode.lookup", prompt_ids=turn)["cached_tokens"] == 4
    got, done = submit(w, turn, 4)
    assert done["cached_tokens"] == 4 and got == clean_answer(w, turn, 4)
  finally: w.close()

def test_a_pull_that_fails_half_way_falls_back_to_computing_the_prefix_and_the_next_pull_is_clean(guarded_node):
  """A prefill node (here, over tcp) pulls a cached prefix out of the decode node's blocks; the holder takes back the read
  grants of every layer after the first, so the pull fails half-way: the job computes the prefix itself (no error, no
  pulled tokens), the decode node's tokens equal a clean node's; the next job pulls over fresh pools and is clean too."""
  from tinyhet.device.memory import local_node
  from tinyhet.model.llama import Llama, random_weights, small_config
  from tinyhet.model.sampling import Sampler
  from tinyhet.runtime.control import ControlClient
  from tinyhet.service.prefill_node import Job, PrefillNode
  from test_e2e import TOKEN
  node = local_node()
  node.endpoint.token = TOKEN
  cfg = small_config(**SMALL)
  prefill = PrefillNode(Llama(cfg, random_weights(cfg, device="HET", seed=7), "HET"), node, transport="tcp")
  w, ctl = writer_when_free("kv-router", guarded_node.address), ControlClient(node.endpoint, guarded_node.address)
  try:
    prompt = [121 + i for i in range(13)]
    submit(w, prompt, 1)                                                     # the node computes it: its 3 full blocks are cached
    for turn, tail in enumerate(([7, 8, 9], [10, 11, 12])):
      ids = prompt + tail
      r = ctl.call("decode.reserve", prompt_ids=ids, max_new_tokens=4, timeout=10, use_cache=True)
      assert r["cached_tokens"] == 12
      if turn == 0: w.ctl.call("test.withdraw_reads", seq_id=r["seq_id"], from_layer=1)
      sampler = Sampler()
      out = prefill._prefill(Job(ids, guarded_node.address, r, {"sampler": sampler, "samplers": [sampler]}))
      assert out["pulled_tokens"] == (0 if turn == 0 else 12), out
      got = [out["first_token"]] + [i["token"] for i in ctl.stream("decode.generate", seq_id=r["seq_id"], first_token=out["first_token"],
                                                                    seed=out["seed"], timeout=10) if "token" in i]
      assert got == clean_answer(w, ids, 4), f"turn {turn}"
    assert w.ctl.call("decode.info")["open_sequences"] == 0
  finally:
    ctl.close()
    w.close()
    prefill.close()

def test_after_its_warm_up_a_prefill_nodes_pulled_turns_build_no_capture_and_make_no_pools(guarded_node):
  """A prefill node's warm-up (WarmUp.for_prefill) builds the pulled path's pools, one table width wide, and the captures of
  every suffix chunk length over them: then the turns of a growing conversation, each prefix pulled out of the decode
  node's blocks (the first turn's: this node is no trusted writer, so what it writes is not cached), their suffixes running
  at every chunk length, build no capture and make no pools on the request's thread, count nothing cold, and give a clean
  node's tokens."""
  from tinygrad import dtypes
  from tinyhet.device.memory import local_node
  from tinyhet.engine.warm_up import WarmUp
  from tinyhet.model.chunked_prefill import padded_plan
  from tinyhet.model.layer_jit import Replay
  from tinyhet.model.llama import Llama, random_weights, small_config
  from tinyhet.model.sampling import Sampler
  from tinyhet.runtime.control import ControlClient
  from tinyhet.service.prefill_node import Job, PrefillNode
  from test_e2e import TOKEN
  node = local_node()
  node.endpoint.token = TOKEN
  cfg = small_config(**SMALL)
  model = Llama(cfg, random_weights(cfg, device="HET", seed=7), "HET")   # the decode node's
  model.prefill_chunk = 32                                                   # suffix chunks of 16, 24 and 32 tokens
  prefill = PrefillNode(model, node, transport="tcp")
  warm = WarmUp.for_prefill(model, dtypes.float16, block_size=4)              # the decode node's block size and KV dtype
  while warm.step(): pass
  assert warm.ready["pulled"] == {16, 24, 32} and warm.captures > 0 and warm.cold == 0
  w, ctl = writer_when_free("kv-router", guarded_node.address), ControlClient(node.endpoint, guarded_node.address)
  try:
    ids = [141 + i for i in range(13)]
    ids += submit(w, ids, 4)[0]                                              # the decode node computes it; its blocks are cached
    before, suffixes = Replay.captures, []
    for tail in (2, 18, 27, 38):
      ids = ids + [(7 * tail + j) % 256 for j in range(tail)]
      r = ctl.call("decode.reserve", prompt_ids=ids, max_new_tokens=4, timeout=10, use_cache=True)
      suffixes.append(len(ids) - r["cached_tokens"])
      sampler = Sampler()
      out = prefill._prefill(Job(ids, guarded_node.address, r, {"sampler": sampler, "samplers": [sampler]}))
      assert out["pulled_tokens"] == r["cached_tokens"] > 0, out
      assert Replay.captures == before and warm.cold == 0, f"a pulled turn of {len(ids)} tokens built captures or pools on its path"
      got = [out["first_token"]] + [i["token"] for i in ctl.stream("decode.generate", seq_id=r["seq_id"], first_token=out["first_token"],
                                                                    seed=out["seed"], timeout=10) if "token" in i]
      assert got == clean_answer(w, ids, 4), f"{len(ids)} tokens"
      ids += got
    assert {C for n in suffixes for _, _, C in padded_plan(n, 32, 0, (16, 24))} == {16, 24, 32} and max(suffixes) > 64, suffixes
  finally:
    ctl.close()
    w.close()
    prefill.close()
