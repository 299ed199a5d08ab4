"""End to end: prefill on HET, layer-wise KV transfer, paged decode on MESH in another process, against a plain
single-device reference (dense cache, no paging, no transfer)."""
import hashlib, json, os, pathlib, subprocess, sys, threading, time
import numpy as np, pytest
from hypothesis import given, settings, strategies as hst
import tinyhet  # noqa: F401
from tinygrad import Tensor, dtypes
from tinyhet.device.memory import local_node
from tinyhet.model.llama import Llama, DenseKVCache, small_config, random_weights
from tinyhet.engine.local_engine import LocalEngine
from tinyhet.engine.client import DecodeClient
from tinyhet.engine.prefill import GenerationStats, busy_time, transfer_figures
from tinyhet.service.prefill_node import PrefillNode
from tinyhet.runtime.control import ControlClient

ROOT = pathlib.Path(__file__).parent.parent
TOKEN = "e2e-token"
SMALL = dict(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, hidden_dim=96, vocab_size=256, max_context=128)

DECODE_NODE = """
import hashlib, json, sys, threading, tinyhet
from tinyhet.engine.decode_node import DecodeNode
from tinyhet.device.memory import local_node
from tinyhet.model.llama import Llama, small_config, random_weights
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

# each transport once, each with its own prompt length (the 100-token chunked test below runs both transports again)
@pytest.mark.parametrize("prompt_len, new, transport", [(5, 6, "shm"), (23, 9, "tcp")])
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
  assert stats.kv_bytes > 0 and stats.decode_tokens == len(got) - 1
  # the figures: one timeline row per layer in order computed <= posted <= landed; the rate over the moving time
  tl = stats.timeline
  assert [t.layer for t in tl] == list(range(model.cfg.n_layers)) and all(0 < t.computed_s <= t.posted_s <= t.landed_s for t in tl)
  assert stats.landed_clock == "receiver"           # the decode node shares this host's clock
  assert stats.transfer_s == pytest.approx(busy_time([(t.posted_s, t.landed_s) for t in tl]))
  assert stats.transfer_gbps == pytest.approx(stats.kv_bytes / stats.transfer_s / 1e9)
  assert stats.ttft_s == pytest.approx(max(stats.prefill_s, max(t.landed_s for t in tl))) and stats.ttft_s >= stats.prefill_s

@pytest.fixture(scope="module")
def decode16():
  """A decode node whose blocks are the chunked prefill's (16 tokens): chunks leave from the prefill's own pools as they are."""
  proc, info = start_decode_node(blocks=64, bs=16)
  yield info["address"]
  proc.stdin.close()
  proc.wait(30)

@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_chunked_prefill_sends_each_chunk_as_it_is_made_and_gives_the_unchunked_tokens(small, decode16, transport):
  # a 100-token prompt (its bucket 112) in chunks of 32: each layer leaves in 4 pieces (32, 32, 32, then the 4 real tokens
  # of the last chunk), each piece's blocks written from the prefill's pool once that chunk's layer is computed; the decode
  # node starts only once every piece of every layer has landed; greedy tokens equal the unchunked reference's
  model, _ = small
  prompt = [int(t) for t in np.random.default_rng(100).integers(0, SMALL["vocab_size"], 100)]
  want = model.reference_generate(prompt, 6, temperature=0.0)
  model.prefill_chunk = 32
  try:
    client = DecodeClient(local_node(), decode16, model, "small-random", transport)
    try: got, stats = client.generate(prompt, 6)
    finally: client.close()
  finally: model.prefill_chunk = 0
  assert got == want
  assert stats.kv_writes == 4 * model.cfg.n_layers and stats.kv_bytes == model.cfg.n_layers * 7 * 2 * 2 * 16 * 16 * 2   # 7 blocks a layer
  assert [t.layer for t in stats.timeline] == list(range(model.cfg.n_layers)) and all(0 < t.posted_s <= t.landed_s for t in stats.timeline)
  assert stats.transfer_s > 0 and stats.transfer_gbps == pytest.approx(stats.kv_bytes / stats.transfer_s / 1e9)   # over the pieces' writes

@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_short_prompts_layers_leave_from_the_prefills_packed_blocks_after_its_last_layer(small, decode16, transport, monkeypatch):
  """A prompt of one chunk prefilled on a CPU device, to a decode node of the prefill's block size (16) on this host: each
  layer's blocks leave as the qkv half packed them (one piece a layer, send() never called: nothing packed on the host),
  all posted after the last layer is computed (DEFER_SHORT: over shm and over tcp to this host); the tokens equal the
  single-device reference's."""
  import tinyhet.kv.sender as sender_mod
  sent = []
  real = sender_mod.KVSender.send
  monkeypatch.setattr(sender_mod.KVSender, "send", lambda self, *a, **kw: sent.append(a[0]) or real(self, *a, **kw))
  model, _ = small
  prompt = [int(t) for t in np.random.default_rng(40).integers(0, SMALL["vocab_size"], 40)]
  want = model.reference_generate(prompt, 5, temperature=0.0)
  client = DecodeClient(local_node(), decode16, model, "small-random", transport)
  try: got, stats = client.generate(prompt, 5)
  finally: client.close()
  assert got == want and sent == []
  tl = stats.timeline
  assert stats.kv_writes == model.cfg.n_layers and stats.kv_bytes == model.cfg.n_layers * 3 * 2 * 2 * 16 * 16 * 2   # 3 blocks a layer
  assert min(t.posted_s for t in tl) >= max(t.computed_s for t in tl)

def test_a_decode_node_of_another_notice_format_is_refused_in_one_line():
  from tinyhet.engine.checks import IncompatibleDecodeNode, check_compatible
  cfg = small_config(**SMALL)
  info = {"model": "m", "config": {k: getattr(cfg, k) for k in ("n_layers", "n_kv_heads", "head_dim", "vocab_size", "dim")}}
  check_compatible(cfg, "m", {**info, "kv_notice_format": 2}, "at x")
  for old in (info, {**info, "kv_notice_format": 1}):
    with pytest.raises(IncompatibleDecodeNode, match=r"^decode node at x speaks KV notice format 1, this node 2: run the same tinyhet version") as e:
      check_compatible(cfg, "m", old, "at x")
    assert "\n" not in str(e.value)

def test_one_client_serves_a_shorter_prompt_after_a_longer_one(small):
  """A client keeps its host region between requests (tinyhet.kv.sender.SendBuffers): a request smaller than the one that
  sized it packs into its first bytes. Both equal the single-device tokens."""
  model, address = small
  client = DecodeClient(local_node(), address, model, "small-random", "shm")
  try:
    for n in (40, 5, 23):
      prompt = [int(t) for t in np.random.default_rng(n).integers(0, SMALL["vocab_size"], n)]
      assert client.generate(prompt, 4)[0] == model.reference_generate(prompt, 4, temperature=0.0), f"{n}-token prompt"
  finally: client.close()

def generate_with_a_held_write(client, prompt, hold_s: float):
  """Generate once (compiling this prompt's kernels), then again while the first layer write waits hold_s seconds for its
  link (its shm lock taken, as a busy link would hold it): (first tokens, second tokens, second stats)."""
  want, _ = client.generate(prompt, 3)
  held = threading.Event()
  def hold():
    with client.peer.link.lock:
      held.set()
      time.sleep(hold_s)
  holder = threading.Thread(target=hold)
  holder.start()
  held.wait()
  got, st = client.generate(prompt, 3)
  holder.join()
  return want, got, st

def test_prefill_goes_on_while_a_layer_write_is_slow(small, monkeypatch):
  """A write that takes long (a real shm write, held back by its link's lock for HOLD seconds, as a big copy on a busy host
  would be) does not stop prefill: layer 1 is computed before layer 0 has landed, and TTFT shows the wait for the write.
  That holds for layers the writer thread posts, those over INLINE_LAYER_BYTES (here: all of them)."""
  import tinyhet.kv.sender as sender_mod
  monkeypatch.setattr(sender_mod, "INLINE_LAYER_BYTES", 0)
  model, address = small
  prompt = list(range(1, 30))
  client = DecodeClient(local_node(), address, model, "small-random", "shm")
  HOLD = 2.0
  try: want, got, st = generate_with_a_held_write(client, prompt, HOLD)
  finally: client.close()
  assert got == want
  tl = st.timeline
  assert tl[1].computed_s < tl[0].landed_s, f"layer 1 was computed only after layer 0 landed: {tl}"
  assert st.prefill_s < HOLD <= st.ttft_s + 0.05 and st.kv_tail_s > 0

@pytest.fixture(scope="module")
def unregistered(small):
  """The same model on tinygrad's own CPU device, whose memory no transport sends from (as a GPU's without GPUDirect):
  its layers leave through the staging buffers (tinyhet.device.gpu_staging)."""
  cfg = small_config(**SMALL)
  return Llama(cfg, random_weights(cfg, device="CPU", seed=7), "CPU")

@pytest.mark.parametrize("n_buffers", [0, 1, 2])
def test_layers_from_device_memory_equal_single_device(small, unregistered, n_buffers):
  """Through N staging buffers copied by the writer thread, or (0) copied on the prefill thread as before: the tokens and
  the last logits equal the single-device reference (so the decode node holds the same KV bytes)."""
  model, address = small
  prompt = [int(t) for t in np.random.default_rng(11).integers(0, SMALL["vocab_size"], 19)]
  want = model.reference_generate(prompt, 6, temperature=0.0)
  client = DecodeClient(local_node(), address, unregistered, "small-random", "shm", staging_buffers=n_buffers)
  try: got, stats = client.generate(prompt, 6, return_logits=True)
  finally: client.close()
  assert got == want
  ref = reference_last_logits(model, prompt + got[:-1])
  assert np.abs(np.array(stats.last_logits) - ref).max() / np.abs(ref).max() < 1e-3
  assert stats.staging_waits <= max(0, model.cfg.n_layers - n_buffers) and len(stats.timeline) == model.cfg.n_layers
  assert 0 < stats.handoff_s < stats.prefill_s

@pytest.mark.parametrize("n_buffers", [1, 2])
def test_staged_prefill_waits_only_when_every_buffer_is_in_flight(small, unregistered, n_buffers):
  """A write held back for HOLD seconds (its shm link's lock taken, as a busy link would): with 2 buffers for 2 layers
  prefill never waits and computes layer 1 before layer 0 lands; with 1 buffer it waits once, for that write."""
  model, address = small
  prompt = list(range(1, 30))
  client = DecodeClient(local_node(), address, unregistered, "small-random", "shm", staging_buffers=n_buffers)
  HOLD = 2.0
  try: want, got, st = generate_with_a_held_write(client, prompt, HOLD)
  finally: client.close()
  assert got == want
  if n_buffers == 2:
    assert st.staging_waits == 0 and st.timeline[1].computed_s < st.timeline[0].landed_s and st.prefill_s < HOLD
  else: assert st.staging_waits == 1 and st.prefill_s >= HOLD - 0.1

@pytest.mark.parametrize("n_buffers", [0, 2])
def test_service_prefill_node_sends_layers_from_device_memory(small, unregistered, n_buffers):
  """The service's prefill node (tinyhet.service.prefill_node), asked over its control port as the router asks it, with its model
  in memory no transport sends from: through N staging buffers (0: copied on the prefill thread), the decode node goes on
  with the tokens one device gives."""
  model, address = small
  prompt = [int(t) for t in np.random.default_rng(5).integers(0, SMALL["vocab_size"], 21)]
  want = model.reference_generate(prompt, 5, temperature=0.0)
  node = local_node()
  pn = PrefillNode(unregistered, node, "small-random", "shm", staging_buffers=n_buffers)
  decode, prefill = ControlClient(node.endpoint, address), ControlClient(node.endpoint, node.serve())
  reply: dict = {}
  try:
    r = decode.call("decode.reserve", prompt_ids=prompt, max_new_tokens=5)
    asking = threading.Thread(target=lambda: reply.update(prefill.call("prefill.run", prompt_ids=prompt, decode=address, reservation=r)))
    asking.start()
    pn.run_one(timeout=30)                     # this thread is the model's, as a node's main thread is
    asking.join(30)
    got = [reply["first_token"]] + [i["token"] for i in decode.stream("decode.generate", seq_id=r["seq_id"], first_token=reply["first_token"],
                                                                      temperature=0.0, top_p=1.0, seed=reply["seed"], stop_ids=[]) if "token" in i]
    assert len(pn.buffers.staging) == n_buffers         # the layers left through the staging buffers, or (0) without
  finally:
    decode.close(), prefill.close(), pn.close()
  assert got == want
  assert reply["kv_bytes"] == model.cfg.n_layers * len(r["blocks"]) * r["block_bytes"]
  assert reply["staging_waits"] <= max(0, model.cfg.n_layers - n_buffers) and pn.status()["queued_tokens"] == 0

def test_service_prefill_node_sends_a_chunked_prompt_chunk_by_chunk(small, decode16):
  """The service's prefill node with a prompt past the chunk length (70 tokens, chunks of 32): each layer leaves in 3 pieces
  from the chunked prefill's pools (kv_bytes: every block once); the decode node's tokens are the unchunked reference's."""
  model, _ = small
  prompt = [int(t) for t in np.random.default_rng(6).integers(0, SMALL["vocab_size"], 70)]
  want = model.reference_generate(prompt, 5, temperature=0.0)
  node = local_node()
  pn = PrefillNode(model, node, "small-random", "tcp")
  decode, prefill = ControlClient(node.endpoint, decode16), ControlClient(node.endpoint, node.serve())
  reply: dict = {}
  model.prefill_chunk = 32
  try:
    r = decode.call("decode.reserve", prompt_ids=prompt, max_new_tokens=5)
    asking = threading.Thread(target=lambda: reply.update(prefill.call("prefill.run", prompt_ids=prompt, decode=decode16, reservation=r)))
    asking.start()
    pn.run_one(timeout=30)
    asking.join(30)
    got = [reply["first_token"]] + [i["token"] for i in decode.stream("decode.generate", seq_id=r["seq_id"], first_token=reply["first_token"],
                                                                      temperature=0.0, top_p=1.0, seed=reply["seed"], stop_ids=[]) if "token" in i]
    info = decode.call("decode.info")
  finally:
    model.prefill_chunk = 0
    decode.close(), prefill.close(), pn.close()
  assert got == want
  assert reply["kv_bytes"] == model.cfg.n_layers * len(r["blocks"]) * r["block_bytes"] and len(r["blocks"]) == 5
  assert reply["kv_writes"] == 3 * model.cfg.n_layers and info["rejected_notices"] == 0     # its bucket 80: chunks 32, 32, 16

@given(hst.lists(hst.tuples(hst.floats(0, 5), hst.floats(0, 1), hst.floats(0, 3), hst.floats(0, 3)), min_size=1, max_size=12),
       hst.booleans())
@settings(max_examples=200, deadline=None)
def test_transfer_rate_is_over_moving_time(layers, with_receiver):
  """Each layer: posted at p, confirmed by the writer at p + c, noticed by the receiver at p + r. The rate divides by the
  union of [posted, landed], landed being the earlier of the two: a confirmation that waits for a busy process does not count."""
  t0, t_first = 0.0, 2.0
  posted = {l: 1 + p for l, (p, _, _, _) in enumerate(layers)}
  confirmed = {l: posted[l] + c for l, (_, c, _, _) in enumerate(layers)}
  receiver = {l: posted[l] + r for l, (_, _, r, _) in enumerate(layers)} if with_receiver else None
  computed = {l: posted[l] - x for l, (_, _, _, x) in enumerate(layers)}
  stats = GenerationStats()
  transfer_figures(stats, t0, t_first, computed, posted, confirmed, 1000, receiver)
  landed = {l: min(confirmed[l], receiver[l]) if receiver else confirmed[l] for l in posted}
  assert stats.transfer_s == pytest.approx(busy_time([(posted[l], landed[l]) for l in posted]))
  assert stats.transfer_s <= busy_time([(posted[l], confirmed[l]) for l in posted]) + 1e-12
  assert stats.ttft_s == max(t_first, max(landed.values())) and stats.kv_tail_s == max(0.0, max(landed.values()) - t_first)
  assert stats.transfer_gbps == (1000 / stats.transfer_s / 1e9 if stats.transfer_s > 0 else 0.0)
  assert stats.landed_clock == ("receiver" if receiver else "writer") and [t.landed_s for t in stats.timeline] == [landed[l] for l in sorted(landed)]

def test_single_device_engine_equals_reference(small):
  """`tinyhet run --no-disagg`'s engine (paged cache and jitted step on HET, no transfer) gives reference_generate's tokens,
  greedy and sampled, over several requests through one engine (one decode capture, blocks reused)."""
  model, _ = small
  engine = LocalEngine(model, 64, block_size=4)
  for n, new in ((5, 6), (23, 9), (40, 20)):
    prompt = [int(t) for t in np.random.default_rng(n).integers(0, SMALL["vocab_size"], n)]
    got, st = engine.generate(prompt, new)
    assert got == model.reference_generate(prompt, new) and st["decode_tokens"] == new - 1 and st["ttft_s"] > 0
  prompt = [3, 1, 4, 1, 5, 9, 2, 6]
  sampled = dict(temperature=0.9, top_p=0.95, seed=11)
  assert engine.generate(prompt, 12, **sampled)[0] == model.reference_generate(prompt, 12, **sampled)
  stop = model.reference_generate(prompt, 4)[1]
  assert engine.generate(prompt, 10, stop_ids=(stop,))[0] == model.reference_generate(prompt, 4)[:2]
  assert engine.cache.block_manager.num_free == engine.cache.block_manager.num_blocks - 1   # all but DecodeEngine's padding block
  with pytest.raises(ValueError, match="does not fit this engine's KV pool"): engine.generate([1] * 60, 10)
  with pytest.raises(ValueError, match="exceeds the model's context"): engine.generate([1] * 100, 100)
  with pytest.raises(ValueError, match="at least one token"): engine.generate([], 3)

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
  from tinyhet.engine.checks import IncompatibleDecodeNode
  with pytest.raises(IncompatibleDecodeNode, match="same --model"): DecodeClient(local_node(), address, other, "other", "tcp")

def test_a_client_naming_another_kv_dtype_is_refused(small):
  """DecodeClient(kv_dtype=...) (bench e2e --kv-dtypes names each node's) against a float16 decode node: one line naming both."""
  model, address = small
  from tinyhet.engine.checks import IncompatibleDecodeNode
  with pytest.raises(IncompatibleDecodeNode, match="keeps its KV in float16, this node in q8_0"):
    DecodeClient(local_node(), address, model, "small-random", "tcp", kv_dtype="q8_0")
  DecodeClient(local_node(), address, model, "small-random", "tcp", kv_dtype="float16").close()

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
  """A reservation larger than what is free waits (admission), and a prompt larger than the pool is refused (admission by
  need: max_new_tokens past the pool is no reason to refuse)."""
  proc, info = start_decode_node(blocks=8, bs=4)          # 32 token slots
  from tinyhet.runtime.control import ControlClient, ControlError
  local_node().endpoint.token = TOKEN
  a, b = ControlClient(local_node().endpoint, info["address"]), ControlClient(local_node().endpoint, info["address"])
  try:
    with pytest.raises(ControlError, match="prompt of 33 tokens needs 9 KV blocks.*pool has 8 blocks"):
      a.call("decode.reserve", prompt_ids=[1] * 33, max_new_tokens=5)
    first = a.call("decode.reserve", prompt_ids=[1] * 20, max_new_tokens=4)
    with pytest.raises(ControlError, match="stayed full"): b.call("decode.reserve", prompt_ids=[2] * 20, max_new_tokens=4, timeout=0.5)
    a.close()                                             # the holder goes away: its blocks come back
    assert b.call("decode.reserve", prompt_ids=[2] * 20, max_new_tokens=4, timeout=10)["seq_id"] != first["seq_id"]
  finally:
    b.close()
    proc.stdin.close()
    proc.wait(30)

def test_bench_e2e_reports_the_overhead_of_disaggregation(small):
  """bench e2e's figures for one prompt length, on the small model: per transport the overhead is TTFT with transfer minus
  TTFT of the same prefill with no transfer (best of the rounds of each), with a consistent per-layer timeline."""
  from tinyhet.bench.e2e import measure_length
  model, address = small
  clients = {t: DecodeClient(local_node(), address, model, "small-random", t) for t in ("shm", "tcp")}
  try: rows, decode = measure_length(model, clients, LocalEngine(model, 64, block_size=4), list(range(1, 21)), 6, 2)
  finally:
    for c in clients.values(): c.close()
  assert [r["transport"] for r in rows] == ["shm", "tcp"]
  for r in rows:
    assert r.keys() >= {"prompt_tokens", "ttft_s", "ttft_no_transfer_s", "overhead_s", "kv_bytes", "transport", "timeline"}
    assert r["prompt_tokens"] == 20 and r["kv_bytes"] > 0 and r["ttft_s"] > 0 and r["ttft_no_transfer_s"] > 0
    assert r["overhead_s"] == pytest.approx(r["ttft_s"] - r["ttft_no_transfer_s"], abs=1e-9)
    assert r["ttft_s"] == min(r["rounds"]["ttft_s"]) and r["ttft_no_transfer_s"] == min(r["rounds"]["ttft_no_transfer_s"])
    assert len(r["rounds"]["ttft_s"]) == 2 and len(r["timeline"]) == model.cfg.n_layers
    assert all(x["computed_s"] <= x["posted_s"] <= x["landed_s"] <= r["ttft_s"] + 1e-6 for x in r["timeline"])
    # where the overhead goes: the prefill thread's hand-off inside its prefill, one write a layer (20 tokens: not chunked)
    assert 0 < r["handoff_ms"] < 1e3 * r["prefill_s"] <= 1e3 * r["ttft_s"] + 1e-3 and r["kv_writes"] == model.cfg.n_layers
  assert decode["prompt_tokens"] == 20 and decode["decode_tok_s"]["disagg"] > 0 and decode["decode_tok_s"]["single_device"] > 0

# ---------------------------------------------------------------- the embedded model through the CLI

SMOLLM2_PROMPT = "What is the capital of France? Answer in one short sentence."

def tinyhet_cli(*args, timeout=900):
  out = subprocess.run([sys.executable, "-m", "tinyhet", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
  assert out.returncode == 0, out.stderr[-3000:]
  return json.loads(out.stdout)

@pytest.mark.slow
def test_smollm2_run_disaggregated_and_single_device():
  disagg = tinyhet_cli("run", SMOLLM2_PROMPT, "--max-tokens", "12", "--json", "--quiet", "--overhead")
  alone = tinyhet_cli("run", SMOLLM2_PROMPT, "--max-tokens", "12", "--json", "--quiet", "--no-disagg")
  assert disagg["generated_ids"] == alone["generated_ids"]
  assert "Paris" in disagg["text"], disagg["text"]
  assert disagg["transport"] == "shm" and disagg["kv_bytes"] > 0 and disagg["transfer_s"] > 0
  assert set(disagg) >= {"prompt_ids", "generated_ids", "text", "ttft_s", "kv_bytes", "transfer_gbps", "kv_tail_s", "decode_tok_s", "transport"}
  assert alone["transport"] == "none" and alone["decode_tok_s"] > 0
  assert disagg["overhead_s"] == pytest.approx(disagg["ttft_s"] - disagg["ttft_no_transfer_s"]) and disagg["ttft_no_transfer_s"] > 0
  assert len(disagg["timeline"]) == 30 and disagg["transfer_gbps"] == pytest.approx(disagg["kv_bytes"] / disagg["transfer_s"] / 1e9)

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
