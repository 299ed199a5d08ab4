"""The paged cache under the real model: batched greedy decoding through Scheduler + PagedKVCache (prefill on this node,
jitted decode, preemption and recompute in a pool too small for all sequences) gives the tokens of the model's dense
reference; decode steps through the engines' one decode step (DecodeEngine: bucketed, padded, jitted)."""
import numpy as np
import pytest
from tinygrad import Tensor, dtypes
from tinyhet.engine.decode_engine import DecodeEngine
from tinyhet.engine.scheduler import Scheduler, Sequence
from tinyhet.kv.paged_cache import PagedKVCache
from tinyhet.model import llama as model

@pytest.mark.slow
def test_batched_paged_decoding_matches_the_dense_reference():
  cfg = model.small_config(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, hidden_dim=96, vocab_size=256, max_context=128)
  llama = model.Llama(cfg, model.random_weights(cfg, seed=0))
  rng = np.random.default_rng(0)
  prompts = [[int(x) for x in rng.integers(0, 256, n)] for n in (7, 19, 12, 30)]
  new_tokens = [20, 9, 24, 14]
  want = [llama.reference_generate(p, n, kv_dtype=dtypes.float16) for p, n in zip(prompts, new_tokens)]

  # 12 blocks of 8 = 96 slots for up to 4 sequences of 27..44 tokens: admission waits and decode preempts
  cache = PagedKVCache(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, num_blocks=13, block_size=8, max_seq_len=128)   # +1: the padding rows'
  engine = DecodeEngine(llama, cache)
  sched = Scheduler(cache.block_manager, max_num_seqs=4, capacity=12)
  seqs = [Sequence(i, list(p), max_new_tokens=n) for i, (p, n) in enumerate(zip(prompts, new_tokens))]
  for seq in seqs: sched.add(seq)
  while not sched.is_finished():
    batch, is_prefill = sched.schedule()
    assert batch, "the scheduler stalled"
    if is_prefill:                                     # each prompt (or preempted sequence) in one forward, T = its length
      sampled = []
      for seq in batch:
        positions = Tensor(cache.begin_step([seq.seq_id], n_tokens=seq.num_tokens))
        assert positions.tolist() == [list(range(seq.num_tokens))]
        sampled.append(int(llama.forward(Tensor([seq.token_ids], dtype=dtypes.int32), positions, cache).numpy()[0].argmax()))
    else: sampled = [int(row.argmax()) for row in engine.step([seq.seq_id for seq in batch], [seq.token_ids[-1] for seq in batch])]
    sched.postprocess(batch, sampled)
  assert sched.num_preemptions > 0
  for seq, ref in zip(seqs, want): assert seq.token_ids[seq.num_prompt_tokens:] == ref, f"sequence {seq.seq_id}"
  assert cache.block_manager.num_free == 12
