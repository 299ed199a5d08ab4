"""Draft-model speculation (tinyhet.engine.draft_model, mode "draft"): over random tiny models, greedy and sampled tokens
equal plain decode's whatever the draft (the target itself: every draft kept; another model: most rejected), the
target's pool ends as plain decode leaves it, the draft's pool holds exactly what it was fed and gives every block back
when its sequences are forgotten; a long prompt catches up over steps within the budget; a draft runs only at buckets
it has captured once it warms up; tokenizers that differ are named."""
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from test_speculative import CFG, run, state
from tinyhet.engine.decode_engine import DecodeEngine
from tinyhet.engine.draft_model import DraftModel, same_tokenizer
from tinyhet.kv.paged_cache import PagedKVCache
from tinyhet.model import llama as model
from tinyhet.model.spec import ByteTokenizer

@pytest.fixture(scope="module")
def llama(): return model.Llama(CFG, model.random_weights(CFG, seed=1))

@pytest.fixture(scope="module")
def other():
  """A smaller model of the same vocabulary (1 layer, other weights): its drafts mostly disagree."""
  cfg = model.small_config(n_layers=1, dim=32, n_heads=2, n_kv_heads=1, hidden_dim=48, vocab_size=CFG.vocab_size, max_context=CFG.max_context)
  return model.Llama(cfg, model.random_weights(cfg, seed=5))

def engine(llama):
  return DecodeEngine(llama, PagedKVCache(CFG.n_layers, CFG.n_kv_heads, CFG.head_dim, num_blocks=64, block_size=8, max_seq_len=256))

@pytest.fixture(scope="module")
def engines(llama, other):
  """One target engine and one draft of each kind for every example (their captures made once)."""
  return engine(llama), {"self": DraftModel(llama, 64, 8), "other": DraftModel(other, 64, 8)}

def decode(llama, target, prompts, new, k, **kw):
  """run() on the shared target engine, its sequences (and the draft's) freed after, whatever happens: (tokens, the target
  pool's state, the SpeculativeStep)."""
  try:
    toks, bm, spec = run(llama, prompts, new, k, engine=target, **kw)
    return toks, state(bm), spec
  finally:
    for i in range(len(prompts)):
      if i in target.cache.block_manager: target.cache.block_manager.deallocate(i)

prompt = st.lists(st.integers(0, 31), min_size=3, max_size=30)     # the lengths test_speculative.py prefills (its compiles shared)

@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompts=st.lists(prompt, min_size=1, max_size=3), k=st.integers(1, 8), new=st.integers(1, 20), adaptive=st.booleans(),
       which=st.sampled_from(["self", "other"]))
def test_draft_greedy_equals_plain_and_both_pools_end_clean(llama, engines, prompts, k, new, adaptive, which):
  target, drafts = engines
  draft = drafts[which]
  plain, plain_state, _ = decode(llama, target, prompts, new, 0)
  try:
    fast, fast_state, spec = decode(llama, target, prompts, new, k, adaptive=adaptive, draft=draft)
    assert fast == plain and fast_state == plain_state
    draft.check()
    for i, (p, t) in enumerate(zip(prompts, plain)):          # what the draft holds: the sequence's tokens, up to its last
      fed = draft.fed.get(i, [])                              # (none where the prefill gave every token)
      assert fed == (p + t)[:len(fed)] and len(fed) < len(p) + len(t)
    if which == "self" and not adaptive and k > 1 and new > 4: assert spec.accepted > 0     # the target's own drafts are kept
  finally:
    for i in range(len(prompts)): draft.forget(i)
  draft.check()
  assert draft.bm.num_free == draft.bm.num_blocks - 1                                      # all but PAD_SEQ's block back

def test_draft_sampled_equals_plain_sampling(llama, other):
  prompts = [[1, 2, 3, 4] * 6, [5, 1, 5, 2] * 4]
  plain, _, _ = run(llama, prompts, 24, 0, temperature=0.8)
  for d in (DraftModel(llama, 32, 8), DraftModel(other, 32, 8)):
    fast, _, spec = run(llama, prompts, 24, 4, temperature=0.8, draft=d)
    assert fast == plain and spec.drafted > 0

def test_a_long_prompt_catches_up_within_the_budget(llama):
  """A prompt longer than the catch-up budget is fed over several steps, never more than the budget a step, and drafts
  only once it has caught up; the tokens stay plain decode's."""
  draft = DraftModel(llama, 64, 8, catch_up=16)
  rows = []
  step = draft.step
  draft.step = lambda sids, feeds: (rows.append(sum(map(len, feeds))), step(sids, feeds))[1]
  p = [i % 29 for i in range(100)]
  plain, _, _ = run(llama, [p], 12, 0)
  fast, _, spec = run(llama, [p], 12, 4, draft=draft)
  assert fast == plain and max(rows) <= 16 and rows[:6] == [16] * 6
  assert spec.drafted > 0

def test_a_warming_draft_runs_only_at_captured_buckets(llama):
  """With warm-up on (ready set), nothing is drafted before its buckets are captured, and then only at those."""
  draft = DraftModel(llama, 64, 8)
  draft.ready = set()
  p = [[3, 1, 4, 1, 5, 9, 2, 6] * 3]
  plain, _, _ = run(llama, p, 10, 0)
  fast, _, spec = run(llama, p, 10, 4, draft=draft)
  assert fast == plain and spec.drafted == 0 and draft.steps == 0 and not draft.engine.steps
  for B in (1, 2, 4, 8): draft.warm(B)
  fast, _, spec = run(llama, p, 10, 4, draft=draft)
  assert fast == plain and spec.drafted > 0 and set(draft.engine.steps) == {1, 2, 4, 8}

def test_other_tokenizers_are_named():
  assert same_tokenizer(ByteTokenizer(), ByteTokenizer()) is None
  class Bigger(ByteTokenizer): vocab_size = 300
  assert "different kinds" in same_tokenizer(ByteTokenizer(), Bigger())
  b = ByteTokenizer()
  b.vocab_size = 300
  assert "vocabularies of 256 and 300" in same_tokenizer(ByteTokenizer(), b)

def test_a_prompt_is_fed_to_the_draft_only_where_it_pays(llama):
  """The catch-up rule against set step costs (the node measures its own): a cheap draft's catch-up of 100 tokens pays
  for a sequence with 100 tokens to go and not for one with 10; a draft as dear as the model never pays."""
  from tinyhet.engine.spec_policy import SpecPolicy
  from tinyhet.engine.speculative import SpeculativeStep
  draft = DraftModel(llama, 64, 8)
  spec = SpeculativeStep(engine(llama), policy=SpecPolicy(draft_prior=0.6), draft=draft)
  spec.costs = lambda rows: 0.010 * max(1.0, rows / 8)        # a plain step: 10 ms up to 8 rows
  draft.price = lambda rows: 0.002 * max(1.0, rows / 4)       # a draft step: 2 ms up to 4 rows
  assert spec.policy.draft_gain(1, 8, spec.costs, draft.price) > 0.002
  gain = spec.catch_up_gain(1, 8)
  assert spec.catch_up_pays(100, 100, gain) and not spec.catch_up_pays(100, 10, gain)
  draft.price = lambda rows: 0.010 * max(1.0, rows / 8)
  assert spec.policy.draft_gain(1, 8, spec.costs, draft.price) == 0 and not spec.catch_up_pays(100, 10 ** 6, spec.catch_up_gain(1, 8))
