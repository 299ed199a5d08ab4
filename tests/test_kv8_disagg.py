"""8-bit and bfloat16 KV end to end: a decode node process holding its KV in q8_0, fp8_e4m3 or bfloat16 (its bits, never a
tinygrad bfloat16 tensor: clang < 17 has no __bf16), fed layer by layer over tcp and shm by a
prefill on HET, gives the tokens of the single-device engine with the same KV dtype (`tinyhet run --no-disagg`'s), and a
node whose kv_dtype differs from the decode node's is refused in one line naming both."""
import dataclasses, json, os, subprocess, sys
import numpy as np, pytest
import tinyhet  # noqa: F401
from tinyhet.config import load_config
from tinyhet.device.memory import LocalNode
from tinyhet.engine.checks import IncompatibleDecodeNode
from tinyhet.engine.client import DecodeClient
from tinyhet.engine.local_engine import LocalEngine
from tinyhet.model.llama import Llama, small_config, random_weights

TOKEN = "kv8-token"
SMALL = dict(n_layers=2, dim=128, n_heads=4, n_kv_heads=2, hidden_dim=192, vocab_size=256, max_context=256)   # head_dim 32: q8_0's group

DECODE_NODE = """
import json, sys, threading, tinyhet
from tinyhet.engine.decode_node import DecodeNode
from tinyhet.device.memory import local_node
from tinyhet.model.llama import Llama, small_config, random_weights
cfg = small_config(**{small})
model = Llama(cfg, random_weights(cfg, device="MESH", seed=7), "MESH")
node = local_node()
decode = DecodeNode(model, node, kv_blocks=48, block_size=16, max_num_seqs=4, model_id="kv8-random", kv_dtype={kv!r})
print(json.dumps({{"address": node.serve()}}), flush=True)
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
decode.run(stop)
"""

def node_with(kv_dtype: str) -> LocalNode:
  node = LocalNode(dataclasses.replace(load_config(), kv_dtype=kv_dtype))
  node.endpoint.token = TOKEN
  return node

@pytest.fixture(scope="module", params=["q8_0", "fp8_e4m3", "bfloat16"])
def q8_decode(request):
  env = {**os.environ, "TINYHET_TOKEN": TOKEN, "TINYHET_NODE": "kv8-decode", "TINYHET_ARENA_BYTES": "256M"}
  proc = subprocess.Popen([sys.executable, "-c", DECODE_NODE.format(small=SMALL, kv=request.param)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True, env=env)
  line = proc.stdout.readline()
  if not line: raise RuntimeError(f"decode node did not start (exit {proc.wait()})")
  cfg = small_config(**SMALL)
  yield Llama(cfg, random_weights(cfg, device="HET", seed=7), "HET"), json.loads(line)["address"], request.param
  proc.stdin.close()
  proc.wait(30)

@pytest.mark.parametrize("transport, prompt_len", [("tcp", 23), ("shm", 40)])
def test_8bit_disaggregated_equals_single_device_of_the_same_kv_dtype(q8_decode, transport, prompt_len):
  model, address, kv = q8_decode
  prompt = [int(t) for t in np.random.default_rng(prompt_len).integers(0, SMALL["vocab_size"], prompt_len)]
  engine = LocalEngine(model, 128, block_size=16, kv_dtype=kv)
  want, _ = engine.generate(prompt, 10)
  client = DecodeClient(node_with(kv), address, model, "kv8-random", transport)
  try: got, stats = client.generate(prompt, 10)
  finally: client.close()
  assert stats.transport == transport and got == want
  # the wire carried the pool's bytes (q8_0: 34/64 of float16's per value; fp8: one byte; bfloat16: two), the prompt's blocks only
  per_token = 2 * SMALL["n_layers"] * SMALL["n_kv_heads"] * (SMALL["dim"] // SMALL["n_heads"]) * {"q8_0": 34 / 32, "bfloat16": 2}.get(kv, 1)
  assert stats.kv_bytes == -(-prompt_len // 16) * 16 * per_token

def test_a_decode_node_of_another_kv_dtype_is_refused_in_one_line(q8_decode):
  model, address, kv = q8_decode
  with pytest.raises(IncompatibleDecodeNode, match=rf"keeps its KV in {kv}, this node in float16") as e:
    DecodeClient(node_with("float16"), address, model, "kv8-random", "tcp")
  assert "\n" not in str(e.value)

def test_config_rejects_an_unknown_kv_dtype():
  out = subprocess.run([sys.executable, "-c", "from tinyhet.config import load_config; load_config()"], capture_output=True, text=True,
                       env={**os.environ, "TINYHET_KV_DTYPE": "q4_0"})
  assert out.returncode != 0 and "kv_dtype" in out.stderr and "q8_0" in out.stderr

def test_info_shows_tokens_per_gib_of_the_kv_dtype():
  from tinyhet.model.model_files import embedded_model_path
  out = subprocess.run([sys.executable, "-m", "tinyhet", "info", "--model", str(embedded_model_path()), "--json"], capture_output=True,
                       text=True, env={**os.environ, "TINYHET_KV_DTYPE": "q8_0"}, timeout=300)
  kv = json.loads(out.stdout)["kv"]
  # SmolLM2-135M: 30 layers, 3 kv heads of 64; q8_0 34 bytes per 32 values
  assert kv["kv_dtype"] == "q8_0" and kv["bytes_per_token"] == 2 * 30 * 3 * 64 * 34 / 32
  assert kv["tokens_per_gib"] / kv["float16_tokens_per_gib"] >= 1.85
