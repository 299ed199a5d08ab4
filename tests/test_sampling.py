"""The batch sampler (tinyhet.model.sampling.sample_batch): a batch gives each row what a sampler of one gives it, the
top-k / min-p / top-p cut found among the candidates equals the cut of a full sort, penalties as vLLM's, logprobs that
match a float64 log-softmax."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from tinyhet.model.sampling import CANDIDATES, Sampler, kept_sets, sample_batch, softmax

settings_st = st.fixed_dictionaries({"temperature": st.sampled_from([0.0, 0.5, 1.0, 1.7]), "top_p": st.sampled_from([1.0, 0.9, 0.5]),
                                     "seed": st.integers(0, 2**40), "top_k": st.sampled_from([0, 1, 5, 50]), "min_p": st.sampled_from([0.0, 0.1]),
                                     "presence_penalty": st.sampled_from([0.0, 1.0]), "repetition_penalty": st.sampled_from([1.0, 1.3]),
                                     "logprobs": st.sampled_from([None, 0, 3])})

@settings(max_examples=40, deadline=None)
@given(st.lists(settings_st, min_size=1, max_size=6), st.integers(0, 2**31), st.integers(0, 300))
def test_a_batch_draws_what_each_row_draws_alone(rows, data_seed, position):
  rng = np.random.default_rng(data_seed)
  V = 300
  logits = (rng.standard_normal((len(rows), V)) * 3).astype(np.float32)
  tokens = [list(rng.integers(0, V, 12)) for _ in rows]
  samplers = [Sampler(**r, output_from=4) for r in rows]
  alone = [Sampler(**r, output_from=4).draw(logits[i], position + i, tokens[i]) for i, r in enumerate(rows)]
  batch = sample_batch(logits, samplers, [position + i for i in range(len(rows))], tokens)
  assert [d.token for d in batch] == [d.token for d in alone]
  assert [d.logprob for d in batch] == [d.logprob for d in alone] and all(s.position == position + i + 1 for i, s in enumerate(samplers))
  for d, r in zip(batch, rows):
    if r["logprobs"] is not None: assert len(d.top) == r["logprobs"] and all(a[1] >= b[1] for a, b in zip(d.top, d.top[1:]))

def test_greedy_without_options_is_the_argmax_and_logprobs_match_float64():
  rng = np.random.default_rng(1)
  logits = (rng.standard_normal((5, 5000)) * 4).astype(np.float32)
  draws = sample_batch(logits, [Sampler(0.0, 1.0, 0, logprobs=5) for _ in range(5)], [3] * 5)
  x = logits.astype(np.float64)
  lp = x - x.max(1, keepdims=True) - np.log(np.exp(x - x.max(1, keepdims=True)).sum(1, keepdims=True))
  assert [d.token for d in draws] == list(np.argmax(logits, 1))
  for i, d in enumerate(draws):
    assert abs(d.logprob - lp[i, d.token]) < 1e-5 and [t for t, _ in d.top] == list(np.argsort(-lp[i], kind="stable")[:5])

@pytest.mark.parametrize("top_p, top_k, min_p", [(0.999, 0, 0.0), (0.5, 0, 0.0), (1.0, 1500, 0.0), (1.0, 0, 0.5), (0.9, 2000, 0.01)])
def test_the_cut_among_candidates_is_the_full_sorts(top_p, top_k, min_p):
  """A flat distribution over more tokens than CANDIDATES (the cut lies past them: a full sort), and a peaked one, with ties."""
  rng = np.random.default_rng(2)
  V = 3 * CANDIDATES
  for logits in (rng.standard_normal(V).astype(np.float32) * 0.01, np.round(rng.standard_normal(V) * 3).astype(np.float32)):
    s = Sampler(1.0, top_p, 0, top_k=top_k, min_p=min_p)
    p = softmax(logits[None])[0]
    order = np.lexsort((np.arange(V), -p))
    n = top_k or V
    n = min(n, int((p[order[:n]] >= min_p * p[order[0]]).sum())) if min_p else n
    c = np.cumsum(p[order[:n]], dtype=np.float64)
    n = min(n, int(np.searchsorted(c / c[-1], top_p)) + 1) if top_p < 1 else n
    assert list(kept_sets(p[None], [s])[0]) == sorted(order[:n])

def test_penalties_as_vllm():
  logits = np.array([2.0, -1.0, 0.5, 3.0], np.float32)
  prompt, out = [0], [1, 3, 3]
  s = Sampler(0.0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=1.0, logit_bias={"2": 1.0}, output_from=1)
  from tinyhet.model.sampling import processed
  got = processed(logits[None], [s], [prompt + out])[0]
  # repetition: seen tokens 0, 1, 3 (prompt and output); frequency and presence: output tokens 1 (once) and 3 (twice); bias on 2
  assert got.tolist() == pytest.approx([2.0 / 2, -1.0 * 2 - 0.5 - 1.0, 0.5 + 1.0, 3.0 / 2 - 1.0 - 1.0])
  with pytest.raises(ValueError, match="top_k"): Sampler(1.0, top_k=-3)
  with pytest.raises(ValueError, match="unknown"): Sampler(1.0, typical_p=0.5)
  with pytest.raises(ValueError, match="non-finite"): Sampler(0.0)(np.array([1.0, np.nan], np.float32))
