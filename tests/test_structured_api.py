"""Structured outputs and tool calling through the `openai` client, unchanged, against real processes: a `both` node and a
router over the random model with a 1024-token context (the shared fixtures' 256 tokens do not hold a tool prompt and a
round trip's history). The model's weights are random, so only the grammar keeps its output in shape: what these tests
check is what constrained decoding guarantees, whatever the model prefers."""
import json
import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st
from test_service import Proc, Router

SPEC = "random:max_context=1024"
MODEL = "random:n_layers=2,dim=64,n_heads=4,n_kv_heads=2,hidden_dim=96,vocab_size=256,max_context=1024,seed=7"   # its id
jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")

@pytest.fixture(scope="module")
def served():
  node = Proc("node", "--role", "both", "--listen", "127.0.0.1:0", "--model", SPEC, "--quiet", "--kv-memory", "16M")
  router = None
  try:
    router = Router("--both", node.address, "--model", SPEC)
    router.wait_ready(nodes_up=1)
    yield router, openai.OpenAI(base_url=f"http://{router.address}/v1", api_key="unused", max_retries=0)
  finally:
    for p in (router, node):
      if p is not None: p.stop()

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                                                           "required": ["city"], "additionalProperties": False}}}

def test_json_schema_outputs_validate(served):
  router, client = served
  fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
  for seed in (1, 2):
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a person"}], response_format=fmt, max_tokens=200,
                                         temperature=1.0, seed=seed)
    assert out.choices[0].finish_reason == "stop", out
    jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)
  chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a person"}], response_format=fmt,
                                               max_tokens=200, temperature=1.0, seed=3, stream=True))
  assert chunks[-1].choices[0].finish_reason == "stop"
  jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in chunks)), PERSON)
  out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "json"}], response_format={"type": "json_object"},
                                       max_tokens=300, temperature=0.7, seed=4)
  if out.choices[0].finish_reason == "stop": assert isinstance(json.loads(out.choices[0].message.content), dict)
  else: assert out.choices[0].message.content.startswith("{")        # cut by max_tokens: an object that is still open

def test_vllm_guided_fields(served):
  router, client = served
  def complete(**extra):
    out = client.completions.create(model=MODEL, prompt="x", max_tokens=100, temperature=1.0, seed=5, extra_body=extra)
    return out.choices[0].text, out.choices[0].finish_reason
  text, reason = complete(guided_json=PERSON)
  assert reason == "stop"
  jsonschema.validate(json.loads(text), PERSON)
  assert complete(guided_choice=["yes", "no", "maybe"]) in (("yes", "stop"), ("no", "stop"), ("maybe", "stop"))
  import re
  text, reason = complete(guided_regex=r"[a-c]{2}-[0-9]{3}")
  assert reason == "stop" and re.fullmatch(r"[a-c]{2}-[0-9]{3}", text), text
  text, reason = complete(guided_grammar='root ::= "(" [0-9] ("+" [0-9])? ")"')          # GBNF
  assert reason == "stop" and re.fullmatch(r"\([0-9](\+[0-9])?\)", text), text
  text, reason = complete(guided_grammar='start: "go " DIR\nDIR: "north" | "south"')          # Lark
  assert reason == "stop" and text in ("go north", "go south"), text

def test_tool_call_round_trip(served):
  router, client = served
  for stream in (False, True):
    msgs = [{"role": "user", "content": "weather in Paris?"}]
    kw = dict(model=MODEL, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, max_tokens=120, temperature=1.0, seed=7)
    if stream:
      chunks = list(client.chat.completions.create(messages=msgs, stream=True, **kw))
      assert chunks[-1].choices[0].finish_reason == "tool_calls"
      deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
      assert len(deltas) == 1 and deltas[0].index == 0 and deltas[0].type == "function"
      call = {"id": deltas[0].id, "type": "function", "function": {"name": deltas[0].function.name, "arguments": deltas[0].function.arguments}}
    else:
      out = client.chat.completions.create(messages=msgs, **kw)
      assert out.choices[0].finish_reason == "tool_calls" and len(out.choices[0].message.tool_calls) == 1, out
      c = out.choices[0].message.tool_calls[0]
      call = {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
    assert call["function"]["name"] == "get_weather" and call["id"].startswith("call_")
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])
    msgs += [{"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "tool", "tool_call_id": call["id"], "content": "sunny, 21 C"}]
    final = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER], max_tokens=8, temperature=0)
    assert final.choices[0].finish_reason in ("stop", "length") and isinstance(final.choices[0].message.content, str)
    # the history reached the model: the call and its result rendered into the prompt (the byte tokenizer: one token a byte)
    want = prompt_ids(msgs, [WEATHER])
    assert final.usage.prompt_tokens == len(want) and b"sunny, 21 C" in bytes(want)

# random function schemas from a small grammar: objects of enums, bounded numbers and strings, and arrays of them
LEAF = st.one_of(st.just({"type": "integer", "minimum": -50, "maximum": 50}), st.just({"type": "number", "minimum": 0, "maximum": 10}),
                 st.just({"type": "boolean"}), st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 5)),
                 st.builds(lambda v: {"enum": v}, st.lists(st.sampled_from(["x", "yy", "z z", 1, None]), min_size=1, max_size=3, unique=True)))
VALUE = st.recursive(LEAF, lambda inner: st.one_of(
  st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n}, inner, st.integers(0, 2)),
  st.builds(lambda props: {"type": "object", "properties": props, "required": sorted(props), "additionalProperties": False},
            st.dictionaries(st.sampled_from(["a", "b", "c"]), inner, max_size=2))), max_leaves=3)
PARAMS = st.builds(lambda props, req: {"type": "object", "properties": props, "required": sorted(p for p in props if req),
                                       "additionalProperties": False}, st.dictionaries(st.sampled_from(["p", "q"]), VALUE, max_size=2), st.booleans())

CALL_ROOM = 384   # tokens a forced call is given: a call of these schemas is under 200 bytes but for a long number's digits

def prompt_ids(msgs: list, fns: list) -> list[int]:
  """The prompt as the router renders it, in the byte tokenizer's tokens (one a byte)."""
  from tinyhet.model.spec import ByteTokenizer
  from tinyhet.service import tools
  tok = ByteTokenizer()
  return tools.encode(tok, tools.clean_messages(msgs), tools.parse_tools({"tools": fns}, tok))

@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.filter_too_much])
@given(st.lists(PARAMS, min_size=1, max_size=2), st.booleans(), st.integers(0, 2**31))
def test_forced_tool_calls_validate(served, params, named, seed):
  """tool_choice named or required: however the model leans, the reply is tool calls of the given functions whose arguments
  parse and validate against their schemas. The draws whose rendered tools leave the call less than CALL_ROOM tokens of the
  1,024-token context are set aside (such a call ends at the context, finish_reason length, as it should)."""
  router, client = served
  fns = [{"type": "function", "function": {"name": f"f{i}", "parameters": p}} for i, p in enumerate(params)]
  assume(len(prompt_ids([{"role": "user", "content": "go"}], fns)) + CALL_ROOM <= 1024)
  choice = {"type": "function", "function": {"name": fns[-1]["function"]["name"]}} if named else "required"
  out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "go"}], tools=fns, tool_choice=choice,
                                       parallel_tool_calls=False, temperature=1.0, seed=seed)
  assert out.choices[0].finish_reason == "tool_calls", out
  calls = out.choices[0].message.tool_calls
  assert len(calls) == 1 and (not named or calls[0].function.name == fns[-1]["function"]["name"])
  schema = next(f["function"]["parameters"] for f in fns if f["function"]["name"] == calls[0].function.name)
  jsonschema.validate(json.loads(calls[0].function.arguments), schema)

@pytest.mark.parametrize("path, body, field", [
  ("chat", {"response_format": {"type": "json_object"}, "tools": [WEATHER], "tool_choice": "required"}, "response_format"),
  ("chat", {"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
  ("chat", {"guided_regex": "("}, "guided_regex"),
  ("chat", {"response_format": {"type": "xml"}}, "response_format"),
  ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}}, "response_format"),
  ("chat", {"guided_grammar": "root ::= ("}, "guided_grammar"),
  ("chat", {"tool_choice": "required"}, "tool_choice"),
  ("chat", {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
  ("chat", {"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
  ("chat", {"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
  ("chat", {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function",
                                                                                 "function": {"name": "f", "arguments": "{oops"}}]}]}, "messages"),
  ("completions", {"tools": [WEATHER]}, "tools"),
])
def test_unsupported_combinations_are_400s(served, path, body, field):
  router, _ = served
  base = {"model": MODEL, "max_tokens": 4, **({"messages": [{"role": "user", "content": "hi"}]} if path == "chat" else {"prompt": "hi"})}
  status, _, obj = router.request("POST", f"/v1/{'chat/completions' if path == 'chat' else 'completions'}", {**base, **body})
  assert status == 400 and obj["error"]["param"] == field, obj
