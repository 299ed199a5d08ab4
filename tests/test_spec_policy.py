"""The speculative policy (tinyhet.engine.spec_policy): its plan is the draft choice with the most expected tokens per
second of step time (checked against every choice by brute force), never past a sequence's n-gram draft, and a draft
matched on a surer tail never gets fewer tokens than a less sure one; its estimate for each match length follows what the
verify steps of that length keep, and no other; an n kept from drafting is probed once every probe_every steps where a
padding row of the step holds the probe (every max_probe_gap steps where none does), by one sequence at most."""
import itertools
import pytest
from hypothesis import given, settings, strategies as st
from tinyhet.engine.decode_engine import batch_bucket
from tinyhet.engine.spec_policy import SpecPolicy

def rate(policy, ns, take, cost):
  """Expected tokens per second of a step that verifies take[i] drafted tokens of the sequence whose draft matched on ns[i]."""
  gain = sum(policy.p(n) ** m for n, t in zip(ns, take) for m in range(1, t + 1))
  return (len(ns) + gain) / cost(len(ns) + sum(take))

def with_estimates(ps: dict, margin: float = 0.0) -> SpecPolicy:
  """A policy whose estimate for n is ps[n] (as after many verifies), probes off, drafts taken at any gain (margin 0)."""
  pol = SpecPolicy(probe_every=10**9, margin=margin)
  for n, p in ps.items(): pol.acc[n], pol.tried[n] = 1000 * p, 1000.0
  return pol

costs = st.sampled_from(["flat", "linear", "gentle", "steep"])
def cost_fn(kind, base):
  """A step's time as StepCosts gives it: its batch bucket's (the bucket of r rows), flat, or growing with the bucket."""
  f = {"flat": lambda b: base, "linear": lambda b: base * b, "gentle": lambda b: base * (1 + 0.2 * b),
       "steep": lambda b: base * (1 + 0.8 * (b - 1))}[kind]
  return lambda r: f(batch_bucket(r))

@settings(max_examples=150, deadline=None)
@given(ps=st.lists(st.floats(0.0, 0.99), min_size=3, max_size=3), ns=st.lists(st.sampled_from([1, 4, 16]), min_size=1, max_size=3),
       lens=st.lists(st.integers(0, 3), min_size=3, max_size=3), kind=costs, base=st.floats(0.001, 0.1))
def test_plan_is_the_best_choice_and_stays_within_the_drafts(ps, ns, lens, kind, base):
  pol, lens = with_estimates(dict(zip((1, 4, 16), ps))), lens[:len(ns)]
  cost = cost_fn(kind, base)
  take = pol.plan(list(range(len(ns))), lens, ns, cost)
  assert all(0 <= t <= n for t, n in zip(take, lens))
  best = max(rate(pol, ns, c, cost) for c in itertools.product(*[range(n + 1) for n in lens]))
  assert rate(pol, ns, take, cost) >= best * (1 - 1e-8)    # the plan breaks ties (to 1e-9) toward fewer rows
  if kind == "linear" and len(ns) == 1: assert take == [0]    # a row costs a whole step: a draft (worth < 1) never pays
  if kind == "flat" and min(pol.p(n) for n in ns) > 0.01: assert take == lens     # rows are free: every drafted token pays

@settings(max_examples=150, deadline=None)
@given(ps=st.lists(st.floats(0.0, 0.999), min_size=3, max_size=3), ns=st.lists(st.sampled_from([1, 4, 16]), min_size=2, max_size=16),
       lens=st.lists(st.integers(0, 8), min_size=16, max_size=16), kind=costs, base=st.floats(0.001, 0.1))
def test_a_surer_draft_never_gets_fewer_tokens(ps, ns, lens, kind, base):
  """Per-sequence draft lengths: where p(n_a) > p(n_b), sequence a verifies at least as many of its draft as b does (as far
  as a's draft goes)."""
  pol, lens = with_estimates(dict(zip((1, 4, 16), ps))), lens[:len(ns)]
  take = pol.plan(list(range(len(ns))), lens, ns, cost_fn(kind, base))
  for a, b in itertools.permutations(range(len(ns)), 2):
    if pol.p(ns[a]) > pol.p(ns[b]): assert take[a] >= min(take[b], lens[a]), (a, b, take)

@settings(max_examples=150, deadline=None)
@given(ps=st.lists(st.floats(0.0, 0.999), min_size=3, max_size=3), ns=st.lists(st.sampled_from([1, 4, 16]), min_size=1, max_size=4),
       lens=st.lists(st.integers(0, 8), min_size=4, max_size=4), kind=costs, base=st.floats(0.001, 0.1), margin=st.floats(0.0, 0.3))
def test_drafts_beat_the_plain_step_by_the_margin(ps, ns, lens, kind, base, margin):
  """With a margin, a plan that drafts expects at least (1 + margin) times the plain step's tokens per second, and is the
  best of the choices that do (brute force)."""
  pol, lens, cost = with_estimates(dict(zip((1, 4, 16), ps)), margin), lens[:len(ns)], cost_fn(kind, base)
  take = pol.plan(list(range(len(ns))), lens, ns, cost)
  plain = rate(pol, ns, [0] * len(ns), cost)
  if any(take): assert rate(pol, ns, take, cost) >= plain * (1 + margin) * (1 - 1e-8)
  choices = [c for c in itertools.product(*[range(n + 1) for n in lens]) if rate(pol, ns, c, cost) >= plain * (1 + margin) * (1 + 1e-8)]
  if choices: assert any(take) and rate(pol, ns, take, cost) >= max(rate(pol, ns, c, cost) for c in choices) * (1 - 1e-8)

def test_no_match_no_draft_and_no_cost_asked():
  asked = []
  take = SpecPolicy().plan([1, 2], [0, 0], [0, 0], lambda r: asked.append(r) or 1.0)
  assert take == [0, 0] and asked == []

@settings(max_examples=100, deadline=None)
@given(verifies=st.lists(st.tuples(st.sampled_from([1, 2, 16]), st.integers(0, 8), st.booleans()), max_size=40),
       decay=st.floats(0.0, 0.5))
def test_each_estimate_follows_its_own_verifies(verifies, decay):
  """p(n) is a weighted average of the prior and each n-matched verify's kept rate (accepted / tried), whichever
  sequence ran it; the verifies of another n leave it where it is."""
  pol = SpecPolicy(decay=decay)
  rates = {n: [pol.prior] for n in (1, 2, 16)}
  for n, accepted, whole in verifies:
    before = {m: pol.p(m) for m in (1, 2, 16)}
    tried = accepted if whole and accepted else accepted + 1
    pol.update(seq_id=len(rates[n]), n=n, tried=tried, accepted=accepted)
    rates[n].append(accepted / tried)
    assert all(pol.p(m) == before[m] for m in (1, 2, 16) if m != n)
    assert min(rates[n]) - 1e-9 <= pol.p(n) <= min(max(rates[n]), 0.999) + 1e-9

def test_probes_come_back_one_per_n():
  pol = SpecPolicy(probe_every=4)
  cost = lambda r: 1.0 + 0.5 * (batch_bucket(r) - 1)    # a verify row costs half a step: only a likely draft pays
  for _ in range(30): pol.update(7, 1, 1, 0)            # every first drafted token of a 1-matched draft rejected
  assert pol.p(1) < 0.01
  # 3 sequences (bucket 4: a padding row, where a probe costs nothing)
  plan = lambda: pol.plan([7, 8, 9], [4, 0, 0], [1, 0, 0], cost)[0]
  takes = [plan() for _ in range(15)]
  assert takes == [0, 0, 0, 0, 1] * 3        # kept from drafting, but one token probed every 5th step
  pol.update(7, 1, 1, 0)                     # the last probe missed: the next one waits twice as long
  assert [plan() for _ in range(9)] == [0] * 8 + [1]
  pol.update(7, 1, 1, 1)                     # a kept probe: back to every 5th step
  assert [plan() for _ in range(5)] == [0] * 4 + [1]
  # a batch that fills its bucket (a probe's row would run the step at the next one): probes wait max_probe_gap steps,
  # and the n is probed by one of the sequences with such a draft, not by each (p(1) = 0 here: the rows the probe's
  # bucket holds for free are worth nothing either)
  zero = SpecPolicy(prior=0.0, probe_every=4, max_probe_gap=8)
  for _ in range(8): assert zero.plan([1, 2, 3, 4], [4, 4, 0, 0], [1, 1, 0, 0], cost) == [0, 0, 0, 0]
  assert sorted(zero.plan([1, 2, 3, 4], [4, 4, 0, 0], [1, 1, 0, 0], cost)) == [0, 0, 0, 1]
  for _ in range(8): assert zero.plan([5], [4], [1], cost) == [0]     # batch 1 fills bucket 1 too
  assert zero.plan([5], [4], [1], cost) == [1]
  for _ in range(20): pol.update(8, 16, 4, 4)    # 16-matched drafts kept whole: they are drafted, the 1-matched ones are not
  # 3 drafts fill bucket 4; a 4th would run the step at bucket 8 (7 rows' cost for 0.999^4 more)
  assert pol.p(16) > 0.95 and pol.plan([8], [4], [16], cost) == [3] and pol.plan([8], [7], [16], cost) == [7]
  assert pol.plan([8, 9], [4, 4], [16, 1], cost) == [2, 0]     # with a second row, 2 fill bucket 4

def test_a_new_sequence_starts_at_the_nodes_figure():
  chat, copy = SpecPolicy(), SpecPolicy()
  assert chat.p(1) == chat.prior == chat.p(16)
  for sid in range(30):                      # earlier sequences: drafts never kept, or always kept
    chat.update(sid, 1, 1, 0)
    copy.update(sid, 16, 4, 4)
  assert chat.p(1) < 0.05 < chat.prior < 0.9 < copy.p(16)
  assert copy.p(1) == copy.prior and chat.p(16) == chat.prior     # each n learns from its own drafts only
  chat.forget(3)
  assert chat.p(1) < 0.05                    # the node's figure outlives the sequences it came from
  with pytest.raises(TypeError): chat.plan([1], [2], cost=lambda r: 1.0)     # ns is required: the estimate is by n

@settings(max_examples=100, deadline=None)
@given(times=st.lists(st.tuples(st.sampled_from([1, 3, 16, 17]), st.floats(0.001, 1.0)), min_size=1, max_size=40),
       window=st.integers(1, 8))
def test_step_costs_are_the_least_of_each_buckets_recent_steps(times, window):
  """A bucket's cost is the least of its last `window` recorded steps (a delayed step never raises it past a quiet one
  still in the window), every row count priced at its bucket's."""
  from tinyhet.engine.step_costs import StepCosts
  costs, seen = StepCosts(engine=None, window=window), {}
  for rows, t in times:
    costs.record(rows, t)
    seen.setdefault(batch_bucket(rows), []).append(t)
    assert all(costs(b) == min(ts[-window:]) for b, ts in seen.items())
  assert all(costs(b) == costs(r) for r, _ in times for b in [batch_bucket(r)])

@settings(max_examples=60, deadline=None)
@given(ps=st.lists(st.floats(0.0, 0.999), min_size=3, max_size=3), ns=st.lists(st.sampled_from([1, 4, 16]), min_size=1, max_size=16),
       lens=st.lists(st.integers(0, 8), min_size=16, max_size=16), top=st.sampled_from([1, 2, 4, 8, 12, 16]), base=st.floats(0.001, 0.1))
def test_a_plan_never_needs_a_bucket_the_node_cannot_run(ps, ns, lens, top, base):
  """Buckets past `top` cost infinity (StepCosts(capture=False) before they are captured): no plan's step, probes included,
  needs one; a batch whose probes alone would need one drafts nothing."""
  pol, lens = with_estimates(dict(zip((1, 4, 16), ps))), lens[:len(ns)]
  pol.idle = {1: 10**6, 4: 10**6, 16: 10**6}              # every probe due
  take = pol.plan(list(range(len(ns))), lens, ns, lambda r: base * batch_bucket(r) ** 0.5 if batch_bucket(r) <= top else float("inf"))
  assert all(0 <= t <= n for t, n in zip(take, lens))
  assert sum(take) == 0 or batch_bucket(len(ns) + sum(take)) <= top
