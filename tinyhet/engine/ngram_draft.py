"""Prompt-lookup drafting (n-gram): the tokens that followed the last place where a sequence's newest n tokens appeared
before, in its prompt or its output so far. No second model: it pays where the output quotes its input (rewrites, patches).

  draft = ngram_draft(token_ids, k=4)     # at most k token ids; [] where no n-gram (n = 3, 2, 1) of the tail recurs
"""
from __future__ import annotations
import numpy as np

MAX_N = 3            # the longest tail matched first; shorter ones only where it does not recur

def ngram_draft(token_ids: list[int], k: int, max_n: int = MAX_N, min_n: int = 1) -> list[int]:
  """Up to k tokens that followed the most recent earlier occurrence of the last n tokens (n from max_n down to min_n)."""
  if k < 1 or len(token_ids) < 2: return []
  a = np.asarray(token_ids, dtype=np.int64)
  L = len(a)
  for n in range(min(max_n, L - 1), min_n - 1, -1):
    tail = a[L - n:]
    # starts i < L - n of a window equal to the tail, latest first: a[i:i+n] == tail, with a token after it
    hits = np.ones(L - n, dtype=bool)
    for j in range(n): hits &= a[j:L - n + j] == tail[j]
    if (idx := np.flatnonzero(hits)).size:
      start = int(idx[-1]) + n
      return [int(t) for t in a[start:start + k]]
  return []
