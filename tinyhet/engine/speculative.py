"""Speculative decoding on the decode node's paged KV: each sequence's newest token and up to k drafted tokens
(engine/ngram_draft.py) go through the model in one step (the weights read once for k + 1 tokens a row), the longest
prefix of drafts that the model itself would have produced is kept, and the rejected drafts' KV slots are given back.

  spec = SpeculativeStep(engine)                       # over a DecodeEngine's model and paged cache
  draws = spec.step(seq_ids, token_lists, samplers, k)  # per sequence the Draws of 1..k+1 new tokens

Before a step each sequence holds len(tokens) slots (the newest token's included, as for a plain decode step); after it
len(tokens) + len(draws) - 1, and the blocks taken for rejected drafts are back in the free queue where they were
(BlockManager.truncate, last taken first): lengths, table sizes and free blocks are as a plain decode of the same tokens
leaves them, no hash covering a rejected token. Which block ids each sequence holds may differ from plain decode's: rows
cross block boundaries in another order, and a block one row rolls back stays free while a later row keeps its own.

Why the output is plain decode's: row j of the step holds the model's logits after the tokens before it, so its draw is the
token plain decode draws at that position; a draft is kept only while it equals that draw. Sampling draws from (seed,
position) (tinyhet.model.sampling), so the same holds at any temperature: for a draft that is one token (a point mass),
drawing the model's token with the position's draw and keeping the draft while they agree is the standard rejection rule
(kept with probability p(x); on a rejection the token drawn is from p restricted to tokens != x, renormalized), and the
tokens are plain sampling's, token for token.
"""
from __future__ import annotations
import contextlib
import numpy as np
from tinygrad import Tensor, dtypes
from tinyhet.device.cpu_threads import kernel_threads
from tinyhet.engine.ngram_draft import ngram_draft
from tinyhet.model.sampling import sample_batch

MODES = ("off", "ngram")
MAX_K = 8

def check_speculative(value) -> dict:
  """A request's `speculative` field ({"mode": "off" | "ngram", "k": 1..8}), checked: ValueError in one line."""
  if not isinstance(value, dict) or set(value) - {"mode", "k"}:
    raise ValueError(f'speculative must be an object like {{"mode": "ngram", "k": 4}}, got {str(value)[:60]!r}')
  mode, k = value.get("mode", "ngram"), value.get("k", 4)
  if mode not in MODES: raise ValueError(f"speculative mode must be one of {', '.join(MODES)}, got {str(mode)[:40]!r}")
  if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_K:
    raise ValueError(f"speculative k must be an integer in 1..{MAX_K}, got {k!r}")
  return {"mode": mode, "k": k}

class SpeculativeStep:
  """Draft, verify in one multi-token step through the paged cache, keep the agreeing prefix, roll the rest back."""
  def __init__(self, engine):
    self.engine, self.cache, self.bm = engine, engine.cache, engine.cache.block_manager
    self.drafted = self.accepted = self.steps = 0      # /metrics' counters: accept length = accepted / steps + 1

  def drafts(self, token_lists: list[list[int]], k: int, limits: list[int]) -> list[list[int]]:
    """Each sequence's draft, cut so its slots fit the plain free blocks (no cached block evicted, nothing preempted) and
    its limit (tokens it may still take, less the one every step gives)."""
    out, free = [], len(self.bm.free_ids)
    for tokens, limit in zip(token_lists, limits):
      d = ngram_draft(tokens, min(k, max(0, limit - 1), self.cache.max_seq_len - len(tokens)))
      out.append(d)
    T = 1 + max(len(d) for d in out)
    while T > 1 and sum(self.bm.blocks_needed(len(t) + T - 1) - self.bm.blocks_needed(len(t)) for t in token_lists) > free: T -= 1
    return [d[:T - 1] for d in out]

  def step(self, seq_ids: list[int], token_lists: list[list[int]], samplers: list, k: int, limits: list[int] | None = None,
           stops: list[set] | None = None, lock=None) -> list[list]:
    """Per sequence the Draws of its new tokens (1 + its accepted drafts). limits: tokens each may still take. stops: each
    sequence's stop ids, after which nothing more is kept (cut before the rollback). lock: held while the block manager
    and the step's block tables are touched (the decode node's, whose other threads change them)."""
    limits = limits or [k + 1] * len(seq_ids)
    with lock if lock is not None else contextlib.nullcontext():
      drafts = self.drafts(token_lists, k, limits)
      T = 1 + max(len(d) for d in drafts)
      if T > 1:
        rows = []
        for sid, tokens, d in zip(seq_ids, token_lists, drafts):
          for _ in range(T - 1): self.bm.append_slot(sid)
          rows.append([tokens[-1], *d, *[d[-1] if d else tokens[-1]] * (T - 1 - len(d))])   # a short draft padded: its rows are dropped
        positions = self.cache.begin_step(seq_ids, T)
    if T == 1:                                # nothing drafted: a plain decode step
      self.steps += len(seq_ids)
      logits = self.engine.step(seq_ids, [t[-1] for t in token_lists], lock)
      return [[d] for d in sample_batch(logits, samplers, [len(t) for t in token_lists], token_lists)]
    logits = self.forward(rows, positions)     # (B, T, vocab)
    out = []
    for i, (tokens, d) in enumerate(zip(token_lists, drafts)):
      kept = []
      for j in range(len(d) + 1):            # the model's draw at each drafted position, kept while the draft agrees
        draw = sample_batch(logits[i, j][None], [samplers[i]], [len(tokens) + j], [tokens + d[:j]])[0]
        kept.append(draw)
        if isinstance(draw, Exception) or j == len(d) or draw.token != d[j] or (stops and draw.token in stops[i]): break
      self.drafted += len(d)
      self.accepted += len(kept) - 1
      out.append(kept)
    with lock if lock is not None else contextlib.nullcontext():
      for sid, tokens, kept in reversed(list(zip(seq_ids, token_lists, out))):   # undone last taken first: the free queue's order
        self.bm.truncate(sid, len(tokens) + len(kept) - 1)
    self.steps += len(seq_ids)
    return out

  def forward(self, rows: list[list[int]], positions: np.ndarray) -> np.ndarray:
    """Logits (B, T, vocab) of every row's T tokens, whose slots the block manager holds (the last T of each sequence;
    positions: the cache's begin_step for them)."""
    B, T = len(rows), len(rows[0])
    dev = self.cache.pools[0].device
    with kernel_threads(self.engine.model.device):
      toks = Tensor(np.array(rows, dtype=np.int32), dtype=dtypes.int32, device=dev)
      pos = Tensor(positions.astype(np.int32), dtype=dtypes.int32, device=dev)
      return self.engine.model.forward(toks, pos, self.cache, all_rows=True).realize().numpy().reshape(B, T, -1)
