"""`tinyhet bench het`: the HET device on its configured backend (CUDA/NV on a GPU machine), in one short run.

Checks tinygrad ops on HET and MESH against numpy (float32, float16, int32), that every buffer lies inside HET's
registered arena, that HET -> MESH -> HET round trips are byte-exact (on a GPU: a GPU buffer copied into MESH memory),
that the arenas' bytes in use return to their start value, and measures HET's matmul throughput against the same
backend without tinyhet in the same run. Exits non-zero when a check fails. Usage: HET_BACKEND=CUDA tinyhet bench het
"""
from __future__ import annotations
import argparse, json, sys, time
import numpy as np

def buffer_address(opaque) -> int:
  from tinyhet.device.memory import address_of
  if hasattr(opaque, "va_addr"): return int(opaque.va_addr)      # HCQ buffers (CPU, NV, AMD)
  if hasattr(opaque, "value"): return int(opaque.value)          # CUDA device pointers
  if isinstance(opaque, memoryview): return address_of(opaque)   # tinygrad's PYTHON emulator
  raise TypeError(f"unknown buffer type {type(opaque).__name__}")

def het_span() -> tuple[int, int]:
  """[start, end) of HET's registered memory."""
  from tinygrad import Device
  from tinyhet.device.memory import local_node
  alloc = Device["HET"].allocator
  if getattr(alloc, "arena_buf", None) is not None: return buffer_address(alloc.arena_buf), buffer_address(alloc.arena_buf) + alloc.arena_bytes
  arena = local_node().arenas["HET"]
  return arena.base, arena.base + arena.size

def check_ops(device: str, rng, sizes) -> list[str]:
  from tinygrad import Tensor, dtypes
  failures = []
  for dt, np_dt in ((dtypes.float32, np.float32), (dtypes.float16, np.float16), (dtypes.int32, np.int32)):
    for n in sizes:
      a = (rng.standard_normal((n, n)) * 4).astype(np_dt)
      b = (rng.standard_normal((n, n)) * 4).astype(np_dt)
      ta, tb = Tensor(a, device=device), Tensor(b, device=device)
      tol = 1e-2 if np_dt == np.float16 else 1e-5
      got = {"add": (ta + tb).numpy(), "mul": (ta * tb).numpy(), "sum": ta.sum(axis=1).numpy(), "max": ta.max(axis=0).numpy()}
      want = {"add": a + b, "mul": a * b, "sum": a.sum(axis=1, dtype=np_dt), "max": a.max(axis=0)}
      if np_dt != np.int32:
        got["matmul"], want["matmul"] = (ta.float() @ tb.float()).numpy(), a.astype(np.float32) @ b.astype(np.float32)
      for k in got:
        if not np.allclose(got[k].astype(np.float64), want[k].astype(np.float64), rtol=tol * 10, atol=tol * n):
          failures.append(f"{device} {dt} {n}x{n} {k}: differs from numpy")
  return failures

def check_buffers_in_arena(tensors) -> list[str]:
  lo, hi = het_span()
  out = []
  for t in tensors:
    buf = t.uop.buffer
    addr = buffer_address(buf._buf) if buf._base is None else buffer_address(buf.base._buf) + buf.offset
    if not (lo <= addr and addr + buf.nbytes <= hi): out.append(f"a HET buffer at {addr:#x} lies outside the registered arena [{lo:#x}, {hi:#x})")
  return out

def matmul_tflops(device: str, n: int, dtype, reps: int = 5) -> float:
  from tinygrad import Tensor, Device
  a, b = Tensor.rand(n, n, device=device).cast(dtype).realize(), Tensor.rand(n, n, device=device).cast(dtype).realize()
  (a @ b).realize()
  Device[device].synchronize()
  st = time.perf_counter()
  for _ in range(reps): (a @ b).realize()
  Device[device].synchronize()
  return 2 * n ** 3 * reps / (time.perf_counter() - st) / 1e12

def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="tinyhet bench het", description=__doc__.splitlines()[0])
  ap.add_argument("--json", action="store_true")
  ap.add_argument("--quick", action="store_true", help="tiny shapes (tinygrad's PYTHON emulator needs them)")
  args = ap.parse_args(argv)
  import gc
  import tinyhet  # noqa: F401  (installs HET and MESH)
  from tinygrad import Tensor, Device, dtypes
  from tinyhet.device.memory import local_node
  from tinyhet.device.backend import resolve_backend
  backend = resolve_backend(local_node().config.het_backend)
  rng = np.random.default_rng(0)
  sizes = (3, 8) if args.quick else (7, 64, 256)
  report: dict = {"backend": backend, "failures": []}
  Tensor([1.0], device="HET").realize()
  Tensor([1.0], device="MESH").realize()
  gc.collect()
  start_use = {k: a.in_use for k, a in local_node().arenas.items()}
  if getattr(Device["HET"].allocator, "spans", None) is not None: start_use["HET-device"] = Device["HET"].allocator.spans.in_use
  report["failures"] += check_ops("HET", rng, sizes) + check_ops("MESH", rng, sizes)
  # round trips and placement
  x = rng.integers(0, 2**31, size=(5, 1000 if not args.quick else 33), dtype=np.int32)
  h = Tensor(x, device="HET").realize()
  m = h.to("MESH").realize()
  back = m.to("HET").realize()
  if not np.array_equal(back.numpy(), x) or not np.array_equal(m.numpy(), x): report["failures"].append("HET -> MESH -> HET is not byte-exact")
  report["failures"] += check_buffers_in_arena([h, back])
  del h, m, back
  gc.collect()
  end_use = {k: a.in_use for k, a in local_node().arenas.items() if k in start_use}
  if getattr(Device["HET"].allocator, "spans", None) is not None: end_use["HET-device"] = Device["HET"].allocator.spans.in_use
  if end_use != {k: v for k, v in start_use.items() if k in end_use}:
    report["failures"].append(f"bytes in use did not return to their start value: {start_use} -> {end_use}")
  if not args.quick:
    n, dt = (4096, dtypes.float16) if backend != "CPU" else (512, dtypes.float32)
    report["matmul"] = {"n": n, "dtype": str(dt), "het_tflops": round(matmul_tflops("HET", n, dt), 3),
                        "baseline_tflops": round(matmul_tflops(backend, n, dt), 3), "baseline": f"tinygrad {backend} without tinyhet"}
  if args.json: print(json.dumps(report))
  else:
    print(f"HET backend: {backend}")
    if "matmul" in report: print(f"matmul {report['matmul']['n']}^3 {report['matmul']['dtype']}: HET {report['matmul']['het_tflops']} TFLOP/s, "
                                 f"{backend} alone {report['matmul']['baseline_tflops']} TFLOP/s")
    print("all checks passed" if not report["failures"] else "FAILED:\n  " + "\n  ".join(report["failures"]))
  return 1 if report["failures"] else 0

if __name__ == "__main__": sys.exit(main())
