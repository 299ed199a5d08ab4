"""Checkpoints written by transformers' own save_pretrained, 4.57 (float32) and 5.24 (bfloat16), made by
tests/fixtures/make_hf_models.py with transformers' float32 logits of every position of a prompt + its 32 greedy tokens:
Llama (Llama 3.1 RoPE), Mistral (SentencePiece vocabulary under 4.x, Tekken under 5.x), Qwen2 (q/k/v biases, tied
embeddings), Qwen3 (q/k norms, head_dim != hidden/heads). Each loads as a user's download would, tokenizes and renders its
chat template as transformers did, and gives transformers' logits within 1e-4 and its 32 greedy tokens through tinyhet's
engines (the dense reference, the prefill's captured layers and chunks, the paged decode of `tinyhet run --no-disagg`).
The same weights written as GGUF the way llama.cpp's converter writes them (tests/gguf_from_hf.py) give those logits too."""
import functools, json, pathlib
import numpy as np
import pytest
from tinygrad import Tensor, dtypes
from gguf_from_hf import write_gguf_from_hf
from tinyhet.engine.local_engine import LocalEngine
from tinyhet.model.llama import DenseKVCache
from tinyhet.model.weights import load_model

FIXTURES = sorted(p for p in (pathlib.Path(__file__).parent / "fixtures" / "hf").iterdir() if p.is_dir())
# every family through the engines once, every fixture through the dense forward and once more (engines or GGUF): each
# model's compile is seconds on 2 cores
ENGINES = [d for d in FIXTURES if d.name in ("tf4-llama", "tf5-mistral", "tf5-qwen2", "tf4-qwen3")]
AS_GGUF = [d for d in FIXTURES if d not in ENGINES or d.name == "tf5-mistral"]   # tf5-mistral: Tekken in GGUF
TOL = 1e-4   # absolute, on logits of magnitude up to ~26

def reference(d: pathlib.Path) -> tuple[dict, np.ndarray]:
  return json.loads((d / "reference.json").read_text()), np.load(d / "logits.npy")

def all_logits(m, ids: list[int]) -> np.ndarray:
  T = len(ids)
  cache = DenseKVCache(m.cfg, 1, T, dtypes.float32)
  return m.forward(Tensor([ids], dtype=dtypes.int32), Tensor.arange(T, dtype=dtypes.int32).reshape(1, T), cache, all_rows=True).numpy()[0]

@functools.cache
def _load(d: pathlib.Path):
  m, tok = load_model(d, "CPU", quiet=True)
  return (d, *reference(d), m, tok)

@pytest.fixture(params=FIXTURES, ids=lambda p: p.name)
def loaded(request): return _load(request.param)

@pytest.fixture(params=ENGINES, ids=lambda p: p.name)
def one_per_family(request): return _load(request.param)

def test_the_fixtures_are_what_transformers_wrote(loaded):
  d, ref, _, m, _ = loaded
  c = json.loads((d / "config.json").read_text())
  assert c["transformers_version"] == ref["transformers"] and c["transformers_version"].split(".")[0] == d.name[2]
  assert m.cfg.arch == ref["family"] and c["architectures"] == [ref["architecture"]]
  assert (m.cfg.qkv_bias, m.cfg.qk_norm) == (ref["family"] == "qwen2", ref["family"] == "qwen3")

def test_logits_of_every_position_match_transformers(loaded):
  _, ref, want, m, _ = loaded
  got = all_logits(m, ref["prompt_ids"] + ref["greedy"])
  assert got.shape == want.shape and np.abs(got - want).max() < TOL

def test_greedy_tokens_through_the_paged_single_device_engine(one_per_family):
  _, ref, _, m, _ = one_per_family
  engine = LocalEngine(m, kv_tokens=len(ref["prompt_ids"]) + 32, kv_dtype="float32")   # `tinyhet run --no-disagg`'s engine
  out, _ = engine.generate(ref["prompt_ids"], 32)
  assert out == ref["greedy"]

def test_chunked_prefill_gives_the_prompts_last_logits(one_per_family):
  _, ref, want, m, _ = one_per_family
  T = len(ref["prompt_ids"])
  m.prefill_chunk = 8                                   # chunks of 8 through the paged pool and the flash-decoding kernel
  try: got = m.prefill(Tensor([ref["prompt_ids"]], dtype=dtypes.int32), kv_dtype=dtypes.float32).numpy()[0]
  finally: m.prefill_chunk = 0
  assert np.abs(got - want[T - 1]).max() < TOL

def test_tokenizer_and_chat_template_as_transformers(loaded):
  _, ref, _, _, tok = loaded
  assert tok.encode(ref["prompt"]) == ref["prompt_ids"]
  assert tok.render_chat(ref["messages"]) == ref["chat_text"] and tok.encode_chat(ref["messages"]) == ref["chat_ids"]
  assert tok.decode(ref["greedy"]) == ref["decoded_greedy"]
  assert tok.eos_id in tok.stop_ids

@pytest.mark.parametrize("d", AS_GGUF, ids=lambda p: p.name)
def test_the_same_weights_as_gguf_give_the_same_logits(d, tmp_path):
  ref, want = reference(d)
  quant = "F32" if ref["saved_dtype"] == "float32" else "BF16"     # exact either way
  m, tok = load_model(write_gguf_from_hf(d, tmp_path / f"{d.name}.gguf", quant), "CPU", quiet=True)
  assert m.cfg.arch == {"mistral": "llama"}.get(ref["family"], ref["family"])      # llama.cpp runs Mistral as `llama`
  assert np.abs(all_logits(m, ref["prompt_ids"] + ref["greedy"]) - want).max() < TOL
  assert tok.encode(ref["prompt"]) == ref["prompt_ids"] and tok.render_chat(ref["messages"]) == ref["chat_text"]
  if (d / "tokenizer.model").is_file(): return   # SentencePiece in GGUF: text after a special token gets a space, as llama.cpp does
  assert tok.encode_chat(ref["messages"]) == ref["chat_ids"]

def test_quantized_qwen_gguf_rows_permute_as_blocks(tmp_path):
  """Q8_0 Qwen: the Q/K rows are permuted on load as rows of blocks (packed) or of floats (dequantized): the same model,
  and near transformers' (quantization error only)."""
  d = FIXTURES[[p.name for p in FIXTURES].index("tf4-qwen2")]
  ref, want = reference(d)
  path = write_gguf_from_hf(d, tmp_path / "q8.gguf", "Q8_0")
  ids = ref["prompt_ids"] + ref["greedy"]
  packed, deq = (all_logits(load_model(path, "CPU", quiet=True, packed=p)[0], ids) for p in (True, False))
  assert np.abs(packed - deq).max() < 1e-3
  assert np.abs(packed - want).max() / np.abs(want).max() < 0.05

def test_info_names_the_architecture_and_what_was_read(tmp_path):
  import subprocess, sys
  def info(path, *flags):
    out = subprocess.run([sys.executable, "-m", "tinyhet", "info", "--model", str(path), *flags], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout
  d = FIXTURES[[p.name for p in FIXTURES].index("tf5-qwen3")]
  j = json.loads(info(d, "--json"))
  assert j["architecture"] == "Qwen3ForCausalLM" and j["layout"] == ["per-head q/k RMSNorm", "tied embeddings"]
  assert j["config_used"]["head_dim"] == 32 and "transformers_version" in j["config_ignored"] and j["config_checked"]["hidden_act"] == "silu"
  text = info(d)
  assert "architecture Qwen3ForCausalLM" in text and "ignored     architectures" in text
  g = json.loads(info(write_gguf_from_hf(FIXTURES[[p.name for p in FIXTURES].index("tf4-qwen2")], tmp_path / "q.gguf"), "--json"))
  assert g["architecture"] == "qwen2" and g["layout"][0] == "q/k/v biases" and "pre-tokenizer qwen2" in g["tokenizer"]
  bad = subprocess.run([sys.executable, "-m", "tinyhet", "info", "--model", str(tmp_path)], capture_output=True, text=True, timeout=300)
  assert bad.returncode != 0 and "config.json" in bad.stderr and "Traceback" not in bad.stderr

TEXTS = ["HelloWorld and CamelCaseWords", "digits 1234567 and 3.14", "it's we'll they'd", "caf\u00e9 cafe\u0301 na\u00efve",
         "tabs\tand\n\nnewlines  ", "  leading spaces", "symbols: <>{}[] /path/to\n", "\u00dcber \u00e7a \u4e2d\u6587", ""]

@pytest.mark.parametrize("d", FIXTURES, ids=lambda p: p.name)
def test_the_gguf_vocabulary_tokenizes_as_tokenizer_json(d, tmp_path):
  """The GGUF's tokens, merges and pre-tokenizer name (qwen2, tekken, llama-bpe) or SentencePiece pieces and scores give the
  ids transformers' tokenizer.json gives, on text that exercises each pre-tokenizer's rules (digits, case changes, NFC)."""
  from tinyhet.model.tokenizer import Tokenizer
  from tinyhet.model.weights import read_gguf
  hf = Tokenizer.from_hf_dir(d)
  gg = Tokenizer.from_gguf_metadata(read_gguf(write_gguf_from_hf(d, tmp_path / "t.gguf")).metadata)
  for text in TEXTS:
    # SentencePiece: llama.cpp (so tinyhet's GGUF vocabulary) puts the dummy space before every text, transformers' Metaspace
    # not before one that starts with a space
    if (d / "tokenizer.model").is_file() and text.startswith(" "): continue
    assert gg.encode(text) == hf.encode(text), text
