"""The model files people download: a Hugging Face directory as transformers 5 writes it (config.json with rope_parameters,
safetensors, chat_template.jinja, generation_config.json) against the same weights as a GGUF; bfloat16 and float16 weights
kept in their 2 bytes and run on this machine's clang; config fields tinyhet does not implement refused by name."""
import dataclasses, json
import numpy as np
import pytest
from tinygrad import Tensor, dtypes
import llama_numpy as ref
from tinyhet.model.bf16_weight import BF16Weight
from tinyhet.model.layers import rope_frequencies
from tinyhet.model.llama import DenseKVCache, Llama, RopeScaling, random_weights, small_config
from tinyhet.model.weights import WeightsError, hf_config, load_gguf, load_hf, load_model, model_nbytes

PROMPT = [3, 17, 99, 5, 9, 71, 42, 7]
TEMPLATE = "{% for m in messages %}<t1>{{ m['role'] }}:{{ m['content'] }}<t2>{% endfor %}{% if add_generation_prompt %}<t1>assistant:{% endif %}"

def last_logits(cfg, w) -> np.ndarray:
  m = Llama(cfg, w)
  return m.forward(Tensor([PROMPT], dtype=dtypes.int32), Tensor([list(range(len(PROMPT)))], dtype=dtypes.int32),
                   DenseKVCache(cfg, 1, len(PROMPT), dtypes.float32)).numpy()[0]

def rel(a, b) -> float: return float(np.abs(a - b).max() / np.abs(b).max())

def tokenizer_json(d, vocab_size: int):
  """A tokenizer.json for the <tN> vocabulary the GGUF writer uses (the same tokens, matched whole)."""
  from tinyhet.model.tokenizer import Tokenizer
  cfg = small_config(n_layers=1, vocab_size=vocab_size)
  ref.write_gguf(cfg, ref.random_hf_weights(cfg), d / "v.gguf")
  from tinyhet.model.weights import read_gguf
  Tokenizer.from_gguf_metadata(read_gguf(d / "v.gguf").metadata).tok.save(str(d / "tokenizer.json"))
  (d / "v.gguf").unlink()

# SmolLM2's RoPE base, 100000: a loader that missed rope_parameters would run with transformers' default 10000 and part from the GGUF
CONFIGS = {"smollm2-like": small_config(rope_theta=100000.0),
           "llama3.1-like": small_config(n_kv_heads=1, tie_embeddings=True, rope_theta=500000.0, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 32))}

@pytest.mark.parametrize("name", CONFIGS)
def test_transformers5_directory_gives_the_ggufs_logits(name, tmp_path):
  cfg = CONFIGS[name]
  w = ref.random_hf_weights(cfg, seed=11)
  ref.write_gguf(cfg, w, tmp_path / "m.gguf")
  hf = tmp_path / "hf"
  ref.write_hf_v5(cfg, w, hf, chat_template=TEMPLATE, generation_config={"bos_token_id": 1, "eos_token_id": [2, 7], "do_sample": False})
  tokenizer_json(hf, cfg.vocab_size)
  assert "rope_theta" not in json.loads((hf / "config.json").read_text())        # only inside rope_parameters, as transformers 5 writes it
  hcfg = hf_config(hf)
  assert hcfg.rope_theta == cfg.rope_theta and hcfg.rope_scaling == cfg.rope_scaling
  np.testing.assert_allclose(rope_frequencies(hcfg), ref.inv_freq(cfg), rtol=1e-12)
  gm, gtok = load_model(tmp_path / "m.gguf", "CPU", quiet=True)
  hm, htok = load_model(hf, "CPU", quiet=True)
  g, h = last_logits(gm.cfg, gm.w), last_logits(hm.cfg, hm.w)
  expected = ref.forward(cfg, w, PROMPT)[-1]
  assert rel(h, g) < 1e-5 and rel(h, expected) < 1e-4
  # greedy tokens from both agree with each other
  assert hm.reference_generate(PROMPT, 12, kv_dtype=dtypes.float32) == gm.reference_generate(PROMPT, 12, kv_dtype=dtypes.float32)
  assert htok.chat_template == TEMPLATE and {2, 7} <= set(htok.stop_ids)           # chat_template.jinja, generation_config.json's eos ids
  assert htok.render_chat([{"role": "user", "content": "hi"}]) == "<t1>user:hi<t2><t1>assistant:"

def test_transformers4_and_5_configs_agree(tmp_path):
  cfg = CONFIGS["llama3.1-like"]
  for name, c in (("v4", ref.hf_config_json(cfg)), ("v5", ref.hf_config_json_v5(cfg))):
    (tmp_path / name).mkdir()
    (tmp_path / name / "config.json").write_text(json.dumps(c))
  assert hf_config(tmp_path / "v4") == dataclasses.replace(hf_config(tmp_path / "v5"), name="v4")
  c = ref.hf_config_json_v5(cfg) | {"rope_scaling": ref.hf_config_json(cfg)["rope_scaling"]}   # both, agreeing: as transformers merges
  (tmp_path / "v5" / "config.json").write_text(json.dumps(c))
  assert hf_config(tmp_path / "v5").rope_scaling == cfg.rope_scaling

def _bf16_weights(w, norms: bool):
  """The weights as a bfloat16 checkpoint holds them: matrices rounded to bfloat16, norms too where the file has them so
  (safetensors; llama.cpp keeps vectors in F32)."""
  return {k: ref.bf16_round(a) if a.ndim == 2 or norms else a for k, a in w.items()}

@pytest.mark.parametrize("fmt", ["gguf", "safetensors"])
def test_bf16_runs_in_two_bytes_and_matches_float32(fmt, tmp_path):
  cfg = small_config(rope_theta=100000.0)
  w = ref.random_hf_weights(cfg, seed=12)
  if fmt == "gguf": ref.write_gguf(cfg, w, path := tmp_path / "m.bf16.gguf", quant="BF16")
  else: ref.write_hf_v5(cfg, w, path := tmp_path / "hf", dtype="bfloat16")
  lcfg, lw = (load_gguf(path, "CPU", quiet=True)[:2]) if fmt == "gguf" else load_hf(path, "CPU", quiet=True)
  mats = [lw.tok_embeddings, lw.output] + [getattr(layer, f) for layer in lw.layers for f in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")]
  assert all(isinstance(m, BF16Weight) and m.blocks.dtype == dtypes.uint16 for m in mats)
  n_matrix = sum(int(np.prod(m.shape)) for m in mats)
  assert lw.nbytes() == 2 * n_matrix + 4 * (cfg.dim * (2 * cfg.n_layers + 1))    # 2 bytes a weight; norms as float32
  assert model_nbytes(path) == lw.nbytes()
  got = last_logits(lcfg, lw)
  assert rel(got, ref.forward(cfg, _bf16_weights(w, fmt == "safetensors"), PROMPT)[-1]) < 1e-4     # the stored bfloat16 values, exactly widened
  assert rel(got, ref.forward(cfg, w, PROMPT)[-1]) < 3e-2                      # and the float32 model they were rounded from
  m = Llama(lcfg, lw)                                                          # prefill (captured layers) and decode run too
  prefill = m.prefill(Tensor([PROMPT], dtype=dtypes.int32), kv_dtype=dtypes.float32).numpy()[0]
  assert rel(prefill, got) < 1e-4
  assert len(m.reference_generate(PROMPT, 4)) == 4

def test_f16_safetensors_stay_float16(tmp_path):
  cfg = small_config()
  w = ref.random_hf_weights(cfg, seed=13)
  ref.write_hf_v5(cfg, w, tmp_path / "hf", dtype="float16")
  lcfg, lw = load_hf(tmp_path / "hf", "CPU", quiet=True)
  assert lw.layers[0].wq.dtype == dtypes.float16 and lw.tok_embeddings.dtype == dtypes.float16
  assert model_nbytes(tmp_path / "hf") == lw.nbytes() == 2 * cfg.n_params()     # float16 norms are kept as they are
  w16 = {k: a.astype(np.float16).astype(np.float32) for k, a in w.items()}
  assert rel(last_logits(lcfg, lw), ref.forward(cfg, w16, PROMPT)[-1]) < 1e-4

def test_model_nbytes_is_what_loads(tmp_path):
  cfg = small_config()
  w = ref.random_hf_weights(cfg, seed=14)
  for quant in ("F32", "F16", "Q8_0"):
    ref.write_gguf(cfg, w, p := tmp_path / f"{quant}.gguf", quant=quant)
    for packed in (False, True):
      assert model_nbytes(p, packed) == load_gguf(p, "CPU", quiet=True, packed=packed)[1].nbytes(), (quant, packed)
  assert model_nbytes(tmp_path / "Q8_0.gguf", True) < model_nbytes(tmp_path / "Q8_0.gguf") / 3

# ---- refused: one error naming the field or tensor -------------------------------------------------------------------------------

BAD_CONFIGS = [({"attention_bias": True}, "attention_bias = true"), ({"hidden_act": "gelu"}, "hidden_act = \"gelu\""),
               ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "rope_type = \"yarn\""),
               ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0}}, "rope_type = \"dynamic\""),
               ({"rope_theta": 20000.0}, "rope_theta = 20000.0 contradicts"),
               ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}}, "needs high_freq_factor"),
               ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "beta_fast": 32}}, "rope_parameters.beta_fast"),
               ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
               ({"residual_multiplier": 0.5}, "residual_multiplier = 0.5 is not a field tinyhet knows"),
               ({"model_type": "phi3"}, "model_type 'phi3'"), ({"mlp_bias": True}, "mlp_bias")]

@pytest.mark.parametrize("change,message", BAD_CONFIGS, ids=[m for _, m in BAD_CONFIGS])
def test_config_fields_that_change_the_model_are_refused(change, message, tmp_path):
  (tmp_path / "config.json").write_text(json.dumps(ref.hf_config_json_v5(small_config()) | change))
  with pytest.raises(WeightsError, match=message.replace("(", r"\(")):
    hf_config(tmp_path)

def test_linear_rope_and_mistral_window(tmp_path):
  c = ref.hf_config_json_v5(small_config()) | {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}}
  (tmp_path / "config.json").write_text(json.dumps(c))
  np.testing.assert_allclose(rope_frequencies(hf_config(tmp_path)), ref.inv_freq(small_config()) / 4, rtol=1e-12)
  c = ref.hf_config_json_v5(small_config(max_context=64)) | {"model_type": "mistral", "sliding_window": 32}
  (tmp_path / "config.json").write_text(json.dumps(c))
  assert hf_config(tmp_path).max_context == 32          # within the window, sliding-window attention is full attention

def test_unsupported_layouts_are_named_before_any_weight_is_read(tmp_path):
  cfg = small_config()
  w = ref.random_hf_weights(cfg, seed=15)
  bias = {"blk.0.attn_q.bias": np.zeros(cfg.n_heads * cfg.head_dim, np.float32)}
  ref.write_gguf(cfg, w, tmp_path / "bias.gguf", extra=bias)
  ref.write_hf_v5(cfg, w | {"model.layers.0.self_attn.q_proj.bias": np.zeros(64, np.float32)}, tmp_path / "hf")
  bad_shape = dict(w, **{"model.layers.1.mlp.up_proj.weight": np.zeros((cfg.hidden_dim, cfg.dim + 1), np.float32)})
  ref.write_hf_v5(cfg, bad_shape, tmp_path / "hf_shape")
  cases = [(tmp_path / "bias.gguf", "blk.0.attn_q.bias"), (tmp_path / "hf", "q_proj.bias"), (tmp_path / "hf_shape", r"up_proj.weight has shape")]
  for path, message in cases:
    with pytest.raises(WeightsError, match=message): model_nbytes(path)   # the headers alone: no weight read
    with pytest.raises(WeightsError, match=message): load_model(path, "CPU", quiet=True)

def test_llama2_style_gguf_with_a_sentencepiece_vocabulary_loads_and_runs(tmp_path):
  from test_tokenizer import sentencepiece_vocab, spm_reference
  tokens, scores, types = sentencepiece_vocab(3)
  cfg = small_config(vocab_size=len(tokens))
  w = ref.random_hf_weights(cfg, seed=16)
  ref.write_gguf(cfg, w, tmp_path / "llama2.gguf", quant="Q8_0", sentencepiece=(tokens, scores, types))
  m, tok = load_model(tmp_path / "llama2.gguf", "CPU", quiet=True, packed=True)
  ids = tok.encode("abc de")
  assert ids == [1, *spm_reference("abc de", tokens, scores)] and tok.decode(ids) == "abc de"
  assert len(m.reference_generate(ids, 3)) == 3
  ref.write_gguf(cfg, w, tmp_path / "bert.gguf", sentencepiece=(tokens, scores, types))
  import gguf
  r = gguf.GGUFReader(tmp_path / "bert.gguf", "r+")        # the same file with another tokenizer model, edited in place
  field = r.fields["tokenizer.ggml.model"]
  field.parts[field.data[0]][:] = np.frombuffer(b"bert\0", np.uint8)[:len(field.parts[field.data[0]])]
  del r
  for call in (lambda: model_nbytes(tmp_path / "bert.gguf"), lambda: load_model(tmp_path / "bert.gguf", "CPU", quiet=True)):
    with pytest.raises(WeightsError, match="tokenizer.ggml.model 'bert.*supported: gpt2.*llama"): call()

def test_random_bf16_weights_are_bf16_bits_of_the_float_ones():
  cfg = small_config(n_layers=1)
  w16 = random_weights(cfg, dtype=dtypes.bfloat16, seed=3)
  w32 = random_weights(cfg, seed=3)
  assert isinstance(w16.layers[0].wq, BF16Weight) and w16.layers[0].wq.nbytes() == 2 * w16.layers[0].wq.shape[0] * w16.layers[0].wq.shape[1]
  np.testing.assert_array_equal(w16.layers[0].w_down.dequantize().numpy(), ref.bf16_round(w32.layers[0].w_down.numpy()))
  assert np.isfinite(last_logits(cfg, w16)).all()
