"""Llama, Mistral, Qwen2 and Qwen3 weights from a Hugging Face directory: config.json (read by tinyhet.model.hf_config), and
model.safetensors or model.safetensors.index.json with its shards. Every shard's header is read and checked (names, shapes,
dtypes) before any weight is; then the tensors go onto the device the caller names, in their stored dtype (float32, float16,
or bfloat16 kept as its 2-byte bits, BF16Weight). Qwen2's q/k/v biases and Qwen3's q/k norms become float32 vectors.

RoPE layout: Hugging Face checkpoints hold Q and K rows permuted for rotate-half RoPE; the model rotates interleaved pairs,
as Meta's checkpoints and GGUF files are laid out, so those rows are permuted back on load (llama.cpp's converter does the
same permutation when it writes a Llama GGUF), and with them the q/k biases and, within a head, the q/k norms' weights.
"""
from __future__ import annotations
import dataclasses, json, math, pathlib, struct
from tinyhet.model.bf16_weight import BF16Weight, bf16_to_float
from tinyhet.model.hf_config import hf_config
from tinyhet.model.llama import LayerWeights, LlamaConfig, LlamaWeights
from tinyhet.model.model_files import Progress, WeightsError, expected_shapes, hf_rows_to_interleaved, keep_layers

HF_LAYER_NAMES = {"attn_norm": "input_layernorm", "wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj",
                  "wo": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm", "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj",
                  "w_down": "mlp.down_proj"}
HF_BIAS_NAMES = {"bq": "self_attn.q_proj.bias", "bk": "self_attn.k_proj.bias", "bv": "self_attn.v_proj.bias"}   # Qwen2
HF_QK_NORM_NAMES = {"q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight"}                     # Qwen3
SAFETENSORS_DTYPES = {"F32": 4, "F16": 2, "BF16": 2}   # the stored dtypes tinyhet reads, and their sizes

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

def hf_layer_names(cfg: LlamaConfig) -> dict[str, str]:
  """LayerWeights field -> its Hugging Face name within a layer (model.layers.N.<name>), for cfg's family."""
  names = {field: f"{hf}.weight" for field, hf in HF_LAYER_NAMES.items()}
  return names | (HF_BIAS_NAMES if cfg.qkv_bias else {}) | (HF_QK_NORM_NAMES if cfg.qk_norm else {})

def hf_names(cfg: LlamaConfig) -> dict[str, str]:
  """Hugging Face tensor name -> the LlamaWeights field it fills, every layer of cfg."""
  names = {"model.embed_tokens.weight": "tok_embeddings", "model.norm.weight": "norm"} | ({} if cfg.tie_embeddings else {"lm_head.weight": "output"})
  return names | {f"model.layers.{l}.{hf}": field for l in range(cfg.n_layers) for field, hf in hf_layer_names(cfg).items()}

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
    raise WeightsError(f"{directory}: tensor {extra[0]} ({len(extra)} unexpected in all) is not part of a {cfg.arch} model that tinyhet runs "
                       "(biases, quantization scales or other layers would change the model)")
  for name, field in known.items():
    if (t := table.get(name)) is None: raise WeightsError(f"{directory}: tensor {name} is missing")
    if t.dtype not in SAFETENSORS_DTYPES:
      raise WeightsError(f"{t.file}: tensor {name} is {t.dtype}, not supported (supported: {', '.join(SAFETENSORS_DTYPES)})")
    if t.shape != shapes[field]: raise WeightsError(f"{t.file}: tensor {name} has shape {t.shape}, config.json needs {shapes[field]}")
    if t.end - t.start != SAFETENSORS_DTYPES[t.dtype] * max(1, math.prod(t.shape)):
      raise WeightsError(f"{t.file}: tensor {name}'s data_offsets do not fit its shape {t.shape} and dtype {t.dtype}")
  return table

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
  heads = {"wq": cfg.n_heads, "wk": cfg.n_kv_heads, "bq": cfg.n_heads, "bk": cfg.n_kv_heads, "q_norm": 1, "k_norm": 1}   # rows to permute
  for l in range(cfg.n_layers):
    layers.append(LayerWeights(**{field: get(f"model.layers.{l}.{hf}", heads.get(field)) for field, hf in hf_layer_names(cfg).items()}))
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
