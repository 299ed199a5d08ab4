"""Speculative decoding on a real decode node process (`tinyhet node --speculative ngram`, tinyhet.engine.speculative_rows):
through the router's HTTP API, a request decoded speculatively (the node's default, or the request's own `speculative`
field, n-gram or the node's draft model: `--draft-model`, here the model's own weights) streams
exactly the tokens of the same request with speculation off, greedy and sampled with a seed; /metrics counts the
drafted and accepted tokens; a bad `speculative` field is a 400 naming it; `--speculative draft` without a draft model
and a draft model of another tokenizer are refused in one line."""
import subprocess, sys, time
from concurrent.futures import ThreadPoolExecutor
import pytest
from test_service import ENV, SPEC, Router, node

REPEAT = [5, 9, 14, 3, 7, 11, 2, 8] * 4        # a prompt that repeats itself: the n-gram lookup drafts on it

@pytest.fixture(scope="module")
def router():
  # warm-up before the node says ready: a verify step runs only at a batch bucket the warm-up has captured
  procs = [node("prefill"), node("decode", "--kv-memory", "16M", "--max-seqs", "8", "--speculative", "ngram", "--draft-model", SPEC,
                                 env={"TINYHET_WARM_UP": "before"})]
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

def test_draft_model_requests_decode_plain_decodes_tokens(router):
  """Three requests at once in mode draft decode to plain decode's tokens, greedy and sampled. Whether the node drafts is
  its policy's priced call (this draft costs what the model does, so it may decline or only probe): tests/test_draft_model.py
  and tests/test_bench_spec.py check drafts that are made and kept."""
  prompts = [[(i * 37 + j) % 250 + 1 for i in range(40)] for j in range(3)]      # nothing to quote: no n-gram drafts
  for sampling in ({"temperature": 0}, {"temperature": 0.8, "seed": 3}):
    def both(spec):
      with ThreadPoolExecutor(3) as ex:
        return list(ex.map(lambda p: router.stream({"prompt": p, "max_tokens": 48, "speculative": spec, **sampling}), prompts))
    plain = both({"mode": "off"})
    assert all(len(t) == 48 for t in plain) and both({"mode": "draft", "k": 4}) == plain, sampling

@pytest.mark.parametrize("args, says", [(["--speculative", "draft"], "needs a draft model"),
                                        (["--draft-model", "random:vocab_size=300,max_context=256"], "not the model's")])
def test_a_node_refuses_a_draft_it_cannot_use(args, says):
  r = subprocess.run([sys.executable, "-m", "tinyhet", "node", "--role", "decode", "--listen", "127.0.0.1:0", "--model", SPEC,
                      "--kv-memory", "16M", "--quiet", *args], env=ENV, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
  assert r.returncode == 2 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr

@pytest.mark.parametrize("bad", [{"mode": "eagle"}, {"k": 0}, {"k": 9}, {"k": True}, "ngram", {"mode": "ngram", "depth": 2}])
def test_bad_speculative_field_is_a_400(router, bad):
  status, _, obj = router.request("POST", "/v1/completions", {"prompt": REPEAT, "max_tokens": 2, "speculative": bad})
  assert status == 400 and obj["error"]["param"] == "speculative", (bad, obj)
