"""Choosing the next token from logits, on the host with numpy, a whole batch at once in float32: greedy, temperature,
penalties (presence, frequency, repetition), logit_bias, top-k, min-p, top-p; deterministic for a seed; logprobs read from
the same float32 logits."""
from __future__ import annotations
import math, secrets
from dataclasses import dataclass
import numpy as np

MIN_TEMPERATURE = 1e-6     # below this, logits / temperature overflows float32 for ordinary logits; such a temperature is greedy anyway
CANDIDATES = 1024          # top-k/top-p/min-p look at this many most likely tokens per row first (argpartition), the whole row only if needed
MAX_TOP_LOGPROBS = 20

def _number(v) -> bool: return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

def check_sampling(temperature, top_p) -> tuple[float, float]:
  """Validate sampling settings where a request arrives (CLI, control request), so a bad value never reaches the sampler."""
  if not _number(temperature) or temperature < 0 or 0 < temperature < MIN_TEMPERATURE:
    raise ValueError(f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE:g}, got {temperature!r}")
  if not _number(top_p) or not 0 < top_p <= 1: raise ValueError(f"top_p must be a number in (0, 1], got {top_p!r}")
  return float(temperature), float(top_p)

# the options beyond temperature/top_p/seed, as the router sends them to the nodes: name -> (default, check, what it must be)
OPTIONS = {
  "top_k": (0, lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= -1, "an integer >= -1 (0 or -1: off)"),
  "min_p": (0.0, lambda v: _number(v) and 0 <= v <= 1, "a number in [0, 1]"),
  "presence_penalty": (0.0, lambda v: _number(v) and -2 <= v <= 2, "a number in [-2, 2]"),
  "frequency_penalty": (0.0, lambda v: _number(v) and -2 <= v <= 2, "a number in [-2, 2]"),
  "repetition_penalty": (1.0, lambda v: _number(v) and 0 < v <= 10, "a number in (0, 10] (1: off)"),
  "logit_bias": (None, lambda v: v is None or (isinstance(v, dict) and len(v) <= 1024 and all(
    isinstance(k, str) and k.isdigit() and _number(b) and -100 <= b <= 100 for k, b in v.items())), "an object of token id -> bias in [-100, 100]"),
  "logprobs": (None, lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_TOP_LOGPROBS),
               f"null or an integer in 0..{MAX_TOP_LOGPROBS} (how many top alternatives)"),
  "prompt_logprobs": (None, lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_TOP_LOGPROBS),
                      "null or an integer in 0..20 (the prompt's own logprobs, with this many alternatives)"),
  "output_from": (None, lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0), "null or a token index"),
  # vLLM's min_tokens: the ids in min_tokens_ids (the request's stop ids) are never drawn for the first min_tokens output tokens
  "min_tokens": (0, lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 1 << 20, "an integer in 0..2**20"),
  "min_tokens_ids": ((), lambda v: isinstance(v, (list, tuple)) and len(v) <= 1024 and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                                                         for t in v), "a list of at most 1024 token ids"),
  # llguidance grammar text (tinyhet.engine.grammar): the node that samples builds its Constraint, which masks every draw
  # speculative decoding on the decode node (tinyhet.engine.speculative; check_speculative below gives the precise error)
  "speculative": (None, lambda v: v is None or _speculative_ok(v),
                  'null or an object like {"mode": "ngram", "k": 4} (mode off, ngram or draft, k in 1..8)'),
  "grammar": (None, lambda v: v is None or (isinstance(v, str) and 0 < len(v) <= 1 << 20), "null or a grammar text of at most 1 MiB"),
}

MODES = ("off", "ngram", "draft")    # draft: a draft model's greedy tokens (tinyhet.engine.draft_model), on a node that has one
MAX_K = DEFAULT_K = 8   # the most a sequence drafts a step; the policy cuts each draft to what pays (tinyhet.engine.spec_policy)

def check_speculative(value) -> dict:
  """A request's `speculative` field ({"mode": "off" | "ngram" | "draft", "k": 1..8}), checked: ValueError in one line."""
  if not isinstance(value, dict) or set(value) - {"mode", "k"}:
    raise ValueError(f'speculative must be an object like {{"mode": "ngram", "k": 4}}, got {str(value)[:60]!r}')
  mode, k = value.get("mode", "ngram"), value.get("k", DEFAULT_K)
  if mode not in MODES: raise ValueError(f"speculative mode must be one of {', '.join(MODES)}, got {str(mode)[:40]!r}")
  if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_K:
    raise ValueError(f"speculative k must be an integer in 1..{MAX_K}, got {k!r}")
  return {"mode": mode, "k": k}

def _speculative_ok(value) -> bool:
  try: check_speculative(value)
  except ValueError: return False
  return True

def check_options(options: dict) -> dict:
  """The sampling options of a control request, checked: ValueError naming a bad or unknown one."""
  if not isinstance(options, dict): raise ValueError(f"sampling options must be an object, got {type(options).__name__}")
  for k, v in options.items():
    if k not in OPTIONS: raise ValueError(f"unknown sampling option {k!r}: known ones are {', '.join(OPTIONS)}")
    if not OPTIONS[k][1](v): raise ValueError(f"{k} must be {OPTIONS[k][2]}, got {str(v)[:60]!r}")
  return dict(options)

@dataclass
class Draw:
  """One sampled token; with logprobs asked for, its log-probability and the top alternatives [(token, logprob)] under the
  model's distribution (the raw logits' log-softmax: before penalties, temperature and truncation, as vLLM's default)."""
  token: int
  logprob: float | None = None
  top: list | None = None

class Sampler:
  """sampler(logits (vocab,), position, tokens) -> token id. temperature == 0 is greedy (argmax, lowest id on ties); otherwise
  softmax of the processed logits / temperature, cut to the top_k most likely, to those at least min_p times the most likely,
  and to the smallest set of most likely tokens whose probability reaches top_p (in that order, each on the renormalized
  mass of the one before), sampled with one uniform draw that depends only on (seed, position): position is the index the
  token takes in the sequence (the prompt's length for the first generated token). No random state carries from one token
  to the next, so a sequence continued anywhere -- on another node, or prefilled again with its tokens so far as the prompt
  after a node was lost -- draws what a clean run draws. Without a position the sampler counts on from the last one.
  Penalties (as vLLM's): repetition_penalty divides positive and multiplies negative logits of every token in `tokens`
  (prompt and output); presence_penalty and frequency_penalty subtract per token of the output (tokens[output_from:];
  output_from None: all of `tokens` is prompt); logit_bias adds to the given ids. Greedy reads the penalized logits too.
  seed None: a random seed, kept in .seed so another node can continue the stream."""

  def __init__(self, temperature: float = 0.0, top_p: float = 1.0, seed: int | None = 0, position: int = 0, **options):
    self.temperature, self.top_p = check_sampling(temperature, top_p)
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**64):
      raise ValueError(f"seed must be an integer in [0, 2**64) or None, got {seed!r}")
    self.seed, self.position = secrets.randbits(63) if seed is None else seed, position
    o = {k: d for k, (d, _, _) in OPTIONS.items()} | check_options(options)
    self.top_k, self.min_p, self.logprobs, self.output_from = max(0, o["top_k"]), float(o["min_p"]), o["logprobs"], o["output_from"]
    self.prompt_logprobs = o["prompt_logprobs"]      # read by the node that prefills (tinyhet.engine.prompt_logprobs)
    self.presence, self.frequency, self.repetition = float(o["presence_penalty"]), float(o["frequency_penalty"]), float(o["repetition_penalty"])
    self.bias = {int(k): float(b) for k, b in (o["logit_bias"] or {}).items()}
    self.min_tokens, self.min_tokens_ids = o["min_tokens"], tuple(o["min_tokens_ids"])
    if self.min_tokens and self.output_from is None: raise ValueError("min_tokens needs output_from (where the output starts)")
    self.speculative = o["speculative"]     # None: the decode node's default (tinyhet.engine.speculative_rows)
    self.grammar, self.constraint = o["grammar"], None     # the constraint: tinyhet.engine.grammar.constrain sets it on the node

  def holds_back_stops(self, position: int) -> bool:
    """Whether the token at `position` is one of the first min_tokens of the output (no stop id is drawn, no stop string ends it)."""
    return bool(self.min_tokens) and position - self.output_from < self.min_tokens

  @property
  def penalizes(self) -> bool: return bool(self.presence or self.frequency or self.repetition != 1.0 or self.bias)
  @property
  def truncates(self) -> bool: return bool(self.top_k or self.min_p > 0 or self.top_p < 1)

  def uniform(self, position: int) -> float:
    """The draw in [0, 1) for the token at `position`: numpy's SeedSequence hashes (seed, position), so neighbours are unrelated."""
    return float(np.random.default_rng((self.seed, position)).random())

  def probabilities(self, logits: np.ndarray, tokens=()) -> np.ndarray:
    """The distribution sampled from (float32, sums to 1); one-hot at the argmax when greedy."""
    x = processed(_rows(logits), [self], [list(tokens)])
    if self.constraint is not None: x = np.where(self.constraint.allowed(list(tokens)), x, np.float32(-np.inf))
    if self.temperature == 0:
      p = np.zeros_like(x[0])
      p[int(np.argmax(x[0]))] = 1.0
      return p
    p = softmax(x / np.float32(self.temperature))[0]
    kept = kept_sets(p[None], [self])[0]
    if kept is None: return p
    cut = np.zeros_like(p)
    cut[kept] = p[kept]
    return cut / cut.sum()

  def __call__(self, logits: np.ndarray, position: int | None = None, tokens=()) -> int: return self.draw(logits, position, tokens).token

  def draw(self, logits: np.ndarray, position: int | None = None, tokens=()) -> Draw:
    """The token as sample_batch draws it for a batch of one, with its logprobs when asked for; ValueError for non-finite logits."""
    position = self.position if position is None else position
    draw = sample_batch(_rows(logits), [self], [position], [list(tokens)])[0]
    if isinstance(draw, Exception): raise draw
    return draw

def _rows(logits) -> np.ndarray: return np.asarray(logits, dtype=np.float32).reshape(1, -1)

def softmax(x: np.ndarray) -> np.ndarray:
  """Row-wise softmax in float32 (B, V)."""
  e = np.exp(x - x.max(axis=1, keepdims=True))
  return e / e.sum(axis=1, keepdims=True)

def log_softmax(x: np.ndarray) -> np.ndarray:
  """Row-wise log-softmax of float32 logits (B, V): the shift and the log-sum-exp in float64, the result float32."""
  m = x.max(axis=1, keepdims=True)
  lse = np.log(np.exp(x - m).sum(axis=1, keepdims=True, dtype=np.float64))
  return (x.astype(np.float64) - m - lse).astype(np.float32)

def top_alternatives(lp: np.ndarray, n: int) -> list[tuple[int, float]]:
  """The n most likely (token, logprob) of one row of log-probabilities, most likely first (lowest id on ties)."""
  if n <= 0: return []
  idx = np.argpartition(-lp, n - 1)[:n] if n < lp.shape[0] else np.arange(lp.shape[0])
  idx = idx[np.lexsort((idx, -lp[idx]))]
  return [(int(i), float(lp[i])) for i in idx[:n]]

def processed(x: np.ndarray, samplers: list[Sampler], tokens: list) -> np.ndarray:
  """The logits after each row's penalties and logit_bias (a copy where any applies)."""
  rows = [i for i, s in enumerate(samplers) if s.penalizes]
  if not rows: return x
  x, V = x.copy(), x.shape[1]
  for i in rows:
    s, seen = samplers[i], np.asarray(tokens[i], dtype=np.int64)
    seen = seen[(seen >= 0) & (seen < V)]
    if s.repetition != 1.0 and seen.size:
      ids = np.unique(seen)
      v = x[i, ids]
      x[i, ids] = np.where(v > 0, v / s.repetition, v * s.repetition)
    if (s.presence or s.frequency) and s.output_from is not None:
      counts = np.bincount(seen[s.output_from:], minlength=V).astype(np.float32)
      x[i] -= s.frequency * counts + s.presence * (counts > 0)
    for t, b in s.bias.items():
      if 0 <= t < V: x[i, t] += b
  return x

def kept_sets(p: np.ndarray, samplers: list[Sampler]) -> list:
  """Per row of probabilities: the token ids top_k, min_p and top_p keep (ascending ids), or None where none truncates."""
  out: list = [None] * len(samplers)
  rows = [i for i, s in enumerate(samplers) if s.truncates]
  if not rows: return out
  V = p.shape[1]
  K = min(V, max(CANDIDATES, max(samplers[i].top_k for i in rows)))
  sub = p[rows]
  cand = np.argpartition(-sub, K - 1, axis=1)[:, :K] if K < V else np.broadcast_to(np.arange(V), sub.shape)
  full = []
  for r, i in enumerate(rows):
    c = cand[r]
    order = c[np.lexsort((c, -sub[r, c]))]          # most likely first, lowest id on ties
    keep = _keep(sub[r, order], samplers[i], V, float(sub[r].sum(dtype=np.float64)))
    if keep < 0 or (K < V and sub[r, order[keep - 1]] <= sub[r, order[-1]]): full.append(r)   # the cut lies past the candidates, or ties cross it
    else: out[i] = np.sort(order[:keep])
  if full:                                          # those rows sorted whole, at once (a stable sort: lowest id first on ties)
    orders = np.argsort(-sub[full], axis=1, kind="stable")
    for j, r in enumerate(full):
      keep = _keep(sub[r, orders[j]], samplers[rows[r]], V, 1.0)
      out[rows[r]] = np.sort(orders[j, :keep])
  return out

def _keep(sorted_p: np.ndarray, s: Sampler, V: int, row_total: float) -> int:
  """How many of the most likely tokens the sampler keeps (at least one), from the K most likely probabilities sorted
  descending (K == V: the whole row); -1 when the cut may lie past those K (sort the whole row)."""
  K, n = sorted_p.shape[0], V if not s.top_k else min(s.top_k, V)
  if s.min_p > 0:
    m = int(np.count_nonzero(sorted_p[:min(n, K)] >= s.min_p * sorted_p[0]))
    if m == K < n: return -1                   # more may pass past the candidates
    n = min(n, m)
  if s.top_p < 1:
    c = np.cumsum(sorted_p[:min(n, K)], dtype=np.float64)
    total = row_total if n > K else c[-1]       # the mass top_p is a share of: the top-k/min-p set's, or the whole row's
    i = int(np.searchsorted(c / total, s.top_p))   # the tokens before the cut, and the one that crosses top_p
    if i >= K: return -1
    n = min(n, i + 1)
  return -1 if n > K else max(1, n)

def sample_batch(logits: np.ndarray, samplers: list[Sampler], positions: list[int], tokens: list | None = None) -> list:
  """One token per row of logits (B, V) float32: row i by samplers[i] at positions[i], penalties over tokens[i] (the
  sequence so far). Returns a Draw per row, or a ValueError for a row whose logits are not finite (that row only fails).
  Advances each sampler's position."""
  x = np.asarray(logits, dtype=np.float32)
  B = x.shape[0]
  tokens = tokens if tokens is not None else [[] for _ in range(B)]
  finite = np.isfinite(x).all(axis=1)
  out: list = [None] * B
  for i in np.flatnonzero(~finite):
    out[i] = ValueError(f"the model produced non-finite logits ({int((~np.isfinite(x[i])).sum())} of {x.shape[1]})")
  allowed = {}
  for i in range(B):              # a grammar's rows: the tokens it admits (prefetched while the step ran, as a rule)
    if finite[i] and (c := samplers[i].constraint) is not None:
      try: allowed[i] = c.allowed(tokens[i])
      except ValueError as e: out[i] = e
      else:
        if not allowed[i].any(): out[i] = ValueError("the grammar admits no token of the model's vocabulary here")
  ok = [i for i in range(B) if finite[i] and out[i] is None]
  if not ok: return out
  # every row ok and no grammar's mask to write in place: the logits as they are (x[ok] would copy B x vocab floats)
  xs, ss = (x if len(ok) == B and not allowed else x[ok]), [samplers[i] for i in ok]
  proc = processed(xs, ss, [tokens[i] for i in ok])
  early = [r for r, s in enumerate(ss) if s.min_tokens_ids and s.holds_back_stops(positions[ok[r]])]
  if early:                                         # min_tokens: the stop ids cannot be drawn yet
    proc = proc.copy() if proc is xs else proc
    V = proc.shape[1]
    for r in early: proc[r, [t for t in ss[r].min_tokens_ids if t < V]] = -np.inf
  lps = log_softmax(xs[[r for r, s in enumerate(ss) if s.logprobs is not None]]) if any(s.logprobs is not None for s in ss) else None
  for r, i in enumerate(ok):      # in place: proc is x[ok]'s copy or processed's, and the logprobs (raw logits) are read already
    if i in allowed: np.copyto(proc[r], -np.inf, where=~allowed[i])
  hot = [r for r, s in enumerate(ss) if s.temperature > 0]
  if hot:
    temps = np.array([[ss[r].temperature] for r in hot], dtype=np.float32)
    p = softmax(proc[hot] / temps)
    kept = kept_sets(p, [ss[r] for r in hot])
  tok = np.argmax(proc, axis=1)                     # greedy rows: the first maximum, the lowest id on ties
  for j, r in enumerate(hot):
    s, pos = ss[r], positions[ok[r]]
    ids = kept[j] if kept[j] is not None else None
    cdf = np.cumsum(p[j] if ids is None else p[j, ids], dtype=np.float32)
    # the first token whose cumulative probability passes the draw: never a token of probability 0 (cdf is flat there)
    k = min(int(np.searchsorted(cdf, s.uniform(pos) * cdf[-1], side="right")), cdf.shape[0] - 1)
    tok[r] = k if ids is None else ids[k]
  lp_row = 0
  for r, i in enumerate(ok):
    s = ss[r]
    s.position = positions[i] + 1
    if s.logprobs is None: out[i] = Draw(int(tok[r]))
    else:
      lp = lps[lp_row]
      lp_row += 1
      out[i] = Draw(int(tok[r]), float(lp[tok[r]]), top_alternatives(lp, s.logprobs))
  return out
