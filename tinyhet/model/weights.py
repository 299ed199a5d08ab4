"""Loading a Llama: from a GGUF file (tinyhet.model.gguf_loader) or a Hugging Face directory of safetensors (tinyhet.model.hf_loader),
onto the device the caller names, with its tokenizer. Everything a load needs is checked from the files' headers first
(architecture, config, tokenizer model, every tensor's name, shape and type): an unsupported model is one clear error before
any weight is read. The names below are the public API; the loaders' modules hold the details.
"""
from __future__ import annotations
import pathlib
from tinyhet.model.gguf_loader import (GGUF_LAYER_NAMES, GGUFFile, GGUFTensorInfo, check_gguf, gguf_config, gguf_loaded_nbytes, gguf_matrix,  # noqa: F401
                                 gguf_raw, gguf_tensor, load_gguf, read_gguf)
from tinyhet.model.hf_loader import HF_LAYER_NAMES, check_hf, hf_config, hf_loaded_nbytes, hf_rows_to_interleaved, load_hf  # noqa: F401
from tinyhet.model.llama import Llama
from tinyhet.model.model_files import EMBEDDED_FILE, EMBEDDED_PACKAGE, INSTALL_HINT, Progress, WeightsError, embedded_model_path  # noqa: F401

def load_model(path: str | pathlib.Path | None = None, device: str | None = None, n_layers: int | None = None, max_context: int | None = None,
               quiet: bool = False, packed: bool = False):
  """(Llama, Tokenizer) from a GGUF file or a Hugging Face directory; None means the embedded SmolLM2-135M-Instruct.
  The tokenizer is built first: a vocabulary that cannot be used fails before the weights are read.
  packed: keep a GGUF's quantized matrices in their blocks, read directly by the kernels (see load_gguf): 5.6x less memory
  for SmolLM2's Q4_1 and ~1.6x faster decode once warm, but a process's first forward takes about twice as long (tinygrad
  schedules and generates code for the dequantizing kernels in Python), so it pays in long-running (decode) processes.
  Default False: float32 on load. F16 and BF16 weights stay in their 2 bytes either way."""
  from tinyhet.model.tokenizer import Tokenizer
  path = embedded_model_path() if path is None else pathlib.Path(path)
  if path.is_dir():
    check_hf(path, hf_config(path, max_context))
    tok = Tokenizer.from_hf_dir(path)
    cfg, w = load_hf(path, device, n_layers, max_context, quiet)
    return Llama(cfg, w, device), tok
  g = read_gguf(path)
  check_gguf(g)
  tok = Tokenizer.from_gguf_metadata(g.metadata)
  cfg, w, _ = load_gguf(path, device, n_layers, max_context, quiet, packed)
  return Llama(cfg, w, device), tok

def model_name(path) -> str:
  """A short name for a model path: the file or directory name (the embedded model's file name when path is None)."""
  return (embedded_model_path() if path is None else pathlib.Path(path)).name

def model_nbytes(path, packed: bool = False) -> int:
  """Bytes the model's weights take once loaded (load_model with this `packed`), from the files' headers alone: each matrix
  in the form it is loaded in (F16/BF16 at 2 bytes, quantized blocks at their size when packed, float32 otherwise). Checks
  the model as load_model would: a missing, corrupt or unsupported model raises WeightsError here, before memory is sized."""
  path = embedded_model_path() if path is None else pathlib.Path(path)
  if path.is_dir(): return hf_loaded_nbytes(path)
  return gguf_loaded_nbytes(read_gguf(path), packed)

def describe_model(path) -> dict:
  """What tinyhet reads from a model file without loading its weights (`tinyhet info --model`): the format, the architecture,
  the config it becomes, what of the file's config was used, checked or ignored, the tensors' types, the tokenizer's kind and
  the chat template. Raises WeightsError (or TokenizerError) as a load would."""
  import dataclasses, json
  from tinyhet.model.gguf_loader import gguf_types
  from tinyhet.model.hf_config import read_hf_config
  from tinyhet.model.hf_loader import check_hf
  from tinyhet.model.tokenizer import Tokenizer
  path = embedded_model_path() if path is None else pathlib.Path(path)
  if path.is_dir():
    cfg, read = read_hf_config(path)
    table = check_hf(path, cfg)
    tok = Tokenizer.from_hf_dir(path)
    tj = json.loads((path / "tokenizer.json").read_text())
    pre = tj.get("pre_tokenizer") or {}
    pres = [p["type"] for p in pre.get("pretokenizers", [pre])] if pre else []
    kind = f"{tj['model']['type']}" + (", byte fallback" if tj["model"].get("byte_fallback") else "") + "".join(f", {p}" for p in pres)
    out = {"format": "Hugging Face safetensors", "architecture": read["architecture"], "model_type": cfg.arch, "config_used": read["used"],
           "config_checked": read["checked"], "config_ignored": read["ignored"], "sliding_window": read["sliding_window"],
           "tensor_dtypes": sorted({t.dtype for t in table.values()}), "tensors": len(table), "tokenizer": f"tokenizer.json ({kind})"}
  else:
    g = read_gguf(path)
    cfg = check_gguf(g)
    tok = Tokenizer.from_gguf_metadata(g.metadata)
    arch = g.metadata["general.architecture"]
    model = g.metadata.get("tokenizer.ggml.model")
    kind = "SentencePiece" if model == "llama" else f"byte-level BPE, pre-tokenizer {g.metadata.get('tokenizer.ggml.pre', 'default')}"
    out = {"format": "GGUF", "architecture": arch, "model_type": cfg.arch, "tensor_dtypes": gguf_types(g), "tensors": len(g.tensors),
           "config_used": {k: v for k, v in g.metadata.items() if k.startswith(f"{arch}.")}, "tokenizer": f"GGUF {model} ({kind})"}
  layout = ["q/k/v biases"] * cfg.qkv_bias + ["per-head q/k RMSNorm"] * cfg.qk_norm + ["tied embeddings"] * cfg.tie_embeddings
  return out | {"config": {k: v for k, v in dataclasses.asdict(cfg).items() if k != "rope_freq_factors"}, "layout": layout,
                "vocab_size": tok.vocab_size, "chat_template": bool(tok.chat_template), "stop_ids": list(tok.stop_ids)}
