"""Speculative decoding's sampled mode and its no-draft path, over a random tiny model (vocabulary 32):
- the sampled tokens' frequencies match plain sampling's within a chi-square bound (two independent samples, disjoint
  seeds: a homogeneity test over (position, token) cells, so a rule that kept drafts too often or drew the wrong
  replacement after a rejection would show as a large statistic);
- a step the policy gives no drafts is a plain decode step: the engine's step without counts, replayed from the plain
  capture of its batch bucket, with the tokens of plain decode."""
import math
import numpy as np
import pytest
from tinygrad import Tensor, dtypes
from tinyhet.engine.decode_engine import DecodeEngine, batch_bucket
from tinyhet.engine.spec_policy import SpecPolicy
from tinyhet.engine.speculative import SpeculativeStep
from tinyhet.kv.paged_cache import PagedKVCache
from tinyhet.model import llama as model
from tinyhet.model.layer_jit import Replay
from tinyhet.model.sampling import Sampler, sample_batch

CFG = model.small_config(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, hidden_dim=96, vocab_size=32, max_context=128)
B, NEW, K = 9, 4, 3                   # sequences a round (past one decode tile: drafts uncut), tokens each, tokens drafted a step
PROMPT = [3, 9, 4, 3, 9, 4, 3, 9, 4, 3, 9]     # the 3-gram recurs: every step drafts

@pytest.fixture(scope="module")
def engine():
  llama = model.Llama(CFG, model.random_weights(CFG, seed=3))
  e = DecodeEngine(llama, PagedKVCache(CFG.n_layers, CFG.n_kv_heads, CFG.head_dim, num_blocks=6 * B + 8, block_size=8, max_seq_len=128))
  return e                            # each bucket captured where a step first meets it

def decode_round(engine, seeds, spec=None, temperature=1.0, prompts=None):
  """len(seeds) prompts (default: copies of PROMPT; all of one length) sampled with these seeds, NEW tokens each
  (speculatively when spec is given); their new tokens."""
  cache, bm = engine.cache, engine.cache.block_manager
  prompts = prompts or [PROMPT] * len(seeds)
  ids, samplers, L = list(range(len(seeds))), [Sampler(temperature, 1.0, seed=s) for s in seeds], len(prompts[0])
  for i in ids: bm.allocate(i, L)
  logits = engine.model.forward(Tensor(prompts, dtype=dtypes.int32), Tensor(cache.begin_step(ids, L)), cache)
  last = logits.numpy().reshape(len(ids), -1, CFG.vocab_size)[:, -1]
  toks = [[*p, d.token] for p, d in zip(prompts, sample_batch(last, samplers, [L] * len(ids), prompts))]
  try:
    while (live := [i for i in ids if len(toks[i]) - L < NEW]):
      for i in live: bm.append_slot(i)
      if spec is None:
        out = engine.step(live, [toks[i][-1] for i in live])
        draws = [[d] for d in sample_batch(out, [samplers[i] for i in live], [len(toks[i]) for i in live], [toks[i] for i in live])]
      else:
        draws = spec.step(live, [toks[i] for i in live], [samplers[i] for i in live], K, [NEW - (len(toks[i]) - L) for i in live])
      for i, ds in zip(live, draws): toks[i] += [d.token for d in ds]
  finally:
    for i in ids: bm.deallocate(i)
  return [t[L:L + NEW] for t in toks]

def chi_square_bound(df: int, z: float = 3.09) -> float:
  """The chi-square quantile at 1 - 0.001 (z = 3.09), Wilson-Hilferty's approximation."""
  return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3

def homogeneity(a: np.ndarray, b: np.ndarray) -> tuple[float, int]:
  """Pearson's two-sample chi-square over cells (cells with fewer than 10 counts in both merged into one): (statistic, df)."""
  small = (a + b) < 10
  a = np.append(a[~small], a[small].sum()); b = np.append(b[~small], b[small].sum())
  keep = (a + b) > 0
  a, b = a[keep], b[keep]
  n, m = a.sum(), b.sum()
  ea, eb = (a + b) * n / (n + m), (a + b) * m / (n + m)
  return float(((a - ea) ** 2 / ea).sum() + ((b - eb) ** 2 / eb).sum()), len(a) - 1

def cells(rounds: list[list[list[int]]]) -> np.ndarray:
  """Counts of (position 1..NEW-1, token): the positions a speculative step verifies (position 0 is the prefill's)."""
  c = np.zeros((NEW - 1, CFG.vocab_size), dtype=np.int64)
  for rows in rounds:
    for t in rows:
      for j in range(1, NEW): c[j - 1, t[j]] += 1
  return c.ravel()

def test_sampled_frequencies_match_plain_sampling(engine):
  spec = SpeculativeStep(engine, adaptive=False)       # every n-gram draft verified: the rejection rule runs every step
  rounds = 30
  plain = [decode_round(engine, [1000 + r * B + i for i in range(B)]) for r in range(rounds)]
  fast = [decode_round(engine, [5000 + r * B + i for i in range(B)], spec) for r in range(rounds)]
  assert spec.drafted > 0 and 0 < spec.accepted < spec.drafted       # drafts kept and drafts rejected
  stat, df = homogeneity(cells(plain), cells(fast))
  assert df >= 5 and stat < chi_square_bound(df), (stat, df)
  # the same bound tells a different distribution apart: plain sampling at another temperature
  other = [decode_round(engine, [1000 + r * B + i for i in range(B)], temperature=0.4) for r in range(rounds)]
  stat, df = homogeneity(cells(plain), cells(other))
  assert stat > chi_square_bound(df), (stat, df)

def test_no_drafts_is_the_plain_captured_step(engine):
  """A policy that never drafts (estimate 0, no probes), over prompts holding every token (so an n-gram draft is always
  there to decline): every step is the engine's plain step, no counts, one replay of the plain capture of its batch's
  bucket, no capture made, and the tokens are plain decode's."""
  calls, step, steps = [], engine.step, engine.steps
  def counted(*args, counts=None, **kw):
    calls.append(counts)
    return step(*args, counts=counts, **kw)
  replays = []
  def wrap(B, r):
    def call(*a, **kw):
      replays.append(B)
      return r(*a, **kw)
    return call
  spec = SpeculativeStep(engine, policy=SpecPolicy(prior=0.0, probe_every=10**9))
  seeds, rng = list(range(B)), np.random.default_rng(0)
  prompts = [[int(t) for t in rng.permutation(CFG.vocab_size)] for _ in seeds]
  plain = decode_round(engine, seeds, temperature=0.0, prompts=prompts)
  spec.costs(B)                          # the policy's cost of a plain step, measured before the steps are counted
  captured = Replay.captures             # the plain run captured bucket B (when no test before it did)
  engine.step, engine.steps = counted, {b: wrap(b, r) for b, r in steps.items()}
  try: fast = decode_round(engine, seeds, spec, temperature=0.0, prompts=prompts)
  finally: engine.step, engine.steps = step, steps
  assert fast == plain and spec.verifies == 0 and spec.plain_steps == NEW - 1 and spec.drafted == 0
  assert calls == [None] * (NEW - 1) and replays == [batch_bucket(B)] * (NEW - 1) and Replay.captures == captured
