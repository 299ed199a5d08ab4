"""Prefill through captured layers (tinyhet.model.layer_jit) gives the numbers of the layer-by-layer path through a dense cache:
the logits, and every layer's K and V as on_layer sees them; the K, V handed out stay intact while later layers and later
prompts run (they are sent from those buffers); the captures kept are bounded."""
import numpy as np
import pytest
import tinyhet  # noqa: F401  (HET)
from tinygrad import Tensor, dtypes
from tinyhet.model import layer_jit
from tinyhet.model.llama import DenseKVCache, Llama, random_weights, small_config
from tinyhet.model.packed import Q4_1

@pytest.fixture(scope="module")
def llama():
  cfg = small_config(n_layers=3, dim=64, n_heads=4, n_kv_heads=2, hidden_dim=160, vocab_size=300, max_context=64)
  return Llama(cfg, random_weights(cfg, device="MESH", seed=5, packed=Q4_1), "MESH")

def prefill(llama, ids, **kw):
  kv = {}
  logits = llama.prefill(Tensor([ids], dtype=dtypes.int32, device="MESH"), on_layer=lambda l, k, v: kv.setdefault(l, (k, v)), **kw)
  return logits.numpy(), kv

@pytest.mark.parametrize("T", [4, 8, 37])   # 37: three 16-token blocks, the last partial, and five 8-row tiles of the C attention
def test_captured_layers_give_the_dense_paths_bits(llama, T):
  ids = [int(t) for t in np.random.default_rng(T).integers(0, 300, T)]
  got, got_kv = prefill(llama, ids)
  assert llama._layer_jits[(T, dtypes.float16)].tiled is not None    # on MESH (a CPU device): the C prefill tiles, no (T, T) scores
  got_kv = {l: (k.numpy().copy(), v.numpy().copy()) for l, (k, v) in got_kv.items()}
  want, want_kv = prefill(llama, ids, cache=DenseKVCache(llama.cfg, 1, T, device="MESH"))
  # the same numbers up to rounding: tinygrad fuses the two attention forms differently, so float32 sums differ in their last
  # bits, which can move a float16 K or V of a later layer by one step, and that moves the logits by ~1e-5..1e-4
  np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4)
  for l, (k, v) in want_kv.items():
    if l == 0:       # before any attention: the same kernels, the same bits
      np.testing.assert_array_equal(got_kv[l][0], k.numpy())
      np.testing.assert_array_equal(got_kv[l][1], v.numpy())
    np.testing.assert_allclose(got_kv[l][0].astype(np.float32), k.numpy().astype(np.float32), rtol=2e-3, atol=2e-3)   # float16 K, V
    np.testing.assert_allclose(got_kv[l][1].astype(np.float32), v.numpy().astype(np.float32), rtol=2e-3, atol=2e-3)
  # a shorter prompt padded to T: its logits and K, V are the unpadded prompt's (up to the order of the sums over T keys)
  short, short_kv = prefill(llama, ids[:T - 3] + [0] * 3, n_valid=T - 3)
  want, want_kv = prefill(llama, ids[:T - 3], cache=DenseKVCache(llama.cfg, 1, T - 3, device="MESH"))
  np.testing.assert_allclose(short, want, rtol=1e-3, atol=1e-4)
  np.testing.assert_allclose(short_kv[0][0].numpy()[:T - 3].astype(np.float32), want_kv[0][0].numpy().astype(np.float32), rtol=1e-3, atol=1e-3)

def test_handed_out_kv_stays_intact_through_later_layers_and_prompts(llama):
  rng = np.random.default_rng(0)
  copies, held = {}, {}
  def keep(l, k, v):
    held[l] = (k, v)
    copies[l] = (k.numpy().copy(), v.numpy().copy())
  llama.prefill(Tensor([[int(t) for t in rng.integers(0, 300, 8)]], dtype=dtypes.int32, device="MESH"), on_layer=keep)
  for _ in range(2): prefill(llama, [int(t) for t in rng.integers(0, 300, 8)])       # the same capture, replayed
  for l, (k, v) in held.items():
    np.testing.assert_array_equal(k.numpy(), copies[l][0])
    np.testing.assert_array_equal(v.numpy(), copies[l][1])

def test_captures_kept_are_bounded(llama):
  for T in range(1, layer_jit.KEEP + 3): layer_jit.layer_jit(llama, T, dtypes.float16)
  assert len(llama._layer_jits) == layer_jit.KEEP and (layer_jit.KEEP + 2, dtypes.float16) in llama._layer_jits

def test_layers_stored_in_other_types_get_captures_of_their_own():
  """A GGUF may keep some of a layer's weights in another type than layer 0's (llama.cpp's Q4_K_M keeps some in Q6_K):
  those layers replay captures of their own (a capture made on layer 0's shapes failed on them), and the numbers are the
  dense path's. Layers of one signature share one capture per half."""
  import dataclasses
  from tinyhet.model.packed import PackedWeight, Q8_0
  cfg = small_config(n_layers=4, dim=64, n_heads=4, n_kv_heads=2, hidden_dim=160, vocab_size=300, max_context=64)
  w = random_weights(cfg, device="MESH", seed=9, packed=Q4_1)
  for l in (1, 3):
    w.layers[l] = dataclasses.replace(w.layers[l], wv=PackedWeight.random(*w.layers[l].wv.shape, Q8_0, "MESH"),
                                      w_down=PackedWeight.random(*w.layers[l].w_down.shape, Q8_0, "MESH"))
  mixed = Llama(cfg, w, "MESH")
  ids = [int(t) for t in np.random.default_rng(2).integers(0, 300, 8)]
  for _ in range(3): got, _ = prefill(mixed, ids)          # run, capture, replay
  want, _ = prefill(mixed, ids, cache=DenseKVCache(cfg, 1, 8, device="MESH"))
  np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4)
  assert len(mixed._layer_jits[(8, dtypes.float16)].halves) == 4      # QKV and FINISH, for two signatures

def test_on_chunk_gets_each_layers_packed_blocks_and_on_layer_the_layers_it_refuses(llama):
  """On a CPU device the qkv half packs K, V into the layer's pool as it computes them (the finish half attends over it):
  on_chunk gets each layer's pool as one piece of the prompt's blocks (pads past n_valid left out), whose bytes are
  pack_kv of the K, V on_layer would get; a layer it refuses goes to on_layer. The logits do not change."""
  from tinyhet.kernels.kv_pack import pack_kv
  T, n = 37, 34
  ids = [int(t) for t in np.random.default_rng(3).integers(0, 300, n)] + [0] * (T - n)
  want, want_kv = prefill(llama, ids, n_valid=n)
  want_kv = {l: (k.numpy().copy(), v.numpy().copy()) for l, (k, v) in want_kv.items()}
  pieces, held = [], {}
  def take(l, pool, b0, b1, piece, n_pieces) -> bool:
    pieces.append((l, b0, b1, piece, n_pieces))
    held[l] = pool
    return l != 1                                      # layer 1 refused: it goes to on_layer
  got, got_kv = prefill(llama, ids, n_valid=n, on_chunk=take)
  np.testing.assert_array_equal(got, want)
  assert pieces == [(l, 0, -(-n // layer_jit.BLOCK), 0, 1) for l in range(llama.cfg.n_layers)] and set(got_kv) == {1}
  for l, pool in held.items():
    k, v = (Tensor(x, device="MESH") for x in want_kv[l])
    np.testing.assert_array_equal(pool.numpy(), pack_kv(k, v, layer_jit.BLOCK).numpy())
  prefill(llama, ids, n_valid=n)                       # a held pool stays intact while later prompts run (the sender reads it)
  for l, pool in held.items():
    k, v = (Tensor(x, device="MESH") for x in want_kv[l])
    np.testing.assert_array_equal(pool.numpy(), pack_kv(k, v, layer_jit.BLOCK).numpy())
