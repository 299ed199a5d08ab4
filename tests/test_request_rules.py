"""One set of request rules (tinyhet.model.request_rules) for the HTTP API and the nodes: whatever body the API accepts,
the nodes' own checks accept what the router then sends (so no request fails on a node after its first token streamed),
and the limits the decode node holds (stop strings of at most 200 characters, temperatures it can sample) are refused at
the API with a 400 naming the field."""
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from tinyhet.model.request_rules import MAX_STOP_CHARS, MAX_STOPS, check_generation, check_stop
from tinyhet.service.api_schema import ApiError, parse_chat, parse_completion

SPEC = "random:max_context=256"

@pytest.fixture(scope="module")
def tok():
  from tinyhet.model import spec
  return spec.load_tokenizer(SPEC), spec.model_id(SPEC)

NUMBER = st.one_of(st.floats(-3, 12), st.floats(0, 1e-5), st.integers(-3, 12), st.sampled_from([0, 1e-7, 1e-6, 2, float("inf"), float("nan")]))
FIELDS = {"temperature": NUMBER, "top_p": NUMBER, "seed": st.one_of(st.integers(-1, 2**65), st.floats()), "top_k": st.integers(-3, 10**6),
          "min_p": NUMBER, "presence_penalty": NUMBER, "frequency_penalty": NUMBER, "repetition_penalty": NUMBER,
          "stop": st.one_of(st.text(max_size=MAX_STOP_CHARS + 2), st.lists(st.text(max_size=MAX_STOP_CHARS + 2), max_size=MAX_STOPS + 1),
                            st.just("x" * (MAX_STOP_CHARS + 1))),
          "logit_bias": st.dictionaries(st.sampled_from(["0", "7", "255", "256", "007", "-1", "x"]), NUMBER, max_size=3),
          "logprobs": st.one_of(st.integers(-1, 25), st.booleans()), "top_logprobs": st.integers(-1, 25), "echo": st.booleans(),
          "max_tokens": st.integers(1, 300)}

@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.fixed_dictionaries({}, optional=FIELDS), st.booleans())
def test_what_the_api_accepts_every_node_accepts(tok, body, chat):
  parse = parse_chat if chat else parse_completion
  body = {**body, "messages": [{"role": "user", "content": "hi"}]} if chat else {**body, "prompt": [1, 2, 3]}
  try: p = parse(body, tok[0], tok[1], 256)
  except ApiError as e:
    assert e.status == 400 and (e.param is None or e.param in body), (e, e.param)
    return
  # what the router sends a node: its options with output_from (tinyhet.service.router.Cluster._attempt), the stop strings
  check_generation(p["temperature"], p["top_p"], p["seed"], {**p["options"], "output_from": len(p["prompt_ids"])}, p["stop"])

@pytest.mark.parametrize("field, value", [("stop", "x" * (MAX_STOP_CHARS + 1)), ("stop", ["a", "x" * (MAX_STOP_CHARS + 1)]),
                                          ("stop", ["a"] * (MAX_STOPS + 1)), ("temperature", 1e-7)])
def test_what_a_node_refuses_is_a_400_at_the_api(tok, field, value):
  with pytest.raises(ApiError) as e: parse_completion({"prompt": [1, 2], field: value}, tok[0], tok[1], 256)
  assert e.value.status == 400 and e.value.param == field
  with pytest.raises(ValueError):           # and the node's own check says the same
    check_generation(value if field == "temperature" else 0.0, 1.0, 0, {}, value if isinstance(value, list) else [value] if field == "stop" else [])

def test_the_longest_stop_passes_both():
  longest = ["x" * MAX_STOP_CHARS] * MAX_STOPS
  assert check_stop(longest) == longest and check_stop(None) == []
  for bad in ("x", [""], [1], ["a"] * (MAX_STOPS + 1)):
    with pytest.raises(ValueError, match="stop"): check_stop(bad)
