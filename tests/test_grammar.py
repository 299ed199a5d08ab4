"""Constrained decoding without processes: tinyhet.engine.grammar's masks in the batch sampler, and tinyhet.service.tools'
parsing. Random logits stand in for a model: whatever they prefer, the grammar decides what may be drawn."""
import json
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from tinyhet.engine.grammar import GrammarError, constrain, grammars, prefetch
from tinyhet.model.sampling import Sampler, sample_batch
from tinyhet.model.spec import ByteTokenizer
from tinyhet.service import tools
from tinyhet.service.structured import output_grammar

jsonschema = pytest.importorskip("jsonschema")
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": -9, "maximum": 99}, "s": {"enum": ["ab", "c"]},
                                           "l": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}},
          "required": ["n", "s", "l"], "additionalProperties": False}
V = 300                         # the model's vocabulary: wider than the byte tokenizer's 256

def constrained(grammar: str, seed: int, temperature: float = 1.0, prompt=(1, 2, 3), tok=None, n_vocab=V) -> Sampler:
  s = Sampler(temperature, 1.0, seed, grammar=grammar, output_from=len(prompt))
  constrain(s, tok or ByteTokenizer(), n_vocab)
  return s

def generate(samplers, seed: int, steps: int = 200, n_vocab=V) -> list[list[int]]:
  """Decode rows together from random logits, as the decode node's loop does (masks prefetched), until each row's grammar
  is done (or steps run out); unconstrained rows run the whole way."""
  rng, seqs, live = np.random.default_rng(seed), [[1, 2, 3] for _ in samplers], list(range(len(samplers)))
  for _ in range(steps):
    if not live: break
    f = prefetch([samplers[i] for i in live], [seqs[i] for i in live])
    if f is not None: f.result()
    logits = rng.standard_normal((len(live), n_vocab)).astype(np.float32) * 4
    draws = sample_batch(logits, [samplers[i] for i in live], [len(seqs[i]) for i in live], [seqs[i] for i in live])
    for i, d in zip(list(live), draws):
      assert not isinstance(d, Exception), d
      seqs[i].append(d.token)
      c = samplers[i].constraint
      if c is not None and c.done(seqs[i]): live.remove(i)
  return [s[3:] for s in seqs]

@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**32), st.sampled_from([0.0, 0.7, 1.5]))
def test_outputs_follow_the_schema(seed, temperature):
  g, _ = output_grammar({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}})
  for out in generate([constrained(g, seed, temperature), constrained(g, seed + 1, temperature)], seed):     # masks: llguidance's executor
    jsonschema.validate(json.loads(bytes(out)), SCHEMA)

@settings(max_examples=15, deadline=None)
@given(st.integers(0, 2**32))
def test_unconstrained_rows_draw_what_they_draw_alone(seed):
  """A batch of constrained and unconstrained rows: the unconstrained ones draw the tokens they draw in a batch of their own."""
  g, _ = output_grammar({"guided_regex": "[a-z]{1,40}"})
  mixed = generate([Sampler(1.0, 1.0, seed + 1), constrained(g, seed), Sampler(0.0, 1.0, 0)], seed, steps=20)
  alone = generate([Sampler(1.0, 1.0, seed + 1), Sampler(1.0, 1.0, 99), Sampler(0.0, 1.0, 0)], seed, steps=20)
  assert mixed[0] == alone[0] and mixed[2] == alone[2]
  assert all(97 <= t <= 122 for t in mixed[1]) and mixed[1] != alone[1]

def test_a_draw_is_repeatable_and_a_restart_continues():
  """The prefill node draws the first token twice; a request restarted on another node starts its Constraint with the output
  so far in its prompt (output_from): both see the grammar's state from the tokens alone."""
  g, _ = output_grammar({"guided_json": SCHEMA})
  s = constrained(g, 5)
  logits = np.random.default_rng(0).standard_normal(V).astype(np.float32)
  assert s.draw(logits, 3, [1, 2, 3]).token == s.draw(logits, 3, [1, 2, 3]).token == ord("{")
  out, = generate([s], 11)
  for cut in (1, len(out) // 2, len(out) - 1):
    seq = [1, 2, 3, *out[:cut]]
    again = constrained(g, 5, prompt=(1, 2, 3))
    nxt = out[cut]
    assert again.constraint.allowed(seq)[nxt], (cut, bytes(out))

def test_compiled_once_per_grammar_and_bad_ones_refused():
  tok = ByteTokenizer()
  gs = grammars(tok, V)
  g, _ = output_grammar({"guided_choice": ["yes", "no"]})
  before = gs.compiles
  for seed in range(3): constrained(g, seed, tok=tok)
  assert gs.compiles == before + 1
  with pytest.raises(GrammarError): gs.constraint("start: (")
  with pytest.raises(ValueError, match="tokenizer"): constrain(Sampler(grammar=g), None, V)

def test_choices_end_the_sequence_at_their_last_byte():
  g, _ = output_grammar({"guided_choice": ["north", "south", "no"]})
  outs = {bytes(generate([constrained(g, seed)], seed)[0]) for seed in range(12)}
  assert outs <= {b"north", b"south", b"no"} and len(outs) >= 2

def test_the_embedded_models_vocabulary():
  """A Hugging Face tokenizer (SmolLM2's, 49,152 tokens): the grammar ends by admitting only the end-of-reply tokens."""
  from tinyhet.model.weights import embedded_model_path
  try: path = embedded_model_path()
  except Exception as e: pytest.skip(f"the embedded model is not installed: {e}")
  from tinyhet.model.tokenizer import Tokenizer
  from tinyhet.model.weights import read_gguf
  tok = Tokenizer.from_gguf_metadata(read_gguf(path).metadata)
  g, _ = output_grammar({"guided_json": SCHEMA})
  s = constrained(g, 3, tok=tok, n_vocab=tok.vocab_size)
  seq, rng = [1, 2, 3], np.random.default_rng(3)
  for _ in range(100):
    d = sample_batch(rng.standard_normal((1, tok.vocab_size)).astype(np.float32), [s], [len(seq)], [seq])[0]
    seq.append(d.token)
    if d.token in tok.stop_ids: break
  assert seq[-1] in tok.stop_ids
  jsonschema.validate(json.loads(tok.decode(seq[3:-1])), SCHEMA)

WEATHER = {"type": "function", "function": {"name": "w", "parameters": {"type": "object", "properties": {"c": {"type": "string"}}}}}

@settings(max_examples=40, deadline=None)
@given(st.text(alphabet="ab <>/\n", max_size=12), st.lists(st.integers(0, 40), max_size=6), st.booleans())
def test_streamed_tool_calls_are_the_parsed_ones(prefix, cuts, two):
  spec = tools.parse_tools({"tools": [WEATHER]}, ByteTokenizer())
  call = '<tool_call>\n{"name": "w", "arguments": {"c": "x<y"}}\n</tool_call>'
  text = prefix + call + ("\n" + call if two else "")
  stream, content, calls = tools.ToolStream(spec), "", []
  for a, b in zip([0, *sorted(cuts)], [*sorted(cuts), len(text)]):
    c, k = stream.push(text[a:b] if a < b else "")
    content, calls = content + c, calls + k
  c, k = stream.finish()
  content, calls = content + c, calls + k
  want_content, want = tools.parse_output(text, spec)
  assert [x["function"] for x in calls] == [x["function"] for x in want] and len(want) == 1 + two
  assert content.strip() == (want_content or "")

def test_llama3_format_and_native_templates():
  """A template that renders tools itself gets them (tools=...); Llama 3's JSON calls parse, separated by '; '."""
  assert tools.template_format("{% for t in tools %}{{ t | tojson }}{% endfor %}<tool_call>") == ("hermes", True)
  assert tools.template_format('{{ tools }} Environment: ipython "parameters"') == ("llama3", True)
  assert tools.template_format("{{ messages }}") == ("hermes", False)
  spec = tools.ToolSpec([WEATHER], "auto", None, True, "llama3", True)
  content, calls = tools.parse_output('<|python_tag|>{"name": "w", "parameters": {"c": "a"}}; {"name": "w", "parameters": {}}', spec)
  assert content is None and [json.loads(c["function"]["arguments"]) for c in calls] == [{"c": "a"}, {}]
  assert tools.parse_output('{"name": "other", "parameters": {}}', spec) == ('{"name": "other", "parameters": {}}', [])
  from tinyhet.model.tokenizer import Tokenizer
  class Tok(Tokenizer):
    def __init__(self):
      self.chat_template, self.bos_id, self.eos_id = "{% for t in tools %}[{{ t.function.name }}]{% endfor %}<tool_call>", None, None
    def encode(self, text, add_special=True): return list(text.encode())
    def token_text(self, i): return ""
  assert bytes(tools.encode(Tok(), [{"role": "user", "content": "x"}], tools.parse_tools({"tools": [WEATHER]}, Tok()))) == b"[w]<tool_call>"

def test_parallel_required_calls_all_validate():
  """tool_choice required with parallel_tool_calls: one or more calls, each of a given function with valid arguments (the
  byte vocabulary has no end token, so the reply runs to the step limit and only its finished calls count)."""
  fns = [WEATHER, {"type": "function", "function": {"name": "n", "parameters": SCHEMA}}]
  spec = tools.parse_tools({"tools": fns, "tool_choice": "required"}, ByteTokenizer())
  g = tools.tool_grammar(spec)
  for seed in range(3):
    out, = generate([constrained(g, seed)], seed, steps=300)
    content, calls = tools.parse_output(bytes(out).decode(), spec)
    assert calls and (content is None or "<tool_call>".startswith(content[:11]))     # what is left: the unfinished last call
    for c in calls:
      jsonschema.validate(json.loads(c["function"]["arguments"]), next(f["function"]["parameters"] for f in fns if f["function"]["name"] ==
                                                                         c["function"]["name"]))

def test_vllm_structured_outputs_is_guided_under_one_field():
  from tinyhet.service.api_error import ApiError
  for key, guided, value in (("json", "guided_json", SCHEMA), ("regex", "guided_regex", "a+"), ("choice", "guided_choice", ["a", "b"]),
                             ("grammar", "guided_grammar", 'root ::= "x"')):
    assert output_grammar({"structured_outputs": {key: value}}) == (output_grammar({guided: value})[0], "structured_outputs")
  assert output_grammar({"structured_outputs": {"json_object": True}})[0] == output_grammar({"response_format": {"type": "json_object"}})[0]
  for bad in ({}, {"regex": "a", "choice": ["a"]}, {"xml": "x"}, {"regex": "("}, "a+"):
    with pytest.raises(ApiError) as e: output_grammar({"structured_outputs": bad})
    assert e.value.param == "structured_outputs"
  with pytest.raises(ApiError) as e: output_grammar({"guided_regex": "a", "structured_outputs": {"regex": "b"}})
  assert e.value.param == "structured_outputs"

def test_tool_choice_auto_is_free_and_none_leaves_the_tools_out():
  tok, msgs = ByteTokenizer(), [{"role": "user", "content": "hi"}]
  def parsed(**body):
    p = tools.constrain_request({"options": {}}, {"tools": [WEATHER], **body}, spec := tools.parse_tools({"tools": [WEATHER], **body}, tok))
    return p, spec
  p, spec = parsed()
  assert spec.choice == "auto" and "grammar" not in p["options"] and b"<tools>" in bytes(tools.encode(tok, msgs, spec))
  p, spec = parsed(tool_choice="none")
  assert spec is None and "grammar" not in p["options"] and tools.encode(tok, msgs, spec) == tok.encode_chat(msgs)
  for choice in ("required", {"type": "function", "function": {"name": "w"}}):
    assert "%json" in parsed(tool_choice=choice)[0]["options"]["grammar"]
