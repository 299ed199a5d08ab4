"""Choosing the next token from logits, on the host with numpy: greedy, temperature, top-p; deterministic for a seed."""
from __future__ import annotations
import math, secrets
import numpy as np

MIN_TEMPERATURE = 1e-6     # below this, logits / temperature overflows float64 for ordinary logits; such a temperature is greedy anyway

def check_sampling(temperature, top_p) -> tuple[float, float]:
  """Validate sampling settings where a request arrives (CLI, control request), so a bad value never reaches the sampler."""
  def number(v) -> bool: return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
  if not number(temperature) or temperature < 0 or 0 < temperature < MIN_TEMPERATURE:
    raise ValueError(f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE:g}, got {temperature!r}")
  if not number(top_p) or not 0 < top_p <= 1: raise ValueError(f"top_p must be a number in (0, 1], got {top_p!r}")
  return float(temperature), float(top_p)

class Sampler:
  """sampler(logits (vocab,), position) -> token id. temperature == 0 is greedy (argmax, lowest id on ties); otherwise softmax
  of logits / temperature, cut to the smallest set of most likely tokens whose probability reaches top_p, sampled with one
  uniform draw that depends only on (seed, position): position is the index the token takes in the sequence (the prompt's
  length for the first generated token). No random state carries from one token to the next, so a sequence continued
  anywhere -- on another node, or prefilled again with its tokens so far as the prompt after a node was lost -- draws what
  a clean run draws. Without a position the sampler counts on from the last one (from `position`, 0 by default).
  seed None: a random seed, kept in .seed so another node can continue the stream."""

  def __init__(self, temperature: float = 0.0, top_p: float = 1.0, seed: int | None = 0, position: int = 0):
    self.temperature, self.top_p = check_sampling(temperature, top_p)
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**64):
      raise ValueError(f"seed must be an integer in [0, 2**64) or None, got {seed!r}")
    self.seed, self.position = secrets.randbits(63) if seed is None else seed, position

  def uniform(self, position: int) -> float:
    """The draw in [0, 1) for the token at `position`: numpy's SeedSequence hashes (seed, position), so neighbours are unrelated."""
    return float(np.random.default_rng((self.seed, position)).random())

  def probabilities(self, logits: np.ndarray) -> np.ndarray:
    """The distribution sampled from (float64, sums to 1); one-hot at the argmax when greedy."""
    logits = _finite(logits)
    if self.temperature == 0:
      p = np.zeros_like(logits)
      p[int(np.argmax(logits))] = 1.0
      return p
    z = logits / self.temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    if self.top_p < 1:
      order = np.argsort(-p, kind="stable")
      keep = np.searchsorted(np.cumsum(p[order]), self.top_p) + 1   # the tokens before the cut, and the one that crosses top_p
      cut = np.zeros_like(p)
      cut[order[:keep]] = p[order[:keep]]
      p = cut / cut.sum()
    return p

  def __call__(self, logits: np.ndarray, position: int | None = None) -> int:
    position = self.position if position is None else position
    self.position = position + 1
    if self.temperature == 0: return int(np.argmax(_finite(logits)))
    cdf = np.cumsum(self.probabilities(logits))
    # the first token whose cumulative probability passes the draw: never a token of probability 0 (cdf is flat there)
    return min(int(np.searchsorted(cdf, self.uniform(position) * cdf[-1], side="right")), cdf.shape[0] - 1)

def _finite(logits) -> np.ndarray:
  logits = np.asarray(logits, dtype=np.float64).reshape(-1)
  if not np.isfinite(logits).all(): raise ValueError(f"the model produced non-finite logits ({int((~np.isfinite(logits)).sum())} of {logits.size})")
  return logits
