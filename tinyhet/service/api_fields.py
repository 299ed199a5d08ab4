"""Which request fields of OpenAI's and vLLM's chat and completions APIs this server takes, and the checks of those that
tinyhet.service.api_schema does not read itself: `n`, a completions list of prompts, and vLLM's extra sampling fields
(ignore_eos, min_tokens, stop_token_ids, include_stop_str_in_output, skip_special_tokens, spaces_between_special_tokens,
add_special_tokens, add_generation_prompt). A field that is no field of either API, or one this server does not implement
set to anything but its default, is a 400 naming it: never a silent 200 that ignored it."""
from __future__ import annotations
from tinyhet.service.api_error import ApiError

def _is_int(x) -> bool: return isinstance(x, int) and not isinstance(x, bool)

MAX_N = 128              # samples per prompt at most (a decode node also refuses more than its batch, --max-seqs)
MAX_PROMPTS = 256        # prompts in one completions request at most

# the fields of each API: read (and where not implemented, refused) by api_schema, by the tool and structured-output work
# (tools, response_format, guided_*), or by this module; REFUSED below holds the rest that either API has
COMMON = {"model", "max_tokens", "temperature", "top_p", "seed", "n", "stream", "stream_options", "stop", "presence_penalty", "frequency_penalty",
          "logit_bias", "logprobs", "user", "metadata", "top_k", "min_p", "repetition_penalty", "return_token_ids", "best_of", "use_beam_search",
          "prompt_logprobs", "response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
          "guided_whitespace_pattern", "structural_tag", "structured_outputs", "cache_salt", "ignore_eos", "min_tokens", "stop_token_ids",
          "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens", "add_special_tokens",
          "speculative"}    # tinyhet's own: speculative decoding on the decode node (docs/speculative.md)
CHAT = COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls", "functions", "function_call",
                 "audio", "modalities", "prediction", "add_generation_prompt", "safety_identifier"}
COMPLETION = COMMON | {"prompt", "echo", "suffix", "tools", "tool_choice"}     # tools: api_schema says they are for chat

# OpenAI's and vLLM's fields this server does not implement: name -> the values that mean "off" (the field may be sent so)
REFUSED = {
  "store": (None, False), "service_tier": (None, "auto", "default"), "reasoning_effort": (None,), "verbosity": (None,),
  "web_search_options": (None,), "prompt_cache_key": (None,), "length_penalty": (None, 1.0, 1), "truncate_prompt_tokens": (None,),
  "allowed_token_ids": (None,), "bad_words": (None, []), "logits_processors": (None,), "continue_final_message": (None, False),
  "documents": (None,), "chat_template": (None,), "chat_template_kwargs": (None, {}), "mm_processor_kwargs": (None,), "priority": (None, 0),
  "request_id": (None,), "return_tokens_as_token_ids": (None, False), "kv_transfer_params": (None,), "vllm_xargs": (None,),
  "prompt_embeds": (None,), "include_reasoning": (None, True), "thinking_token_budget": (None,), "echo@chat": (None, False),
  # structured outputs' options this server does not take (cache_salt is read: tinyhet.service.tenancy)
  "guided_decoding_backend": (None,), "guided_whitespace_pattern": (None,), "structural_tag": (None,),
}

def check_fields(body: dict, chat: bool) -> None:
  """400 for a field neither API has, and for one of REFUSED set to anything but its "off" values."""
  known = CHAT if chat else COMPLETION
  for name in body:
    key = f"{name}@chat" if chat and f"{name}@chat" in REFUSED else name
    if key in REFUSED:
      if not any(body[name] == f and type(body[name]) is type(f) for f in REFUSED[key]):
        raise ApiError(f"'{name}' is not supported by this server: leave it out", name)
    elif name not in known:
      what = "chat completions" if chat else "completions"
      raise ApiError(f"'{str(name)[:60]}' is not a {what} request field (OpenAI's or vLLM's): leave it out", str(name)[:60])

def _bool(body: dict, name: str, default: bool) -> bool:
  v = body.get(name)
  if v is None: return default
  if not isinstance(v, bool): raise ApiError(f"'{name}' must be true or false", name)
  return v

def sample_count(body: dict) -> int:
  """`n`: how many samples of each prompt (1..MAX_N)."""
  n = body.get("n")
  if n is None: return 1
  if not _is_int(n) or not 1 <= n <= MAX_N: raise ApiError(f"'n' must be an integer in 1..{MAX_N} (samples of the prompt)", "n")
  return n

def extra_sampling(body: dict, stop_ids: tuple[int, ...], n_vocab: int) -> dict:
  """vLLM's extra sampling fields, checked: the stop ids the nodes end a sequence at (the tokenizer's end-of-turn ids unless
  ignore_eos, plus stop_token_ids), min_tokens (the sampling options that keep those ids out of the first min_tokens tokens),
  and how the text is made (include_stop_str_in_output, skip_special_tokens, spaces_between_special_tokens)."""
  extra = body.get("stop_token_ids")
  if extra is not None and (not isinstance(extra, list) or len(extra) > 64 or not all(_is_int(t) and 0 <= t < n_vocab for t in extra)):
    raise ApiError(f"'stop_token_ids' must be a list of at most 64 token ids in 0..{n_vocab - 1}", "stop_token_ids")
  ignore_eos = _bool(body, "ignore_eos", False)
  ids = list(dict.fromkeys(([] if ignore_eos else list(stop_ids)) + list(extra or [])))
  min_tokens = body.get("min_tokens")
  if min_tokens is None: min_tokens = 0
  if not _is_int(min_tokens) or min_tokens < 0: raise ApiError("'min_tokens' must be a non-negative integer", "min_tokens")
  key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
  if _is_int(body.get(key)) and min_tokens > body[key]:
    raise ApiError(f"'min_tokens' ({min_tokens}) must be at most '{key}' ({body[key]})", "min_tokens")
  options = {"min_tokens": min_tokens, "min_tokens_ids": ids} if min_tokens and ids else {"min_tokens": min_tokens} if min_tokens else {}
  return {"stop_ids": ids, "min_tokens": min_tokens, "sampling_extra": options,
          "include_stop": _bool(body, "include_stop_str_in_output", False), "skip_special": _bool(body, "skip_special_tokens", True),
          "spaces_between_special": _bool(body, "spaces_between_special_tokens", True)}

def completion_prompts(prompt) -> list:
  """The prompts of a completions request: a string, a list of token ids, or a list of those (one choice each)."""
  if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt)): return [prompt]
  if isinstance(prompt, list) and prompt and all(isinstance(p, str) or (isinstance(p, list) and all(_is_int(t) for t in p)) for p in prompt):
    if len(prompt) > MAX_PROMPTS: raise ApiError(f"'prompt' holds {len(prompt)} prompts; at most {MAX_PROMPTS} in one request", "prompt")
    return prompt
  raise ApiError("'prompt' must be a string, a list of token ids, or a list of those (one choice per prompt)", "prompt")
