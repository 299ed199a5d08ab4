"""tinyhet bench qmm: the matmul kernels (kernels/quant_matmul.py) per weight type against the path they replaced, on one
core, timed as this thread's CPU time (steadier than wall time on a shared machine): tinygrad's own kernels on the lazily
dequantized weights (a matrix-vector product at one row; at many rows a float32 copy of the matrix, then a float matmul),
the path every type but Q4_0/Q4_1/Q8_0 took before; and llama.cpp's own ggml_mul_mat on the same blocks (bench/ggml_matmul.py:
libggml-cpu from llama-cpp-python's wheel, one thread, its plain path: x converted to the type's vec_dot type, no repacking).
One (N, K) matrix of random blocks. The kernels are timed as llama.cpp's side is, called through ctypes (the same C, built by
clang with tinygrad's CPU flags), and also inside a TinyJit (8 products a call; that adds tinygrad's launch costs)."""
from __future__ import annotations
import argparse, json, sys, time
import numpy as np

REPS = 8

def best_of(fns: dict, n: int, rounds: int) -> dict:
  """Each callable's least CPU time per call over `rounds` rounds of n calls, the callables taking turns in every round (so a
  burst of load on a shared machine meets all of them, and the least is the figure least disturbed by it)."""
  best = {k: float("inf") for k in fns}
  for _ in range(rounds):
    for k, fn in fns.items(): best[k] = min(best[k], cpu_time(fn, n))
  return best

def direct(ggml_type: int, M: int, N: int, K: int, int8: bool, out: np.ndarray, w: np.ndarray, x: np.ndarray, tmp: str, tiled=None,
           prefetch: bool = True):
  """The kernel tinygrad runs (the same C, compiled by clang with tinygrad's CPU flags into a shared object), called through
  ctypes as llama.cpp's side is: its time without the jit's launch costs."""
  import ctypes, os, subprocess
  from tinygrad import Device
  from tinyhet.kernels import quant_matmul as qmm
  name, src = qmm.kernel_source(ggml_type, M, N, K, 1, tiled, int8=int8, prefetch=prefetch)
  march = list(getattr(Device["MESH"].compiler, "args", None) or ["-march=native"])

  def build(name: str, src: str):
    so = os.path.join(tmp, name + ".so")
    subprocess.run(["clang", "-O2", "-shared", "-fPIC", "-ffreestanding", "-fno-math-errno", *march, "-x", "c", "-", "-o", so],
                   input=src.encode(), check=True)
    return getattr(ctypes.CDLL(so), name)
  # the int8 and bf16 tiled kernels: x rounded first by its own kernel (timed with the product), into the buffer it reads
  rounding = qmm.rounding_kernel(name, ggml_type, M, K, 1)
  xr = [np.zeros(rounding[2], np.uint8)] if rounding else []
  ws = w if isinstance(w, list) else [w]   # a list: one matrix after another, each call the next (weights cold, as in a step)
  keep = [np.ascontiguousarray(a) for a in (out, *ws, x, *xr)]   # the arrays live as long as the call that writes and reads them
  fn, ptr = build(name, src), [ctypes.c_void_p(a.ctypes.data) for a in keep]
  assert keep[0] is out, "out must be a contiguous array"
  xin = ptr[-1] if rounding else ptr[1 + len(ws)]
  calls = [[ptr[0], ptr[1 + i], xin] for i in range(len(ws))]
  turn = iter(range(1 << 62))
  if rounding:
    rfn, rargs = build(*rounding[:2]), (ptr[-1], ptr[1 + len(ws)], 0)
    return lambda: (rfn(*rargs), fn(*calls[next(turn) % len(calls)], 0)) if keep else None
  return lambda: fn(*calls[next(turn) % len(calls)], 0) if keep else None

def cpu_time(fn, n: int) -> float:
  for _ in range(2): fn()
  t0 = time.thread_time()
  for _ in range(n): fn()
  return (time.thread_time() - t0) / n

def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(prog="tinyhet bench qmm", description=__doc__.split("\n\n")[0])
  ap.add_argument("--types", default="Q4_K,Q5_K,Q6_K,Q8_0,Q5_0,F16,BF16")
  ap.add_argument("--rows", default="1,16,512", help="rows of x")
  ap.add_argument("--shape", default="1536,1536", help="N,K of the weight")
  ap.add_argument("--int8", action="store_true", help="also the int8-activation mode's kernel (block types; its tiled kernel past "
                  "quant_matmul.INT8_TILED_MIN_M rows, beside the int8 decode kernel where one runs at that count)")
  ap.add_argument("--rounds", type=int, default=5, help="rounds in which the kernels and llama.cpp take turns; the least time of each")
  ap.add_argument("--no-ggml", action="store_true", help="skip llama.cpp's ggml_mul_mat (llama-cpp-python not installed)")
  ap.add_argument("--cold", type=float, default=0, help="MB: also the kernels over a rotating set of copies of the matrix this large "
                  "(a model's weights: each read once a step, from memory), beside the same kernel on one matrix: the float kernel "
                  "with its weight prefetch and without (cold_ms, cold_nopf_ms), the int8 one with --int8 (int8_cold_ms)")
  ap.add_argument("--json", action="store_true")
  args = ap.parse_args(argv)
  import tempfile
  import tinyhet  # noqa: F401  (MESH)
  from tinygrad import Tensor, TinyJit, dtypes
  from tinyhet.device.cpu_threads import kernel_threads
  from tinyhet.kernels import quant_blocks as qb, quant_matmul as qmm
  from tinyhet.model.packed import PackedWeight
  N, K = (int(v) for v in args.shape.split(","))
  rng, rows, tmp = np.random.default_rng(0), [], tempfile.mkdtemp(prefix="tinyhet-qmm-")
  for name in args.types.split(","):
    t = getattr(qb, name)
    raw = qb.random_blocks(N, K, t, rng)
    b = Tensor(raw, device="MESH").realize()
    if t in qb.FLOAT_TYPES: old_w = Tensor(qb.dequantize_reference(raw, t, K) if t == qb.F16 else
                                           (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(N, K), device="CPU")
    else: old_w = PackedWeight(Tensor(raw, device="CPU"), (N, K), t).realize()
    if t == qb.F16: old_w = old_w.cast(dtypes.float16).realize()
    for M in (int(m) for m in args.rows.split(",")):
      x = rng.standard_normal((M, K)).astype(np.float32)
      xc = Tensor(x, device="CPU").realize()
      # REPS products in one jitted call, each on its own copy of x: the jit's fixed cost per call (~0.1 ms of Python, which
      # a model's step pays once for all its kernels) is spread over them; times below are per product
      xm = [Tensor(x, device="MESH").realize() for _ in range(REPS)]
      new = TinyJit(lambda *xs: Tensor.realize(*[qmm.quant_matmul(xi, b, t, (N, K), 1) for xi in xs]))
      def old_fn(x):
        w = old_w.dequantize() if isinstance(old_w, PackedWeight) else old_w
        if M > 8: w = w.contiguous()              # the float32 copy the old linear made for more than 8 rows
        return x.matmul(w.T, dtype=dtypes.float32).realize()
      old = TinyJit(old_fn)
      n = max(2, 40 // M)
      with kernel_threads("MESH"): t_jit = cpu_time(lambda: new(*xm), n) / REPS
      got = np.zeros((M, N), np.float32)
      fns = {"new": direct(t, M, N, K, False, got, raw, x, tmp)}
      fns["new"]()
      if args.cold:   # the float kernel over the rotating copies, with its weight prefetch and without
        copies = [raw.copy() for _ in range(max(1, int(args.cold * 1e6 / raw.nbytes)))]
        for key, pf in (("cold", True), ("cold_nopf", False)):
          fns[key] = direct(t, M, N, K, False, np.zeros((M, N), np.float32), copies, x, tmp, prefetch=pf)
      # the same kernel: the shared object's product is the jitted one's
      np.testing.assert_allclose(got, new(*xm).numpy(), rtol=1e-5, atol=1e-5 * np.abs(got).max())
      int8_name = qmm.kernel_source(t, M, N, K, 1, int8=True)[0]
      if args.int8 and ("_int8" in int8_name or int8_name.endswith("_bf16t")):   # BF16: the mode's kernel rounds x to bfloat16
        fns["int8"] = direct(t, M, N, K, True, np.zeros((M, N), np.float32), raw, x, tmp)
        if args.cold:
          fns["int8_cold"] = direct(t, M, N, K, True, np.zeros((M, N), np.float32), copies, x, tmp)
      tiled8 = int8_name.endswith("_int8t")
      if args.int8 and tiled8 and "_int8" in qmm.kernel_source(t, M, N, K, 1, False, True)[0]:
        # the int8 decode kernel the tiled one replaced past INT8_TILED_MIN_M rows
        fns["int8_decode"] = direct(t, M, N, K, True, np.zeros((M, N), np.float32), raw, x, tmp, tiled=False)
      if not args.no_ggml:
        from tinyhet.bench.ggml_matmul import GgmlMatmul
        fns["ggml"] = GgmlMatmul(raw, t, (N, K), x)
      best = best_of(fns, n, args.rounds)
      t_new = best["new"]
      t_old = cpu_time(lambda: old(xc), max(2, n // 4))
      rows.append({"type": name, "rows": M, "new_ms": t_new * 1e3, "jit_ms": t_jit * 1e3, "old_ms": t_old * 1e3, "speedup": t_old / t_new,
                   "new_weight_gbps": b.nbytes() / t_new / 1e9, "new_gflops": 2 * M * N * K / t_new / 1e9,
                   **{f"{k}_ms": v * 1e3 for k, v in best.items() if k != "new"}})
      r = rows[-1]
      if "ggml_ms" in r and not args.json:
        print(f"{name:5} {M:4} rows: ggml_mul_mat {r['ggml_ms']:8.3f} ms: the float kernel is {r['ggml_ms'] / r['new_ms']:.2f}x llama.cpp")
      if "int8_ms" in r:
        vs = f", {r['ggml_ms'] / r['int8_ms']:.2f}x llama.cpp" if "ggml_ms" in r else ""
        r["int8_kernel"] = "tiled" if int8_name.endswith("_int8t") else "bf16 tiled" if int8_name.endswith("_bf16t") else "decode"
        if "int8_cold_ms" in r: vs += f"; cold weights {r['int8_cold_ms']:.3f} ms, {r['int8_cold_ms'] / r['int8_ms']:.2f}x"
        if "int8_decode_ms" in r: vs += f", {r['int8_decode_ms'] / r['int8_ms']:.2f}x the int8 decode kernel ({r['int8_decode_ms']:.3f} ms)"
        if not args.json: print(f"{name:5} {M:4} rows: int8 {r['int8_kernel']} kernel {r['int8_ms']:8.3f} ms, {r['new_ms'] / r['int8_ms']:.2f}x "
                                f"the float kernel{vs}")
      if "cold_ms" in r and not args.json:
        print(f"{name:5} {M:4} rows: cold weights {r['cold_ms']:8.3f} ms, without the prefetch {r['cold_nopf_ms']:8.3f} ms "
              f"({r['cold_nopf_ms'] / r['cold_ms']:.2f}x)")
      if not args.json: print(f"{name:5} {M:4} rows: kernel {r['new_ms']:8.3f} ms ({r['new_weight_gbps']:5.1f} GB/s of weights, "
                              f"{r['new_gflops']:5.1f} GFLOP/s; {r['jit_ms']:.3f} ms in a jit)  old path {r['old_ms']:9.3f} ms  "
                              f"{r['speedup']:6.1f}x", flush=True)
  if args.json: print(json.dumps({"shape": [N, K], "rows": rows}))
  return 0

if __name__ == "__main__": sys.exit(main())
