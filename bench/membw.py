"""Memory read bandwidth: the figure a decode step is bound by (it reads weights and KV; it writes almost nothing). memcpy's
rate is the wrong bound for that, since a copy also writes every byte it reads.

read_gbps streams a large array through `threads` Python threads, each reducing its own disjoint slice with numpy's max
(numpy releases the GIL inside reductions, so the threads read in parallel; int64 max measured the fastest reduction here,
sum and float reductions are compute-bound below the memory's rate), and takes the best of a few repeats.
`python -m tinyhet.bench.membw` prints the rate for 1, 2, ... threads.
"""
from __future__ import annotations
import os, sys, threading, time
import numpy as np

CHUNK = 8 << 20      # bytes a thread sums per call: large enough that the call's overhead vanishes, small enough to stay lazy

def _cpus() -> int:
  return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)

def _read(a: np.ndarray, lo: int, hi: int, out: list, i: int):
  out[i] = max(int(a[off:min(hi, off + CHUNK // 8)].max()) for off in range(lo, hi, CHUNK // 8))

def read_gbps(nbytes: int = 1 << 30, threads: int | None = None, repeats: int = 3) -> float:
  """GB/s (1e9 bytes/s) of reading nbytes of memory with `threads` threads (default: the CPUs this process may run on)."""
  threads = _cpus() if threads is None else threads
  if threads < 1: raise ValueError(f"threads must be at least 1, got {threads}")
  if nbytes < 8 * threads: raise ValueError(f"nbytes {nbytes} is too small to split over {threads} threads")
  a = np.ones(nbytes // 8, dtype=np.int64)            # written once: every page is resident before timing
  bounds = np.linspace(0, len(a), threads + 1).astype(int)
  best = 0.0
  for _ in range(repeats):
    out = [0] * threads
    ts = [threading.Thread(target=_read, args=(a, int(bounds[i]), int(bounds[i + 1]), out, i)) for i in range(threads)]
    t0 = time.perf_counter()
    for t in ts: t.start()
    for t in ts: t.join()
    dt = time.perf_counter() - t0
    if out != [1] * threads: raise RuntimeError("read_gbps: a thread did not read its slice")
    best = max(best, a.nbytes / dt / 1e9)
  return best

if __name__ == "__main__":
  n = int(sys.argv[1]) if len(sys.argv) > 1 else 1 << 30
  for k in range(1, _cpus() + 1): print(f"{k} thread{'s' if k > 1 else ' '}: {read_gbps(n, k):6.2f} GB/s read")
