"""Checking OpenAI request bodies: each field's type and range, the model's name and the context's length. A bad body
raises ApiError (HTTP 4xx) whose message says which field to change and how; nothing else is raised for any JSON value."""
from __future__ import annotations
from tinyhet.engine.speculative import check_speculative
from tinyhet.model.request_rules import MAX_STOP_CHARS, MAX_STOPS, check_generation, check_stop
from tinyhet.service.api_error import ApiError
from tinyhet.service.api_fields import check_fields, completion_prompts, extra_sampling, sample_count

def node_rules(body: dict, temperature, top_p, seed, options: dict, stop: list[str]) -> None:
  """The nodes' own checks of what the router will send (tinyhet.model.request_rules), so a node never refuses it later."""
  try: check_generation(temperature, top_p, seed, options, stop)
  except ValueError as e:
    name = str(e).split()[0]
    raise ApiError(f"a node refuses this request: {e}", name if name in body else None) from None

def _is_int(x) -> bool: return isinstance(x, int) and not isinstance(x, bool)
def _is_num(x) -> bool: return isinstance(x, (int, float)) and not isinstance(x, bool)

def _common(body, tok, model_id: str, max_context: int | None, prompt_ids: list[int], chat: bool) -> dict:
  model = body.get("model")
  if model is None: model = model_id      # the router serves one model: leaving it out means that one (as vLLM's and llama.cpp's servers do)
  if not isinstance(model, str): raise ApiError(f"'model' must be a string: {model_id!r} (GET /v1/models lists it)", "model")
  if model != model_id:
    raise ApiError(f"the model {model[:100]!r} does not exist here; this server serves {model_id!r}", "model", 404, "model_not_found")
  if max_context is None: raise ApiError("no decode node is up yet: retry in a few seconds (GET /ready says when)", None, 503, "not_ready")
  n_vocab = tok.vocab_size
  if not prompt_ids: raise ApiError("the prompt is empty: give at least one token", "messages" if chat else "prompt")
  if any(not 0 <= t < n_vocab for t in prompt_ids):
    raise ApiError(f"prompt token ids must be in 0..{n_vocab - 1}", "prompt")
  room = max_context - len(prompt_ids)
  if room < 1:
    raise ApiError(f"the prompt has {len(prompt_ids)} tokens; the context holds {max_context}: shorten the prompt", "messages" if chat else "prompt",
                   code="context_length_exceeded")
  key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
  max_tokens = body.get(key)
  if max_tokens is None: max_tokens = room if chat else min(16, room)
  if not _is_int(max_tokens) or max_tokens < 1: raise ApiError(f"'{key}' must be a positive integer, got {str(max_tokens)[:50]!r}", key)
  if max_tokens > room:
    raise ApiError(f"the prompt ({len(prompt_ids)} tokens) + {key} ({max_tokens}) exceeds the context ({max_context}): set {key} to at most "
                   f"{room}", key, code="context_length_exceeded")
  temperature = body.get("temperature")
  temperature = 1.0 if temperature is None else temperature        # OpenAI's default
  if not _is_num(temperature) or not 0 <= temperature <= 2: raise ApiError("'temperature' must be a number in 0..2 (0: greedy)", "temperature")
  top_p = body.get("top_p")
  top_p = 1.0 if top_p is None else top_p
  if not _is_num(top_p) or not 0 < top_p <= 1: raise ApiError("'top_p' must be a number in (0, 1]", "top_p")
  seed = body.get("seed")
  if seed is not None and (not _is_int(seed) or not 0 <= seed < 2**63): raise ApiError("'seed' must be a non-negative integer", "seed")
  check_fields(body, chat)
  n = sample_count(body)
  stream = body.get("stream")
  if stream is not None and not isinstance(stream, bool): raise ApiError("'stream' must be true or false", "stream")
  opts = body.get("stream_options")
  if opts is not None and (not isinstance(opts, dict) or not isinstance(opts.get("include_usage", False), bool)):
    raise ApiError("'stream_options' must be an object like {\"include_usage\": true}", "stream_options")
  stop = body.get("stop")
  stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
  try: stop = check_stop(stop)          # the decode node's own rule (tinyhet.model.request_rules)
  except ValueError:
    raise ApiError(f"'stop' must be a non-empty string or a list of at most {MAX_STOPS} of them, each at most {MAX_STOP_CHARS} characters",
                   "stop") from None
  # tools, tool_choice, response_format and guided_*: tinyhet.service.tools and structured (constrain_request)
  unsupported = {"best_of": (None, 1), "functions": (None, []), "function_call": (None, "none"),
                 "suffix": (None, ""), "prediction": (None,), "audio": (None,),
                 "modalities": (None, ["text"]), "use_beam_search": (None, False), "prompt_logprobs": (None,)}
  if not chat:
    for name in ("tools", "tool_choice"):
      if body.get(name) is not None: raise ApiError(f"'{name}' is for chat completions (/v1/chat/completions): leave it out here", name)
  for name, fine in unsupported.items():
    if name in body and not any(body[name] == f and type(body[name]) is type(f) for f in fine):
      raise ApiError(f"'{name}' is not supported by this server: leave it out", name)
  cache_salt = body.get("cache_salt")           # vLLM's field: requests share cached KV only with the same salt (tinyhet.service.tenancy)
  if cache_salt is not None and (not isinstance(cache_salt, str) or not 0 < len(cache_salt) <= 256):
    raise ApiError("'cache_salt' must be a non-empty string of at most 256 characters", "cache_salt")
  rti = body.get("return_token_ids", False)
  if not isinstance(rti, bool): raise ApiError("'return_token_ids' must be true or false", "return_token_ids")
  options, logprobs, echo = sampling_options(body, n_vocab), _logprobs(body, chat), False
  if logprobs is not None: options["logprobs"] = logprobs
  if not chat:
    echo = body.get("echo", False)
    if not isinstance(echo, bool): raise ApiError("'echo' must be true or false", "echo")
    if echo and logprobs is not None: options["prompt_logprobs"] = logprobs      # the prompt's own, from the prefill's logits
  extra = extra_sampling(body, tuple(getattr(tok, "stop_ids", ())), n_vocab)
  options.update(extra.pop("sampling_extra"))
  if body.get("speculative") is not None:
    try: options["speculative"] = check_speculative(body["speculative"])
    except ValueError as e: raise ApiError(str(e), "speculative") from None
  node_rules(body, temperature, top_p, seed, {**options, "output_from": len(prompt_ids)}, stop)
  return {"prompt_ids": prompt_ids, "max_tokens": max_tokens, "temperature": float(temperature), "top_p": float(top_p), "seed": seed,
          "stream": bool(stream), "include_usage": bool(opts and opts.get("include_usage")), "stop": stop, "chat": chat,
          "return_token_ids": rti, "options": options, "logprobs": logprobs, "echo": echo, "n": n,
          "prompts": [prompt_ids], "cache_salt": cache_salt, **extra}

# the sampling options beyond temperature and top_p: name -> (the range's check, what to send); the decode node applies them
_RANGES = {"presence_penalty": (lambda v: _is_num(v) and -2 <= v <= 2, "a number in -2..2"),
           "frequency_penalty": (lambda v: _is_num(v) and -2 <= v <= 2, "a number in -2..2"),
           "repetition_penalty": (lambda v: _is_num(v) and 0 < v <= 10, "a number in (0, 10] (1: off)"),
           "min_p": (lambda v: _is_num(v) and 0 <= v <= 1, "a number in 0..1"),
           "top_k": (lambda v: _is_int(v) and v >= -1, "an integer >= -1 (0 or -1: all tokens)")}

def sampling_options(body: dict, n_vocab: int) -> dict:
  out = {}
  for name, (ok, what) in _RANGES.items():
    v = body.get(name)
    if v is None: continue
    if not ok(v): raise ApiError(f"'{name}' must be {what}, got {str(v)[:50]!r}", name)
    out[name] = float(v) if name != "top_k" else v
  bias = body.get("logit_bias")
  if bias is not None:
    if not isinstance(bias, dict) or len(bias) > 1024: raise ApiError("'logit_bias' must be an object of at most 1024 token id -> bias", "logit_bias")
    for k, v in bias.items():
      if not (isinstance(k, str) and k.isdigit() and int(k) < n_vocab) or not (_is_num(v) and -100 <= v <= 100):
        raise ApiError(f"'logit_bias' maps token ids (0..{n_vocab - 1}, as strings) to numbers in -100..100; {str(k)[:20]!r}: {str(v)[:20]!r} is not",
                       "logit_bias")
    if bias: out["logit_bias"] = {str(int(k)): float(v) for k, v in bias.items()}
  return out

def _logprobs(body: dict, chat: bool) -> int | None:
  """How many top alternatives per token the client wants (0: the chosen token's logprob only), or None: no logprobs."""
  if chat:
    want, top = body.get("logprobs"), body.get("top_logprobs")
    if want is not None and not isinstance(want, bool): raise ApiError("'logprobs' must be true or false", "logprobs")
    if top is not None and (not _is_int(top) or not 0 <= top <= 20): raise ApiError("'top_logprobs' must be an integer in 0..20", "top_logprobs")
    if top is not None and not want: raise ApiError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (top or 0) if want else None
  n = body.get("logprobs")
  if n is None: return None
  if not _is_int(n) or not 0 <= n <= 5: raise ApiError("'logprobs' must be an integer in 0..5 (top alternatives per token)", "logprobs")
  return n

def _encode(fn, what, param: str) -> list[int]:
  try: return fn(what)
  except ApiError: raise
  except Exception as e:       # text the tokenizer cannot take (lone surrogates), a chat template that raises
    raise ApiError(f"'{param}' could not be tokenized: {str(e)[:200]}: send valid UTF-8 text", param) from None

def parse_completion(body, tok, model_id: str, max_context: int | None) -> dict:
  """POST /v1/completions: prompt is a string, a list of token ids, or a list of those (one choice per prompt, times n)."""
  if not isinstance(body, dict): raise ApiError("the body must be a JSON object")
  add_special = body.get("add_special_tokens", True)
  if not isinstance(add_special, bool): raise ApiError("'add_special_tokens' must be true or false", "add_special_tokens")
  prompts = [_encode(lambda t: tok.encode(t, add_special), p, "prompt") if isinstance(p, str) else list(p)
             for p in completion_prompts(body.get("prompt"))]
  out = _common(body, tok, model_id, max_context, prompts[0], chat=False)
  for ids in prompts[1:]: _common(body, tok, model_id, max_context, ids, chat=False)    # each prompt fits the context
  out["prompts"] = prompts
  from tinyhet.service.tools import constrain_request
  return constrain_request(out, body)

def parse_chat(body, tok, model_id: str, max_context: int | None) -> dict:
  """POST /v1/chat/completions: messages [{role, content}], content a string or a list of {"type": "text", "text"} parts."""
  if not isinstance(body, dict): raise ApiError("the body must be a JSON object")
  from tinyhet.service import tools
  gen, special = chat_flags(body)
  clean, spec = tools.clean_messages(body.get("messages")), tools.parse_tools(body, tok)     # the tool turns, the tools
  ids = _encode(lambda m: with_bos(tok, tools.encode(tok, m, spec, gen), special), clean, "messages")
  return tools.constrain_request(_common(body, tok, model_id, max_context, ids, chat=True), body, spec)

def chat_flags(body: dict) -> tuple[bool, bool]:
  """vLLM's add_generation_prompt (default true) and add_special_tokens (default false: the template writes BOS itself
  where the model wants one) of a chat request."""
  gen, special = body.get("add_generation_prompt", True), body.get("add_special_tokens", False)
  if not isinstance(gen, bool): raise ApiError("'add_generation_prompt' must be true or false", "add_generation_prompt")
  if not isinstance(special, bool): raise ApiError("'add_special_tokens' must be true or false", "add_special_tokens")
  return gen, special

def with_bos(tok, ids: list[int], special: bool) -> list[int]:
  """add_special_tokens on a chat: BOS first where the tokenizer adds one to text and the template did not write it."""
  bos = getattr(tok, "bos_id", None)
  return [bos, *ids] if special and getattr(tok, "add_bos", False) and bos is not None and ids[:1] != [bos] else ids
