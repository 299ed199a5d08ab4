"""Structured outputs: a request's response_format (OpenAI) or guided_* field (vLLM) as one llguidance grammar text, which
the nodes enforce token by token (tinyhet.engine.grammar). At most one of them per request; a schema, regex or grammar that
does not compile is a 400 naming its field.

  response_format {"type": "text"}                                   no constraint
                  {"type": "json_object"}                            any JSON object
                  {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}   JSON valid against the schema
  guided_json     a JSON schema (object or its JSON text)            as json_schema
  guided_regex    a regular expression (Rust regex syntax)           the whole output matches it
  guided_choice   a list of strings                                  the output is one of them
  guided_grammar  a Lark grammar (llguidance's dialect) or a GBNF one (llama.cpp's)
  structured_outputs  newer vLLM's one object for the same: {"json" | "regex" | "choice" | "grammar": ..., or "json_object": true}
JSON is written compactly (", " and ": " between items, no other whitespace), so a model cannot spend its tokens on blanks.
"""
from __future__ import annotations
import functools, json
from tinyhet.service.api_error import ApiError

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")

def schema_grammar(schema, param: str) -> str:
  """The grammar of JSON valid against schema; ApiError naming param when llguidance cannot compile it."""
  from llguidance import LLMatcher
  if not isinstance(schema, (dict, bool)): raise ApiError(f"'{param}' must be a JSON schema (an object)", param)
  try: text = LLMatcher.grammar_from_json_schema(schema if isinstance(schema, dict) else {} if schema else {"not": {}}, defaults=JSON_OPTIONS)
  except ValueError as e: raise ApiError(f"'{param}': the schema cannot be enforced: {str(e)[:300]}", param) from None
  return _checked(text, param)

def _checked(text: str, param: str) -> str:
  from tinyhet.engine.grammar import GrammarError, check_grammar
  try: return check_grammar(text)
  except GrammarError as e: raise ApiError(f"'{param}' cannot be enforced: {e}", param) from None

def _response_format(rf) -> str | None:
  if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
    raise ApiError("'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or {\"type\": \"json_schema\", \"json_schema\": "
                   "{\"name\": ..., \"schema\": {...}}}", "response_format")
  if rf["type"] == "text": return None
  if rf["type"] == "json_object": return schema_grammar({"type": "object"}, "response_format")
  js = rf.get("json_schema")
  if not isinstance(js, dict) or not isinstance(js.get("name", ""), str) or not isinstance(js.get("strict", False), (bool, type(None))):
    raise ApiError("'response_format.json_schema' must be an object {\"name\": str, \"schema\": {...}, \"strict\": bool}", "response_format")
  return schema_grammar(js.get("schema", {}), "response_format")

def _guided(name: str, v) -> str:
  import llguidance
  if name == "guided_json":
    if isinstance(v, str):
      try: v = json.loads(v)
      except ValueError: raise ApiError("'guided_json' must be a JSON schema: an object or its JSON text", name) from None
    return schema_grammar(v, name)
  if name == "guided_regex":
    if not isinstance(v, str) or not v: raise ApiError("'guided_regex' must be a non-empty regular expression", name)
    return _checked(llguidance.LLMatcher.grammar_from_regex(v), name)
  if name == "guided_choice":
    if not isinstance(v, list) or not v or not all(isinstance(c, str) and c for c in v):
      raise ApiError("'guided_choice' must be a non-empty list of non-empty strings", name)
    return _checked(llguidance.grammar_from("choice", json.dumps(v)), name)
  if not isinstance(v, str) or not v.strip(): raise ApiError("'guided_grammar' must be a Lark or GBNF grammar (a string)", name)
  try: text = llguidance.grammar_from("grammar", v)
  except Exception as e: raise ApiError(f"'guided_grammar' is neither Lark nor GBNF: {str(e)[:300]}", name) from None
  return _checked(text, name)

STRUCTURED = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice", "grammar": "guided_grammar"}

def _structured_outputs(v) -> str:
  given = {k: x for k, x in v.items() if x is not None} if isinstance(v, dict) else None
  if given == {"json_object": True}: return schema_grammar({"type": "object"}, "structured_outputs")
  if not given or len(given) != 1 or next(iter(given)) not in STRUCTURED:
    raise ApiError("'structured_outputs' must hold one of json, regex, choice, grammar (or json_object: true)", "structured_outputs")
  name, value = next(iter(given.items()))
  try: return _guided(STRUCTURED[name], value)
  except ApiError as e: raise ApiError(str(e).replace(STRUCTURED[name], f"structured_outputs.{name}"), "structured_outputs") from None

def output_grammar(body: dict) -> tuple[str | None, str | None]:
  """(grammar text, the field that asked for it) of a request body, or (None, None) without one."""
  given = [k for k in ("response_format", *GUIDED, "structured_outputs") if body.get(k) is not None]
  if len(given) > 1: raise ApiError(f"'{given[1]}' and '{given[0]}' both constrain the output: send one of them", given[1])
  if not given: return None, None
  name = given[0]
  try: key = json.dumps(body[name])            # key order kept: a schema's properties come out in its order
  except (TypeError, ValueError): key = None
  text = _compiled(name, key) if key is not None else _grammar_of(name, body[name])
  return text, (name if text is not None else None)

@functools.lru_cache(maxsize=256)
def _compiled(name: str, key: str) -> str | None:
  """A field's grammar, compiled once per distinct value (the JSON text of it): a schema sent again costs a lookup."""
  return _grammar_of(name, json.loads(key))

def _grammar_of(name: str, value) -> str | None:
  return (_response_format(value) if name == "response_format" else _structured_outputs(value) if name == "structured_outputs" else
          _guided(name, value))
