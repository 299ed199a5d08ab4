"""decode.reserve with the prefix cache (use_cache) and decode.lookup, on a real decode node process (tests/decode_util.py):
a reservation that hits gets the cached length and descriptors of its suffix's blocks only, so a write into a shared
block is refused like any write outside the reservation, and the cached bytes stay as they were; bad lookups are refused
and the node keeps serving."""
import pytest
from tinyhet.runtime.control import ControlError
from tinyhet.runtime.descriptor import RegionDescriptor
from tinyhet.runtime.transport import TransportError
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
