"""Prompt-lookup drafting (n-gram): the tokens that followed the last place where a sequence's newest n tokens appeared
before, in its prompt or its output so far. No second model: it pays where the output quotes its input (rewrites, patches).

  draft, n = ngram_draft(token_ids, k=8)   # at most k token ids and the n matched; ([], 0) where not even the last token recurs
  index = NgramIndex()                     # the same drafts for one growing sequence, from a table kept as it grows
  draft, n = index.draft(token_ids, k)

The tail is matched at the longest of SIZES that recurs (16, 10, 6, 4, 3, 2, 1 tokens), at its most recent earlier
place. n is returned because it tells how far to trust the draft: measured on tinyhet bench spec's greedy outputs, a
16-token match's next token was the model's ~98% of the time, a 1-token match's 29% (copy) and 15% (free chat); the
policy (spec_policy.py) keeps its acceptance estimates by n.

Where the continuation reaches the sequence's end (the tail recurs within the last k tokens: the output repeats itself),
it goes on through the draft's own tokens, so a loop of period p drafts k tokens, not p - 1.

NgramIndex gives ngram_draft's answer without scanning the sequence each step (a dict from each SIZES-long window to the
last place it ended, filled as tokens come): a step costs a few dict lookups a sequence, not a pass over its tokens per n.
"""
from __future__ import annotations
import numpy as np

SIZES = (16, 10, 6, 4, 3, 2, 1)      # tail lengths tried, longest first

def continuation(token_ids, end: int, k: int) -> list[int]:
  """k tokens after position end (< len - 1): the sequence's own, then, past its end, the draft's (the same period)."""
  L, out = len(token_ids), []
  for j in range(k):
    i = end + 1 + j
    out.append(int(token_ids[i]) if i < L else out[i - L])
  return out

def ngram_draft(token_ids: list[int], k: int, sizes: tuple[int, ...] = SIZES) -> tuple[list[int], int]:
  """Up to k tokens that followed the most recent earlier occurrence of the last n tokens, n the longest of sizes that
  recurs; and n (0, with no draft, where none does)."""
  if k < 1 or len(token_ids) < 2: return [], 0
  a = np.asarray(token_ids, dtype=np.int64)
  L = len(a)
  for n in sizes:
    if n > L - 1: continue
    tail = a[L - n:]
    # starts i < L - n of a window equal to the tail, latest first: a[i:i+n] == tail, with a token after it
    hits = np.ones(L - n, dtype=bool)
    for j in range(n): hits &= a[j:L - n + j] == tail[j]
    if (idx := np.flatnonzero(hits)).size: return continuation(token_ids, int(idx[-1]) + n - 1, k), n
  return [], 0

CHECKED = 16          # the last tokens indexed that a list must hold where the index has them to count as the same

class NgramIndex:
  """ngram_draft for one sequence that only grows (its prompt, then its output). A list that is shorter than the one
  indexed, or holds another first token or other tokens where the last CHECKED indexed ones were, is indexed again from
  the start (a cheap check, not a full one: the drafts of a list that passes it wrongly are only worse guesses, which
  the verify step rejects)."""
  def __init__(self, sizes: tuple[int, ...] = SIZES):
    self.sizes, self.last = sizes, {}     # window tuple -> the last position it ended at (with a token after it)
    self.n, self.ends = 0, ()             # tokens indexed; the first and the last CHECKED of them

  def draft(self, token_ids: list[int], k: int) -> tuple[list[int], int]:
    L, n0 = len(token_ids), self.n
    if L < n0 or n0 and (token_ids[0], *token_ids[max(0, n0 - CHECKED):n0]) != self.ends: self.last, n0 = {}, 0
    last, lo = self.last, max(0, n0 - 1)
    if L - 1 - lo <= 16:      # a step's few tokens: the windows ending at positions lo..L-2 (now followed by a token)
      for end in range(lo, L - 1):
        for n in self.sizes:
          if n <= end + 1: last[tuple(token_ids[end - n + 1:end + 1])] = end
    else:                     # a prompt: the same windows, each n's made by zip (in C), later ones last
      for n in self.sizes:
        if (first := max(lo, n - 1)) > L - 2: continue              # the first end a window of n fits before
        cols = [token_ids[first - n + 1 + j:L - n + j] for j in range(n)]   # column j: each window's j-th token
        last.update(zip(zip(*cols), range(first, L - 1)))
    self.n, self.ends = L, ((token_ids[0], *token_ids[max(0, L - CHECKED):]) if L else ())
    if k < 1 or L < 2: return [], 0
    for n in self.sizes:
      if n <= L - 1 and (end := last.get(tuple(token_ids[L - n:]))) is not None: return continuation(token_ids, end, k), n
    return [], 0
