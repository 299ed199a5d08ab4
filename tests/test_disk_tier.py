"""The KV disk tier's store (tinyhet.kv.disk_store) and its hooks in the block manager (tinyhet.kv.disk_tier): every read
returns nothing or exactly the bytes written, across restarts, a torn or foreign record, a full disk and a kill -9."""
import hashlib, os, pathlib, signal, subprocess, sys, textwrap
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from tinyhet.kv.disk_store import ALIGN, DiskStore

ROOT = pathlib.Path(__file__).resolve().parent.parent

def payload(h: int, n: int = 3000) -> bytes:
  """The bytes a test puts under hash h: its own, so any mix-up shows."""
  return (hashlib.blake2b(h.to_bytes(8, "little")).digest() * (n // 64 + 1))[:n]

def store(root, size=1 << 20, key="model-a/float16", **kw) -> DiskStore:
  return DiskStore(root, size, key, log=kw.pop("log", lambda m: None), **kw)

@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.sampled_from(["put", "put", "put", "get", "restart", "flush"]), st.integers(0, 40)), max_size=60),
       size=st.sampled_from([ALIGN * 8, ALIGN * 40, 1 << 20]))
def test_index_returns_nothing_or_exactly_the_bytes_put(tmp_path_factory, ops, size):
  root = tmp_path_factory.mktemp("disk")
  s, put = store(root, size), set()
  try:
    for op, h in ops:
      if op == "put":
        if s.put(h, payload(h)): put.add(h)
      elif op == "flush": s.flush()
      elif op == "restart":
        s.close()
        s = store(root, size)
        assert s.found_blocks == len(s.index) and set(s.index) <= put      # only what was put; the size bound may drop some
      got = s.get(h)
      assert got is None or got == payload(h), f"hash {h}: other bytes than were put"
    s.flush()
    assert s.disk_bytes() <= max(size, s.segment_bytes)
    for h in put: assert s.get(h) in (None, payload(h))
  finally: s.close()

def test_flushed_blocks_survive_a_restart(tmp_path):
  s = store(tmp_path)
  for h in range(10): assert s.put(h, payload(h))
  s.flush()
  assert s.status()["disk_written_bytes"] == 10 * 3000
  s.close()
  s = store(tmp_path)
  assert s.found_blocks == 10 and all(s.get(h) == payload(h) for h in range(10))
  assert s.status()["disk_read_bytes"] == 10 * 3000
  s.close()

def test_a_torn_block_is_dropped_and_the_rest_hit(tmp_path):
  s = store(tmp_path)
  for h in range(6): s.put(h, payload(h))
  s.flush()
  e = s.index[3]
  s.close()
  seg = s.dir / f"seg-{e.segment:08d}.kv"
  with open(seg, "r+b") as f:                    # a torn write: the second half of block 3's bytes never made it
    f.seek(e.offset + 64 + e.length // 2)
    f.write(b"\0" * (e.length // 2))
  with open(s.dir / "index.log", "ab") as f: f.write(b"\x01" * 20)   # and a torn tail of the index log
  s = store(tmp_path)
  assert s.found_blocks == 6 and s.torn_index == 20
  assert s.get(3) is None and 3 not in s.index and s.status()["disk_bad_blocks"] == 1
  assert all(s.get(h) == payload(h) for h in (0, 1, 2, 4, 5))
  s.close()

def test_another_models_files_are_ignored(tmp_path):
  a = store(tmp_path, key="model-a/float16")
  for h in range(4): a.put(h, payload(h))
  a.flush()
  a.close()
  b = store(tmp_path, key="model-a/q8_0")       # the same model, another KV dtype: another folder, nothing found
  assert b.found_blocks == 0 and b.get(1) is None and b.dir != a.dir
  b.close()
  for p in a.dir.iterdir(): (b.dir / p.name).write_bytes(p.read_bytes())   # a's files copied into b's folder
  b = store(tmp_path, key="model-a/q8_0")
  assert b.found_blocks == 0 and all(b.get(h) is None for h in range(4))    # a foreign index: set aside, never read
  assert (b.dir / "index.log.ignored").exists()
  b.close()

def test_oldest_segments_go_past_the_size_bound(tmp_path):
  size = ALIGN * 16                              # segments of 4 pages: one block each
  s = store(tmp_path, size)
  for h in range(20):
    s.put(h, payload(h))
    s.flush()
  assert s.disk_bytes() <= size and 19 in s.index and 0 not in s.index
  assert all(s.get(h) == payload(h) for h in s.hashes())
  s.close()

def test_a_full_queue_drops_the_spill_without_blocking(tmp_path):
  s = store(tmp_path, queue_blocks=1)
  results = [s.put(h, payload(h, 1 << 20)) for h in range(50)]
  assert not all(results) and s.status()["disk_dropped_spills"] > 0
  s.flush()
  assert all(s.get(h) == payload(h, 1 << 20) for h in s.hashes())
  s.close()

CHILD = textwrap.dedent("""
  import hashlib, resource, sys
  sys.path.insert(0, {root!r})
  from tinyhet.kv.disk_store import DiskStore
  def payload(h, n=3000): return (hashlib.blake2b(h.to_bytes(8, "little")).digest() * (n // 64 + 1))[:n]
  if {fsize}: resource.setrlimit(resource.RLIMIT_FSIZE, ({fsize}, {fsize}))
  s = DiskStore({dir!r}, 1 << 30, "model-a/float16")
  for h in range({n}):
    s.put(h, payload(h))
    if h % 8 == 7:
      s.flush()
      print("flushed", h + 1, s.status()["disk_writing"], flush=True)
  s.flush()
  print("gets", sum(s.get(h) == payload(h) for h in range({n})), s.status()["disk_writing"], flush=True)
""")

def child(tmp_path, n, fsize=0):
  code = CHILD.format(root=str(ROOT), dir=str(tmp_path), n=n, fsize=fsize)
  return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

def test_a_full_disk_stops_the_writing_and_reads_go_on(tmp_path):
  p = child(tmp_path, 64, fsize=ALIGN * 8)      # a file-size limit: EFBIG past 8 pages of a segment (Python ignores SIGXFSZ)
  out, err = p.communicate(timeout=60)
  assert p.returncode == 0, err
  last = out.splitlines()[-1].split()
  assert last[0] == "gets" and last[2] == "False" and 0 < int(last[1]) < 64, out
  assert err.count("is full") == 1, err          # logged once
  s = store(tmp_path)
  assert s.found_blocks == int(last[1]) and all(s.get(h) == payload(h) for h in s.hashes())
  s.close()

def test_kill_9_mid_write_keeps_what_was_written(tmp_path):
  p = child(tmp_path, 100000)
  seen = 0
  for line in p.stdout:                          # wait until a few batches are on disk, then kill it while it writes on
    seen = int(line.split()[1])
    if seen >= 64: break
  os.kill(p.pid, signal.SIGKILL)
  p.wait(timeout=30)
  s = store(tmp_path)
  assert s.found_blocks >= seen                  # every flushed block is found
  assert all(s.get(h) == payload(h) for h in s.hashes())
  s.close()

@pytest.mark.parametrize("device_usage", [1, 0])
def test_evicted_blocks_come_back_into_fresh_blocks(tmp_path, device_usage):
  """On a real pool: a block evicted from RAM is spilled, staged and restored with the same bytes, and counts as cached.
  device_usage 0: while another thread compiles a kernel (tinygrad switches its process-wide ALLOW_DEVICE_USAGE off then),
  as in a `tinyhet node` whose warm-up captures while requests are admitted: the spill and the restore must not sync."""
  import numpy as np
  from tinygrad.helpers import Context
  from tinyhet.kv.disk_tier import DiskTier
  from tinyhet.kv.paged_cache import PagedKVCache
  import tinyhet  # noqa: F401  (MESH: a node's pool, whose sync goes through tinygrad's runtime device)
  cache = PagedKVCache(2, 1, 4, num_blocks=4, block_size=4, prefix_cache=True, model_id="model-a/float16", max_seq_len=64, device="MESH")
  tier = DiskTier(cache, tmp_path, 1 << 20)
  bm, rng = cache.block_manager, np.random.default_rng(0)
  a = list(range(1, 10))                         # 9 tokens: 2 full blocks cached
  bm.allocate(1, len(a), a)
  blocks = {}
  for b in bm.block_table(1):
    for layer in range(2): cache.write_block_bytes(layer, b, blocks.setdefault((layer, b), rng.bytes(cache.block_nbytes)))
  want = [[blocks[(layer, b)] for layer in range(2)] for b in bm.block_table(1)[:2]]
  bm.deallocate(1, a)
  with Context(ALLOW_DEVICE_USAGE=device_usage):
    bm.allocate(2, 16, list(range(100, 116)))    # another prompt takes every block: a's two are evicted and spilled
  tier.store.flush()
  assert tier.store.status()["disk_blocks"] == 2 and bm.num_cached == 0
  bm.deallocate(2)
  assert tier.chain(a) == 2 and tier.stage(a) == 2
  with Context(ALLOW_DEVICE_USAGE=device_usage): bm.allocate(3, len(a), a)
  assert bm.cached_length(3) == 8 and tier.status()["disk_hit_tokens"] == 8
  got = [[cache.read_block_bytes(layer, b) for layer in range(2)] for b in bm.block_table(3)[:2]]
  assert got == want
  bm.check()
  tier.close()

def test_a_whole_prompts_eviction_reaches_the_disk(tmp_path):
  """One allocation evicts a whole conversation's blocks at once (SmolLM2-sized records, 360 KiB each: ~90 of them in a
  few ms, far faster than the writer syncs them). Every one of them reaches the disk: the writer's queue used to hold 64
  blocks, the rest were skipped (uncounted), and a later turn's hit ended at the first of them."""
  from tinyhet.kv.disk_tier import DiskTier
  from tinyhet.kv.paged_cache import PagedKVCache
  import tinyhet  # noqa: F401  (MESH)
  cache = PagedKVCache(30, 3, 64, num_blocks=105, block_size=16, prefix_cache=True, model_id="model-a/float16", max_seq_len=4096, device="MESH")
  tier, bm = DiskTier(cache, tmp_path, 1 << 30), cache.block_manager
  try:
    a, b = list(range(1, 1600)), list(range(5000, 6600))       # 99 full blocks of a cached, then b takes nearly every block
    bm.allocate(1, len(a), a)
    bm.deallocate(1, a)
    cached = bm.num_cached
    bm.allocate(2, len(b), b)
    evicted = cached - bm.num_cached
    tier.store.flush()
    s = tier.store.status()
    assert evicted > 64 and s["disk_blocks"] == evicted and s["disk_dropped_spills"] == 0
    ram = len(bm.match(a))                                     # the rest of a's chain is on disk, none of it missing
    assert ram + tier.chain(a, "", ram) == cached == 99
  finally: tier.close()

def test_a_bad_size_is_refused(tmp_path):
  with pytest.raises(ValueError, match="at least"): DiskStore(tmp_path, 10, "k")

def test_on_tmpfs():
  if not os.path.isdir("/dev/shm"): pytest.skip("no /dev/shm (tmpfs) here")
  import tempfile
  with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
    s = store(d)
    s.put(7, payload(7))
    s.flush()
    assert s.get(7) == payload(7)    # O_DIRECT where this kernel's tmpfs takes it (6.6+), buffered where it refuses it
    s.close()

def _failing_bm(spill_fails: bool, restore_fails: bool):
  from tinyhet.kv.block_manager import BlockManager
  bm, logged = BlockManager(4, 4, prefix_cache=True, model_id="m"), []
  bm.log = logged.append
  def evicted(b, h):
    if spill_fails: raise OSError(28, "No space left on device")
  def restore(h):
    def fill(b):
      if restore_fails: raise RuntimeError("a copy into the pool failed")
    return fill
  bm.evicted, bm.restore = evicted, restore
  return bm, logged

def test_a_spill_that_raises_costs_no_block():
  """BlockManager._take: the eviction hook raising (a disk tier's copy failing) drops that spill only; the block is the
  allocation's, every other block stays accounted, and the next allocation still finds the whole pool."""
  bm, logged = _failing_bm(spill_fails=True, restore_fails=False)
  bm.restore = None
  a = list(range(1, 17))
  bm.allocate(1, 16, a)
  bm.deallocate(1, a)                             # 4 cached free blocks
  assert bm.allocate(2, 16, list(range(100, 116))) and bm.num_free == 0   # evicts all 4: every spill raises
  bm.check()
  bm.deallocate(2)
  assert bm.num_free == 4 and bm.tier_errors == 4 and len(logged) == 1
  bm.allocate(3, 16, list(range(200, 216)))
  bm.check()

@settings(max_examples=40, deadline=None)
@given(ops=st.lists(st.tuples(st.integers(0, 5), st.integers(1, 16)), max_size=30), spill_fails=st.booleans(), restore_fails=st.booleans())
def test_failing_tier_hooks_never_leak_a_block(ops, spill_fails, restore_fails):
  """Whatever the tier's hooks do, every block is free or held (check()) and a freed pool is whole again."""
  bm, _ = _failing_bm(spill_fails, restore_fails)
  live = {}
  for i, (prompt, n) in enumerate(ops):
    ids = [prompt * 50 + j for j in range(n)]
    if live and (i % 3 == 2 or not bm.can_allocate(n, ids)):
      sid = next(iter(live))
      bm.deallocate(sid, live.pop(sid))
    if bm.can_allocate(n, ids):
      bm.allocate(i, n, ids)
      live[i] = ids
    bm.check()
  for sid, ids in live.items(): bm.deallocate(sid, ids)
  bm.check()
  assert bm.num_free == bm.num_blocks
