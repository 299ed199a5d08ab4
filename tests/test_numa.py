"""NUMA placement (runtime/numa.py, config numa): node lists parsed (bad ones refused), an interleave policy set on an arena
before its pages are touched (as /proc/self/numa_maps shows it), the node of each touched page (move_pages), the config
option. This machine has one NUMA node: the policy and the page queries are real, the spread over nodes is not seen."""
import ctypes
import pytest
from tinyhet.config import ConfigError, load_config
from tinyhet.runtime import numa
from tinyhet.runtime.arena import Arena

def test_node_lists():
  assert numa.parse_node_list("0") == [0] and numa.parse_node_list("0-3\n") == [0, 1, 2, 3] and numa.parse_node_list("0,2-3") == [0, 2, 3]
  for bad in ("x", "3-1", "0-", "-1", "1,a"):
    with pytest.raises(ValueError): numa.parse_node_list(bad)
  assert numa.online_nodes() and all(n >= 0 for n in numa.online_nodes())

def test_interleave_sets_the_arena_policy_and_pages_land_on_its_nodes():
  a = Arena(8 << 20, "numa-test", hugepages=False)
  assert numa.policy_of(a.base) == "default"
  numa.interleave(a.base, a.size)
  nodes = numa.online_nodes()
  assert numa.policy_of(a.base) == "interleave:" + (str(nodes[0]) if len(nodes) == 1 else f"{nodes[0]}-{nodes[-1]}")
  assert set(numa.page_nodes(a.base, 4 << 12)) == {-2}                 # not touched yet: no pages
  ctypes.memset(a.base, 1, 1 << 20)
  got = numa.page_nodes(a.base, 1 << 20)
  assert set(got) <= set(nodes) and (len(nodes) == 1 or len(set(got)) > 1), got
  with pytest.raises(ValueError): numa.interleave(a.base, a.size, nodes=[])
  with pytest.raises(OSError): numa.interleave(a.base + 1, 4096)       # not page-aligned: the kernel's EINVAL

def test_the_config_option(tmp_path):
  assert load_config(env={}).numa == "off" and load_config(env={"TINYHET_NUMA": "interleave"}).numa == "interleave"
  assert load_config(env={"TINYHET_NUMA": "replicate"}).numa == "replicate"
  with pytest.raises(ConfigError, match="numa"): load_config(env={"TINYHET_NUMA": "sockets"})

def test_a_node_with_numa_interleave_interleaves_its_arenas():
  from tinyhet.device.memory import LocalNode
  node = LocalNode(load_config(env={"TINYHET_NUMA": "interleave", "TINYHET_ARENA_BYTES": "16M"}))
  assert numa.policy_of(node.arena("MESH").base).startswith("interleave:")
  assert numa.policy_of(LocalNode(load_config(env={"TINYHET_ARENA_BYTES": "16M"})).arena("MESH").base) == "default"

def test_cpu_nodes_name_each_cpu_once():
  import os
  where = numa.cpu_nodes()
  assert where, "no /sys/devices/system/node on this machine"
  assert set(where.values()) <= set(numa.online_nodes()) and set(os.sched_getaffinity(0)) <= set(where)

def test_replicated_weights_are_read_from_each_threads_copy_with_real_threads():
  # numa = replicate's mechanism on this one-node VM: a buffer copied twice (both copies bound to node 0), the pool's worker
  # reading copy 1 and the caller copy 0. Copy 1 is changed on purpose, so a kernel split over the 2 threads shows which
  # copy each part read: the caller's half the original, the worker's half the copy. The copy's pages are on the node it
  # was bound to (move_pages). Cleared, every part reads the original again. Not testable here: copies on other nodes
  # (one node), and the speed of reading a local copy
  import numpy as np
  from tinygrad import Tensor
  from tinyhet.device.cpu_threads import kernel_threads, pool
  from tinyhet.device.numa_replicas import replicate
  if pool().threads < 2: pytest.skip("needs 2 CPU threads for the pool")
  n = 1 << 20
  w = Tensor.ones(n, device="MESH").contiguous().realize()
  reps = replicate([w.uop.base.buffer], nodes=[0, 0], thread_copy=[0, 1])
  try:
    assert reps.thread_copy == [0, 1]
    np.frombuffer(reps.copy_view(0, 1), np.float32)[:] = 2.0
    addr = reps.copies[0][1]
    assert set(numa.page_nodes(addr - addr % 4096, 1 << 20)) == {0}        # the copy's pages: on node 0, where it was bound
    with kernel_threads("MESH"): y = (w * 3).realize().numpy()
    assert sorted(set(y.tolist())) == [3.0, 6.0] and (y == 3.0).sum() == (y == 6.0).sum() == n // 2
  finally: reps.close()
  with kernel_threads("MESH"): assert ((w * 3).realize().numpy() == 3.0).all()
  one = replicate([w.uop.base.buffer], nodes=[0])                          # by default each thread reads its pinned CPU's node's copy
  try: assert one.thread_copy == [0] * pool().threads
  finally: one.close()

def test_kv_pool_pages_are_first_touched_by_the_pool_thread_of_their_share_with_real_threads():
  # the decode pool's first touch (CpuPool.touch, kv/paged_cache.first_touch): share t of a range, whole pages, is zeroed by
  # pool thread t, which reports the CPU it ran on: a worker's is the CPU it is pinned to, and each share's pages are on that
  # CPU's node (move_pages), pages outside the range untouched. On this one-node VM every node is 0: that the pages follow
  # their toucher to another node is the kernel's first-touch policy, not seen here
  import os
  from tinyhet.device.cpu_threads import pool
  p = pool()
  if p.threads < 2: pytest.skip("needs 2 CPU threads for the pool")
  a = Arena(4 << 20, "touch-test", hugepages=False)
  page, lo, n = 4096, a.base + 8 * 4096, 37 * 4096 + 100        # not whole pages at the end: the last share stops at lo + n
  assert set(numa.page_nodes(a.base, 64 * page)) == {-2}        # nothing touched yet
  cpus = p.touch(lo, n, 2)
  assert len(cpus) == 2 and all(c in os.sched_getaffinity(0) for c in cpus)
  assert cpus[1] == p.pinned_cpu(1)
  where = numa.cpu_nodes()
  pages = 38                                                    # the range's pages; share t: pages [38t/2, 38(t+1)/2)
  got = numa.page_nodes(lo, pages * page)
  for t in range(2): assert set(got[pages * t // 2:pages * (t + 1) // 2]) == {where.get(cpus[t], 0)}, (t, got)
  assert set(numa.page_nodes(a.base, 8 * page)) == {-2} and set(numa.page_nodes(lo + pages * page, 8 * page)) == {-2}
  ctypes.memset(lo, 7, n)                                       # a pool's span reused: touch zeroes it (whole range, no more)
  ctypes.memset(lo + n, 9, 1)
  p.touch(lo, n, 2)
  assert ctypes.string_at(lo, n) == bytes(n) and ctypes.string_at(lo + n, 1) == b"\x09"
  for parts, nbytes in ((0, n), (p.threads + 1, n), (1, 0)):
    with pytest.raises(ValueError): p.touch(lo, nbytes, parts)

def test_a_decode_pool_is_zeroed_by_its_first_touch():
  from tinygrad import dtypes
  from tinyhet.device.cpu_threads import pool, pool_threads
  from tinyhet.kv.paged_cache import create_pool, first_touch
  if pool_threads("MESH") < 2: pytest.skip("needs 2 CPU threads for the pool")
  t = create_pool(40, 2, 64, 16, dtypes.float16, "MESH")
  assert t.uop.base.op.name == "BUFFER" and (t.float().numpy() == 0).all()
  assert first_touch(t, pool().threads) is not None
  assert first_touch(create_pool(4, 2, 64, 16, dtypes.float16, "CPU"), 2) is None    # not registered memory: zeroed by a kernel
