"""The model fingerprint (tinyhet.model.fingerprint): two checkpoints of the same shape and the same file name are different
models to every check that matters (a decode node's decode.info, the prefill node's compatibility check, the router's
view), while one file is one model however it is named or capped; the kernel mode is part of it; the weights' digest is
computed once per file and found again by (path, size, mtime)."""
import json, os
import pytest
import llama_numpy as ref
from tinyhet.engine.checks import IncompatibleDecodeNode, check_compatible
from tinyhet.model.fingerprint import cache_key, content_digest, fingerprint
from tinyhet.model.llama import small_config
from tinyhet.model.spec import model_id

CFG = small_config(n_layers=1, vocab_size=64, max_context=64)

@pytest.fixture
def two_files(tmp_path, monkeypatch):
  """a/model.gguf and b/model.gguf: one shape, one name, other weights; the digest cache in tmp_path."""
  monkeypatch.setenv("TINYHET_DIGEST_CACHE", str(tmp_path / "digests.json"))
  paths = []
  for seed, d in ((1, "a"), (2, "b")):
    (tmp_path / d).mkdir()
    ref.write_gguf(CFG, ref.random_hf_weights(CFG, seed=seed), p := tmp_path / d / "model.gguf")
    paths.append(p)
  return paths

def test_same_name_same_shape_other_weights_are_other_models(two_files, tmp_path, monkeypatch):
  a, b = two_files
  assert model_id(str(a)) == model_id(str(b)) == "model.gguf"              # what the name checks saw: one model
  fa, fb = fingerprint(str(a), CFG, True), fingerprint(str(b), CFG, True)
  assert fa != fb and content_digest(a) != content_digest(b)
  assert fingerprint(str(a), CFG, True) == fa                                # one file: one fingerprint, every time
  assert fingerprint(str(a), small_config(n_layers=1, vocab_size=64, max_context=32), True) == fa   # a context cap changes no KV
  assert fingerprint(str(a), CFG, False) != fa                               # --float-weights: other kernels, other KV bytes
  monkeypatch.setenv("TINYHET_INT8_ACTIVATIONS", "1")
  assert fingerprint(str(a), CFG, True) != fa                                # the int8-activation mode too
  monkeypatch.delenv("TINYHET_INT8_ACTIVATIONS")
  assert cache_key(fa, "float16") != cache_key(fa, "bfloat16")               # and the block hashes are keyed by the KV dtype as well
  assert fingerprint("random:seed=3", CFG, True) != fingerprint("random:seed=4", CFG, True)
  assert fingerprint("random:seed=3", CFG, True) == fingerprint("random:seed=3", CFG, False)   # seeded float32 weights: no kernel mode
  # the digest is computed once per (path, size, mtime): a second look is a stat; a touched file is read again
  store = tmp_path / "digests.json"
  assert len(json.loads(store.read_text())) == 2                           # one entry per file, however often it was asked for
  st = a.stat()
  os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
  assert fingerprint(str(a), CFG, True) == fa and len(json.loads(store.read_text())) == 3

def info(cfg, fp: str) -> dict:
  return {"model": "model.gguf", "fingerprint": fp, "kv_notice_format": 2, "config": {k: getattr(cfg, k) for k in
          ("n_layers", "n_kv_heads", "head_dim", "vocab_size", "dim")}}

def test_a_prefill_node_refuses_a_decode_node_of_another_file_of_the_same_name(two_files):
  """The real decode node process (tinyhet node --role decode) of a/model.gguf says its fingerprint in decode.info; a prefill
  node of b/model.gguf (same name, same shape) refuses it, one of a/model.gguf takes it."""
  from test_service import Proc, TOKEN
  from tinyhet.device.memory import LocalNode
  from tinyhet.config import load_config
  from tinyhet.runtime.control import ControlClient
  from tinyhet.model.weights import gguf_config, read_gguf
  a, b = two_files
  cfg = gguf_config(read_gguf(a))                                            # the config as the node loads it
  fa, fb = fingerprint(str(a), cfg, True), fingerprint(str(b), cfg, True)
  env = {"TINYHET_DIGEST_CACHE": str(a.parent.parent / "digests.json")}
  d = Proc("node", "--role", "decode", "--listen", "127.0.0.1:0", "--model", str(a), "--quiet", "--kv-memory", "4M", env=env)
  me = LocalNode(load_config(env={"TINYHET_TOKEN": TOKEN, "TINYHET_ARENA_BYTES": "16M"}))
  try:
    assert d.info()["fingerprint"] == fa
    ctl = ControlClient(me.endpoint, d.address)
    got = ctl.call("decode.info")
    ctl.close()
    assert got["model"] == "model.gguf" and got["fingerprint"] == d.info()["fingerprint"]
    with pytest.raises(IncompatibleDecodeNode, match="fingerprint"): check_compatible(cfg, "model.gguf", got, "at d", fb)
    check_compatible(cfg, "model.gguf", got, "at d", fa)
  finally:
    d.stop()
    me.endpoint.close()

def test_the_router_keeps_a_node_of_another_fingerprint_out():
  from test_router import cluster, state
  first, other = state("decode", up=False), state("decode", up=False)
  c = cluster(first, other)
  c._beat(first, {**first.status, "model": "m", "fingerprint": "f1"})
  c._beat(other, {**other.status, "model": "m", "fingerprint": "f2"})
  assert first.up and not other.up and "fingerprint f2" in other.reason and "f1" in other.reason
  c._beat(other, {**other.status, "model": "m", "fingerprint": "f1"})        # restarted from the right file: it joins
  assert other.up
  with pytest.raises(IncompatibleDecodeNode, match="fingerprint"): check_compatible(CFG, "model.gguf", info(CFG, "f1"), "at x", "f2")
