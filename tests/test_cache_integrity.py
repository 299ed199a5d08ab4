"""Every block in a decode node's prefix cache holds the KV a clean node computes for its tokens, whatever happens to the
requests that put it there: random request streams (the node's own prefills, writes by a peer it does not trust, two
tenants' salts) with random failures (a prefill that fails after its first layer, a decode step that fails, a pull that
ends half-way, a writer that disconnects mid-transfer), on a real decode node process (tests/decode_util.py). After each
request every cached block's bytes are compared with the same block of a clean prefill of its tokens here (same seeded
weights): equal to float16 rounding (a decoded token's KV comes from the decode step, not a prefill), where poison or a
never-written block is off by the size of the values themselves."""
import time
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from tinygrad import dtypes
from tinyhet.engine.prefill import prefill_logits
from tinyhet.kv.block_manager import block_hashes
from tinyhet.kv.paged_cache import PagedKVCache
from tinyhet.model.llama import Llama, random_weights, small_config
from tinyhet.runtime.control import ControlError
from tinyhet.runtime.descriptor import RegionDescriptor
from decode_util import DecodeNodeProcess, Writer, generate, kv_bytes
from test_e2e import SMALL
from test_kv_reserve import read, reserve

BS = 4
PREFIXES = [[40, 41, 42, 43, 44, 45, 46, 47, 48], [40, 41, 42, 43, 90, 91], [7, 7, 7, 7, 7, 7, 7, 7]]

class Clean:
  """What a clean node stores for tokens: the bytes of their last full block, per layer, from one prefill of them."""
  def __init__(self):
    cfg = small_config(**SMALL)
    self.model = Llama(cfg, random_weights(cfg, device="HET", seed=7), "HET")
    self.cache = PagedKVCache(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 16, BS, "float16", device="HET", max_seq_len=cfg.max_context)
    self.memo: dict[tuple, list[np.ndarray]] = {}

  def block(self, tokens: tuple) -> list[np.ndarray]:
    if tokens not in self.memo:
      bm = self.cache.block_manager
      bm.allocate(1, len(tokens))
      try:
        prefill_logits(self.model, list(tokens), dtypes.float16, self.cache.layer_storer(1))
        b = bm.block_table(1)[len(tokens) // BS - 1]
        self.memo[tokens] = [np.frombuffer(self.cache.read_block_bytes(l, b), np.float16).astype(np.float32) for l in range(SMALL["n_layers"])]
      finally: bm.deallocate(1)
    return self.memo[tokens]

@pytest.fixture(scope="module")
def rig():
  node = DecodeNodeProcess(blocks=48, bs=BS, trusted=("kv-trusted",))
  router, mallory = Writer("kv-router", node.address), Writer("kv-mallory", node.address)
  try: yield node, router, mallory, Clean(), {}
  finally:
    for w in (router, mallory): w.close()
    node.close()

def remember(chains: dict, key: str, tokens: list[int], salt: str):
  """The tokens each block hash of this request names (whatever the node did with them)."""
  for i, h in enumerate(block_hashes(tokens, BS, key, salt=salt)): chains[h] = tuple(tokens[:(i + 1) * BS])

def check_cache(router: Writer, clean: Clean, chains: dict) -> str:
  got = router.ctl.call("test.cached")
  for h, layers in got["blocks"]:
    assert h in chains, f"block hash {h} names no tokens any request sent"
    for layer, (have, want) in enumerate(zip(layers, clean.block(chains[h]))):
      have = np.frombuffer(bytes.fromhex(have), np.float16).astype(np.float32)
      err = np.abs(have - want).max()
      assert err <= 1e-3 * max(1.0, np.abs(want).max()), f"cached block of {chains[h]} differs from a clean prefill at layer {layer} by {err}"
  return got["key"]

OPS = st.lists(st.tuples(st.sampled_from(["submit", "submit", "fail-prefill", "fail-step", "untrusted", "disconnect", "pull-abort"]),
                         st.integers(0, len(PREFIXES) - 1), st.lists(st.integers(1, 250), max_size=5), st.sampled_from(["", "tenant-b"]),
                         st.integers(1, 4)), min_size=1, max_size=4)

@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS)
def test_every_cached_block_holds_what_a_clean_node_computes_for_its_tokens(rig, ops):
  node, router, mallory, clean, chains = rig
  key = chains.setdefault("key", router.ctl.call("test.cached")["key"])
  for kind, which, tail, salt, new in ops:
    prompt = PREFIXES[which] + tail
    if kind in ("submit", "fail-prefill", "fail-step"):
      if kind != "submit": router.ctl.call("test.fail", what=kind.removeprefix("fail-"))
      got = []
      try:
        for item in router.ctl.stream("decode.submit", prompt_ids=prompt, max_new_tokens=new + (kind == "fail-step"), cache_salt=salt):
          if "token" in item: got.append(item["token"])
      except ControlError as e: assert kind != "submit" and "injected" in str(e), e
      router.ctl.call("test.fail", what="clear")
      remember(chains, key, prompt + got, salt)
    elif kind == "untrusted":                       # a token holder's own bytes, decoded over: never cached
      r = reserve(mallory, prompt, new)
      mallory.fill(kv_bytes(len(r["blocks"]) * r["block_bytes"], seed=len(prompt)))
      mallory.write_layers(r, range(SMALL["n_layers"]))
      remember(chains, key, prompt + generate(mallory, r, timeout=10), "")
    elif kind == "disconnect":                      # a trusted writer that leaves after its first layer
      w = Writer("kv-trusted", node.address)
      try:
        r = reserve(w, prompt, new)
        w.fill(kv_bytes(len(r["blocks"]) * r["block_bytes"], seed=3))
        w.write_layers(r, [0])
      finally: w.close()
      remember(chains, key, prompt, "")
    else:                                           # a pull of the cached prefix that reads one layer, then gives the reservation up
      r = router.ctl.call("decode.reserve", prompt_ids=prompt, max_new_tokens=new, timeout=10, use_cache=True, cache_salt=salt)
      if r["prefix_blocks"]:
        read(router, RegionDescriptor.from_hex(r["read_pools"][0]), r["prefix_blocks"], r["block_bytes"]).wait(10)
      router.ctl.call("decode.release", seq_id=r["seq_id"])
      remember(chains, key, prompt, salt)
    check_cache(router, clean, chains)
  deadline = time.monotonic() + 10                   # a disconnected writer's sequence leaves once the node sees the connection close
  while router.ctl.call("decode.info")["open_sequences"] and time.monotonic() < deadline: time.sleep(0.05)
  assert router.ctl.call("decode.info")["open_sequences"] == 0
