"""An independent float32 Llama in numpy, in Hugging Face's layout (rotate-half RoPE on un-permuted q/k rows, names as in
transformers' LlamaForCausalLM), the reference the tinygrad model is tested against. Also writes such weights as GGUF
(the way llama.cpp's converter does, Q/K rows permuted) and as Hugging Face safetensors."""
from __future__ import annotations
import json, math, pathlib
import numpy as np

def random_hf_weights(cfg, seed=0) -> dict[str, np.ndarray]:
  """Hugging Face names -> float32 arrays for a tinyhet LlamaConfig."""
  rng = np.random.default_rng(seed)
  def lin(o, i): return rng.uniform(-math.sqrt(3 / i), math.sqrt(3 / i), (o, i)).astype(np.float32)
  def norm(n): return rng.uniform(0.8, 1.2, n).astype(np.float32)
  qd, kvd = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
  w = {"model.embed_tokens.weight": rng.uniform(-1, 1, (cfg.vocab_size, cfg.dim)).astype(np.float32), "model.norm.weight": norm(cfg.dim)}
  for l in range(cfg.n_layers):
    p = f"model.layers.{l}."
    w |= {p + "input_layernorm.weight": norm(cfg.dim), p + "self_attn.q_proj.weight": lin(qd, cfg.dim),
          p + "self_attn.k_proj.weight": lin(kvd, cfg.dim),
          p + "self_attn.v_proj.weight": lin(kvd, cfg.dim), p + "self_attn.o_proj.weight": lin(cfg.dim, qd),
          p + "post_attention_layernorm.weight": norm(cfg.dim), p + "mlp.gate_proj.weight": lin(cfg.hidden_dim, cfg.dim),
          p + "mlp.up_proj.weight": lin(cfg.hidden_dim, cfg.dim), p + "mlp.down_proj.weight": lin(cfg.dim, cfg.hidden_dim)}
  if not cfg.tie_embeddings: w["lm_head.weight"] = lin(cfg.vocab_size, cfg.dim)
  return w

def inv_freq(cfg) -> np.ndarray:
  """transformers' _compute_llama3_parameters, written as its loop."""
  base = [1.0 / (cfg.rope_theta ** (i / cfg.head_dim)) for i in range(0, cfg.head_dim, 2)]
  s = cfg.rope_scaling
  if s is None: return np.array(base)
  out = []
  for f in base:
    wavelen = 2 * math.pi / f
    if wavelen < s.original_max_context / s.high_freq_factor: out.append(f)
    elif wavelen > s.original_max_context / s.low_freq_factor: out.append(f / s.factor)
    else:
      smooth = (s.original_max_context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
      out.append((1 - smooth) * f / s.factor + smooth * f)
  return np.array(out)

def forward(cfg, w: dict[str, np.ndarray], tokens: list[int], kv_dtype=np.float32) -> np.ndarray:
  """Full-sequence causal forward of one sequence; returns the logits of every position (T, vocab) float32. K and V are
  rounded through kv_dtype, as a cache in that dtype stores them."""
  T, H, KVH, D = len(tokens), cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
  def rms(x, g): return (x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.norm_eps) * g).astype(np.float32)
  ang = np.outer(np.arange(T), inv_freq(cfg))
  cos, sin = np.concatenate([np.cos(ang)] * 2, -1).astype(np.float32), np.concatenate([np.sin(ang)] * 2, -1).astype(np.float32)  # (T, D)
  def rope(x):                                                           # x: (T, heads, D), rotate_half
    rot = np.concatenate([-x[..., D // 2:], x[..., :D // 2]], -1)
    return x * cos[:, None] + rot * sin[:, None]
  x = w["model.embed_tokens.weight"][tokens]
  for l in range(cfg.n_layers):
    p = f"model.layers.{l}."
    h = rms(x, w[p + "input_layernorm.weight"])
    q = rope((h @ w[p + "self_attn.q_proj.weight"].T).reshape(T, H, D))
    k = rope((h @ w[p + "self_attn.k_proj.weight"].T).reshape(T, KVH, D)).astype(kv_dtype).astype(np.float32)
    v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(T, KVH, D).astype(kv_dtype).astype(np.float32)
    out = np.zeros((T, H, D), np.float32)
    for hd in range(H):
      kv = hd // (H // KVH)
      s = q[:, hd] @ k[:, kv].T / np.float32(math.sqrt(D))               # (T, T)
      s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
      s = np.exp(s - s.max(-1, keepdims=True))
      out[:, hd] = (s / s.sum(-1, keepdims=True)) @ v[:, kv]
    x = x + out.reshape(T, H * D) @ w[p + "self_attn.o_proj.weight"].T
    h = rms(x, w[p + "post_attention_layernorm.weight"])
    g = h @ w[p + "mlp.gate_proj.weight"].T
    x = x + ((g / (1 + np.exp(-g))) * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
  return rms(x, w["model.norm.weight"]) @ w.get("lm_head.weight", w["model.embed_tokens.weight"]).T

def hf_config_json(cfg) -> dict:
  d = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": cfg.dim, "num_hidden_layers": cfg.n_layers,
       "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "intermediate_size": cfg.hidden_dim,
       "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_context,
       "tie_word_embeddings": cfg.tie_embeddings, "torch_dtype": "float32"}
  if (s := cfg.rope_scaling) is not None:
    d["rope_scaling"] = {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor,
                         "original_max_position_embeddings": s.original_max_context}
  return d

def hf_config_json_v5(cfg, dtype: str = "float32") -> dict:
  """config.json as transformers 5 writes it: rope_theta and the rope scaling inside rope_parameters, `dtype` for torch_dtype."""
  d = {k: v for k, v in hf_config_json(cfg).items() if k not in ("rope_theta", "rope_scaling", "torch_dtype")}
  rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
  if (s := cfg.rope_scaling) is not None:
    rope |= {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor,
             "original_max_position_embeddings": s.original_max_context}
  return d | {"rope_parameters": rope, "dtype": dtype, "transformers_version": "5.0.0", "attention_bias": False, "mlp_bias": False,
              "hidden_act": "silu", "attention_dropout": 0.0, "pretraining_tp": 1, "use_cache": True, "bos_token_id": 1, "eos_token_id": 2}

def bf16_bits(a: np.ndarray) -> np.ndarray:
  """float32 -> bfloat16 bits (uint16), round to nearest even, as torch's .to(torch.bfloat16) rounds."""
  u = np.ascontiguousarray(a, np.float32).view(np.uint32).astype(np.uint64)
  return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)

def bf16_round(a: np.ndarray) -> np.ndarray:
  return (bf16_bits(a).astype(np.uint32) << 16).view(np.float32)

def write_hf_v5(cfg, w: dict[str, np.ndarray], directory: pathlib.Path, dtype: str = "float32", shards: int = 2,
                chat_template: str | None = None, generation_config: dict | None = None):
  """A directory as transformers 5's save_pretrained writes it: safetensors shards written by the safetensors package (dtype
  float32, float16 or bfloat16), model.safetensors.index.json, config.json with rope_parameters, chat_template.jinja and
  generation_config.json."""
  from safetensors import TensorSpec, serialize_file
  directory.mkdir(parents=True, exist_ok=True)
  names, weight_map = sorted(w), {}
  for i in range(shards):
    fn, arrays = f"model-{i + 1:05d}-of-{shards:05d}.safetensors", {}
    for n in names[i::shards]:
      arrays[n] = bf16_bits(w[n]) if dtype == "bfloat16" else np.ascontiguousarray(w[n], np.float16 if dtype == "float16" else np.float32)
      weight_map[n] = fn
    specs = {n: TensorSpec(dtype=dtype, shape=a.shape, data_ptr=a.ctypes.data, data_len=a.nbytes) for n, a in arrays.items()}
    serialize_file(specs, str(directory / fn), metadata={"format": "pt"})
  (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
  (directory / "config.json").write_text(json.dumps(hf_config_json_v5(cfg, dtype)))
  if chat_template is not None: (directory / "chat_template.jinja").write_text(chat_template)
  if generation_config is not None: (directory / "generation_config.json").write_text(json.dumps(generation_config))

def write_hf(cfg, w: dict[str, np.ndarray], directory: pathlib.Path, shards: int = 2):
  """Safetensors shards + model.safetensors.index.json + config.json, as transformers' save_pretrained writes them."""
  from tinygrad import Tensor
  from tinygrad.nn.state import safe_save
  directory.mkdir(parents=True, exist_ok=True)
  names = sorted(w)
  weight_map = {}
  for i in range(shards):
    part = names[i::shards]
    fn = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
    safe_save({n: Tensor(w[n]) for n in part}, str(directory / fn))
    weight_map |= {n: fn for n in part}
  (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
  (directory / "config.json").write_text(json.dumps(hf_config_json(cfg)))

def hf_to_gguf_permute(w: np.ndarray, n_head: int) -> np.ndarray:
  """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute: rotate-half rows -> interleaved pairs."""
  return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

GGUF_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}

def add_shape(wr, cfg) -> None:
  """A GGUF writer's model shape keys, as llama.cpp's converter writes them for a Llama-layout model."""
  wr.add_block_count(cfg.n_layers)
  wr.add_context_length(cfg.max_context)
  wr.add_embedding_length(cfg.dim)
  wr.add_feed_forward_length(cfg.hidden_dim)
  wr.add_head_count(cfg.n_heads)
  wr.add_head_count_kv(cfg.n_kv_heads)
  wr.add_key_length(cfg.head_dim)
  wr.add_value_length(cfg.head_dim)
  wr.add_rope_dimension_count(cfg.head_dim)
  wr.add_rope_freq_base(cfg.rope_theta)
  wr.add_layer_norm_rms_eps(cfg.norm_eps)
  wr.add_vocab_size(cfg.vocab_size)

def write_gguf(cfg, w: dict[str, np.ndarray], path: pathlib.Path, quant: str = "F32", tokens: list[str] | None = None, arch: str = "llama",
               sentencepiece: tuple[list[str], list[float], list[int]] | None = None, extra: dict[str, np.ndarray] | None = None):
  """A GGUF file the way llama.cpp's converter writes a Llama: metadata, Q/K rows permuted, names blk.N.*; quant is a GGML type
  name gguf-py can quantize (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), for 2-D weights only, as llama.cpp quantizes. Llama 3.1
  rope scaling goes in as rope_freqs.weight. sentencepiece: (tokens, scores, token types) of a Llama 2-style vocabulary
  (tokenizer.ggml.model "llama") instead of a byte-level BPE one; extra: more tensors, as written."""
  import gguf
  from gguf.quants import quantize
  wr = gguf.GGUFWriter(str(path), arch)
  wr.add_name("tiny")
  add_shape(wr, cfg)
  if sentencepiece is not None:
    wr.add_tokenizer_model("llama")
    wr.add_token_list(sentencepiece[0])
    wr.add_token_scores(sentencepiece[1])
    wr.add_token_types(sentencepiece[2])
    wr.add_bos_token_id(1)
    wr.add_eos_token_id(2)
  else:
    wr.add_tokenizer_model("gpt2")
    wr.add_token_list(tokens if tokens is not None else [f"<t{i}>" for i in range(cfg.vocab_size)])
  qtype = gguf.GGMLQuantizationType[quant]
  def add(name, a):
    if a.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32: wr.add_tensor(name, a.astype(np.float32))
    else: wr.add_tensor(name, quantize(a.astype(np.float32), qtype), raw_dtype=qtype)
  add("token_embd.weight", w["model.embed_tokens.weight"])
  if cfg.rope_scaling is not None: add("rope_freqs.weight", (2 * math.pi / inv_freq(cfg)) / (2 * math.pi / _base_freq(cfg)))
  for l in range(cfg.n_layers):
    for hf, gg in GGUF_NAMES.items():
      a = w[f"model.layers.{l}.{hf}.weight"]
      if gg == "attn_q": a = hf_to_gguf_permute(a, cfg.n_heads)
      if gg == "attn_k": a = hf_to_gguf_permute(a, cfg.n_kv_heads)
      add(f"blk.{l}.{gg}.weight", a)
  add("output_norm.weight", w["model.norm.weight"])
  if "lm_head.weight" in w: add("output.weight", w["lm_head.weight"])
  for name, a in (extra or {}).items(): wr.add_tensor(name, a)
  wr.write_header_to_file()
  wr.write_kv_data_to_file()
  wr.write_tensors_to_file()
  wr.close()

def _base_freq(cfg) -> np.ndarray: return np.array([1.0 / (cfg.rope_theta ** (i / cfg.head_dim)) for i in range(0, cfg.head_dim, 2)])

def quantized_roundtrip(w: dict[str, np.ndarray], quant: str) -> dict[str, np.ndarray]:
  """The weights as a GGUF of that type holds them: 2-D matrices quantized and dequantized by gguf-py (llama.cpp's reference)."""
  import gguf
  from gguf.quants import dequantize, quantize
  if quant == "F32": return w
  t = gguf.GGMLQuantizationType[quant]
  return {k: dequantize(quantize(a, t), t).astype(np.float32) if a.ndim == 2 else a for k, a in w.items()}
