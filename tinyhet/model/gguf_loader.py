"""Llama, Mistral, Qwen2 and Qwen3 weights from a GGUF file (llama.cpp's format, architectures `llama` (Mistral too), `qwen2`,
`qwen3`): the header and tensor table, the config from llama.cpp's metadata keys, a check of every tensor's name, shape and
type against that config before any weight is read, then the tensors onto the device the caller names (only those of the
layers asked for). Qwen2's biases (blk.N.attn_q/k/v.bias) and Qwen3's norms (blk.N.attn_q_norm/attn_k_norm.weight) become
float32 vectors.

Matrices come in their stored form where the model has a kernel path for it: block-quantized types as PackedWeight (when
packed) or dequantized to float32, F16 as a float16 Tensor, BF16 always as its 2-byte bits (BF16Weight), F32 as float32.
Q and K rows of a `llama` file are in the interleaved-pair RoPE order already (llama.cpp's converter permutes Hugging Face's
rows). A `qwen2` or `qwen3` file keeps Hugging Face's rotate-half order (llama.cpp runs those with its NEOX RoPE), so their Q
and K rows (a quantized matrix's rows of blocks), biases and norms are permuted on load, as for a Hugging Face checkpoint.
"""
from __future__ import annotations
import dataclasses, io, pathlib
from typing import Any
import numpy as np
from tinyhet.model.bf16_weight import BF16, BF16Weight, bf16_to_float
from tinyhet.model.llama import LayerWeights, LlamaConfig, LlamaWeights
from tinyhet.model.model_files import Progress, WeightsError, expected_shapes, hf_rows_to_interleaved, keep_layers
from tinyhet.model.packed import PackedWeight
from tinyhet.model.tokenizer import GGUF_TOKENIZERS

GGUF_LAYER_NAMES = {"attn_norm": "attn_norm", "wq": "attn_q", "wk": "attn_k", "wv": "attn_v", "wo": "attn_output", "ffn_norm": "ffn_norm",
                    "w_gate": "ffn_gate", "w_up": "ffn_up", "w_down": "ffn_down"}
GGUF_BIAS_NAMES = {"bq": "attn_q.bias", "bk": "attn_k.bias", "bv": "attn_v.bias"}                # qwen2
GGUF_QK_NORM_NAMES = {"q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight"}            # qwen3
NORMS = ("attn_norm", "ffn_norm", *GGUF_BIAS_NAMES, *GGUF_QK_NORM_NAMES)   # vectors: float32 on load
ARCHS = ("llama", "qwen2", "qwen3")       # llama.cpp's names; `llama` covers Mistral
REPERMUTED = ("qwen2", "qwen3")           # rotate-half (NEOX) Q/K rows in the file
GGML_TYPE_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 18: "IQ3_XXS",
                   21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 30: "BF16", 39: "MXFP4", 41: "Q1_0"}
FLOAT_TYPES = (0, 1, BF16)                    # F32, F16, BF16: what a norm vector may be stored as

@dataclasses.dataclass(frozen=True)
class GGUFTensorInfo:
  name: str
  shape: tuple[int, ...]   # numpy order (rows, cols), i.e. GGUF's dims reversed
  ggml_type: int
  offset: int              # absolute byte offset in the file
  nbytes: int

@dataclasses.dataclass
class GGUFFile:
  path: pathlib.Path
  metadata: dict[str, Any]
  tensors: dict[str, GGUFTensorInfo]

def _gguf_error(path, what: str) -> WeightsError:
  return WeightsError(f"{path} is not a usable GGUF file ({what}); check the path, or download the file again")

def _type_names(types) -> str: return ", ".join(GGML_TYPE_NAMES.get(t, str(t)) for t in sorted(types))

def read_gguf(path: str | pathlib.Path) -> GGUFFile:
  """The metadata and the tensor table of a GGUF file (no tensor data is read). Raises WeightsError for a missing, truncated
  or corrupt file."""
  from tinygrad.llm.gguf import _GGML_NATIVE, _GGML_QUANT, read_int32, read_int64, read_str, read_uint32, read_uint64, readers
  path = pathlib.Path(path)
  if not path.is_file(): raise WeightsError(f"model file {path} does not exist; pass --model with a GGUF file or a Hugging Face directory")
  size = path.stat().st_size
  with open(path, "rb") as f:
    r = io.BufferedReader(f, 1 << 20)
    if r.read(4) != b"GGUF": raise _gguf_error(path, "it does not start with the GGUF magic bytes")
    try:
      version, n_tensors, n_kv = read_int32(r), read_int64(r), read_int64(r)
      if version not in (2, 3): raise _gguf_error(path, f"GGUF version {version}, expected 2 or 3")
      if not (0 <= n_tensors < 1 << 20 and 0 <= n_kv < 1 << 20): raise _gguf_error(path, f"implausible header: {n_tensors} tensors, {n_kv} keys")
      metadata = {}
      for _ in range(n_kv):
        key, typ = read_str(r), read_int32(r)
        if typ not in readers: raise _gguf_error(path, f"metadata {key!r} has unknown type {typ}")
        metadata[key] = readers[typ](r)
      infos = []
      for _ in range(n_tensors):
        name, dims = read_str(r), tuple(read_uint64(r) for _ in range(read_uint32(r)))
        infos.append((name, dims, read_int32(r), read_uint64(r)))
      data_start = -(-r.tell() // (align := metadata.get("general.alignment", 32))) * align
    except WeightsError: raise
    except (Exception, MemoryError) as e:   # struct.error at EOF, UnicodeDecodeError, absurd lengths in random bytes
      raise _gguf_error(path, f"header unreadable: {type(e).__name__}: {e}") from None
  tensors = {}
  for name, dims, typ, off in infos:
    n = int(np.prod(dims)) if dims else 1
    if typ in _GGML_NATIVE: nbytes = n * _GGML_NATIVE[typ].itemsize
    elif typ in _GGML_QUANT: nbytes = n // _GGML_QUANT[typ][0] * _GGML_QUANT[typ][1]
    else:
      raise WeightsError(f"{path}: tensor {name} has GGML type {typ}, which tinyhet cannot read (supported: "
                         f"{_type_names(set(_GGML_QUANT) | set(FLOAT_TYPES))}); use a file quantized to one of those")
    if (end := data_start + off + nbytes) > size: raise _gguf_error(path, f"truncated: tensor {name} ends at byte {end}, the file has {size}")
    tensors[name] = GGUFTensorInfo(name, tuple(reversed(dims)), typ, data_start + off, nbytes)
  return GGUFFile(path, metadata, tensors)

def gguf_config(g: GGUFFile, max_context: int | None = None) -> LlamaConfig:
  """A LlamaConfig from GGUF metadata (llama.cpp's keys, `{arch}.*`)."""
  kv = g.metadata
  arch = kv.get("general.architecture")
  if arch not in ARCHS:
    raise WeightsError(f"{g.path}: architecture {arch!r} is not supported; tinyhet runs GGUF architectures {', '.join(ARCHS)} (Llama 2/3/3.x, "
                       "Mistral, SmolLM2, Qwen2/2.5, Qwen3)")
  def need(key):
    if f"{arch}.{key}" not in kv: raise _gguf_error(g.path, f"metadata {arch}.{key} is missing")
    return kv[f"{arch}.{key}"]
  if kv.get(f"{arch}.expert_count", 0):
    raise WeightsError(f"{g.path}: a mixture of {kv[f'{arch}.expert_count']} experts (Mixtral) is not supported; tinyhet runs dense Llama models")
  dim, n_heads = need("embedding_length"), need("attention.head_count")
  head_dim = kv.get(f"{arch}.attention.key_length", dim // n_heads)
  if kv.get(f"{arch}.attention.value_length", head_dim) != head_dim:
    raise WeightsError(f"{g.path}: value heads of {kv[f'{arch}.attention.value_length']} dims with key heads of {head_dim} are not supported")
  if kv.get(f"{arch}.rope.dimension_count", head_dim) != head_dim:
    raise WeightsError(f"{g.path}: RoPE over {kv[f'{arch}.rope.dimension_count']} of {head_dim} head dims (partial RoPE) is not supported")
  freq_factors = None
  scaling = kv.get(f"{arch}.rope.scaling.type", "none")
  if scaling == "linear": freq_factors = (float(kv.get(f"{arch}.rope.scaling.factor", 1.0)),) * (head_dim // 2)   # positions / factor
  elif scaling not in ("none", ""):
    raise WeightsError(f"{g.path}: rope scaling type {scaling!r} is not supported (supported: none, linear; Llama 3.1 scaling comes as "
                       "rope_freqs.weight and is)")
  vocab = len(kv["tokenizer.ggml.tokens"]) if "tokenizer.ggml.tokens" in kv else kv.get(f"{arch}.vocab_size", g.tensors["token_embd.weight"].shape[0])
  ctx = need("context_length")
  return LlamaConfig(dim=dim, n_layers=need("block_count"), n_heads=n_heads, n_kv_heads=kv.get(f"{arch}.attention.head_count_kv", n_heads),
                     head_dim=head_dim, hidden_dim=need("feed_forward_length"), vocab_size=vocab,
                     norm_eps=kv.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5), rope_theta=kv.get(f"{arch}.rope.freq_base", 10000.0),
                     max_context=min(ctx, max_context) if max_context else ctx, tie_embeddings="output.weight" not in g.tensors,
                     rope_freq_factors=freq_factors, name=kv.get("general.name", g.path.stem), arch=arch,
                     qkv_bias=arch == "qwen2", qk_norm=arch == "qwen3")

def gguf_layer_names(cfg: LlamaConfig) -> dict[str, str]:
  """LayerWeights field -> its GGUF name within a layer (blk.N.<name>), for cfg's family."""
  names = {field: f"{gg}.weight" for field, gg in GGUF_LAYER_NAMES.items()}
  return names | (GGUF_BIAS_NAMES if cfg.qkv_bias else {}) | (GGUF_QK_NORM_NAMES if cfg.qk_norm else {})

def gguf_names(cfg: LlamaConfig) -> dict[str, str]:
  """GGUF tensor name -> the LlamaWeights field it fills ("tok_embeddings", "wq", ...), every layer of cfg."""
  names = {"token_embd.weight": "tok_embeddings", "output_norm.weight": "norm"} | ({} if cfg.tie_embeddings else {"output.weight": "output"})
  return names | {f"blk.{l}.{gg}": field for l in range(cfg.n_layers) for field, gg in gguf_layer_names(cfg).items()}

def check_gguf(g: GGUFFile, cfg: LlamaConfig | None = None) -> LlamaConfig:
  """Everything the load will need, from the header alone: the architecture and config, the tokenizer model, and each tensor's
  name, shape and type. One WeightsError naming the first thing that is not supported, before any weight is read."""
  from tinygrad.llm.gguf import _GGML_QUANT
  cfg = cfg or gguf_config(g)
  if (tm := g.metadata.get("tokenizer.ggml.model")) not in GGUF_TOKENIZERS:
    raise WeightsError(f"{g.path}: tokenizer.ggml.model {tm!r} is not supported (supported: gpt2 = byte-level BPE as Llama 3 and SmolLM2 "
                       "use, llama = SentencePiece as Llama 2 and Mistral use)")
  known, shapes = gguf_names(cfg), expected_shapes(cfg)
  if (extra := sorted(set(g.tensors) - set(known) - {"rope_freqs.weight"})):
    raise WeightsError(f"{g.path}: tensor {extra[0]} ({len(extra)} unexpected in all) is not part of a {cfg.arch} model that tinyhet runs "
                       "(token_embd, output_norm, output, rope_freqs and blk.N.attn_norm/attn_q/attn_k/attn_v/attn_output/ffn_norm/"
                       "ffn_gate/ffn_up/ffn_down weights, attn_q/k/v biases, attn_q_norm/attn_k_norm)")
  for name, field in known.items():
    if (t := g.tensors.get(name)) is None: raise _gguf_error(g.path, f"tensor {name} is missing")
    if t.shape != shapes[field]:
      raise WeightsError(f"{g.path}: tensor {name} has shape {t.shape}, the metadata's config needs {shapes[field]}")
    matrix = len(t.shape) == 2
    ok = t.ggml_type in FLOAT_TYPES or (matrix and t.ggml_type in _GGML_QUANT and t.shape[1] % _GGML_QUANT[t.ggml_type][0] == 0)
    if not ok:
      allowed = FLOAT_TYPES + (tuple(_GGML_QUANT) if matrix else ())
      raise WeightsError(f"{g.path}: tensor {name} is {GGML_TYPE_NAMES.get(t.ggml_type, t.ggml_type)}, not supported for a "
                         f"{'matrix' if matrix else 'vector'} (supported: {_type_names(allowed)})")
  if (rf := g.tensors.get("rope_freqs.weight")) is not None and (rf.shape != (cfg.head_dim // 2,) or rf.ggml_type != 0):
    raise WeightsError(f"{g.path}: rope_freqs.weight is {GGML_TYPE_NAMES.get(rf.ggml_type)} {rf.shape}, expected F32 ({cfg.head_dim // 2},)")
  return cfg

def gguf_raw(g: GGUFFile, name: str, device: str | None, dtype=None):
  """The bytes of one tensor as a uint8 Tensor on `device` (or viewed as `dtype`), read from disk, nothing else of the file."""
  from tinygrad import Tensor
  info = g.tensors[name]
  raw = Tensor(g.path)[info.offset:info.offset + info.nbytes]
  return (raw if dtype is None else raw.bitcast(dtype)).to(device)

def gguf_tensor(g: GGUFFile, name: str, device: str | None):
  """One tensor, dequantized by tinygrad's GGUF reader (quantized types -> float32; float16/float32 kept, bfloat16 -> float32
  by a shift: tinygrad's own bfloat16 kernels do not compile with clang < 15, see tinyhet.model.bf16_weight), realized."""
  from tinygrad import dtypes
  from tinygrad.llm.gguf import ggml_data_to_tensor
  if name not in g.tensors: raise _gguf_error(g.path, f"tensor {name} is missing")
  info = g.tensors[name]
  if info.ggml_type == BF16: return bf16_to_float(gguf_raw(g, name, device, dtypes.uint16)).reshape(info.shape).realize()
  return ggml_data_to_tensor(gguf_raw(g, name, device), int(np.prod(info.shape)), info.ggml_type).reshape(info.shape).realize()

def gguf_matrix(g: GGUFFile, name: str, device: str | None):
  """A weight matrix as stored: block-quantized types as a PackedWeight of the file's blocks, BF16 as BF16Weight, F16/F32 as
  a Tensor of that dtype."""
  from tinygrad import dtypes
  from tinygrad.llm.gguf import _GGML_QUANT
  if name not in g.tensors: raise _gguf_error(g.path, f"tensor {name} is missing")
  info = g.tensors[name]
  if info.ggml_type == BF16 and len(info.shape) == 2: return BF16Weight(gguf_raw(g, name, device, dtypes.uint16), info.shape).realize()
  if info.ggml_type not in _GGML_QUANT or len(info.shape) != 2: return gguf_tensor(g, name, device)
  return PackedWeight(gguf_raw(g, name, device), info.shape, info.ggml_type).realize()

def gguf_types(g: GGUFFile) -> list[str]:
  """The names of the types the file's matrices are stored in, e.g. ['Q4_K', 'Q6_K'] for a Q4_K_M file."""
  return sorted({GGML_TYPE_NAMES.get(t.ggml_type, str(t.ggml_type)) for t in g.tensors.values() if len(t.shape) == 2})

def load_gguf(path: str | pathlib.Path, device: str | None = None, n_layers: int | None = None, max_context: int | None = None,
              quiet: bool = False, packed: bool = False) -> tuple[LlamaConfig, LlamaWeights, dict[str, Any]]:
  """(config, weights, GGUF metadata) from a GGUF file; n_layers keeps the first N layers (the rest is never read).
  packed keeps block-quantized matrices as their GGUF blocks (PackedWeight, dequantized inside the kernels that read them)
  instead of dequantizing them to float32 on load. F16 and BF16 matrices stay in their 2 bytes either way."""
  g = read_gguf(path)
  cfg = keep_layers(check_gguf(g, gguf_config(g, max_context)), n_layers)
  if "rope_freqs.weight" in g.tensors:   # Llama 3.1: llama.cpp stores the per-frequency scaling divisors as a tensor
    cfg = dataclasses.replace(cfg, rope_freq_factors=tuple(float(x) for x in gguf_tensor(g, "rope_freqs.weight", "CPU").numpy()))
  progress = Progress(f"loading {g.path.name}", quiet)
  how = "kept packed" if packed else "dequantized"
  progress.stage(f"{cfg.name}: {cfg.n_layers} layers, dim {cfg.dim}, {'/'.join(gguf_types(g))} weights, {how} on {device or 'the default device'}")
  def get(name):
    if packed or g.tensors[name].ggml_type == BF16: return gguf_matrix(g, name, device)
    return gguf_tensor(g, name, device)
  heads = {"wq": cfg.n_heads, "wk": cfg.n_kv_heads, "bq": cfg.n_heads, "bk": cfg.n_kv_heads, "q_norm": 1, "k_norm": 1}
  def load(field, name):
    x = gguf_tensor(g, name, device) if field in NORMS else get(name)
    if cfg.arch not in REPERMUTED or field not in heads: return x
    if isinstance(x, PackedWeight): return type(x)(hf_rows_to_interleaved(x.blocks, heads[field]), x.shape, x.ggml_type).realize()
    return hf_rows_to_interleaved(x, heads[field]).contiguous().realize()
  emb = get("token_embd.weight")
  layers = []
  for l in range(cfg.n_layers):
    layers.append(LayerWeights(**{field: load(field, f"blk.{l}.{gg}") for field, gg in gguf_layer_names(cfg).items()}))
    progress.count(l + 1, cfg.n_layers)
  w = LlamaWeights(tok_embeddings=emb, layers=layers, norm=gguf_tensor(g, "output_norm.weight", device),
                   output=emb if cfg.tie_embeddings else get("output.weight"))
  progress.done(w.nbytes())
  return cfg, w, g.metadata

def gguf_loaded_nbytes(g: GGUFFile, packed: bool) -> int:
  """Bytes load_gguf's weights take, from the header: block-quantized matrices at their stored size (packed) or float32,
  F16/BF16 matrices at 2 bytes, vectors at float32 (BF16/F16 vectors widened), the tied output counted once."""
  from tinygrad.llm.gguf import _GGML_QUANT
  cfg = check_gguf(g)
  total = 0
  for name in gguf_names(cfg):
    t = g.tensors[name]
    n = int(np.prod(t.shape))
    if len(t.shape) == 1: total += 4 * n if t.ggml_type != 1 else 2 * n
    elif t.ggml_type in _GGML_QUANT: total += t.nbytes if packed else 4 * n
    else: total += t.nbytes
  return total
