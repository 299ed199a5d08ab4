"""A GGUF file from a Hugging Face directory, named and laid out as llama.cpp's convert_hf_to_gguf.py writes one, with the gguf
package (tinyhet's dev extra): architecture `llama` for Llama and Mistral (Q/K rows permuted to interleaved RoPE pairs),
`qwen2` and `qwen3` (rows as Hugging Face keeps them: llama.cpp runs those with rotate-half RoPE); tensor names from gguf's
own name map; the vocabulary from tokenizer.json (byte-level BPE: tokens, merges, the pre-tokenizer's llama.cpp name) or
from tokenizer.model (SentencePiece: pieces, scores, types); the chat template and BOS/EOS from the tokenizer's config."""
from __future__ import annotations
import json, pathlib, struct
import numpy as np
from llama_numpy import _base_freq, add_shape, hf_to_gguf_permute, inv_freq
from tinyhet.model.hf_config import hf_config
from tinyhet.model.hf_loader import hf_table

PRE = {"llama": "llama-bpe", "qwen2": "qwen2", "qwen3": "qwen2", "mistral": "tekken"}   # tokenizer.ggml.pre of a byte-level BPE
ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
CONTROL, NORMAL, UNUSED = 3, 1, 5

def hf_arrays(directory: pathlib.Path) -> dict[str, np.ndarray]:
  """Every tensor of the checkpoint as float32 (bfloat16 widened exactly)."""
  out = {}
  for name, t in hf_table(directory).items():
    raw = np.fromfile(t.file, np.uint8, t.end - t.start, offset=t.start)
    if t.dtype == "BF16": a = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    else: a = raw.view({"F32": np.float32, "F16": np.float16}[t.dtype]).astype(np.float32)
    out[name] = a.reshape(t.shape)
  return out

def sentencepiece_vocab(path: pathlib.Path) -> tuple[list[str], list[float], list[int]]:
  """(pieces, scores, types) of a SentencePiece tokenizer.model: ModelProto field 1 holds the pieces, each {1: text, 2: score, 3: type}."""
  data, pieces = path.read_bytes(), []
  def varint(b, i):
    n = shift = 0
    while True:
      n |= (b[i] & 0x7F) << shift
      i, shift = i + 1, shift + 7
      if not b[i - 1] & 0x80: return n, i
  def fields(b):
    i = 0
    while i < len(b):
      key, i = varint(b, i)
      if key & 7 == 0: v, i = varint(b, i)
      elif key & 7 == 5: v, i = b[i:i + 4], i + 4
      elif key & 7 == 1: v, i = b[i:i + 8], i + 8
      else:
        n, i = varint(b, i)
        v, i = b[i:i + n], i + n
      yield key >> 3, v
  for f, v in fields(data):
    if f != 1: continue
    p = dict(fields(v))
    pieces.append((p[1].decode(), struct.unpack("<f", p.get(2, b"\0\0\0\0"))[0], p.get(3, NORMAL)))
  return [p[0] for p in pieces], [p[1] for p in pieces], [p[2] for p in pieces]

def write_gguf_from_hf(directory: pathlib.Path, path: pathlib.Path, quant: str = "F32") -> pathlib.Path:
  import gguf
  from gguf.quants import quantize
  directory = pathlib.Path(directory)
  cfg, c = hf_config(directory), json.loads((directory / "config.json").read_text())
  family, arch = c["model_type"], ARCH[c["model_type"]]
  w = hf_arrays(directory)
  wr = gguf.GGUFWriter(str(path), arch)
  wr.add_name(directory.name)
  add_shape(wr, cfg)
  tok_cfg = json.loads((directory / "tokenizer_config.json").read_text())
  tj = json.loads((directory / "tokenizer.json").read_text())
  added = {t["id"]: t for t in tj.get("added_tokens", [])}
  if (directory / "tokenizer.model").is_file():                   # SentencePiece (Mistral-7B-v0.3 style)
    tokens, scores, types = sentencepiece_vocab(directory / "tokenizer.model")
    pad = cfg.vocab_size - len(tokens)                             # the converter pads the vocabulary to the embedding's rows
    tokens, scores, types = tokens + [f"[PAD{i}]" for i in range(len(tokens), cfg.vocab_size)], scores + [-1000.0] * pad, types + [UNUSED] * pad
    wr.add_tokenizer_model("llama")
    wr.add_token_list(tokens)
    wr.add_token_scores(scores)
    wr.add_token_types(types)
  else:                                                             # byte-level BPE
    vocab = tj["model"]["vocab"] | {t["content"]: i for i, t in added.items()}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert [vocab[t] for t in tokens] == list(range(len(tokens))), "token ids must be 0..n-1"
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    types = [CONTROL if i in added and added[i].get("special") else NORMAL for i in range(len(tokens))]
    types += [UNUSED] * (cfg.vocab_size - len(tokens))
    tokens += [f"[PAD{i}]" for i in range(len(tokens), cfg.vocab_size)]
    wr.add_tokenizer_model("gpt2")
    wr.add_tokenizer_pre(PRE[family])
    wr.add_token_list(tokens)
    wr.add_token_types(types)
    wr.add_token_merges(merges)
  tid = {t: i for i, t in enumerate(tokens)}
  def special(key):
    v = tok_cfg.get(key)
    return tid.get(v.get("content") if isinstance(v, dict) else v)
  if (b := special("bos_token")) is not None: wr.add_bos_token_id(b)
  if (e := special("eos_token")) is not None: wr.add_eos_token_id(e)
  post = json.dumps(tj.get("post_processor"))
  wr.add_add_bos_token(bool(tok_cfg.get("add_bos_token")) or (b is not None and tokens[b] in post))
  if (directory / "chat_template.jinja").is_file(): wr.add_chat_template((directory / "chat_template.jinja").read_text())
  qtype = gguf.GGMLQuantizationType[quant]
  if cfg.rope_scaling is not None: wr.add_tensor("rope_freqs.weight", (_base_freq(cfg) / inv_freq(cfg)).astype(np.float32))   # Llama 3.1's
  names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.n_layers)
  for hf, a in w.items():
    if hf.endswith("rotary_emb.inv_freq"): continue
    name = names.get_name(hf, try_suffixes=(".weight", ".bias"))
    assert name is not None, f"gguf has no name for {hf}"
    if arch == "llama" and hf.endswith("q_proj.weight"): a = hf_to_gguf_permute(a, cfg.n_heads)
    if arch == "llama" and hf.endswith("k_proj.weight"): a = hf_to_gguf_permute(a, cfg.n_kv_heads)
    if a.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32: wr.add_tensor(name, a.astype(np.float32))
    else: wr.add_tensor(name, quantize(a.astype(np.float32), qtype), raw_dtype=qtype)
  wr.write_header_to_file()
  wr.write_kv_data_to_file()
  wr.write_tensors_to_file()
  wr.close()
  return path
