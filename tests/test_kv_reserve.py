"""decode.reserve with the prefix cache (use_cache) and decode.lookup, on a real decode node process (tests/decode_util.py):
a reservation that hits gets the cached length and descriptors of its suffix's blocks only, so a write into a shared
block is refused like any write outside the reservation, and the cached bytes stay as they were; bad lookups are refused
and the node keeps serving."""
import dataclasses
import pytest
from tinyhet.runtime.control import ControlError
from tinyhet.runtime.descriptor import RegionDescriptor
from tinyhet.runtime.transport import TransportError
from tinyhet.runtime.transport import Span
from decode_util import Writer, generate, kv_bytes
from test_e2e import SMALL

def reserve(w: Writer, prompt: list[int], new: int = 2) -> dict:
  r = w.ctl.call("decode.reserve", prompt_ids=prompt, max_new_tokens=new, timeout=10, use_cache=True)
  r["pools"] = [RegionDescriptor.from_hex(h) for h in r["pools"]]
  return r

def test_a_hit_reserves_and_exposes_only_the_suffix(guarded_node):
  w = Writer("kv-writer", guarded_node.address)
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
  w, intruder = Writer("kv-writer", guarded_node.address), Writer("kv-intruder", guarded_node.address)
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
