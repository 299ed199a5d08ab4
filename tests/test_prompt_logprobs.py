"""A prompt's own logprobs from its prefill's last-layer rows (tinyhet.engine.prompt_logprobs): equal to the dense reference
(every position's logits of one forward) within 1e-3 at lengths on both sides of chunk boundaries, with the top alternatives
in the reference's order; over a cached prefix (the prefix prefilled alone, the suffix's rows from the suffix's own prefill
over the cached K, V), the same; the output head never runs over more rows than a chunk."""
import numpy as np
import pytest
import tinyhet  # noqa: F401  (HET, MESH)
from tinygrad import Tensor, dtypes
from tinyhet.engine.prompt_logprobs import PromptLogprobs, prompt_logprobs
from tinyhet.model.llama import DenseKVCache, Llama, random_weights, small_config
from tinyhet.model.sampling import log_softmax

CHUNK = 16

@pytest.fixture(scope="module")
def llama():
  cfg = small_config(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, hidden_dim=96, vocab_size=256, max_context=256)
  m = Llama(cfg, random_weights(cfg, device="MESH", seed=9), "MESH")
  m.prefill_chunk = CHUNK
  return m

def ids_of(T: int, seed: int = 0) -> list[int]: return [int(t) for t in np.random.default_rng(seed).integers(0, 256, T)]

def dense_logprobs(llama, ids: list[int]) -> np.ndarray:
  """The reference: log-softmax of every position's logits from one dense forward over the prompt, (T, vocab)."""
  T = len(ids)
  logits = llama.forward(Tensor([ids], dtype=dtypes.int32, device="MESH"), Tensor.arange(T, dtype=dtypes.int32).reshape(1, T).to("MESH"),
                         DenseKVCache(llama.cfg, 1, T, dtypes.float16, "MESH"), all_rows=True).numpy()[0]
  return log_softmax(logits)

def check(entries, ids, lp, n_top):
  assert len(entries) == len(ids) and entries[0] is None
  for i in range(1, len(ids)):
    e, row = entries[i], lp[i - 1]
    assert abs(e["logprob"] - row[ids[i]]) < 1e-3, (i, e["logprob"], row[ids[i]])
    top = e["top_logprobs"]
    assert [t for t, _ in top] == list(np.lexsort((np.arange(len(row)), -row))[:n_top]), i    # most likely first, lowest id on ties
    assert all(abs(v - row[t]) < 1e-3 for t, v in top)

@pytest.mark.parametrize("T,n_top", [(1, 1), (2, 0), (16, 3), (17, 1), (40, 20)])     # one chunk, a chunk and one token, three chunks
def test_prompt_logprobs_equal_the_dense_reference_across_chunk_boundaries(llama, T, n_top):
  ids = ids_of(T, T)
  check(prompt_logprobs(llama, ids, n_top), ids, dense_logprobs(llama, ids), n_top)
  assert all(C <= CHUNK for C in llama.__dict__.get("_row_heads", {}))     # the head's logits: a chunk's rows at most, never (T, vocab)

def test_over_a_cached_prefix_the_prefix_alone_and_the_suffix_give_the_whole_prompts(llama):
  # as a decode node scores a prefix-cache hit: the prefix's rows by a prefill of it alone, the suffix's by its own prefill
  # over the cached blocks (prefill_suffix_logits)
  from tinyhet.engine.local_engine import LocalEngine
  from tinyhet.engine.prefill import prefill_logits, prefill_suffix_logits
  engine = LocalEngine(llama, 256, block_size=8, prefix_cache=True)
  ids = ids_of(50, 4)
  engine.generate(ids[:40], 1)
  bm = engine.cache.block_manager
  bm.allocate(997, len(ids), ids)
  hit = bm.cached_length(997)
  assert hit == 40
  scorer = PromptLogprobs(llama, ids, 2)
  prefill_logits(llama, ids[:hit], dtypes.float16, on_hidden=scorer)
  with pytest.raises(RuntimeError, match="rows seen"): scorer.entries                      # the suffix's rows are still missing
  prefill_suffix_logits(llama, engine.cache, 997, ids, hit, on_hidden=scorer)
  check(scorer.entries, ids, dense_logprobs(llama, ids), 2)

def test_bad_alternatives_are_refused(llama):
  for bad in (-1, 21):
    with pytest.raises(ValueError, match="alternatives"): PromptLogprobs(llama, [1, 2], bad)
