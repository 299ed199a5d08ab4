"""A hand-written C function as a tinygrad custom kernel: Tensor.custom_kernel(..., fxn=c_program(...)) runs `src`'s function
`name` over the Tensors' buffers, scheduled, captured by TinyJit and run by the worker pool (runtime/cpu_pool.py) like any
other kernel. Past one part the function's last argument is the part id (core_id), which the pool fills in for each part."""
from __future__ import annotations
import dataclasses
from tinygrad import dtypes
from tinygrad.uop.ops import KernelInfo, Ops, ProgramInfo, UOp

def c_program(name: str, src: str, parts: int, n_bufs: int, outs: tuple[int, ...] = (0,), ins: tuple[int, ...] | None = None):
  """The custom kernel's PROGRAM for C function `name` of `src`: n_bufs buffers (outs written, ins read: by default the first
  written, the rest read), then, past one part, the part id."""
  ins = tuple(range(1, n_bufs)) if ins is None else ins
  def program(*params: UOp) -> UOp:
    core = UOp.variable("core_id", 0, parts - 1, dtypes.int, param=True) if parts > 1 else None
    if core is not None: core = core.replace(arg=dataclasses.replace(core.arg, slot=n_bufs))
    sink = UOp.sink(*params, *([core] if core is not None else []), arg=KernelInfo(name=name))
    info = ProgramInfo(name=name, global_size=(parts, 1, 1), vars=(core,) if core is not None else (), globals=tuple(range(n_bufs)),
                       outs=outs, ins=ins)
    return UOp(Ops.PROGRAM, src=(sink, UOp(Ops.LINEAR, src=(*sink.src, sink)), UOp(Ops.SOURCE, arg=src)), arg=info)
  return program
