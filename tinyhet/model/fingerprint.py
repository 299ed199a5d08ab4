"""The model fingerprint: a digest of everything that decides a model's KV bytes, so that two nodes (or a node and its own
prefix cache) agree on KV only when it would be the same bytes. A file name says nothing: two checkpoints of one shape
can both be called model.gguf.

  fingerprint(spec, cfg, packed) = H(the weights' content digest (a GGUF file, tokenizer included, or every file of a
      Hugging Face directory: safetensors, config.json, tokenizer.json), or the `random:` spec itself; the config as loaded
      (shape, rope theta, scaling and frequency factors, norm eps); the kernel mode (a GGUF's packed blocks or
      --float-weights, the int8-activation mode))
  cache_key(fingerprint, kv_dtype)   what a decode node's block hashes are keyed by: the fingerprint and the pool's KV dtype

The fingerprint is what the compatibility check between a prefill node and a decode node compares (tinyhet.engine.checks:
the prefill node packs in the decode node's KV dtype), and what the router's view of its nodes holds (their heartbeats
carry it and the cache key).

A content digest reads every byte once (BLAKE2b, ~1 GB/s): it is computed once per file and kept in a small cache file
(TINYHET_DIGEST_CACHE, default ~/.cache/tinyhet/digests.json), keyed by (path, size, modification time), so a restart or
a second node on the host checks it with one stat per file.
"""
from __future__ import annotations
import dataclasses, hashlib, json, os, pathlib, threading

_lock = threading.Lock()

def digest_cache_path() -> pathlib.Path:
  if (p := os.environ.get("TINYHET_DIGEST_CACHE")): return pathlib.Path(p)
  return pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache") / "tinyhet" / "digests.json"

def _file_digest(path: pathlib.Path) -> str:
  h = hashlib.blake2b(digest_size=16)
  with open(path, "rb") as f:
    while (chunk := f.read(8 << 20)): h.update(chunk)
  return h.hexdigest()

def _cached_file_digest(path: pathlib.Path, cache: dict) -> str:
  st = path.stat()
  key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
  if (d := cache.get(key)) is None: d = cache[key] = _file_digest(path)
  return d

def content_digest(path) -> str:
  """A digest of the bytes of a file, or of every file under a directory (names included), from the digest cache where
  (path, size, mtime) still match."""
  path = pathlib.Path(path)
  files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
  store = digest_cache_path()
  with _lock:
    try: cache = json.loads(store.read_text())
    except (OSError, ValueError): cache = {}
    if not isinstance(cache, dict): cache = {}
    before = len(cache)
    h = hashlib.blake2b(digest_size=16, person=b"tinyhet-weights")
    for f in files: h.update(f"{f.relative_to(path) if path.is_dir() else ''}={_cached_file_digest(f, cache)};".encode())
    if len(cache) != before:
      try:
        store.parent.mkdir(parents=True, exist_ok=True)
        tmp = store.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache))
        tmp.replace(store)
      except OSError: pass              # a read-only home: the digest is computed again next time, nothing else changes
  return h.hexdigest()

def fingerprint(spec, cfg, packed: bool) -> str:
  """The model's fingerprint (32 hex digits) for a model spec (a path, None for the embedded model, or `random:...`), its
  config as loaded and its kernel mode."""
  from tinyhet.model.layers import int8_activations
  from tinyhet.model.spec import model_id, random_spec
  if random_spec(spec) is not None: weights, gguf = model_id(spec), False      # seeded float32 weights: the spec is the content
  else:
    from tinyhet.model.model_files import embedded_model_path
    path = embedded_model_path() if spec is None else pathlib.Path(spec)
    weights, gguf = content_digest(path), path.is_file()
  shape = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("max_context", "name")}   # a context cap changes no KV byte
  # packed decides the kernels of a GGUF's quantized matrices only (a directory's and random weights load the same either way)
  what = {"weights": weights, "config": shape, "packed": bool(packed) and gguf, "int8_activations": int8_activations()}
  return hashlib.blake2b(json.dumps(what, sort_keys=True, default=str).encode(), digest_size=16, person=b"tinyhet-model").hexdigest()

def cache_key(fp: str, kv_dtype: str) -> str:
  """What a decode node's block hashes are keyed by: its model's fingerprint and its pool's KV dtype."""
  return f"{fp}/{kv_dtype}"
