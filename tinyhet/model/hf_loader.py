"""Llama weights from a Hugging Face directory: config.json as transformers 4.x and 5.x write it, and model.safetensors or
model.safetensors.index.json with its shards. Every shard's header is read and checked (names, shapes, dtypes) before any
weight is; then the tensors go onto the device the caller names, in their stored dtype (float32, float16, or bfloat16 kept
as its 2-byte bits, BF16Weight).

config.json: transformers 5 keeps rope_theta (and Llama 3.1's scaling) inside `rope_parameters`; 4.x writes a top-level
`rope_theta` and `rope_scaling`. Both are read, as transformers reads them. A field that would change the model and that
tinyhet does not implement (biases, another activation, a RoPE type it lacks, quantization, ...) is an error naming it;
a field it does not know at all is one too, rather than a silent default.

RoPE layout: Hugging Face checkpoints hold Q and K rows permuted for rotate-half RoPE; the model rotates interleaved pairs,
as Meta's checkpoints and GGUF files are laid out, so those rows are permuted back on load (llama.cpp's converter does the
same permutation when it writes a GGUF).
"""
from __future__ import annotations
import dataclasses, json, math, pathlib, struct
from tinyhet.model.bf16_weight import BF16Weight, bf16_to_float
from tinyhet.model.llama import LayerWeights, LlamaConfig, LlamaWeights, RopeScaling
from tinyhet.model.model_files import Progress, WeightsError, expected_shapes, keep_layers

HF_LAYER_NAMES = {"attn_norm": "input_layernorm", "wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj",
                  "wo": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm", "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj",
                  "w_down": "mlp.down_proj"}
SAFETENSORS_DTYPES = {"F32": 4, "F16": 2, "BF16": 2}   # the stored dtypes tinyhet reads, and their sizes

# config.json fields read into the LlamaConfig, and fields with no effect on the forward pass (naming, training, generation
# defaults, transformers' bookkeeping). Anything else must have the value CHECKED names, or the config is refused.
MODEL_FIELDS = {"model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                "vocab_size", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings", "tie_word_embeddings",
                "sliding_window"}
NO_EFFECT = {"architectures", "transformers_version", "torch_dtype", "dtype", "_name_or_path", "name_or_path", "_commit_hash", "bos_token_id",
             "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id", "initializer_range", "use_cache", "attention_dropout",
             "pretraining_tp", "output_hidden_states", "output_attentions", "return_dict", "torchscript", "use_bfloat16", "tf_legacy_loss",
             "chunk_size_feed_forward", "id2label", "label2id", "num_labels", "problem_type", "finetuning_task", "tokenizer_class", "prefix",
             "task_specific_params", "is_decoder", "add_cross_attention", "cross_attention_hidden_size", "tie_encoder_decoder",
             # generation defaults saved in old configs (transformers moves them to generation_config.json)
             "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty", "temperature",
             "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size",
             "bad_words_ids", "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id",
             "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens"}
CHECKED = {"hidden_act": ("silu",), "attention_bias": (False,), "mlp_bias": (False,), "is_encoder_decoder": (False,), "pruned_heads": ({},),
           "quantization_config": (None,), "use_sliding_window": (False,)}
MODEL_TYPES = {"llama": 2048, "mistral": 4096 * 32}   # model_type -> transformers' default max_position_embeddings
ROPE_TYPES = {"default": set(), "linear": {"factor"}, "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}}

def _refuse(directory, field: str, value, why: str) -> WeightsError:
  return WeightsError(f"{directory}/config.json: {field} = {json.dumps(value)} {why}")

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

def hf_config(directory: pathlib.Path, max_context: int | None = None) -> LlamaConfig:
  """A LlamaConfig from a Hugging Face config.json (LlamaForCausalLM, MistralForCausalLM), as transformers 4.x or 5.x writes it."""
  directory = pathlib.Path(directory)
  try: c = json.loads((directory / "config.json").read_text())
  except (OSError, ValueError) as e: raise WeightsError(f"{directory}: cannot read config.json ({e}); a Hugging Face model needs it") from None
  if not isinstance(c, dict): raise WeightsError(f"{directory}/config.json: not a JSON object")
  if c.get("model_type") not in MODEL_TYPES:
    raise WeightsError(f"{directory}: model_type {c.get('model_type')!r} is not supported; tinyhet runs Llama ({', '.join(MODEL_TYPES)})")
  for field, allowed in CHECKED.items():
    if field in c and c[field] not in allowed: raise _refuse(directory, field, c[field], f"is not supported (tinyhet's Llama has {allowed[0]!r})")
  if (unknown := sorted(set(c) - MODEL_FIELDS - NO_EFFECT - set(CHECKED))):
    raise _refuse(directory, unknown[0], c[unknown[0]], "is not a field tinyhet knows for a Llama; it may change the model, so the model is "
                  "not loaded (remove it from config.json if it does not)")
  def need(key):
    if not isinstance(c.get(key), int): raise WeightsError(f"{directory}/config.json: {key} is missing or not an integer")
    return c[key]
  theta, scaling, linear = _rope(directory, c)
  n_heads = need("num_attention_heads")
  head_dim = c.get("head_dim") or need("hidden_size") // n_heads
  ctx = c.get("max_position_embeddings") or MODEL_TYPES[c["model_type"]]
  if (window := c.get("sliding_window")) is not None: ctx = min(ctx, window)   # within the window, sliding-window attention is full attention
  return LlamaConfig(dim=need("hidden_size"), n_layers=need("num_hidden_layers"), n_heads=n_heads, n_kv_heads=c.get("num_key_value_heads") or n_heads,
                     head_dim=head_dim, hidden_dim=need("intermediate_size"), vocab_size=need("vocab_size"),
                     norm_eps=float(c.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
                     rope_freq_factors=None if linear is None else (linear,) * (head_dim // 2),
                     max_context=min(ctx, max_context) if max_context else ctx, tie_embeddings=bool(c.get("tie_word_embeddings", False)),
                     name=c.get("_name_or_path") or directory.name)

@dataclasses.dataclass(frozen=True)
class SafetensorsEntry:
  file: pathlib.Path
  dtype: str               # safetensors' name: F32, F16, BF16
  shape: tuple[int, ...]
  start: int               # absolute byte offsets in the file
  end: int

def safetensors_header(path: pathlib.Path) -> dict[str, SafetensorsEntry]:
  """The tensor table of one safetensors file (8-byte little-endian header length, JSON header, data), read without the data."""
  try:
    with open(path, "rb") as f:
      (n,) = struct.unpack("<Q", f.read(8))
      if n > 100 << 20: raise ValueError(f"header length {n}")
      header, size = json.loads(f.read(n)), path.stat().st_size
  except (OSError, ValueError, struct.error) as e: raise WeightsError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})") from None
  table = {}
  for name, h in header.items():
    if name == "__metadata__": continue
    try: start, end = (8 + n + o for o in h["data_offsets"])
    except (KeyError, TypeError, ValueError): raise WeightsError(f"{path}: tensor {name} has no data_offsets") from None
    if end > size: raise WeightsError(f"{path}: truncated: tensor {name} ends at byte {end}, the file has {size}")
    table[name] = SafetensorsEntry(path, h.get("dtype"), tuple(h.get("shape", ())), start, end)
  return table

def hf_names(cfg: LlamaConfig) -> dict[str, str]:
  """Hugging Face tensor name -> the LlamaWeights field it fills, every layer of cfg."""
  names = {"model.embed_tokens.weight": "tok_embeddings", "model.norm.weight": "norm"} | ({} if cfg.tie_embeddings else {"lm_head.weight": "output"})
  return names | {f"model.layers.{l}.{hf}.weight": field for l in range(cfg.n_layers) for field, hf in HF_LAYER_NAMES.items()}

def hf_table(directory: pathlib.Path) -> dict[str, SafetensorsEntry]:
  """Every tensor of the checkpoint, from model.safetensors.index.json's shards or from model.safetensors."""
  if (index := directory / "model.safetensors.index.json").is_file():
    try: files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, AttributeError) as e: raise WeightsError(f"{index}: unreadable ({e})") from None
  elif (directory / "model.safetensors").is_file(): files = ["model.safetensors"]
  else: raise WeightsError(f"{directory}: no model.safetensors.index.json or model.safetensors; pass a Hugging Face model directory")
  table = {}
  for fn in files:
    if not (directory / fn).is_file(): raise WeightsError(f"{directory}: shard {fn}, named in the index, is missing")
    table |= safetensors_header(directory / fn)
  return table

def check_hf(directory: pathlib.Path, cfg: LlamaConfig) -> dict[str, SafetensorsEntry]:
  """The tensor table after checking every tensor the load needs (present, the config's shape, a dtype tinyhet reads) and that
  the checkpoint holds nothing else that would change the model. One WeightsError, before any weight is read."""
  table, known, shapes = hf_table(directory), hf_names(cfg), expected_shapes(cfg)
  derived = lambda n: n.endswith("rotary_emb.inv_freq")   # old checkpoints saved RoPE's frequencies, computed from the config
  if (extra := sorted(n for n in set(table) - set(known) if not derived(n) and not (cfg.tie_embeddings and n == "lm_head.weight"))):
    raise WeightsError(f"{directory}: tensor {extra[0]} ({len(extra)} unexpected in all) is not part of a Llama that tinyhet runs (biases, "
                       "quantization scales or other layers would change the model)")
  for name, field in known.items():
    if (t := table.get(name)) is None: raise WeightsError(f"{directory}: tensor {name} is missing")
    if t.dtype not in SAFETENSORS_DTYPES:
      raise WeightsError(f"{t.file}: tensor {name} is {t.dtype}, not supported (supported: {', '.join(SAFETENSORS_DTYPES)})")
    if t.shape != shapes[field]: raise WeightsError(f"{t.file}: tensor {name} has shape {t.shape}, config.json needs {shapes[field]}")
    if t.end - t.start != SAFETENSORS_DTYPES[t.dtype] * max(1, math.prod(t.shape)):
      raise WeightsError(f"{t.file}: tensor {name}'s data_offsets do not fit its shape {t.shape} and dtype {t.dtype}")
  return table

def hf_rows_to_interleaved(w, n_heads: int):
  """Hugging Face's rotate-half Q/K rows -> interleaved RoPE pairs: llama.cpp convert_hf_to_gguf.py's permute.
  Within each head, row i of the first half and row i of the second half become rows 2i and 2i+1."""
  rows, cols = w.shape
  return w.reshape(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)

def _read(t: SafetensorsEntry, device: str | None):
  """One tensor from disk onto device: float32/float16 as that dtype, bfloat16 as uint16 bits (lazy)."""
  from tinygrad import Tensor, dtypes
  dtype = {"F32": dtypes.float32, "F16": dtypes.float16, "BF16": dtypes.uint16}[t.dtype]
  return Tensor(t.file)[t.start:t.end].bitcast(dtype).reshape(t.shape).to(device)

def load_hf(directory: str | pathlib.Path, device: str | None = None, n_layers: int | None = None, max_context: int | None = None,
            quiet: bool = False) -> tuple[LlamaConfig, LlamaWeights]:
  """(config, weights) from a Hugging Face directory: config.json and model.safetensors.index.json with its shards, or a
  single model.safetensors. Matrices keep their stored dtype (bfloat16 as BF16Weight), vectors become float32; n_layers keeps
  the first N layers (the rest is never read)."""
  directory = pathlib.Path(directory)
  cfg = hf_config(directory, max_context)
  table = check_hf(directory, cfg)
  cfg = keep_layers(cfg, n_layers)
  dtypes_seen = sorted({table[n].dtype for n in hf_names(cfg)})
  progress = Progress(f"loading {directory.name}", quiet)
  progress.stage(f"{cfg.name}: {cfg.n_layers} layers, dim {cfg.dim}, {'/'.join(dtypes_seen)} safetensors onto {device or 'the default device'}")
  def get(name: str, heads: int | None = None):
    t, x = table[name], _read(table[name], device)
    if heads is not None: x = hf_rows_to_interleaved(x, heads)
    if len(t.shape) == 1: return (bf16_to_float(x) if t.dtype == "BF16" else x).contiguous().realize()
    return BF16Weight(x.contiguous(), t.shape).realize() if t.dtype == "BF16" else x.contiguous().realize()
  emb = get("model.embed_tokens.weight")
  layers = []
  for l in range(cfg.n_layers):
    heads = {"wq": cfg.n_heads, "wk": cfg.n_kv_heads}
    layers.append(LayerWeights(**{field: get(f"model.layers.{l}.{hf}.weight", heads.get(field)) for field, hf in HF_LAYER_NAMES.items()}))
    progress.count(l + 1, cfg.n_layers)
  w = LlamaWeights(tok_embeddings=emb, layers=layers, norm=get("model.norm.weight"), output=emb if cfg.tie_embeddings else get("lm_head.weight"))
  progress.done(w.nbytes())
  return cfg, w

def hf_loaded_nbytes(directory: pathlib.Path) -> int:
  """Bytes load_hf's weights take, from config.json and the shard headers: matrices at their stored size, vectors at float32
  (float16 vectors kept), the tied output counted once."""
  cfg = hf_config(directory)
  table = check_hf(directory, cfg)
  def nbytes(t: SafetensorsEntry) -> int: return t.end - t.start if len(t.shape) == 2 or t.dtype != "BF16" else 2 * (t.end - t.start)
  return sum(nbytes(table[n]) for n in hf_names(cfg))
