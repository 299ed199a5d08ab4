"""Batched decode on the decode node: batches padded to a few buckets (one TinyJit capture per bucket, not per batch size),
and padding rows that change no sequence's tokens."""
import queue, threading
import numpy as np
import pytest
from hypothesis import given, strategies as st
import tinyhet  # noqa: F401
from tinyhet.engine.decode_engine import BATCH_BUCKETS, batch_bucket
from tinyhet.engine.decode_node import DecodeNode
from tinyhet.device.memory import local_node
from tinyhet.model.llama import Llama, random_weights, small_config
from tinyhet.model.sampling import Sampler
from tinyhet.engine.scheduler import Sequence

@given(st.integers(1, 1000))
def test_bucket_holds_the_batch_and_pads_little(n):
  b = batch_bucket(n)
  assert b >= n and (b in BATCH_BUCKETS or b % 64 == 0)
  assert b <= max(2 * n, n + 63), "a bucket wastes at most half its rows (or one 64-row step past 128)"
  assert batch_bucket(b) == b and all(batch_bucket(m) <= b for m in range(1, n + 1))

@pytest.mark.slow
def test_shrinking_batch_decodes_the_reference_tokens_with_one_capture_per_bucket():
  cfg = small_config(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, hidden_dim=96, vocab_size=256, max_context=128)
  model = Llama(cfg, random_weights(cfg, device="MESH", seed=5), "MESH")
  rng = np.random.default_rng(2)
  prompts = [[int(t) for t in rng.integers(0, 256, n)] for n in (6, 11, 3, 17, 9)]
  new = [4, 9, 6, 12, 7]                      # sequences finish at different steps: the batch runs at 5, 4, 3, 2 and 1
  want = [model.reference_generate(p, n) for p, n in zip(prompts, new)]
  decode = DecodeNode(model, local_node(), kv_blocks=64, block_size=4, max_num_seqs=8, model_id="batching")
  seqs = []
  for i, (p, n) in enumerate(zip(prompts, new)):
    seq = Sequence(100 + i, list(p), n)
    seq.extra.update(queue=queue.SimpleQueue(), sampler=Sampler(0.0, 1.0, 0), stop_ids=set())
    decode.scheduler.add(seq)                # prefilled on the node (its recompute path), then decoded in one batch
    seqs.append(seq)
  stop = threading.Event()
  got: list[list[int]] = [[] for _ in seqs]
  def collect():
    for i, s in enumerate(seqs):
      while (tok := s.extra["queue"].get(timeout=600)) is not None: got[i].append(tok)
    stop.set()
  t = threading.Thread(target=collect, daemon=True)
  t.start()
  try: decode.run(stop, warm_up=False)
  finally: decode.close()
  t.join(5)
  assert got == want
  assert set(decode.engine.steps) <= {1, 2, 4, 8}, f"decode steps captured for batches {sorted(decode.engine.steps)}, not buckets"
  assert decode.cache.block_manager.num_used == 1, "every sequence's blocks came back (one block stays with the padding rows)"
