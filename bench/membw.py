"""The machine's streaming read bandwidth: the bound a memory-bound decode step is measured against.

memcpy reads and writes (a copy moves every byte twice, and writes cost a read-for-ownership besides), so its rate is not
the read limit. This reads a large array once per pass, split over threads (numpy releases the GIL inside a reduction), and
reports the best pass.
"""
from __future__ import annotations
import os, threading, time
import numpy as np

def read_gbps(nbytes: int = 1 << 30, threads: int | None = None, repeats: int = 5) -> float:
  """GB/s of a streaming read of an nbytes array by `threads` threads (default: the CPUs this process may run on), best of
  `repeats` passes after one warm pass (which also faults the pages in)."""
  threads = threads or len(os.sched_getaffinity(0))
  a = np.ones(nbytes // 8, dtype=np.float64)
  parts = np.array_split(a, threads)
  sink = [0.0] * threads
  def read(i: int): sink[i] = float(np.add.reduce(parts[i]))
  best = float("inf")
  for r in range(repeats + 1):
    ts = [threading.Thread(target=read, args=(i,)) for i in range(threads)]
    t0 = time.perf_counter()
    for t in ts: t.start()
    for t in ts: t.join()
    if r: best = min(best, time.perf_counter() - t0)
  if sum(sink) != float(a.size): raise RuntimeError("read_gbps: a reader returned a wrong sum")
  return a.nbytes / best / 1e9
