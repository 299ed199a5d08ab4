"""The speculative policy (tinyhet.engine.spec_policy): its plan is the draft choice with the most expected tokens per
second of step time (checked against every choice by brute force), never past a sequence's n-gram draft; its acceptance
estimate follows what the verify steps keep; a sequence kept from drafting probes once every probe_every steps."""
import itertools
import pytest
from hypothesis import given, settings, strategies as st
from tinyhet.engine.decode_engine import batch_bucket
from tinyhet.engine.spec_policy import SpecPolicy

def rate(policy, ids, take, cost):
  """Expected tokens per second of a step that verifies take[i] drafted tokens of sequence ids[i]."""
  gain = sum(policy.p(s) ** m for s, t in zip(ids, take) for m in range(1, t + 1))
  return (len(ids) + gain) / cost(len(ids) + sum(take))

def with_estimates(ps):
  pol = SpecPolicy(probe_every=10**9)
  for sid, p in enumerate(ps):          # an estimate of exactly p: one verify's EMA from the prior, alpha 1
    pol.alpha = 1.0
    pol.update(sid, 1000, round(p * 1000))
  pol.alpha = 0.3
  return pol

costs = st.sampled_from(["flat", "linear", "gentle", "steep"])
def cost_fn(kind, base):
  """A step's time as StepCosts gives it: its batch bucket's (the bucket of r rows), flat, or growing with the bucket."""
  f = {"flat": lambda b: base, "linear": lambda b: base * b, "gentle": lambda b: base * (1 + 0.2 * b),
       "steep": lambda b: base * (1 + 0.8 * (b - 1))}[kind]
  return lambda r: f(batch_bucket(r))

@settings(max_examples=150, deadline=None)
@given(ps=st.lists(st.floats(0.0, 0.99), min_size=1, max_size=3), lens=st.lists(st.integers(0, 3), min_size=3, max_size=3),
       kind=costs, base=st.floats(0.001, 0.1))
def test_plan_is_the_best_choice_and_stays_within_the_drafts(ps, lens, kind, base):
  pol, ids, lens = with_estimates(ps), list(range(len(ps))), lens[:len(ps)]
  cost = cost_fn(kind, base)
  take = pol.plan(ids, lens, cost)
  assert all(0 <= t <= n for t, n in zip(take, lens))
  best = max(rate(pol, ids, c, cost) for c in itertools.product(*[range(n + 1) for n in lens]))
  assert rate(pol, ids, take, cost) >= best * (1 - 1e-9)
  if kind == "linear" and len(ps) == 1: assert take == [0]    # a row costs a whole step: a draft (worth < 1) never pays
  if kind == "flat" and min(ps) > 0.01: assert take == lens     # rows are free: every drafted token is worth taking

def test_no_match_no_draft_and_no_cost_asked():
  asked = []
  take = SpecPolicy().plan([1, 2], [0, 0], lambda r: asked.append(r) or 1.0)
  assert take == [0, 0] and asked == []

def test_estimate_follows_the_verifies_and_probes_come_back():
  pol = SpecPolicy(probe_every=4)
  cost = lambda r: 1.0 + 0.5 * (batch_bucket(r) - 1)    # a verify row costs half a step: only a likely draft pays
  for _ in range(20): pol.update(7, 1, 0)    # every first drafted token rejected
  assert pol.p(7) < 0.01
  takes = [pol.plan([7], [4], cost)[0] for _ in range(15)]
  assert takes == [0, 0, 0, 0, 1] * 3        # kept from drafting, but one token probed every 5th step
  pol.update(7, 1, 0)                        # the last probe missed: the next one waits twice as long
  assert [pol.plan([7], [4], cost)[0] for _ in range(9)] == [0] * 8 + [1]
  pol.update(7, 1, 1)                        # a kept probe: back to every 5th step
  assert [pol.plan([7], [4], cost)[0] for _ in range(5)] == [0] * 4 + [1]
  for _ in range(20): pol.update(7, 4, 4)    # then it keeps all it drafts
  # 3 drafts fill bucket 4; a 4th would run the step at bucket 8 (7 rows' cost for 0.999^4 more)
  assert pol.p(7) > 0.95 and pol.plan([7], [4], cost) == [3] and pol.plan([7], [7], cost) == [7]
  pol.forget(7)
  assert pol.p(7) == pytest.approx(pol.all_acc / pol.all_tried)    # a forgotten (or new) sequence starts at the node's figure

def test_a_new_sequence_starts_at_the_nodes_figure():
  chat, copy = SpecPolicy(), SpecPolicy()
  assert chat.p(1) == chat.prior
  for sid in range(30):                      # earlier sequences: drafts never kept, or always kept
    chat.update(sid, 1, 0)
    copy.update(sid, 4, 4)
  assert chat.p(100) < 0.05 < chat.prior < 0.9 < copy.p(100)

def test_estimates_are_bounded():
  pol = SpecPolicy(max_seqs=3)
  for sid in range(10): pol.update(sid, 2, 1)
  assert len(pol.tried) == 3 and set(pol.tried) == {7, 8, 9}
