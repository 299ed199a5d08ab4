"""Tool calling in chat completions: the request's `tools`, `tool_choice` and `parallel_tool_calls`, the history's tool
messages, the prompt as the model's chat template renders tools, and the reply's text parsed back into tool calls.

Two formats, picked from the chat template:
  hermes  <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>, one block per call (Qwen 2.5/3, Hermes, SmolLM2's
          larger instruct models). A template that mentions <tool_call> renders the tools itself; a template that knows no
          tools (SmolLM2's small models, the tests' byte tokenizer) gets them in its system message in this format, the tool
          calls of earlier turns as such blocks and tool results as <tool_response> user turns.
  llama3  {"name": ..., "parameters": {...}} as the whole reply, calls separated by "; " (Llama 3.1/3.2's JSON tool calling;
          the template renders the tools).
tool_choice "auto": the model decides; its reply is parsed. "required" or a named function: the reply is constrained by a
grammar (tinyhet.engine.grammar) to calls of the tools (that one), each call's arguments JSON valid against the function's
`parameters` schema. "none": the tools are left out of the prompt and nothing is parsed.
"""
from __future__ import annotations
import json, re, uuid
from dataclasses import dataclass
from tinyhet.service.api_error import ApiError
from tinyhet.service.structured import JSON_OPTIONS, _checked, output_grammar

OPEN, CLOSE = "<tool_call>", "</tool_call>"
ROLES = ("system", "developer", "user", "assistant", "tool")
FALLBACK_PROMPT = ("You may call these functions:\n<tools>\n{tools}\n</tools>\nTo call one, reply with its name and arguments "
                   "as JSON in <tool_call></tool_call> tags:\n<tool_call>\n{{\"name\": ..., \"arguments\": {{...}}}}\n</tool_call>")

@dataclass
class ToolSpec:
  tools: list[dict]             # as the request gave them: {"type": "function", "function": {"name", "description", "parameters"}}
  choice: str                   # auto | required | none | named
  name: str | None              # the function tool_choice names
  parallel: bool
  format: str                   # hermes | llama3
  native: bool                  # the chat template renders the tools itself

  @property
  def names(self) -> set[str]: return {t["function"]["name"] for t in self.tools}
  @property
  def parses(self) -> bool: return self.choice != "none"

def template_format(template: str | None) -> tuple[str, bool]:
  """(format, native) for a chat template: its own tool rendering where it has one, else hermes in the system message."""
  if template and OPEN in template: return "hermes", True
  if template and "tools" in template and ("ipython" in template or '"parameters"' in template): return "llama3", True
  return "hermes", False

def parse_tools(body: dict, tok) -> ToolSpec | None:
  """The request's tool fields, checked (ApiError naming the field); None when it has no tools (or tool_choice none)."""
  tools, choice, parallel = body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")
  if parallel is not None and not isinstance(parallel, bool): raise ApiError("'parallel_tool_calls' must be true or false", "parallel_tool_calls")
  if tools is None or tools == []:
    if choice not in (None, "none", "auto"): raise ApiError("'tool_choice' needs 'tools': give the functions it may call", "tool_choice")
    return None
  if not isinstance(tools, list) or len(tools) > 128: raise ApiError("'tools' must be a list of at most 128 {\"type\": \"function\", ...}", "tools")
  seen = set()
  for i, t in enumerate(tools):
    f = t.get("function") if isinstance(t, dict) else None
    if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(f, dict):
      raise ApiError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\", \"parameters\"}}}}", "tools")
    name = f.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
      raise ApiError(f"tools[{i}].function.name must be 1-64 letters, digits, '_', '.' or '-'", "tools")
    if name in seen: raise ApiError(f"tools[{i}]: the function {name!r} is given twice", "tools")
    seen.add(name)
    if not isinstance(f.get("parameters", {}), dict): raise ApiError(f"tools[{i}].function.parameters must be a JSON schema (an object)", "tools")
    if not isinstance(f.get("description", ""), str): raise ApiError(f"tools[{i}].function.description must be a string", "tools")
  name = None
  if choice is None: choice = "auto"
  elif isinstance(choice, dict):
    f = choice.get("function")
    name = f.get("name") if choice.get("type") == "function" and isinstance(f, dict) else None
    if not isinstance(name, str): raise ApiError("'tool_choice' must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\"}}",
                                                 "tool_choice")
    if name not in seen: raise ApiError(f"'tool_choice' names {name[:64]!r}, which is not among 'tools'", "tool_choice")
    choice = "named"
  elif choice not in ("none", "auto", "required"):
    raise ApiError("'tool_choice' must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\"}}", "tool_choice")
  if choice == "none": return None
  fmt, native = template_format(getattr(tok, "chat_template", None))
  return ToolSpec(tools, choice, name, True if parallel is None else parallel, fmt, native)

def clean_messages(msgs) -> list[dict]:
  """The chat history checked: {role, content} with content a string or text parts; an assistant turn may carry
  tool_calls (content null), a tool turn answers one (tool_call_id). developer is system."""
  if not isinstance(msgs, list) or not msgs: raise ApiError("'messages' must be a non-empty list of {\"role\", \"content\"} objects", "messages")
  clean = []
  for i, m in enumerate(msgs):
    if not isinstance(m, dict) or m.get("role") not in ROLES:
      raise ApiError(f"messages[{i}] must be an object whose 'role' is system, developer, user, assistant or tool", "messages")
    content, calls = m.get("content"), m.get("tool_calls")
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
      content = "".join(p["text"] for p in content)
    if content is None and m["role"] == "assistant" and calls: content = ""
    if not isinstance(content, str): raise ApiError(f"messages[{i}].content must be a string or a list of text parts", "messages")
    out = {"role": "system" if m["role"] == "developer" else m["role"], "content": content}
    if m["role"] == "assistant" and calls is not None: out["tool_calls"] = _history_calls(calls, i)
    if m["role"] == "tool":
      if not isinstance(m.get("tool_call_id", ""), str): raise ApiError(f"messages[{i}].tool_call_id must be a string", "messages")
      out["tool_call_id"] = m.get("tool_call_id", "")
    clean.append(out)
  return clean

def _history_calls(calls, i: int) -> list[dict]:
  out = []
  if not isinstance(calls, list): raise ApiError(f"messages[{i}].tool_calls must be a list", "messages")
  for c in calls:
    f = c.get("function") if isinstance(c, dict) else None
    if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not isinstance(f.get("arguments", "{}"), (str, dict)):
      raise ApiError(f"messages[{i}].tool_calls: each is {{\"id\", \"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}", "messages")
    args = f.get("arguments", "{}")
    if isinstance(args, str):
      try: args = json.loads(args) if args.strip() else {}
      except ValueError: raise ApiError(f"messages[{i}].tool_calls: the arguments of {f['name'][:64]!r} are not JSON", "messages") from None
    out.append({"id": str(c.get("id", "")), "type": "function", "function": {"name": f["name"], "arguments": args}})
  return out

def encode(tok, messages: list[dict], spec: ToolSpec | None, add_generation_prompt: bool = True) -> list[int]:
  """The prompt's token ids: the template's own tool rendering (tools=...), or the hermes fallback written into the turns."""
  if template_format(getattr(tok, "chat_template", None))[1]:
    return tok.encode_chat(messages, add_generation_prompt, tools=spec.tools if spec is not None else None)
  return tok.encode_chat(fallback_messages(messages, spec), add_generation_prompt)

def fallback_messages(messages: list[dict], spec: ToolSpec | None) -> list[dict]:
  """Turns any template renders: the tools in the system message, earlier calls as <tool_call> blocks, results as user turns."""
  out = []
  for m in messages:
    if m["role"] == "tool": out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
    elif m.get("tool_calls"):
      blocks = [f"{OPEN}\n{json.dumps({'name': c['function']['name'], 'arguments': c['function']['arguments']}, ensure_ascii=False)}\n{CLOSE}"
                for c in m["tool_calls"]]
      out.append({"role": "assistant", "content": "\n".join(([m["content"]] if m["content"] else []) + blocks)})
    else: out.append({"role": m["role"], "content": m["content"]})
  if spec is not None:
    prompt = FALLBACK_PROMPT.format(tools="\n".join(json.dumps(t["function"], ensure_ascii=False, separators=(",", ":")) for t in spec.tools))
    if out and out[0]["role"] == "system": out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
    else: out.insert(0, {"role": "system", "content": prompt})
  return out

def call_schema(f: dict, fmt: str) -> dict:
  args = f.get("parameters") or {"type": "object"}
  key = "parameters" if fmt == "llama3" else "arguments"
  return {"type": "object", "properties": {"name": {"const": f["name"]}, key: args}, "required": ["name", key], "additionalProperties": False}

def tool_grammar(spec: ToolSpec) -> str | None:
  """For required and named tool_choice: the grammar of the reply, calls only (one, or several with parallel_tool_calls)."""
  if spec.choice not in ("required", "named"): return None
  fs = [t["function"] for t in spec.tools if spec.choice == "required" or t["function"]["name"] == spec.name]
  schema = {"anyOf": [call_schema(f, spec.format) for f in fs], "x-guidance": JSON_OPTIONS}
  one = f'"{OPEN}\\n" body "\\n{CLOSE}"' if spec.format == "hermes" else "body"
  sep = '"\\n"' if spec.format == "hermes" else '"; "'
  lark = f"start: call{f' ({sep} call)*' if spec.parallel and spec.choice == 'required' else ''}\ncall: {one}\nbody: %json {json.dumps(schema)}\n"
  from llguidance import LLMatcher
  return _checked(LLMatcher.grammar_from_lark(lark), "tools")

def _decode_calls(text: str, spec: ToolSpec, sep: str = "") -> list[dict] | None:
  """The calls in text (JSON objects, separated by whitespace or sep), or None when it is anything else."""
  dec, calls, i = json.JSONDecoder(), [], 0
  while True:
    while i < len(text) and (text[i].isspace() or (sep and text[i] == sep)): i += 1
    if i == len(text): return calls or None
    try: obj, i = dec.raw_decode(text, i)
    except ValueError: return None
    args = obj.get("arguments", obj.get("parameters", {})) if isinstance(obj, dict) else None
    if not isinstance(obj, dict) or obj.get("name") not in spec.names or not isinstance(args, dict): return None
    calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                  "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}})

def parse_output(text: str, spec: ToolSpec) -> tuple[str | None, list[dict]]:
  """(content, tool calls) of a reply: the calls it holds, the rest of its text (None when there is none)."""
  if spec.format == "llama3":
    calls = _decode_calls(text.removeprefix("<|python_tag|>"), spec, ";")
    return (None, calls) if calls else (text, [])
  calls, rest, pos = [], [], 0
  for m in re.finditer(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), text, re.S):
    got = _decode_calls(m.group(1), spec)
    if got is None: continue
    rest.append(text[pos:m.start()])
    calls += got
    pos = m.end()
  content = ("".join(rest) + text[pos:]).strip() if calls else text
  return (content or None), calls

class ToolStream:
  """A streamed reply's text split into content to send now and tool calls as each completes (hermes: at its </tool_call>;
  llama3: a reply that opens with '{' is held to its end)."""
  def __init__(self, spec: ToolSpec):
    self.spec, self.buf, self.open, self.calls, self.held = spec, "", False, 0, None

  def push(self, piece: str) -> tuple[str, list[dict]]:
    self.buf += piece
    if self.spec.format == "llama3":
      if self.held is None and self.buf.strip(): self.held = self.buf.lstrip().startswith("{")
      if self.held is not False: return "", []
      out, self.buf = self.buf, ""
      return out, []
    content, calls = "", []
    while True:
      if not self.open:
        at = self.buf.find(OPEN)
        if at < 0:                  # send all but what may begin an opening tag
          keep = next((k for k in range(min(len(OPEN) - 1, len(self.buf)), 0, -1) if OPEN.startswith(self.buf[-k:])), 0)
          content, self.buf = content + self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
          return content, calls
        content, self.buf, self.open = content + self.buf[:at], self.buf[at:], True
      end = self.buf.find(CLOSE)
      if end < 0: return content, calls
      block, self.buf, self.open = self.buf[:end + len(CLOSE)], self.buf[end + len(CLOSE):], False
      _, got = parse_output(block, self.spec)
      if got: calls += got
      else: content += block
      self.calls += len(got)

  def finish(self) -> tuple[str, list[dict]]:
    """What is left at the end: held text, or the calls of a held llama3 reply."""
    rest, self.buf = self.buf, ""
    if self.spec.format == "llama3" and self.held:
      content, calls = parse_output(rest, self.spec)
      self.calls += len(calls)
      return content or "", calls
    return rest, []

def reply_message(text: str, spec: ToolSpec, reason: str) -> tuple[dict, str]:
  """A non-streamed chat reply's message and finish_reason: its tool calls parsed out ("tool_calls") where it made any."""
  content, calls = parse_output(text, spec) if spec.parses else (text, [])
  if not calls: return {"role": "assistant", "content": text}, reason
  return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"

def delta_calls(calls: list[dict], first_index: int) -> list[dict]:
  """Calls as a stream's delta.tool_calls: each whole in one chunk, with its index among the reply's calls."""
  return [{"index": first_index + k, **c} for k, c in enumerate(calls)]

def constrain_request(p: dict, body: dict, tools=None) -> dict:
  """A parsed request (api_schema) with its grammar in the nodes' sampling options and its tool spec (tools.ToolSpec) in
  p["tools"]: a forced tool call's grammar, or the response_format / guided_* field's. Both at once is a 400."""
  text, field = output_grammar(body)
  if tools is not None and field is not None:
    raise ApiError(f"'{field}' together with 'tools' is not supported: send one of them (or tool_choice none)", field)
  if tools is not None: text = tool_grammar(tools)
  if text is not None: p["options"]["grammar"] = text
  p["tools"] = tools
  return p
