"""llama.cpp's own matrix product on the same blocks, for `tinyhet bench qmm`: one ggml_mul_mat of the weight's stored bytes
(a ggml tensor of the same GGML type, ne = (K, N)) by x (F32, (K, M)), computed by libggml-cpu from llama-cpp-python's
wheel through ctypes with ggml_graph_plan and ggml_graph_compute. That is ggml's plain CPU path: x converted to the type's vec_dot
type (q8_K for the K-quants, q8_0 for the 32-weight types, F16/BF16 for those weights) and its vec_dot or gemm kernels.
It is not the repacked path (llama.cpp's CPU_REPACK buffer type, which a model load uses for Q4_0, Q4_K and IQ4_NL where
the CPU has it): a plain context does not repack."""
from __future__ import annotations
import ctypes, pathlib
import numpy as np

class _Params(ctypes.Structure):
  _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]

class _Plan(ctypes.Structure):   # ggml-cpu.h's struct ggml_cplan
  _fields_ = [("work_size", ctypes.c_size_t), ("work_data", ctypes.c_void_p), ("n_threads", ctypes.c_int), ("threadpool", ctypes.c_void_p),
              ("abort_callback", ctypes.c_void_p), ("abort_callback_data", ctypes.c_void_p), ("use_ref", ctypes.c_bool)]

@__import__("functools").cache
def _libs() -> tuple[ctypes.CDLL, ctypes.CDLL]:
  import llama_cpp
  d = pathlib.Path(llama_cpp.__file__).parent / "lib"
  base = ctypes.CDLL(str(d / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
  cpu = ctypes.CDLL(str(d / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
  P = ctypes.c_void_p
  for name, res, args in [("ggml_init", P, [_Params]), ("ggml_free", None, [P]),
                          ("ggml_new_tensor_2d", P, [P, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]),
                          ("ggml_mul_mat", P, [P, P, P]), ("ggml_new_graph", P, [P]), ("ggml_build_forward_expand", None, [P, P]),
                          ("ggml_get_data", P, [P]), ("ggml_nbytes", ctypes.c_size_t, [P]), ("ggml_tensor_overhead", ctypes.c_size_t, []),
                          ("ggml_graph_overhead", ctypes.c_size_t, [])]:
    f = getattr(base, name); f.restype, f.argtypes = res, args
  cpu.ggml_cpu_init.restype, cpu.ggml_cpu_init.argtypes = None, []
  cpu.ggml_graph_plan.restype, cpu.ggml_graph_plan.argtypes = _Plan, [P, ctypes.c_int, P]
  cpu.ggml_graph_compute.restype, cpu.ggml_graph_compute.argtypes = ctypes.c_int, [P, ctypes.POINTER(_Plan)]
  cpu.ggml_cpu_init()
  return base, cpu

class GgmlMatmul:
  """out (M, N) = x (M, K) @ W.T with W (N, K) as `raw` (N, row bytes) of GGML type `ggml_type`, by ggml on `threads` threads."""
  def __init__(self, raw: np.ndarray, ggml_type: int, shape: tuple[int, int], x: np.ndarray, threads: int = 1):
    base, self.cpu = _libs()
    (N, K), M = shape, x.shape[0]
    size = raw.nbytes + x.nbytes + 4 * M * N + 3 * base.ggml_tensor_overhead() + base.ggml_graph_overhead() + (1 << 20)
    self.ctx = base.ggml_init(_Params(size, None, False))
    if not self.ctx: raise RuntimeError("ggml_init failed")
    self.base, self.threads, self.shape = base, threads, (M, N)
    w = base.ggml_new_tensor_2d(self.ctx, ggml_type, K, N)
    xt = base.ggml_new_tensor_2d(self.ctx, 0, K, M)   # GGML_TYPE_F32
    if base.ggml_nbytes(w) != raw.nbytes: raise ValueError(f"ggml sizes this weight at {base.ggml_nbytes(w)} bytes, the blocks are {raw.nbytes}")
    ctypes.memmove(base.ggml_get_data(w), np.ascontiguousarray(raw).ctypes.data, raw.nbytes)
    ctypes.memmove(base.ggml_get_data(xt), np.ascontiguousarray(x, dtype=np.float32).ctypes.data, x.nbytes)
    self.out = base.ggml_mul_mat(self.ctx, w, xt)
    self.graph = base.ggml_new_graph(self.ctx)
    base.ggml_build_forward_expand(self.graph, self.out)
    self.plan = self.cpu.ggml_graph_plan(self.graph, threads, None)
    self.work = np.empty(max(self.plan.work_size, 1) + 64, np.uint8)   # x in its vec_dot type and per-thread scratch
    self.plan.work_data = self.work.ctypes.data + (-self.work.ctypes.data) % 64

  def __call__(self) -> None:
    if self.cpu.ggml_graph_compute(self.graph, ctypes.byref(self.plan)) != 0: raise RuntimeError("ggml_graph_compute failed")

  def result(self) -> np.ndarray:
    M, N = self.shape
    return np.ctypeslib.as_array(ctypes.cast(self.base.ggml_get_data(self.out), ctypes.POINTER(ctypes.c_float)), (M, N)).copy()

  def __del__(self):
    if getattr(self, "ctx", None): self.base.ggml_free(self.ctx)
