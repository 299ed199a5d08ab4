"""Speculative decoding on a real decode node process (`tinyhet node --speculative ngram`, tinyhet.engine.speculative_rows):
through the router's HTTP API, a request decoded speculatively (the node's default, or the request's own `speculative`
field) streams exactly the tokens of the same request with speculation off, greedy and sampled with a seed; /metrics
counts the drafted and accepted tokens; a bad `speculative` field is a 400 naming it."""
import time
import pytest
from test_service import Router, node

REPEAT = [5, 9, 14, 3, 7, 11, 2, 8] * 4        # a prompt that repeats itself: the n-gram lookup drafts on it

@pytest.fixture(scope="module")
def router():
  # warm-up before the node says ready: a verify step runs only at a batch bucket the warm-up has captured
  procs = [node("prefill"), node("decode", "--kv-memory", "16M", "--max-seqs", "8", "--speculative", "ngram", env={"TINYHET_WARM_UP": "before"})]
  try:
    r = Router("--prefill", procs[0].address, "--decode", procs[1].address)
    procs.append(r)
    r.wait_ready(nodes_up=2)
    yield r
  finally:
    for p in procs: p.stop()

def tokens(router, **body) -> list[int]:
  return router.stream({"prompt": REPEAT, "max_tokens": 24, **body})

def test_speculative_tokens_equal_plain_and_are_counted(router):
  for sampling in ({"temperature": 0}, {"temperature": 0.8, "seed": 7}):
    plain = tokens(router, speculative={"mode": "off"}, **sampling)
    assert len(plain) == 24
    assert tokens(router, **sampling) == plain, sampling                       # the node's default: ngram, k 8
    assert tokens(router, speculative={"mode": "ngram", "k": 3}, **sampling) == plain, sampling
  deadline = time.monotonic() + 30                 # the counters come with the node's next heartbeat
  while router.metric("tinyhet:spec_draft_tokens_total") == 0:
    assert time.monotonic() < deadline, "no drafted tokens counted in /metrics"
    router.request("GET", "/ready")
  assert router.metric("tinyhet:spec_accepted_tokens_total") <= router.metric("tinyhet:spec_draft_tokens_total")

@pytest.mark.parametrize("bad", [{"mode": "draft"}, {"k": 0}, {"k": 9}, {"k": True}, "ngram", {"mode": "ngram", "depth": 2}])
def test_bad_speculative_field_is_a_400(router, bad):
  status, _, obj = router.request("POST", "/v1/completions", {"prompt": REPEAT, "max_tokens": 2, "speculative": bad})
  assert status == 400 and obj["error"]["param"] == "speculative", (bad, obj)
