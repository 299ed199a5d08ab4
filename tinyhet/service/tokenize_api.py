"""vLLM's /tokenize and /detokenize on the router, in vLLM's shapes, with the model's tokenizer and chat template.

  POST /tokenize    {"prompt": text, "add_special_tokens": true, "return_token_strs": false}, or {"messages": [...],
                    "add_generation_prompt": true, "add_special_tokens": false} (the chat template rendered as
                    /v1/chat/completions renders it) -> {"count", "max_model_len", "tokens", "token_strs"}
  POST /detokenize  {"tokens": [ids]} -> {"prompt": text}
`model` may be left out, as in the generation routes; a wrong one is a 404.
"""
from __future__ import annotations
from tinyhet.service.api_schema import ApiError, parse_chat

def _model(body, model_id: str) -> None:
  if not isinstance(body, dict): raise ApiError("the body must be a JSON object")
  model = body.get("model")
  if model is not None and model != model_id:
    raise ApiError(f"the model {str(model)[:100]!r} does not exist here; this server serves {model_id!r}", "model", 404, "model_not_found")

def _fields(body: dict, allowed: set[str]) -> None:
  for name in body:
    if name not in allowed: raise ApiError(f"'{str(name)[:60]}' is not a field of this request: leave it out", str(name)[:60])

def tokenize(body, tok, model_id: str, max_context: int | None) -> dict:
  _model(body, model_id)
  strs = body.get("return_token_strs", False)
  if not isinstance(strs, bool): raise ApiError("'return_token_strs' must be true or false", "return_token_strs")
  if "messages" in body:
    _fields(body, {"model", "messages", "add_generation_prompt", "add_special_tokens", "return_token_strs"})
    ids = chat_tokens(body, tok, model_id)
  else:
    _fields(body, {"model", "prompt", "add_special_tokens", "return_token_strs"})
    prompt, special = body.get("prompt"), body.get("add_special_tokens", True)
    if not isinstance(prompt, str): raise ApiError("'prompt' must be a string (or send 'messages' for a chat)", "prompt")
    if not isinstance(special, bool): raise ApiError("'add_special_tokens' must be true or false", "add_special_tokens")
    try: ids = tok.encode(prompt, special)
    except Exception as e: raise ApiError(f"'prompt' could not be tokenized: {str(e)[:200]}: send valid UTF-8 text", "prompt") from None
  token_strs = [_token_str(tok, i) for i in ids] if strs else None
  return {"count": len(ids), "max_model_len": max_context, "tokens": ids, "token_strs": token_strs}

def chat_tokens(body: dict, tok, model_id: str) -> list[int]:
  """The chat's prompt ids as /v1/chat/completions makes them (its message checks, its template), whatever their length."""
  keep = {k: body[k] for k in ("messages", "add_generation_prompt", "add_special_tokens") if k in body}
  return parse_chat({**keep, "model": model_id, "max_tokens": 1}, tok, model_id, 1 << 40)["prompt_ids"]

def _token_str(tok, i: int) -> str:
  text = tok.token_text(i) if hasattr(tok, "token_text") else None
  return text if text is not None else tok.decode([i], skip_special=False)

def detokenize(body, tok, model_id: str) -> dict:
  _model(body, model_id)
  _fields(body, {"model", "tokens"})
  ids = body.get("tokens")
  if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < tok.vocab_size for t in ids):
    raise ApiError(f"'tokens' must be a list of token ids in 0..{tok.vocab_size - 1}", "tokens")
  return {"prompt": tok.decode(ids)}
