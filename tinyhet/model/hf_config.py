"""config.json of a Hugging Face checkpoint (Llama, Mistral, Qwen2/2.5, Qwen3) as transformers 4.x and 5.x write it and as the
Hub ships it, read through one table, FIELDS: every field those versions put in a config.json for these architectures is
  used       read into the LlamaConfig,
  metadata   ignored: names, versions, token ids, training and generation settings, transformers' bookkeeping,
  a tuple    the values tinyhet runs; any other value changes the model in a way tinyhet does not implement: refused, naming it.
Fields beginning with "_" (transformers' own bookkeeping: _name_or_path, _model_name_or_path, _commit_hash, ...) and ending
in "_token_id" (the tokenizer's business) are metadata too. A field in none of these is refused: it may change the model.

transformers 5 keeps rope_theta (and any RoPE scaling) inside `rope_parameters`; 4.x writes a top-level `rope_theta` and
`rope_scaling`. Both are read, as transformers reads them.

Sliding-window attention (Mistral's `sliding_window`; Qwen's `use_sliding_window` with `max_window_layers` or `layer_types`)
is full attention for any context up to the window, so a model with a windowed layer gets the window as its context limit:
tinyhet never runs a context where the window would matter.
"""
from __future__ import annotations
import json, pathlib
from tinyhet.model.llama import LlamaConfig, RopeScaling
from tinyhet.model.model_files import WeightsError

USED, METADATA = "used", "metadata"
FIELDS: dict[str, str | tuple] = {
  # understood: read into the LlamaConfig
  "model_type": USED, "hidden_size": USED, "num_hidden_layers": USED, "num_attention_heads": USED, "num_key_value_heads": USED,
  "head_dim": USED, "intermediate_size": USED, "vocab_size": USED, "rms_norm_eps": USED, "max_position_embeddings": USED,
  "tie_word_embeddings": USED, "rope_theta": USED, "rope_scaling": USED, "rope_parameters": USED,
  "sliding_window": USED, "use_sliding_window": USED, "max_window_layers": USED, "layer_types": USED,
  # model-changing: tinyhet runs these values only
  "hidden_act": ("silu",), "attention_bias": (False,), "mlp_bias": (False,), "is_encoder_decoder": (False,), "add_cross_attention": (False,),
  "tie_encoder_decoder": (False,), "pruned_heads": ({}, None), "quantization_config": (None,), "use_mrope": (False,),
  "partial_rotary_factor": (1.0, 1), "attn_logit_softcapping": (None,), "final_logit_softcapping": (None,),
  # metadata: no effect on the forward pass
  "architectures": METADATA, "transformers_version": METADATA, "torch_dtype": METADATA, "dtype": METADATA, "name_or_path": METADATA,
  "initializer_range": METADATA, "use_cache": METADATA, "attention_dropout": METADATA, "pretraining_tp": METADATA,   # tp: the same sums, split
  "output_hidden_states": METADATA, "output_attentions": METADATA, "return_dict": METADATA, "torchscript": METADATA, "use_bfloat16": METADATA,
  "tf_legacy_loss": METADATA, "chunk_size_feed_forward": METADATA, "id2label": METADATA, "label2id": METADATA, "num_labels": METADATA,
  "problem_type": METADATA, "finetuning_task": METADATA, "tokenizer_class": METADATA, "prefix": METADATA, "task_specific_params": METADATA,
  "is_decoder": METADATA, "cross_attention_hidden_size": METADATA,
  # generation defaults that old configs carry (transformers moved them to generation_config.json)
  **dict.fromkeys(("max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty", "temperature",
                   "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size",
                   "bad_words_ids", "num_return_sequences", "output_scores", "return_dict_in_generate", "remove_invalid_values",
                   "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens"), METADATA),
}
# model_type -> (architecture, transformers' default max_position_embeddings, q/k/v biases, per-head q/k norms)
MODEL_TYPES = {"llama": ("LlamaForCausalLM", 2048, False, False), "mistral": ("MistralForCausalLM", 4096 * 32, False, False),
               "ministral": ("MinistralForCausalLM", 32768, False, False),   # Mistral's layout, windows per layer_types
               "qwen2": ("Qwen2ForCausalLM", 32768, True, False), "qwen3": ("Qwen3ForCausalLM", 32768, False, True)}
ROPE_TYPES = {"default": set(), "linear": {"factor"}, "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}}
LAYER_TYPES = ("full_attention", "sliding_attention")

def classify(field: str) -> str | tuple | None:
  """What tinyhet does with a config.json field: USED, METADATA, the values it runs (a tuple), or None (unknown: refused)."""
  if field in FIELDS: return FIELDS[field]
  if field.startswith("_") or field.endswith("_token_id"): return METADATA
  return None

def _refuse(directory, field: str, value, why: str) -> WeightsError:
  name = field if all(p.isidentifier() for p in field.split(".")) else json.dumps(field)   # a name with a newline stays on one line
  return WeightsError(f"{directory}/config.json: {name} = {json.dumps(value)} {why}")

def _rope(directory, c: dict) -> tuple[float, RopeScaling | None, float | None]:
  """(rope_theta, Llama 3.1 scaling, linear scaling factor) from transformers 5's rope_parameters or 4.x's rope_theta/rope_scaling."""
  legacy, params = c.get("rope_scaling") or {}, c.get("rope_parameters") or {}
  for name, d in (("rope_scaling", legacy), ("rope_parameters", params)):
    if not isinstance(d, dict): raise _refuse(directory, name, d, "is not an object")
  for k in set(legacy) & set(params):
    if legacy[k] != params[k]: raise _refuse(directory, f"rope_scaling.{k}", legacy[k], f"contradicts rope_parameters.{k} = {params[k]}")
  p = params | legacy
  if "rope_theta" in p and "rope_theta" in c and float(p["rope_theta"]) != float(c["rope_theta"]):
    raise _refuse(directory, "rope_theta", c["rope_theta"], f"contradicts rope_parameters.rope_theta = {p['rope_theta']}")
  theta = float(p.get("rope_theta", c.get("rope_theta", 10000.0)))
  kind = p.get("rope_type", p.get("type", "default"))
  if "type" in p and "rope_type" in p and p["type"] != p["rope_type"]:
    raise _refuse(directory, "rope_parameters.type", p["type"], f"contradicts rope_type = {p['rope_type']}")
  if kind not in ROPE_TYPES:
    raise _refuse(directory, "rope_type", kind, f"is not supported (supported: {', '.join(ROPE_TYPES)}); tinyhet would compute other positions")
  if float(p.get("partial_rotary_factor", 1.0)) != 1.0:
    raise _refuse(directory, "partial_rotary_factor", p["partial_rotary_factor"], "(partial RoPE) is not supported")
  known = ROPE_TYPES[kind] | {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
  if (unknown := sorted(set(p) - known)):
    raise _refuse(directory, f"rope_parameters.{unknown[0]}", p[unknown[0]], f"is not understood for rope_type {kind}")
  if (missing := sorted(ROPE_TYPES[kind] - set(p))):
    raise WeightsError(f"{directory}/config.json: rope_type {kind} needs {missing[0]}, which is missing")
  if kind == "llama3":
    s = RopeScaling(float(p["factor"]), float(p["low_freq_factor"]), float(p["high_freq_factor"]), int(p["original_max_position_embeddings"]))
    return theta, s, None
  return theta, None, float(p["factor"]) if kind == "linear" else None

def _window(directory, c: dict, n_layers: int) -> int | None:
  """The sliding window if any layer uses one (transformers' rules per family), else None."""
  window, types = c.get("sliding_window"), c.get("layer_types")
  if c["model_type"] in ("llama", "mistral") or (c["model_type"] == "ministral" and types is None): return window   # every layer
  if types is None:   # Qwen configs before layer_types: layers from max_window_layers on slide, when use_sliding_window
    if not c.get("use_sliding_window") or window is None: return None
    types = ["sliding_attention" if i >= c.get("max_window_layers", n_layers) else "full_attention" for i in range(n_layers)]
  if not isinstance(types, list) or len(types) != n_layers or not set(types) <= set(LAYER_TYPES):
    raise _refuse(directory, "layer_types", types, f"is not {n_layers} entries of {' or '.join(LAYER_TYPES)}")
  if "sliding_attention" not in types: return None
  if not isinstance(window, int) or window < 1:
    raise _refuse(directory, "sliding_window", window, "must be a positive integer for sliding_attention layers")
  return window

def read_hf_config(directory: pathlib.Path, max_context: int | None = None) -> tuple[LlamaConfig, dict]:
  """(LlamaConfig, what was read) from a Hugging Face config.json. What was read: {"architecture", "used": {field: value},
  "checked": {field: value} (model-changing fields at a value tinyhet runs), "ignored": [metadata fields], "sliding_window":
  the window of a windowed layer (the context is capped to it) or None}."""
  directory = pathlib.Path(directory)
  try: c = json.loads((directory / "config.json").read_text())
  except (OSError, ValueError) as e: raise WeightsError(f"{directory}: cannot read config.json ({e}); a Hugging Face model needs it") from None
  if not isinstance(c, dict): raise WeightsError(f"{directory}/config.json: not a JSON object")
  if c.get("model_type") not in MODEL_TYPES:
    raise WeightsError(f"{directory}: model_type {c.get('model_type')!r} is not supported; tinyhet runs {', '.join(MODEL_TYPES)}")
  arch, default_ctx, qkv_bias, qk_norm = MODEL_TYPES[c["model_type"]]
  for field, value in c.items():
    kind = classify(field)
    if kind is None:
      raise _refuse(directory, field, value, f"is not a field tinyhet knows for {arch}; it may change the model, so the model is not loaded "
                    "(remove it from config.json if it does not)")
    if isinstance(kind, tuple) and value not in kind:
      raise _refuse(directory, field, value, f"changes the model in a way tinyhet does not implement (it runs {' or '.join(map(json.dumps, kind))})")
  def need(key):
    if not isinstance(c.get(key), int) or isinstance(c.get(key), bool) or c[key] < 1:
      raise WeightsError(f"{directory}/config.json: {key} is missing or not a positive integer")
    return c[key]
  try:
    theta, scaling, linear = _rope(directory, c)
    n_heads, n_layers = need("num_attention_heads"), need("num_hidden_layers")
    head_dim = c.get("head_dim") or need("hidden_size") // n_heads
    ctx = c.get("max_position_embeddings") or default_ctx
    if (window := _window(directory, c, n_layers)) is not None: ctx = min(ctx, window)
    cfg = LlamaConfig(dim=need("hidden_size"), n_layers=n_layers, n_heads=n_heads, n_kv_heads=c.get("num_key_value_heads") or n_heads,
                      head_dim=head_dim, hidden_dim=need("intermediate_size"), vocab_size=need("vocab_size"),
                      norm_eps=float(c.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
                      rope_freq_factors=None if linear is None else (linear,) * (head_dim // 2),
                      max_context=min(ctx, max_context) if max_context else ctx, tie_embeddings=bool(c.get("tie_word_embeddings", False)),
                      name=c.get("_name_or_path") or directory.name, arch=c["model_type"], qkv_bias=qkv_bias, qk_norm=qk_norm)
  except WeightsError: raise
  except (TypeError, ValueError, ZeroDivisionError) as e:   # a field of the wrong type (a string for a number, ...), heads that do not divide
    raise WeightsError(f"{directory}/config.json: a field has a value of the wrong type ({type(e).__name__}: {e})") from None
  read = {"architecture": arch, "used": {k: v for k, v in c.items() if classify(k) == USED},
          "checked": {k: v for k, v in c.items() if isinstance(classify(k), tuple)},
          "ignored": sorted(k for k in c if classify(k) == METADATA), "sliding_window": window}
  return cfg, read

def hf_config(directory: pathlib.Path, max_context: int | None = None) -> LlamaConfig:
  """A LlamaConfig from a Hugging Face config.json (Llama, Mistral, Qwen2, Qwen3 ForCausalLM), as transformers 4.x or 5.x writes it."""
  return read_hf_config(directory, max_context)[0]
