"""What a node checks before it acts on a request from the network (a peer's control request: bad input is an error
reply, never a crash): prompt ids and lengths, and that the decode node it is paired with serves the same model."""
from __future__ import annotations
from tinyhet.kv.notices import NOTICE_FORMAT

class IncompatibleDecodeNode(RuntimeError):
  """The decode node serves another model (or another KV layout) than this prefill node."""

def is_int(v) -> bool: return isinstance(v, int) and not isinstance(v, bool)

def check_prompt(cfg, prompt_ids, max_new_tokens: int | None = None) -> None:
  """prompt_ids is a non-empty list of the model's token ids; with max_new_tokens (a positive integer), prompt and new tokens
  fit the model's context. ValueError saying which."""
  if not isinstance(prompt_ids, list) or not prompt_ids or not all(is_int(t) and 0 <= t < cfg.vocab_size for t in prompt_ids):
    raise ValueError(f"prompt_ids must be a non-empty list of token ids below {cfg.vocab_size}")
  if max_new_tokens is None:
    if len(prompt_ids) >= cfg.max_context: raise ValueError(f"a prompt of {len(prompt_ids)} tokens does not fit the context ({cfg.max_context})")
    return
  if not is_int(max_new_tokens) or max_new_tokens < 1: raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
  if len(prompt_ids) + max_new_tokens > cfg.max_context:
    raise ValueError(f"prompt ({len(prompt_ids)}) + max_new_tokens ({max_new_tokens}) exceeds the model's context ({cfg.max_context})")

def check_salt(salt) -> None:
  """A cache salt: a string of at most 256 bytes (the router sends a digest of the tenant's key and cache_salt)."""
  if not isinstance(salt, str) or len(salt.encode()) > 256:
    raise ValueError(f"cache_salt must be a string of at most 256 bytes, got {str(salt)[:40]!r}")

SHAPE = ("n_layers", "n_kv_heads", "head_dim", "vocab_size", "dim")   # what a decode node's KV blocks and logits depend on

def check_compatible(cfg, model_id: str, info: dict, where: str, fingerprint: str = "", kv_dtype: str = "") -> None:
  """A decode node's decode.info reply `info` is for this model (its shape, its id and its fingerprint where both have one:
  tinyhet.model.fingerprint, the weights' content and kernel mode, not a file name) and speaks this node's KV notice format
  (tinyhet.kv.notices), and where kv_dtype is given (this node's configured one) holds its KV in that dtype, else
  IncompatibleDecodeNode naming both."""
  mine = {k: getattr(cfg, k) for k in SHAPE}
  theirs = {k: info.get("config", {}).get(k) for k in SHAPE}
  if info.get("kv_notice_format", 1) != NOTICE_FORMAT:
    raise IncompatibleDecodeNode(f"decode node {where} speaks KV notice format {info.get('kv_notice_format', 1)}, this node {NOTICE_FORMAT}: "
                                 "run the same tinyhet version on every node")
  if mine != theirs or (model_id and info.get("model") and model_id != info["model"]):
    raise IncompatibleDecodeNode(f"decode node {where} serves {info.get('model') or 'a model'} {theirs}, this node has {model_id or 'a model'} "
                                 f"{mine}: start every node with the same --model")
  if fingerprint and info.get("fingerprint") and fingerprint != info["fingerprint"]:
    raise IncompatibleDecodeNode(f"decode node {where} serves {info.get('model') or 'a model'} of fingerprint {info['fingerprint']}, this node "
                                 f"{model_id or 'a model'} of fingerprint {fingerprint}: the same name but other weights or another kernel mode "
                                 "(--float-weights, TINYHET_INT8_ACTIVATIONS): start every node from the same model file with the same flags")
  if kv_dtype and info.get("kv_dtype") and kv_dtype != info["kv_dtype"]:
    raise IncompatibleDecodeNode(f"decode node {where} keeps its KV in {info['kv_dtype']}, this node in {kv_dtype}: start every node with the "
                                 "same kv_dtype (TINYHET_KV_DTYPE or the config file)")
