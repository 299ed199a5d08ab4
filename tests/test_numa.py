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
