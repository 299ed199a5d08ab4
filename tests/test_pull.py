"""tinyhet.kv.pull on a real Node pair in one process (two LocalNodes, tcp between them): a prefix's blocks pulled into
pools in registered memory (read in place) and into pools tinyhet did not register (through a host region, copied in),
byte for byte; a pull outside the read grant fails with the node's reason. Exposure's access modes and PullCost's choice,
as properties."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from tinygrad import Tensor, dtypes
import tinyhet  # noqa: F401  (HET and MESH)
from tinyhet.config import load_config
from tinyhet.device.memory import LocalNode
from tinyhet.kv.pull import PrefixPull, PullCost, pull_spec
from tinyhet.runtime.exposure import Exposure
from tinyhet.runtime.transport import TransportError

BB, BLOCKS, LAYERS = 512, 6, 3           # block bytes, blocks per layer pool, layers

@pytest.fixture(scope="module")
def pair():
  env = {"TINYHET_TOKEN": "pull-test-token", "TINYHET_ARENA_BYTES": "16M", "TINYHET_TRANSPORT": "tcp"}
  holder, puller = LocalNode(load_config(env={**env, "TINYHET_NODE": "holder"})), LocalNode(load_config(env={**env, "TINYHET_NODE": "puller"}))
  pools = [holder.arena("MESH").alloc(BLOCKS * BB) for _ in range(LAYERS)]
  stored = np.random.default_rng(3).integers(0, 256, (LAYERS, BLOCKS * BB), dtype=np.uint8)
  for r, data in zip(pools, stored): r.view(0, BLOCKS * BB)[:] = data.tobytes()
  address = holder.serve()
  peer = puller.endpoint.connect(address, "tcp")
  yield holder, puller, peer, pools, stored
  peer.close()
  for n in (puller, holder): n.endpoint.close()

def grant(holder, pools, blocks, owner="puller", bb=BB) -> list[str]:
  return [holder.endpoint.expose(r, owner=owner, allowed=[(b * bb, bb) for b in blocks], access="read").to_hex() for r in pools]

@pytest.mark.parametrize("device", ["HET", "CPU"])       # HET: registered (read in place); CPU: not (a host region, then a copy)
def test_a_pull_lands_the_prefix_blocks_in_the_pools_first_blocks(pair, device):
  holder, puller, peer, pools, stored = pair
  prefix = [4, 1, 2]
  reservation = {"prefix_blocks": prefix, "read_pools": grant(holder, pools, prefix), "block_bytes": BB}
  dst = [Tensor.zeros(5, BB, dtype=dtypes.uint8, device=device).contiguous().realize() for _ in range(LAYERS)]
  pull = PrefixPull(puller, peer, reservation, dst)
  assert (pull.host is None) == (device == "HET")               # which way the bytes go
  for layer in range(LAYERS): pull.wait(layer)
  figures = pull.finish()
  assert figures["pulled_bytes"] == LAYERS * len(prefix) * BB and figures["pull_s"] >= 0
  for layer in range(LAYERS):
    got = dst[layer].numpy()
    for i, b in enumerate(prefix): assert (got[i] == stored[layer][b * BB:(b + 1) * BB]).all(), (layer, i)
    assert not got[len(prefix):].any()

def test_a_pull_outside_the_grant_is_refused_and_the_holder_keeps_serving(pair):
  holder, puller, _, pools, stored = pair
  hostile = {"prefix_blocks": [0, 5], "read_pools": grant(holder, pools, [0]), "block_bytes": BB}    # block 5 is not granted
  dst = [Tensor.zeros(2, BB, dtype=dtypes.uint8, device="HET").contiguous().realize() for _ in range(LAYERS)]
  peer = puller.endpoint.connect(holder.endpoint.address, "tcp")
  with pytest.raises(TransportError, match="not open to reads"):
    pull = PrefixPull(puller, peer, hostile, dst)
    pull.wait(0)
  peer.close()
  foreign = {"prefix_blocks": [0], "read_pools": grant(holder, pools, [0], owner="someone-else"), "block_bytes": BB}
  peer = puller.endpoint.connect(holder.endpoint.address, "tcp")
  with pytest.raises(TransportError, match="not exposed to puller"): PrefixPull(puller, peer, foreign, dst).wait(0)
  peer.close()
  peer = puller.endpoint.connect(holder.endpoint.address, "tcp")     # the holder still serves a good pull
  good = {"prefix_blocks": [3], "read_pools": grant(holder, pools, [3]), "block_bytes": BB}
  PrefixPull(puller, peer, good, dst).finish()
  assert (dst[1].numpy()[0] == stored[1][3 * BB:4 * BB]).all()
  peer.close()

def test_a_pull_that_fails_half_way_ends_its_reads_and_frees_its_host_staging(pair):
  """Pools tinyhet did not register (CPU) fill through a host region of the puller; a pull whose second layer is refused
  raises PullFailed (from wait, or from posting once the refusal broke the link), and abort (what a failed prefill calls)
  ends every read and gives that region back."""
  from tinyhet.kv.pull import PullFailed
  holder, puller, _, pools, _ = pair
  arena = puller.arena("MESH")
  before = arena.in_use
  reads = grant(holder, pools[:1], [2]) + grant(holder, pools[1:], [2], owner="someone-else")     # layers 1, 2: not this peer's
  dst = [Tensor.zeros(2, BB, dtype=dtypes.uint8, device="CPU").contiguous().realize() for _ in range(LAYERS)]
  peer = puller.endpoint.connect(holder.endpoint.address, "tcp")
  pull = None
  with pytest.raises(PullFailed, match="cached prefix"):     # layer 1's refusal drops the link: from wait, or from posting
    pull = PrefixPull(puller, peer, {"prefix_blocks": [2], "read_pools": reads, "block_bytes": BB}, dst)   # a later layer
    assert pull.host is not None and arena.in_use > before
    for layer in range(LAYERS): pull.wait(layer)
  if pull is not None: assert pull.abort() and pull.host is None   # a failed post aborted the reads it had posted itself
  assert arena.in_use == before
  peer.close()

def test_malformed_pull_specs_are_refused():
  for bad in ({"prefix_blocks": [1], "read_pools": []}, {"prefix_blocks": [], "read_pools": ["00"]}, {"prefix_blocks": [-1], "read_pools": ["x"]},
              {"prefix_blocks": "1", "read_pools": []}):
    with pytest.raises(ValueError): pull_spec(bad)
  assert pull_spec({}) == ([], [])

@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["rw", "read", "write"]), st.sampled_from(["read", "write"]), st.integers(0, 4096), st.integers(1, 4096))
def test_an_exposure_lets_each_op_through_only_its_grant(access, op, offset, nbytes):
  e = Exposure(memoryview(bytearray(8192)), None, [(1024, 2048)], access)
  inside = 1024 <= offset and offset + nbytes <= 3072
  assert e.allows(offset, nbytes, op) == (inside and access in ("rw", op))

@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 1 << 30), st.floats(1e-4, 10)), max_size=4),
       st.lists(st.tuples(st.integers(1, 1 << 16), st.floats(1e-4, 10)), max_size=4), st.integers(1, 1 << 30), st.integers(1, 1 << 16))
def test_pull_cost_pulls_when_the_link_beats_recomputing(transfers, prefills, nbytes, tokens):
  c = PullCost()
  for b, s in transfers: c.saw_transfer(b, s)
  for t, s in prefills: c.saw_prefill(t, s)
  if not transfers or not prefills: assert c.should_pull(nbytes, tokens)        # nothing measured yet: pull
  else: assert c.should_pull(nbytes, tokens) == (nbytes / c.link_bps < tokens / c.prefill_tok_s)

@pytest.fixture(scope="module")
def llama():
  from tinyhet.model.llama import Llama, random_weights, small_config
  cfg = small_config(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, hidden_dim=96, vocab_size=256, max_context=256)
  return Llama(cfg, random_weights(cfg, device="MESH", seed=5), "MESH")

# three chunks of 16, the last one padded (a suffix within one chunk, padded to its bucket, runs in tests/test_kv_store.py)
@pytest.mark.parametrize("chunk,suffix", [(16, 40)])
def test_a_prefill_over_a_pulled_prefix_gives_the_whole_prompts_logits_and_suffix_kv(pair, llama, chunk, suffix):
  """The prefix's K, V made by a real prefill, stored at scattered blocks of the holder's pools, pulled over tcp; the
  suffix's prefill over them gives the logits and K, V (suffix rows) of the whole prompt's prefill. Twice, with other
  prompts: the second prefill reuses the first's pools (engine.prefill.pull_pools), stale blocks and all. The first hands
  the suffix's K, V out per layer (on_layer), the second as each chunk's blocks in the pools (on_chunk, as the prefill
  node's sender takes them: blocks from the prefix's end on, one piece a chunk, no layer unpacked)."""
  from tinyhet.engine.prefill import prefill_pulled_logits
  from tinyhet.model.chunked_prefill import chunked_prefill, prompt_pools
  from tinyhet.kernels.kv_pack import unpack_kv
  from tinyhet.model.llama import DenseKVCache
  holder, puller, peer, _, _ = pair
  cached, bs = 48, 16
  used = []
  for seed in (chunk, chunk + 1):
    ids = [int(t) for t in np.random.default_rng(seed).integers(0, 256, cached + suffix)]
    own, _ = prompt_pools(llama, cached, dtypes.float16, bs)                  # the prefix's K, V as a decode node would hold them
    chunked_prefill(llama, Tensor([ids[:cached]], dtype=dtypes.int32, device="MESH"), 512, dtypes.float16, pools=own, table=[0, 1, 2])
    bb, where = own[0].nbytes() // 3, [5, 0, 3]
    regions = [holder.arena("MESH").alloc(6 * bb) for _ in own]
    for r, pool in zip(regions, own):
      data = pool.numpy().reshape(3, -1).view(np.uint8)
      for i, b in enumerate(where): r.view(b * bb, bb)[:] = data[i].tobytes()
    reservation = {"prefix_blocks": where, "read_pools": grant(holder, regions, where, bb=bb), "block_bytes": bb}
    kv, pieces = {}, {}
    def take(l, pool, b0, b1, piece, n_pieces):                             # the blocks as they lie in the pool, read now
      rows = [t.numpy() for t in unpack_kv(Tensor(pool.numpy()[b0:b1]), (b1 - b0) * bs, llama.cfg.head_dim)]   # K, V (n * bs, KVH, D)
      pieces.setdefault(l, []).append((b0, b1, piece, n_pieces, rows))
      return True
    def start(pools):
      used.append([id(p) for p in pools])
      return PrefixPull(puller, peer, reservation, pools)
    llama.prefill_chunk = chunk
    try:
      logits, figures = prefill_pulled_logits(llama, ids, cached, bs, dtypes.float16, start, lambda l, k, v: kv.setdefault(l, (k.numpy(), v.numpy())),
                                              take if seed != chunk else None)
    finally: llama.prefill_chunk = 0
    if seed != chunk:                                                         # pieces, in order, from the prefix's end to the prompt's
      assert not kv
      for l, ps in pieces.items():
        assert [p[:4] for p in ps] == [(3, 4, 0, 3), (4, 5, 1, 3), (5, 6, 2, 3)]
        k, v = (np.concatenate([p[4][i] for p in ps])[:suffix] for i in (0, 1))
        kv[l] = (k, v)
    assert figures["pulled_bytes"] == 3 * bb * len(own)
    want_kv = {}
    want = llama.prefill(Tensor([ids], dtype=dtypes.int32, device="MESH"), on_layer=lambda l, k, v: want_kv.setdefault(l, (k.numpy(), v.numpy())),
                         cache=DenseKVCache(llama.cfg, 1, len(ids), device="MESH")).numpy()[0]
    np.testing.assert_allclose(logits, want, rtol=2e-2, atol=2e-3)
    assert int(np.argmax(logits)) == int(np.argmax(want))
    assert sorted(kv) == list(range(llama.cfg.n_layers))
    for l, (k, v) in kv.items():
      assert k.shape[0] == suffix
      np.testing.assert_allclose(k, want_kv[l][0][cached:], rtol=2e-2, atol=2e-2)
      np.testing.assert_allclose(v, want_kv[l][1][cached:], rtol=2e-2, atol=2e-2)
  assert used[0] == used[1]                                                   # the second request ran on the first's pools
  with pytest.raises(ValueError): prefill_pulled_logits(llama, ids, 40, bs, dtypes.float16, None)   # not whole blocks

def test_a_pulled_prefixs_suffix_leaves_as_the_pools_blocks_into_the_reservation(pair, llama):
  """The prefill node's path for a pulled prefix: the suffix's blocks go from the pull's pools to the decode node's reserved
  blocks (KVSender.send_chunk past a cached prefix: pool block 3 + i to reserved block i, one write a chunk, no layer
  unpacked), and those blocks then hold the suffix's K, V of the whole prompt's prefill."""
  from tinyhet.engine.prefill import prefill_pulled_logits
  from tinyhet.kernels.kv_pack import unpack_kv
  from tinyhet.kv.sender import KVSender, Pieces, SendBuffers
  from tinyhet.model.chunked_prefill import chunked_prefill, prompt_pools
  from tinyhet.model.llama import DenseKVCache
  holder, puller, peer, _, _ = pair
  cached, suffix, bs, cfg = 48, 40, 16, llama.cfg
  ids = [int(t) for t in np.random.default_rng(11).integers(0, 256, cached + suffix)]
  own, _ = prompt_pools(llama, cached, dtypes.float16, bs)
  chunked_prefill(llama, Tensor([ids[:cached]], dtype=dtypes.int32, device="MESH"), 512, dtypes.float16, pools=own, table=[0, 1, 2])
  bb = own[0].nbytes() // 3
  held = [holder.arena("MESH").alloc(6 * bb) for _ in own]                 # the prefix at blocks 0-2, the suffix reserved at 5, 3, 4
  for r, pool in zip(held, own): r.view(0, 3 * bb)[:] = pool.numpy().view(np.uint8).tobytes()
  dest = [5, 3, 4]
  reservation = {"seq_id": 7, "blocks": dest, "block_bytes": bb, "block_size": bs, "cached_tokens": cached,
                 "pools": [holder.endpoint.expose(r, owner="puller", allowed=[(b * bb, bb) for b in dest], access="write").to_hex() for r in held],
                 "prefix_blocks": [0, 1, 2], "read_pools": grant(holder, held, [0, 1, 2], bb=bb)}
  buffers = SendBuffers(puller, 0)
  sender = KVSender(puller.endpoint, peer, reservation, cfg, dtypes.float16, buffers)
  llama.prefill_chunk = 16
  try: prefill_pulled_logits(llama, ids, cached, bs, dtypes.float16, lambda pools: PrefixPull(puller, peer, reservation, pools), sender.send,
                             sender.send_chunk)
  finally: llama.prefill_chunk = 0
  transfers = sender.finish(30)
  buffers.free()
  assert sorted(transfers) == list(range(cfg.n_layers)) and all(isinstance(t, Pieces) and len(t.transfers) == 3 for t in transfers.values())
  want_kv = {}
  llama.prefill(Tensor([ids], dtype=dtypes.int32, device="MESH"), on_layer=lambda l, k, v: want_kv.setdefault(l, (k.numpy(), v.numpy())),
                cache=DenseKVCache(cfg, 1, len(ids), device="MESH"))
  for l, r in enumerate(held):
    got = np.frombuffer(bytes(r.view(0, 6 * bb)), np.float16).reshape(6, 2, cfg.n_kv_heads, bs * cfg.head_dim)[dest]
    k, v = (t.numpy() for t in unpack_kv(Tensor(got), suffix, cfg.head_dim))
    np.testing.assert_allclose(k, want_kv[l][0][cached:], rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(v, want_kv[l][1][cached:], rtol=2e-2, atol=2e-2)
