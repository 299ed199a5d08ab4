"""Warm-up and stall-free steps on a decode node (tinyhet.engine.warm_up, Scheduler.schedule_step): after the warm-up no
request builds a capture, whatever its length or batch; while it warms up a request runs at a ready bucket; a prompt spread
over steps gives the tokens of an unchunked prefill while the sequences already decoding get a token every step."""
import json, os, queue, subprocess, sys, threading
from types import SimpleNamespace
import numpy as np
import pytest
import tinyhet  # noqa: F401
from tinyhet.device.memory import local_node
from tinyhet.engine.decode_node import DecodeNode
from tinyhet.engine.scheduler import Sequence
from tinyhet.engine.warm_up import WarmUp
from tinyhet.model.layer_jit import Replay
from tinyhet.model.llama import Llama, random_weights, small_config
from tinyhet.model.sampling import Sampler

def test_a_request_runs_at_a_ready_bucket_while_the_warm_up_goes_on():
  built = []
  warm = WarmUp(SimpleNamespace(), [(k, n, lambda k=k, n=n: built.append((k, n))) for k, n in (("prefill", 64), ("prefill", 16), ("decode", 4))])
  assert warm.pick("prefill", 16) == 16 and warm.cold == 1          # nothing ready holds it: its own, built on its path
  assert warm.step() and built == [("prefill", 64)]
  assert warm.pick("prefill", 16) == 64 and warm.pick("prefill", 64) == 64 and warm.pick("prefill", 96) == 96 and warm.cold == 2
  while warm.step(): pass
  assert warm.done and warm.pick("prefill", 16) == 16 and warm.pick("decode", 8) == 8 and warm.cold == 2   # over: every request its own
  assert warm.status() == {"done": True, "built": 3, "of": 3, "captures": 0, "seconds": warm.status()["seconds"], "cold": 2}

@pytest.fixture(scope="module")
def warm_node():
  """A decode node of a tiny model (context 96, chunks of 32, steps of 16 prompt tokens, batches of 2) with every capture built: ~15 s
  of the suite on 2 cores, the cost the warm-up is there to take off the requests."""
  cfg = small_config(max_context=96)
  model = Llama(cfg, random_weights(cfg, device="MESH", seed=7), "MESH")
  model.prefill_chunk = 32
  decode = DecodeNode(model, local_node(), kv_blocks=64, block_size=4, max_num_seqs=2, model_id="warm", prefill_budget=16)
  decode.warm = WarmUp.for_decode_node(decode)
  while decode.warm.step(): pass
  yield decode
  decode.close()

def serve(decode, prompts, new: int, steps: list | None = None, staggered: bool = False, options: dict | None = None) -> list[list[int]]:
  """Submit the prompts, run the batching loop on this thread (tinygrad's) until every sequence ends; steps, if given, gets
  each step's (decoding sequences' ids, chunks' (id, first, end)). staggered: each prompt once the one before has its first token."""
  seqs = []
  for i, p in enumerate(prompts):
    seq = Sequence(decode.new_seq_id(), list(p), new)
    seq.extra.update(queue=queue.SimpleQueue(), sampler=Sampler(0.0, 1.0, 0, **(options or {})), stop_ids=set())
    seqs.append(seq)
  if steps is not None:
    schedule = decode.scheduler.schedule_step
    def recorded(budget):
      decoding, chunks = schedule(budget)
      if decoding or chunks: steps.append(([s.seq_id for s in decoding], [(s.seq_id, a, b) for s, a, b in chunks]))
      return decoding, chunks
    decode.scheduler.schedule_step = recorded
  got: list[list[int]] = [[] for _ in seqs]
  stop = threading.Event()
  def add(s):
    with decode.cond:
      decode.scheduler.add(s)
      decode.cond.notify_all()
  def collect():
    for i, s in enumerate(seqs):
      while (tok := s.extra["queue"].get(timeout=600)) is not None:
        got[i].append(tok)
        if staggered and len(got[i]) == 1 and i + 1 < len(seqs): add(seqs[i + 1])
    stop.set()
  t = threading.Thread(target=collect, daemon=True)
  t.start()
  for s in seqs[:1] if staggered else seqs: add(s)
  try: decode.run(stop, warm_up=False)
  finally:
    if steps is not None: del decode.scheduler.schedule_step
  t.join(5)
  return got

def test_after_the_warm_up_no_request_builds_a_capture(warm_node):
  decode, rng = warm_node, np.random.default_rng(1)
  assert decode.warm.done and decode.warm.captures > 0 and decode.warm.cold == 0
  before = Replay.captures
  for lengths in ((5,), (17, 40), (31, 64), (90, 3)):     # every length bucket, batches of 1 and 2
    prompts = [[int(t) for t in rng.integers(0, 256, n)] for n in lengths]
    assert [len(t) for t in serve(decode, prompts, 3)] == [3] * len(prompts)
  assert Replay.captures == before, f"{Replay.captures - before} captures built on the request's thread after the warm-up"

def test_a_prompt_spread_over_steps_gives_the_unchunked_tokens_and_decode_goes_on(warm_node):
  decode, rng = warm_node, np.random.default_rng(2)
  short, long = [int(t) for t in rng.integers(0, 256, 6)], [int(t) for t in rng.integers(0, 256, 80)]
  steps: list = []
  got = serve(decode, [short, long], 12, steps, staggered=True)     # the long prompt comes while the short one decodes
  long_id = next(c[0] for _, chunks in steps for c in chunks if c[2] == 80)
  spread = [(d, c) for d, c in steps if any(x[0] == long_id for x in c)]
  assert len(spread) >= 5 and all(sum(b - a for _, a, b in c) <= 16 for _, c in steps)     # 80 tokens in chunks of at most 16
  assert all(d for d, _ in spread[1:]), "a step of the long prompt's chunks left the decoding sequence out"
  decode.prefill_budget = 4096             # the same prompts unchunked (each prefilled whole): the same tokens
  try: assert serve(decode, [short, long], 12) == got
  finally: decode.prefill_budget = 16
  assert got[1] == decode.model.reference_generate(long, 12)      # and the dense single-device reference's

def test_a_prompt_spread_over_steps_gives_its_prompt_logprobs_from_every_chunk(warm_node):
  from tinyhet.engine.prompt_logprobs import prompt_logprobs
  decode, rng = warm_node, np.random.default_rng(3)
  short, long = [int(t) for t in rng.integers(0, 256, 6)], [int(t) for t in rng.integers(0, 256, 70)]
  got = serve(decode, [short, long], 4, staggered=True, options={"prompt_logprobs": 2})   # 70 tokens in 5 chunks beside a decode
  (kind, entries), want = got[1][0], prompt_logprobs(decode.model, long, 2, decode.cache.kv_dtype)
  assert kind == "prompt" and len(entries) == len(want) == 70 and entries[0] is None and want[0] is None
  for e, w in zip(entries[1:], want[1:]):
    assert abs(e["logprob"] - w["logprob"]) < 1e-3 and [t for t, _ in e["top_logprobs"]] == [t for t, _ in w["top_logprobs"]]

COMPILES = """
import tinyhet
from tinygrad.device import Compiler
from tinygrad.helpers import diskcache_get
from tinyhet.model.llama import Llama, random_weights, small_config
from tinyhet.engine.prefill import prefill_logits
misses, compile_cached = [0], Compiler.compile_cached
def counted(self, src):                 # a kernel the disk cache does not hold is compiled now
  if self.cachekey is None or diskcache_get(self.cachekey, src) is None: misses[0] += 1
  return compile_cached(self, src)
Compiler.compile_cached = counted
cfg = small_config(max_context=64)
prefill_logits(Llama(cfg, random_weights(cfg, device="MESH", seed=7), "MESH"), list(range(20)))
print(misses[0])
"""

@pytest.mark.slow
def test_a_restarted_process_compiles_no_kernel(tmp_path):
  # tinygrad's kernels persist in its disk cache (CACHEDB): a second process running the same prefill finds every one
  env = {**os.environ, "CACHEDB": str(tmp_path / "cache.db")}
  runs = [int(subprocess.run([sys.executable, "-c", COMPILES], env=env, capture_output=True, text=True, timeout=600, check=True).stdout.split()[-1])
          for _ in range(2)]
  assert runs[0] > 0 and runs[1] == 0, f"kernels compiled by the first process and the second: {runs}"

def test_tinyhet_node_warms_up_before_it_says_ready_and_says_how_long_it_took():
  # a real node process, TINYHET_WARM_UP=before: its ready line carries the warm-up (every bucket built, none by a request)
  # and its stderr the one line that reports it
  env = {**{k: v for k, v in os.environ.items() if not k.startswith("TINYHET_")}, "TINYHET_WARM_UP": "before", "TINYHET_PREFILL_CHUNK": "32"}
  p = subprocess.Popen([sys.executable, "-m", "tinyhet", "node", "--role", "decode", "--listen", "127.0.0.1:0", "--model", "random:max_context=64",
                        "--max-seqs", "1", "--kv-memory", "1M", "--stdin-stop"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True, env=env)
  try:
    ready = json.loads(p.stdout.readline())
    status = ready["warm_up_status"]
    assert ready["warm_up"] == "before" and status["done"] and status["built"] == status["of"] > 0 and status["captures"] > 0 and status["cold"] == 0
  finally:
    p.stdin.close()
    err = p.stderr.read()
    p.wait(60)
  assert f"tinyhet node: warm-up took {status['seconds']:.1f} s: {status['captures']} captures for {status['of']} buckets" in err, err
