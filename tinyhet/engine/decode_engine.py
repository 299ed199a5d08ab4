"""The decode step every engine runs: a batch of sequences, one new token each, through the paged KV cache.

  engine = DecodeEngine(model, cache)          # the cache holds one block more than its sequences: PAD_SEQ's
  logits = engine.step(seq_ids, tokens)        # (len(seq_ids), vocab) float32; each sequence's slot for the token is held already
  logits = engine.step(seq_ids, tokens, counts=counts)   # counts[i] tokens of seq_ids[i], a row each (speculative's verify step)

A step pads the batch to its bucket (BATCH_BUCKETS) with rows of PAD_SEQ, a one-token sequence whose single block takes
the padding rows' K, V writes; sets the step's block tables (cache.begin_step); writes tokens and positions into the
cache's fixed input buffers (cache.step_inputs); and replays the TinyJit capture of that bucket (one per bucket, the block
count a bound Variable, so one capture serves every context length). The decode node (decode_node.py), the single-device
engine (local_engine.py) and `tinyhet bench decode` all decode through this class, and speculative decoding's verify step
(speculative.py) too: its k + 1 tokens a sequence are rows of a decode step, so it replays the captures of plain decode.
"""
from __future__ import annotations
import contextlib
import numpy as np
from tinyhet.device.cpu_threads import kernel_threads
from tinyhet.kv.paged_cache import PagedKVCache
from tinyhet.model.layer_jit import Replay
from tinyhet.model.llama import Llama

PAD_SEQ = -1              # a one-token sequence that owns one block: the rows that pad a decode batch to its bucket write there
BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)

def batch_bucket(n: int) -> int:
  """The batch a decode step of n sequences runs at: the next bucket (past 128, the next multiple of 64). One TinyJit capture
  per bucket, so a batch that changes every step compiles at most once per bucket; padding rows cost little while decode
  reads the weights once for every row."""
  return next((b for b in BATCH_BUCKETS if b >= n), -(-n // 64) * 64)

def decode_rate(marks: list[float]) -> float:
  """Tokens/s between the first and the last of these token times (perf_counter): the rate of the running batch, not the
  wait for the first step."""
  return (len(marks) - 1) / (marks[-1] - marks[0]) if len(marks) > 1 and marks[-1] > marks[0] else 0.0

class DecodeEngine:
  """The jitted, bucketed, padded paged decode step of `model` over `cache` (on the model's device)."""
  def __init__(self, model: Llama, cache: PagedKVCache):
    self.model, self.cache = model, cache
    self.steps: dict[int, Replay] = {}      # batch bucket -> its capture
    cache.block_manager.allocate(PAD_SEQ, 1)

  def step(self, seq_ids: list[int], tokens: list[int], lock=None, bucket: int | None = None, counts: list[int] | None = None) -> np.ndarray:
    """Logits (len(tokens), vocab) float32 of one decode step: tokens[i] is sequence seq_ids[i]'s newest token, whose slot
    the block manager holds already (Scheduler.schedule, or append_slot). lock: held while the step's block tables are read
    (the block manager's owner may change them from other threads); the forward itself runs without it. bucket: the batch to
    run at (default: batch_bucket's, or while the model warms up the smallest ready one that holds it: tinyhet.engine.warm_up).
    counts: several tokens a sequence, one row each (speculative decoding's verify step): sequence seq_ids[i] has the
    counts[i] tokens after those of the sequences before it, its last counts[i] slots (cache.begin_step's counts). The step
    is the plain decode step of len(tokens) rows, padded to its bucket and replayed from the same capture; its attention
    cuts each row's context as the plain step of len(seq_ids) rows does (cache.begin_step's split_rows)."""
    n = len(tokens)
    if counts is None and n != len(seq_ids) or counts is not None and (len(counts) != len(seq_ids) or sum(counts) != n) or n == 0:
      raise ValueError(f"a decode step takes one token per row: {len(seq_ids)} sequences, {n} tokens, counts {counts}")
    B = bucket or batch_bucket(n)
    if bucket is None and (warm := getattr(self.model, "warm", None)) is not None: B = warm.pick("decode", B)
    with lock if lock is not None else contextlib.nullcontext():
      # a verify's rows cut their context as the plain step of its sequences does (that bucket's attention parts): each
      # row then sums its attention as a plain step would, whatever the verify's row count
      positions = self.cache.begin_step(list(seq_ids) + [PAD_SEQ] * (B - n), 1, None if counts is None else list(counts) + [1] * (B - n),
                                        None if counts is None else batch_bucket(len(seq_ids)))
    with kernel_threads(self.model.device):
      toks, pos = self.cache.step_inputs(np.array(list(tokens) + [0] * (B - n), dtype=np.int32).reshape(B, 1), positions)
      # replayed straight from its capture once made (layer_jit.Replay: TinyJit's own call re-derives every input's view, ~1.3 ms
      # of Python a step measured at batch 16); the inputs are the cache's fixed buffers, so the signature never changes
      if B not in self.steps: self.steps[B] = Replay(lambda t, p, **kv: self.model.forward(t, p, self.cache).realize())
      return self.steps[B](toks, pos, **self.cache.jit_kwargs()).numpy()[:n]

  def warm_up(self, batch_sizes=(1,), lock=None):
    """Capture the step for these batch sizes' buckets now (every row a padding row), so a first request does not pay
    tinygrad's scheduling and compiles."""
    for B in sorted({batch_bucket(b) for b in batch_sizes}):
      for _ in range(3): self.step([PAD_SEQ] * B, [0] * B, lock, bucket=B)      # TinyJit: the first call runs, the second captures, the third replays
