import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from tinygrad import Tensor, TinyJit
from tinygrad.engine import realize
from tinyhet.kv import paged_cache as kv_cache
from tinyhet.kernels.kv_pack import pack_kv, pack_kv_host
from tinyhet.kv.paged_cache import PagedKVCache
from test_paged_attention import dense_reference

D, N_KV, GROUP, N_LAYERS = 32, 2, 4, 2
H = N_KV * GROUP

def random_cache(rng, lengths: list[int], block_size: int = 8, num_blocks: int = 64, device: str = "CPU") -> tuple[PagedKVCache, dict]:
  """A cache holding sequences 0..len(lengths)-1 with random K, V written as a prefill node would (pack_kv, block spans)."""
  cache = PagedKVCache(N_LAYERS, N_KV, D, num_blocks=num_blocks, block_size=block_size, max_seq_len=256, device=device)
  kv = {}
  for sid, n in enumerate(lengths):
    cache.block_manager.allocate(sid, n)
    for layer in range(N_LAYERS):
      k, v = rng.standard_normal((n, N_KV, D)).astype(np.float32), rng.standard_normal((n, N_KV, D)).astype(np.float32)
      cache.write_sequence(sid, layer, pack_kv(Tensor(k), Tensor(v), block_size, cache.kv_dtype).numpy().tobytes())
      kv[sid, layer] = (k.astype(np.float16), v.astype(np.float16))
  return cache, kv

def test_prefill_on_the_decode_node_is_causal_and_chunks_rows(monkeypatch):
  rng = np.random.default_rng(0)
  cache, kv = random_cache(rng, [11])              # 11 cached tokens, then 20 more in one forward
  for _ in range(20): cache.block_manager.append_slot(0)
  splits = kv_cache.decode_splits(20, N_KV, cache.cap)
  monkeypatch.setattr(kv_cache, "SCRATCH_BYTES", 7 * H * splits * (D + 2) * 4)   # 20 rows go in chunks of 7
  assert cache.begin_step([0], n_tokens=20).tolist() == [list(range(11, 31))]
  q = rng.standard_normal((1, 20, H, D)).astype(np.float32)
  k, v = rng.standard_normal((1, 20, N_KV, D)).astype(np.float32), rng.standard_normal((1, 20, N_KV, D)).astype(np.float32)
  pos = np.arange(11, 31, dtype=np.int32)[None]
  out = cache.update_and_attend(1, Tensor(q), Tensor(k), Tensor(v), Tensor(pos)).numpy()
  kk = np.concatenate([kv[0, 1][0], k[0].astype(np.float16)])
  vv = np.concatenate([kv[0, 1][1], v[0].astype(np.float16)])
  for t in range(20): np.testing.assert_allclose(out[0, t], dense_reference(q[0, t], kk[:12 + t], vv[:12 + t]), atol=2e-5, rtol=1e-4)

def test_jitted_decode_matches_unjitted_as_lengths_grow_without_recompiling():
  lengths = [3, 15, 9]
  jit_cache, _ = random_cache(np.random.default_rng(1), lengths)
  plain_cache, _ = random_cache(np.random.default_rng(1), lengths)
  calls = []
  def step(cache, q, k, v, pos):
    calls.append(cache)
    return Tensor.stack(*[cache.update_and_attend(layer, q, k, v, pos) for layer in range(N_LAYERS)]).realize()
  jit_step = TinyJit(lambda q, k, v, pos, **kv: step(jit_cache, q, k, v, pos))
  rng = np.random.default_rng(2)
  programs = None
  for i in range(40):                               # the longest row grows from 16 to 55 tokens: 2 to 7 blocks of 8
    ids = [0, 1, 2]
    for cache in (jit_cache, plain_cache):
      for sid in ids: cache.block_manager.append_slot(sid)
      pos = cache.begin_step(ids)
    assert pos.tolist() == [[cache.block_manager.length(s) - 1] for s in ids]
    q, k, v = (rng.standard_normal((3, 1, n, D)).astype(np.float32) for n in (H, N_KV, N_KV))
    got = jit_step(Tensor(q), Tensor(k), Tensor(v), Tensor(pos), **jit_cache.jit_kwargs()).numpy()
    want = step(plain_cache, Tensor(q), Tensor(k), Tensor(v), Tensor(pos)).numpy()
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-6)
    if i == 2: programs = len(realize.to_program_cache)
  assert calls.count(jit_cache) == 2                     # traced twice (ignore, capture), then replayed 38 times
  assert len(realize.to_program_cache) == programs      # and nothing compiled after the capture

def test_fork_copies_the_partial_block_in_every_layer():
  rng = np.random.default_rng(3)
  cache, kv = random_cache(rng, [13])
  cache.fork(0, 1)
  assert cache.block_manager.block_table(1)[0] == cache.block_manager.block_table(0)[0]      # the full block is shared
  for layer in range(N_LAYERS):
    src, dst = cache.block_manager.block_table(0)[1], cache.block_manager.block_table(1)[1]
    assert src != dst and cache.read_block_bytes(layer, src) == cache.read_block_bytes(layer, dst)

def test_several_tokens_a_sequence_as_decode_rows_attend_causally():
  """begin_step's counts (speculative decoding's verify step): sequence i's counts[i] new tokens are rows of a decode step
  (T = 1), each attending to its sequence's tokens up to its own position, the earlier rows' K, V of this step among them."""
  rng = np.random.default_rng(3)
  cache, kv = random_cache(rng, [11, 5])
  counts = [3, 1]
  for sid, c in enumerate(counts):
    for _ in range(c): cache.block_manager.append_slot(sid)
  pos = cache.begin_step([0, 1], 1, counts)
  assert pos.tolist() == [[11], [12], [13], [5]]
  q = rng.standard_normal((4, 1, H, D)).astype(np.float32)
  k, v = rng.standard_normal((4, 1, N_KV, D)).astype(np.float32), rng.standard_normal((4, 1, N_KV, D)).astype(np.float32)
  out = cache.update_and_attend(0, Tensor(q), Tensor(k), Tensor(v), Tensor(pos)).numpy()
  for r, (sid, first) in enumerate([(0, 0), (0, 0), (0, 0), (1, 3)]):
    kk = np.concatenate([kv[sid, 0][0], k[first:r + 1, 0].astype(np.float16)])
    vv = np.concatenate([kv[sid, 0][1], v[first:r + 1, 0].astype(np.float16)])
    np.testing.assert_allclose(out[r, 0], dense_reference(q[r, 0], kk, vv), atol=2e-5, rtol=1e-4)
  with pytest.raises(ValueError, match="sequence 1 holds fewer than n_tokens=7"): cache.begin_step([0, 1], 1, [1, 7])
  with pytest.raises(ValueError, match="counts takes n_tokens=1"): cache.begin_step([0, 1], 2, [1, 1])

def test_begin_step_is_required_and_checked():
  cache, _ = random_cache(np.random.default_rng(4), [5])
  q = Tensor.zeros(1, 1, H, D).contiguous()
  with pytest.raises(RuntimeError, match="begin_step"): cache.update_and_attend(0, q, q[:, :, :N_KV], q[:, :, :N_KV], Tensor([[5]]))
  with pytest.raises(RuntimeError, match="begin_step"): cache.jit_kwargs()
  with pytest.raises(KeyError, match="sequence 9"): cache.begin_step([9])
  cache.block_manager.allocate(9, 300)
  with pytest.raises(ValueError, match="max_seq_len 256"): cache.begin_step([9])
  with pytest.raises(ValueError, match="block is"): cache.write_block_bytes(0, 0, b"x")
  with pytest.raises(ValueError, match="sequence 0 holds fewer than n_tokens=6"): cache.begin_step([0], n_tokens=6)

def test_block_bytes_through_a_device_copy_match_the_zero_copy_view(monkeypatch):
  cache, _ = random_cache(np.random.default_rng(5), [20])
  block, neighbour = cache.block_manager.block_table(0)[:2]
  direct, before = cache.read_block_bytes(1, block), cache.read_block_bytes(1, neighbour)
  monkeypatch.setattr(kv_cache, "_host_view", lambda buf, sync=True: None)      # a device without host-visible memory: copies instead
  assert cache.read_block_bytes(1, block) == direct
  new = np.random.default_rng(6).integers(0, 256, cache.block_nbytes, dtype=np.uint8).tobytes()
  cache.write_block_bytes(1, block, new)
  monkeypatch.undo()
  assert cache.read_block_bytes(1, block) == new and cache.read_block_bytes(1, neighbour) == before

def test_pools_on_mesh_give_the_same_attention_as_on_cpu():
  import tinyhet.device.backend  # noqa: F401  (registers MESH)
  outs = []
  for device in ("CPU", "MESH"):
    cache, _ = random_cache(np.random.default_rng(7), [9, 30], device=device)
    assert cache.pools[0].device == device and cache.pool_buffer(0).nbytes == 64 * cache.block_nbytes
    for sid in (0, 1): cache.block_manager.append_slot(sid)
    pos = cache.begin_step([0, 1])
    rng = np.random.default_rng(8)
    q, k, v = (Tensor(rng.standard_normal((2, 1, n, D)).astype(np.float32), device=device) for n in (H, N_KV, N_KV))
    outs.append(cache.update_and_attend(1, q, k, v, Tensor(pos, device=device)).numpy())
  np.testing.assert_array_equal(outs[0], outs[1])

def test_block_tables_kept_per_batch_size_not_per_recompute_length():
  """Preemption recomputes a sequence at its own length: those tables must not be cached per length (they grew without bound)."""
  cache = PagedKVCache(N_LAYERS, N_KV, D, num_blocks=64, block_size=8, max_seq_len=256)
  for n in range(1, 40):                      # a recompute of a sequence of n tokens, as after n preemptions of different lengths
    cache.block_manager.allocate(1000 + n, n)
    assert cache.begin_step([1000 + n], n_tokens=n).tolist() == [list(range(n))]
    cache.block_manager.deallocate(1000 + n)
  for B in (1, 2, 3, 2, 1):                    # decode steps: one kept table per batch size, reused (TinyJit needs fixed buffers)
    for i in range(B): cache.block_manager.allocate(i, 5)
    cache.begin_step(list(range(B)), 1)
    for i in range(B): cache.block_manager.deallocate(i)
  assert sorted(cache._tables) == [1, 2, 3]

@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.integers(1, 3), st.sampled_from([2, 4, 8]), st.sampled_from([1, 4, 16]), st.integers(1, 4))
def test_host_pack_gives_pack_kv_bytes(T, KV, D, BS, nb):
  """The writer thread's numpy pack (pack_kv_host) writes exactly the bytes of the pack kernel, zeros past the tokens, and
  nothing outside its blocks."""
  rng = np.random.default_rng(T * 1000 + KV * 100 + D * 10 + BS)
  k, v = (rng.standard_normal((T, KV, D)).astype(np.float16) for _ in range(2))
  want = pack_kv(Tensor(k), Tensor(v), BS).numpy()                       # ceil(T / BS) blocks
  pool = np.full((nb + 2, 2, KV, BS * D), 7, np.float16)
  pack_kv_host(k, v, pool[1:nb + 1])
  m = min(nb, want.shape[0])
  assert np.array_equal(pool[1:m + 1], want[:m]) and (pool[m + 1:nb + 1] == 0).all() and (pool[0] == 7).all() and (pool[nb + 1] == 7).all()
