"""A disk hit read back while a prefill node pulls and prefills (tinyhet.kv.disk_restore): a decode node process with a
disk tier, a PrefillNode in this process. decode.reserve answers at once with the disk chain counted as cached and
`restoring`; the prefill node pulls each layer once decode.restored says it is in; the tokens equal the model's own. A record
torn on disk fails that attempt before a token is decoded from it, and the next attempt's chain ends before it. On a plain
pool (no process): the read-back fills the blocks layer by layer with the bytes spilled, and a cancel stops every write."""
import os, threading
import numpy as np
import pytest
from tinyhet.device.memory import local_node
from tinyhet.kv.block_manager import block_hashes
from tinyhet.kv.disk_store import HEADER_BYTES, INDEX, INDEX_MAGIC
from tinyhet.model.llama import Llama, random_weights, small_config
from tinyhet.runtime.control import ControlClient, ControlError
from tinyhet.service.prefill_node import PrefillNode
from test_disk_tier_node import PROMPTS, Node
from test_e2e import SMALL, TOKEN

@pytest.fixture(scope="module")
def model():
  cfg = small_config(**SMALL)
  return Llama(cfg, random_weights(cfg, device="HET", seed=7), "HET")

def disaggregated(decode: Node, pn: PrefillNode, ctl: ControlClient, prefill: ControlClient, prompt, new: int = 5):
  """reserve (use_cache), prefill.run on pn (this thread runs its model), generate: (reservation, prefill reply, tokens)."""
  r = ctl.call("decode.reserve", prompt_ids=prompt, max_new_tokens=new, timeout=10, use_cache=True)
  reply: dict = {}
  asking = threading.Thread(target=lambda: reply.update(prefill.call("prefill.run", prompt_ids=prompt, decode=decode.address, reservation=r)))
  asking.start()
  pn.run_one(timeout=30)
  asking.join(30)
  stream = ctl.stream("decode.generate", seq_id=r["seq_id"], first_token=reply["first_token"], temperature=0.0, top_p=1.0,
                      seed=reply["seed"], stop_ids=[])
  return r, reply, [reply["first_token"]] + [i["token"] for i in stream if "token" in i]

def index_entries(folder: str) -> dict[int, tuple[str, int, int]]:
  """hash -> (segment path, offset, length) from a tier's index log, read as the node wrote it."""
  (d,) = [p for p in os.scandir(folder) if p.is_dir()]
  raw, out = open(os.path.join(d.path, "index.log"), "rb").read(), {}
  for pos in range(len(INDEX_MAGIC) + 16, len(raw) - INDEX.size + 1, INDEX.size):
    h, seg, off, length, _, _ = INDEX.unpack_from(raw, pos)
    out[h] = (os.path.join(d.path, f"seg-{seg:08d}.kv"), off, length)
  return out

def test_a_disk_hit_is_pulled_layer_by_layer_and_a_torn_one_is_never_decoded(tmp_path, model):
  decode = Node(str(tmp_path))                  # 24 blocks of 4 tokens: the first prompts are evicted to disk
  node = local_node()
  node.endpoint.token = TOKEN
  pn = PrefillNode(model, node, "small-random", "shm")
  ctl, prefill = ControlClient(node.endpoint, decode.address), ControlClient(node.endpoint, node.serve())
  try:
    for p in PROMPTS: decode.greedy(p)          # cached by the node's own prefill, then evicted and spilled
    decode.wait_info(lambda i: i["disk_blocks"] >= 10)
    for k, p in enumerate(PROMPTS[:2]):
      r, reply, got = disaggregated(decode, pn, ctl, prefill, [*p, 9, 9])
      assert r.get("restoring") is True and r["cached_tokens"] == 20, r       # 5 blocks of 4 on disk, counted at once
      assert reply["pulled_tokens"] == 20                                     # pulled through the gate, not computed again
      assert got == model.reference_generate([*p, 9, 9], 5, temperature=0.0), f"prompt {k}: the disk hit changed the tokens"
    info = decode.info()
    assert info["disk_hit_tokens"] == 40 and info["disk_read_bytes"] > 0, info
    # a torn record: layer 1 of PROMPTS[2]'s third block overwritten on disk (its header intact: found only by the checksum)
    hashes = block_hashes(PROMPTS[2], 4, info["cache_key"], 5)
    path, off, length = index_entries(str(tmp_path))[hashes[2]]
    with open(path, "r+b") as f:
      f.seek(off + HEADER_BYTES + length // 2)
      f.write(b"\xa5" * 64)
    with pytest.raises(ControlError, match="checksum"): disaggregated(decode, pn, ctl, prefill, PROMPTS[2] + [9, 9])
    r, _, got = disaggregated(decode, pn, ctl, prefill, PROMPTS[2] + [9, 9])     # the router's next attempt
    assert r["cached_tokens"] == 8 and got == model.reference_generate(PROMPTS[2] + [9, 9], 5, temperature=0.0)
    assert decode.info()["disk_bad_blocks"] >= 1
  finally:
    ctl.close(), prefill.close(), pn.close()
    decode.close()

def test_the_read_back_fills_layer_by_layer_and_a_cancel_stops_it(tmp_path):
  from tinyhet.kv.disk_tier import DiskTier
  from tinyhet.kv.disk_restore import RestoreFailed, RestoreJob
  from tinyhet.kv.paged_cache import PagedKVCache
  import tinyhet  # noqa: F401  (MESH)
  cache = PagedKVCache(3, 1, 4, num_blocks=6, block_size=4, prefix_cache=True, model_id="model-a/float16", max_seq_len=64, device="MESH")
  tier, bm, rng = DiskTier(cache, tmp_path, 1 << 20), cache.block_manager, np.random.default_rng(1)
  a = list(range(1, 14))                        # 13 tokens: 3 full blocks
  bm.allocate(1, len(a), a)
  want = {}
  for i, b in enumerate(bm.block_table(1)):
    for layer in range(3): cache.write_block_bytes(layer, b, want.setdefault((layer, i), rng.bytes(cache.block_nbytes)))
  bm.deallocate(1, a)
  bm.allocate(2, 24, list(range(100, 124)))     # every block: a's three evicted and spilled
  bm.deallocate(2)
  tier.store.flush()
  with tier.planned() as plan: bm.allocate(3, len(a), a)
  assert len(plan) == 3 and bm.cached_length(3) == 12 and bm.num_cached == 0     # taken unfilled, no hash yet
  seen = []
  job = RestoreJob(cache, tier.store, plan)
  worker = threading.Thread(target=job.run)
  worker.start()
  for layer in range(3):
    assert job.wait_layer(layer, 10) > layer
    seen.append([cache.read_block_bytes(layer, b) for b, _, _ in plan])
  worker.join(10)
  assert seen == [[want[(layer, i)] for i in range(3)] for layer in range(3)] and job.failed is None
  tier.committed(3, job)
  assert bm.num_cached == 3 and tier.status()["disk_hit_tokens"] == 12
  bm.check()
  bm.deallocate(3)
  job = RestoreJob(cache, tier.store, plan)     # a sequence that leaves before its read-back ran: nothing is written
  job.cancel()
  job.run()
  with pytest.raises(RestoreFailed): job.wait_layer(0, 1)
  assert job.finished.is_set() and job.layers == 0
  tier.close()

def test_a_restoring_grant_cannot_be_stripped():
  """The grant signs `restoring`: a reservation passed on without it (its prefix pulled before it is read back) is refused."""
  from tinyhet.kv.grants import grant_text
  r = {"seq_id": 1, "pools": [], "blocks": [3], "prefix_blocks": [1, 2], "cached_tokens": 8, "restoring": True}
  assert grant_text("d", "w", r, [1, 2]) != grant_text("d", "w", {k: v for k, v in r.items() if k != "restoring"}, [1, 2])
