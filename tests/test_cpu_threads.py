"""The multi-threaded CPU runtime of HET (on a CPU) and MESH: kernels split over N threads give exactly one thread's results,
for every kernel shape the model uses (prefill, batched paged decode under TinyJit, packed weights), and the configured
thread count is what runs."""
import os, subprocess, sys, textwrap
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
import tinyhet  # noqa: F401  (HET and MESH)
from tinygrad import Device, Tensor, TinyJit, dtypes
from tinygrad.engine.realize import runtime_cache
from tinyhet.device import cpu_threads
from tinyhet.config import ConfigError, load_config
from tinyhet.kv.paged_cache import PagedKVCache
from tinyhet.model.llama import Llama, random_weights, small_config
from tinyhet.model.packed import Q4_1

@pytest.fixture
def threads(monkeypatch):
  """Set TINYHET_CPU_THREADS for the kernels compiled inside the test (the pool grows to it)."""
  def use(n: int):
    monkeypatch.setenv("TINYHET_CPU_THREADS", str(n))
    cpu_threads.configured_threads.cache_clear()
  yield use
  cpu_threads.configured_threads.cache_clear()

def split_programs() -> list:
  return [rt for rt in runtime_cache.values() if isinstance(rt, cpu_threads.PoolProgram) and "core_id" in rt.runtimevars]

def test_mesh_and_het_run_on_the_pool():
  for dev in ("MESH", "HET"):
    if dev == "HET" and type(Device[dev]).__name__ != "HetCPUDevice": continue
    assert Device[dev].runtime_t is cpu_threads.PoolProgram and Device[dev].graph is cpu_threads.PoolGraph

@settings(max_examples=12, deadline=None)
@given(rows=st.sampled_from([1, 3, 64]), cols=st.sampled_from([256, 1024]), out=st.sampled_from([512, 1536]), n=st.sampled_from([2, 3, 4, 8]))
def test_split_matmul_equals_one_thread(rows, cols, out, n):
  rng = np.random.default_rng(rows * cols + out)
  a, w = rng.standard_normal((rows, cols), dtype=np.float32), rng.standard_normal((out, cols), dtype=np.float32)
  results = {}
  for k in (1, n):
    os.environ["TINYHET_CPU_THREADS"] = str(k)
    cpu_threads.configured_threads.cache_clear()
    try:
      with cpu_threads.kernel_threads("MESH"):
        x, wt = Tensor(a, device="MESH"), Tensor(w, device="MESH")
        results[k] = ((x @ wt.T).relu().sum(-1, keepdim=True) + x.max(-1, keepdim=True)).numpy()
    finally:
      del os.environ["TINYHET_CPU_THREADS"]
      cpu_threads.configured_threads.cache_clear()
  np.testing.assert_array_equal(results[n], results[1])

def model_run(llama: Llama, prompt: list[int], batch_prompts: list[list[int]]) -> list[np.ndarray]:
  """Prefill logits, then three jitted paged decode steps of a batch: every kernel shape of the decode node's model."""
  cfg = llama.cfg
  out = [llama.prefill(Tensor([prompt], dtype=dtypes.int32, device="MESH")).numpy()]
  cache = PagedKVCache(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, num_blocks=32, block_size=8, device="MESH", max_seq_len=cfg.max_context)
  for i, p in enumerate(batch_prompts):
    cache.block_manager.allocate(i, len(p))
    positions = cache.begin_step([i], len(p))
    llama.forward(Tensor([p], dtype=dtypes.int32, device="MESH"), Tensor(positions, device="MESH"), cache).realize()
  step = TinyJit(lambda t, p, **kv: llama.forward(t, p, cache).realize())
  tokens = [[p[-1]] for p in batch_prompts]
  for _ in range(3):
    for i in range(len(batch_prompts)): cache.block_manager.append_slot(i)
    positions = cache.begin_step(list(range(len(batch_prompts))), 1)
    with cpu_threads.kernel_threads("MESH"):
      logits = step(Tensor(tokens, dtype=dtypes.int32, device="MESH"), Tensor(positions, device="MESH"), **cache.jit_kwargs()).numpy()
    out.append(logits.copy())
    tokens = [[int(t)] for t in logits.argmax(-1)]
  return out

@pytest.mark.slow
@pytest.mark.parametrize("packed", [None, Q4_1], ids=["float32", "q4_1"])
def test_model_kernels_split_give_one_threads_numbers(threads, packed):
  if cpu_threads.configured_threads() < 2: pytest.skip("one CPU available: nothing runs in parallel")
  # wide enough that tinygrad splits the matmuls, the attention and the logits (it keeps kernels under ~128K ops per part whole)
  cfg = small_config(n_layers=1, dim=256, n_heads=4, n_kv_heads=2, hidden_dim=768, vocab_size=2048, max_context=128)
  llama = Llama(cfg, random_weights(cfg, device="MESH", seed=3, packed=packed), "MESH")
  rng = np.random.default_rng(1)
  prompt, batch = [int(t) for t in rng.integers(0, 2048, 40)], [[int(t) for t in rng.integers(0, 2048, n)] for n in (5, 17, 9)]
  threads(1)
  want = model_run(llama, prompt, batch)
  before = len(split_programs())
  threads(3)
  got = model_run(llama, prompt, batch)
  assert len(split_programs()) > before, "no kernel was split over threads: the test would not test the pool"
  for g, w in zip(got, want): np.testing.assert_array_equal(g, w)

def test_thread_count_is_validated():
  for bad in ("-1", "1025", "many"):
    with pytest.raises(ConfigError, match="TINYHET_CPU_THREADS"): load_config(env={"TINYHET_CPU_THREADS": bad})
  assert load_config(env={}).cpu_threads == 0

def test_default_is_every_cpu_this_process_may_run_on(threads):
  threads(0)
  assert cpu_threads.configured_threads() == len(os.sched_getaffinity(0))

HONOURED = textwrap.dedent("""
  import os, sys, time, json
  import tinyhet
  from tinygrad import Device, Tensor
  from tinyhet.device import cpu_threads
  def workers():
    tasks = [t for t in os.listdir('/proc/self/task') if open(f'/proc/self/task/{t}/comm').read().startswith('tinyhet-cpu')]
    return {t: int(open(f'/proc/self/task/{t}/schedstat').read().split()[0]) for t in tasks}   # ns on a CPU
  w = Tensor.rand(2048, 4096, device="MESH").realize()   # powers of two: tinygrad splits an axis the part count divides
  x = Tensor.rand(8, 4096, device="MESH").realize()
  with cpu_threads.kernel_threads("MESH"):
    (x @ w.T).realize()
    before, t0 = workers(), time.time()
    while time.time() - t0 < 1.5: (x @ w.T).realize()
    after = workers()
  print(json.dumps({"runtime": Device["MESH"].runtime_t.__name__, "configured": cpu_threads.configured_threads(),
                    "pool": cpu_threads.pool().threads, "busy_workers": sum(after[t] - before.get(t, 0) > 50e6 for t in after),
                    "workers": len(after)}))
""")

@pytest.mark.parametrize("n", [1, 4])
def test_configured_thread_count_runs(n):
  env = {k: v for k, v in os.environ.items() if not k.startswith("TINYHET_")} | {"TINYHET_CPU_THREADS": str(n)}
  r = subprocess.run([sys.executable, "-c", HONOURED], env=env, capture_output=True, text=True, timeout=240)
  assert r.returncode == 0, r.stderr
  import json
  got = json.loads(r.stdout.strip().splitlines()[-1])
  assert (got["runtime"], got["configured"], got["pool"], got["workers"]) == ("PoolProgram", n, n, n - 1)
  assert got["busy_workers"] == n - 1, f"{got['busy_workers']} of {n - 1} worker threads ran kernel parts"

PART = r"""
#include <stdint.h>
#include <unistd.h>
#include <sys/syscall.h>
/* one kernel part: records which thread ran part core_id, after some work so that parts overlap in time */
void part(uint64_t out, uint64_t spin, uint64_t core_id) {
  volatile double x = 0; for (uint64_t i = 0; i < spin; i++) x += i;
  ((int64_t *)out)[core_id] = syscall(SYS_gettid);
}
void count(uint64_t out, uint64_t spin, uint64_t core_id) { ((int64_t *)out)[core_id] += 1; }
"""

@pytest.fixture(scope="module")
def part_fn(tmp_path_factory):
  import ctypes
  d = tmp_path_factory.mktemp("part")
  (d / "part.c").write_text(PART)
  subprocess.run(["clang", "-O1", "-shared", "-fPIC", "-o", str(d / "part.so"), str(d / "part.c")], check=True)
  lib = ctypes.CDLL(str(d / "part.so"))
  return lib, ctypes.cast(lib.part, ctypes.c_void_p).value, ctypes.cast(lib.count, ctypes.c_void_p).value

def launch(fn: int, out: np.ndarray, parts: int, spin: int = 20000):
  from tinyhet.runtime.cpu_pool import Command
  cmds = (Command * 1)()
  cmds[0].fn, cmds[0].nargs, cmds[0].core_slot, cmds[0].parts = fn, 3, 2, parts
  cmds[0].args[0], cmds[0].args[1] = out.ctypes.data, spin
  return cmds

@pytest.mark.parametrize("parts", [1, 2, 3, 7, 32])
def test_pool_runs_every_part_once_on_every_thread(part_fn, parts):
  from tinyhet.runtime.cpu_pool import cpu_pool
  pool = cpu_pool(3)
  out = np.zeros(parts, np.int64)
  assert not pool.run(launch(part_fn[1], out, parts))
  assert (out > 0).all(), "a part did not run"
  assert len(set(out.tolist())) == min(parts, pool.threads), "parts did not spread over the pool's threads"

def test_threads_started_later_do_not_rerun_the_last_kernel(part_fn):
  """A pool grown after it ran kernels: its new threads wait for the next kernel instead of taking the last one again."""
  import time
  from tinyhet.runtime.cpu_pool import cpu_pool
  pool = cpu_pool(2)
  first, cmds = np.zeros(16, np.int64), None
  cmds = launch(part_fn[2], first, 16)
  pool.run(cmds)
  cpu_pool(pool.threads + 2)
  time.sleep(0.2)
  assert (first == 1).all(), f"parts ran {first.tolist()} times"
  second = np.zeros(16, np.int64)
  pool.run(launch(part_fn[2], second, 16))
  assert (second == 1).all() and (first == 1).all()

def test_busy_pool_runs_a_second_callers_parts_itself(part_fn):
  """Two Python threads launching at once: one has the pool, the other runs its parts on its own thread; both complete."""
  import threading
  from tinyhet.runtime.cpu_pool import cpu_pool
  pool = cpu_pool(3)
  serial, errors = [0, 0], []
  def work(i):
    for _ in range(200):
      out = np.zeros(8, np.int64)
      serial[i] += pool.run(launch(part_fn[1], out, 8, 2000))
      if not (out > 0).all(): errors.append(f"thread {i}: parts missing")
  ts = [threading.Thread(target=work, args=(i,)) for i in range(2)]
  for t in ts: t.start()
  for t in ts: t.join(60)
  assert not errors and not any(t.is_alive() for t in ts)
  assert sum(serial) > 0, "the two callers never met: the busy path was not exercised"
