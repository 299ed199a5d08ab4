"""End to end: prefill on HET, layer-wise KV transfer, paged decode on MESH in another process, against a plain
single-device reference (dense cache, no paging, no transfer)."""
import hashlib, json, os, pathlib, subprocess, sys
import numpy as np, pytest
import tinyhet  # noqa: F401
from tinygrad import Tensor, dtypes
from tinyhet.memory import local_node
from tinyhet.model import Llama, DenseKVCache, small_config, random_weights
from tinyhet.prefill import DecodeClient

ROOT = pathlib.Path(__file__).parent.parent
TOKEN = "e2e-token"
SMALL = dict(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, hidden_dim=96, vocab_size=256, max_context=128)

DECODE_NODE = """
import hashlib, json, sys, threading, tinyhet
from tinyhet.decode_node import DecodeNode
from tinyhet.memory import local_node
from tinyhet.model import Llama, small_config, random_weights
cfg = small_config(**{small})
w = random_weights(cfg, device="MESH", seed=7)
model = Llama(cfg, w, "MESH")
node = local_node()
decode = DecodeNode(model, node, kv_blocks={blocks}, block_size={bs}, max_num_seqs=4, model_id="small-random")
digest = hashlib.sha256(b"".join(t.numpy().tobytes() for t in w.tensors())).hexdigest()
print(json.dumps({{"address": node.serve(), "weights": digest}}), flush=True)
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
decode.run(stop)
"""

def start_decode_node(blocks=64, bs=4):
  env = {**os.environ, "TINYHET_TOKEN": TOKEN, "TINYHET_NODE": "e2e-decode", "TINYHET_ARENA_BYTES": "256M"}
  proc = subprocess.Popen([sys.executable, "-c", DECODE_NODE.format(small=SMALL, blocks=blocks, bs=bs)], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True, env=env)
  line = proc.stdout.readline()
  if not line: raise RuntimeError(f"decode node did not start (exit {proc.wait()})")
  return proc, json.loads(line)

@pytest.fixture(scope="module")
def small():
  cfg = small_config(**SMALL)
  w = random_weights(cfg, device="HET", seed=7)
  model = Llama(cfg, w, "HET")
  proc, info = start_decode_node()
  assert info["weights"] == hashlib.sha256(b"".join(t.numpy().tobytes() for t in w.tensors())).hexdigest(), "both nodes must hold the same model"
  node = local_node()
  node.endpoint.token = TOKEN
  yield model, info["address"]
  proc.stdin.close()
  proc.wait(30)

def reference_last_logits(model: Llama, ids: list[int]) -> np.ndarray:
  """Last-position logits of one plain forward over ids (dense cache, one device)."""
  cache = DenseKVCache(model.cfg, 1, len(ids), dtypes.float16, model.device)
  T = len(ids)
  return model.forward(Tensor([ids], dtype=dtypes.int32, device=model.device), Tensor.arange(T, dtype=dtypes.int32).reshape(1, T).to(model.device),
                       cache).numpy()[0]

@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize("prompt_len, new", [(5, 6), (23, 9)])
def test_disaggregated_equals_single_device(small, transport, prompt_len, new):
  model, address = small
  prompt = [int(t) for t in np.random.default_rng(prompt_len).integers(0, SMALL["vocab_size"], prompt_len)]
  want = model.reference_generate(prompt, new, temperature=0.0)
  client = DecodeClient(local_node(), address, model, "small-random", transport)
  try: got, stats = client.generate(prompt, new, return_logits=True)
  finally: client.close()
  assert stats.transport == transport
  assert got == want
  ref = reference_last_logits(model, prompt + got[:-1])
  err = np.abs(np.array(stats.last_logits) - ref).max() / np.abs(ref).max()
  assert err < 1e-4, f"last-position logits differ by {err:.2e} (relative)"
  assert stats.kv_bytes > 0 and 0 <= stats.hidden_share <= 1 and stats.decode_tokens == len(got) - 1

def test_sampling_continues_the_same_random_stream(small):
  model, address = small
  prompt = [3, 1, 4, 1, 5, 9, 2, 6]
  want = model.reference_generate(prompt, 12, temperature=0.9, top_p=0.95, seed=11)
  client = DecodeClient(local_node(), address, model, "small-random", "shm")
  try: got, _ = client.generate(prompt, 12, temperature=0.9, top_p=0.95, seed=11)
  finally: client.close()
  assert got == want

def test_decode_node_refuses_another_model(small):
  model, address = small
  other = Llama(small_config(**{**SMALL, "n_layers": 3}), random_weights(small_config(**{**SMALL, "n_layers": 3}), device="HET", seed=1), "HET")
  from tinyhet.prefill import IncompatibleDecodeNode
  with pytest.raises(IncompatibleDecodeNode, match="same --model"): DecodeClient(local_node(), address, other, "other", "tcp")

def test_bad_requests_get_clear_errors(small):
  model, address = small
  from tinyhet.runtime.control import ControlClient, ControlError
  ctl = ControlClient(local_node().endpoint, address)
  try:
    with pytest.raises(ControlError, match="non-empty list of token ids"): ctl.call("decode.reserve", prompt_ids=[], max_new_tokens=3)
    with pytest.raises(ControlError, match="non-empty list of token ids"): ctl.call("decode.reserve", prompt_ids=[1, 10**9], max_new_tokens=3)
    with pytest.raises(ControlError, match="exceeds the model's context"): ctl.call("decode.reserve", prompt_ids=[1] * 100, max_new_tokens=100)
    with pytest.raises(ControlError, match="not reserved"): ctl.call("decode.generate", seq_id=12345, first_token=1)
    with pytest.raises(ControlError, match="unknown request"): ctl.call("decode.teleport")
    with pytest.raises(ControlError, match="TypeError"): ctl.call("decode.reserve", nonsense=1)
    r = ctl.call("decode.reserve", prompt_ids=[1, 2, 3], max_new_tokens=2)
    with pytest.raises(ControlError, match="1 of 2 layers|0 of 2 layers"): ctl.call("decode.generate", seq_id=r["seq_id"], first_token=5, timeout=0.5)
    with pytest.raises(ControlError, match="not reserved"): ctl.call("decode.release", seq_id=r["seq_id"])   # a failed generate ends it
    assert ctl.call("decode.info")["connection_sequences"] == 0
  finally: ctl.close()

def test_full_pool_waits_then_admits():
  """A reservation larger than what is free waits (admission), and one larger than the pool is refused."""
  proc, info = start_decode_node(blocks=8, bs=4)          # 32 token slots
  from tinyhet.runtime.control import ControlClient, ControlError
  local_node().endpoint.token = TOKEN
  a, b = ControlClient(local_node().endpoint, info["address"]), ControlClient(local_node().endpoint, info["address"])
  try:
    with pytest.raises(ControlError, match="need 9 KV blocks.*pool has 8 blocks"): a.call("decode.reserve", prompt_ids=[1] * 30, max_new_tokens=5)
    first = a.call("decode.reserve", prompt_ids=[1] * 20, max_new_tokens=4)
    with pytest.raises(ControlError, match="stayed full"): b.call("decode.reserve", prompt_ids=[2] * 20, max_new_tokens=4, timeout=0.5)
    a.close()                                             # the holder goes away: its blocks come back
    assert b.call("decode.reserve", prompt_ids=[2] * 20, max_new_tokens=4, timeout=10)["seq_id"] != first["seq_id"]
  finally:
    b.close()
    proc.stdin.close()
    proc.wait(30)

# ---------------------------------------------------------------- the embedded model through the CLI

SMOLLM2_PROMPT = "What is the capital of France? Answer in one short sentence."

def tinyhet_cli(*args, timeout=900):
  out = subprocess.run([sys.executable, "-m", "tinyhet", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
  assert out.returncode == 0, out.stderr[-3000:]
  return json.loads(out.stdout)

@pytest.mark.slow
def test_smollm2_run_disaggregated_and_single_device():
  disagg = tinyhet_cli("run", SMOLLM2_PROMPT, "--max-tokens", "12", "--json", "--quiet")
  alone = tinyhet_cli("run", SMOLLM2_PROMPT, "--max-tokens", "12", "--json", "--quiet", "--no-disagg")
  assert disagg["generated_ids"] == alone["generated_ids"]
  assert "Paris" in disagg["text"], disagg["text"]
  assert disagg["transport"] == "shm" and disagg["kv_bytes"] > 0 and 0 <= disagg["hidden_share"] <= 1
  assert set(disagg) >= {"prompt_ids", "generated_ids", "text", "ttft_s", "kv_bytes", "transfer_gbps", "hidden_share", "decode_tok_s", "transport"}

@pytest.mark.slow
def test_run_against_a_separately_started_decode_node_over_tcp():
  """The two-machine recipe on one host: `tinyhet node --role decode`, then `tinyhet run --decode-node ... --transport tcp`."""
  env = {**os.environ, "TINYHET_TOKEN": "two-commands"}
  node = subprocess.Popen([sys.executable, "-m", "tinyhet", "node", "--role", "decode", "--listen", "127.0.0.1:0", "--kv-memory", "256M",
                           "--stdin-stop", "--quiet"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
  try:
    info = json.loads(node.stdout.readline())
    out = subprocess.run([sys.executable, "-m", "tinyhet", "run", SMOLLM2_PROMPT, "--decode-node", info["address"], "--transport", "tcp",
                          "--max-tokens", "12", "--json", "--quiet"], capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout)
    assert r["transport"] == "tcp" and "Paris" in r["text"] and r["decode_device"] == f"MESH on {info['node']}"
  finally:
    node.stdin.close()
    node.wait(60)
