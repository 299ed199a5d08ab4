"""The lengths tinyhet compiles for. tinygrad compiles and captures per shape, so every length a request brings rounds up to
one of a small fixed set, and a node can build the captures of all of them before its first request (tinyhet.engine.warm_up).

  16, 24, 32, 48, 64, 96, ... (powers of two and the 1.5x steps between them) below the chunk length, then the chunk length,
  then the chunk length times 1.5, 2, 3, 4, 6, 8, ...

Consecutive sizes differ by at most 1.5x, so a bucket past 16 pads at most a third of itself. A length past the chunk
length is whole chunks but for one half chunk (1.5x): its last chunk is the chunk length or its half, and the pool of its
blocks is the bucket's, so each bucket past the chunk length is one or two chunk captures (tinyhet.model.chunked_prefill).
"""
from __future__ import annotations
from math import ceil

SMALLEST = 16

def _next(b: int) -> int:
  return b * 3 // 2 if b & (b - 1) == 0 else b * 4 // 3     # 16 -> 24 -> 32 -> 48 -> 64 ...

def sizes(chunk: int, limit: int) -> tuple[int, ...]:
  """Every bucket up to the first that holds `limit` tokens (a model's context), for chunks of `chunk` tokens."""
  if chunk < 1 or limit < 1: raise ValueError(f"buckets: chunk {chunk} and limit {limit} must be positive")
  out, b = [], SMALLEST
  while b < chunk:
    out.append(b)
    b = _next(b)
  out.append(chunk)
  halves = 3                                  # past the chunk length: chunk x 3/2, 4/2, 6/2, 8/2, 12/2, ...
  while out[-1] < limit:
    out.append(ceil(chunk * halves / 2))
    halves = _next(halves)
  return tuple(out)

def bucket(n: int, chunk: int) -> int:
  """The length n tokens run at: the smallest of `sizes` that holds n."""
  if n < 1: raise ValueError(f"buckets: a length must be positive, got {n}")
  return next(b for b in sizes(chunk, n) if b >= n)

def below_chunk(chunk: int) -> tuple[int, ...]:
  """The buckets shorter than the chunk length: the lengths a last chunk may run at."""
  return tuple(b for b in sizes(chunk, chunk) if b < chunk)
