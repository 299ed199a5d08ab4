"""Every core for HET on a CPU and for MESH: tinygrad's CPU kernels split in parts, the parts run by a native worker pool.

tinygrad 0.14 renders a CPU kernel in N parts (a `core_id` argument, NUM_CPU_THREADS at compile time; its heuristic
splits only kernels of at least ~128K operations per part, so small kernels stay whole) and then runs the parts one after
another on one thread. HET's and MESH's CPU devices replace two pieces of that device with their own, through the hooks
tinygrad has for them (a device's runtime class and its graph class; tinygrad itself is unchanged):

  PoolProgram   one kernel launch: its parts go to the worker pool (tinyhet.runtime.cpu_pool) and run side by side
  PoolGraph     a TinyJit capture: the whole list of kernels goes to the pool in one native call, barriers between them

The thread count is TINYHET_CPU_THREADS (config cpu_threads); 0, the default, means the CPUs this process may run on
(os.sched_getaffinity). 1 keeps kernels unsplit, run on the calling thread, as tinygrad does (a TinyJit capture still
goes to C in one call).
"""
from __future__ import annotations
import functools, os, time
from tinygrad import Context
from tinygrad.engine.jit import GraphRunner
from tinygrad.runtime.ops_cpu import CPUProgram
from tinygrad.uop.ops import UOp
from tinyhet.runtime.cpu_pool import MAX_ARGS, Command, CpuPool, cpu_pool

def available_cpus() -> int:
  """The CPUs this process may run on (its affinity mask, which taskset, cgroups' cpusets and numactl narrow)."""
  try: return len(os.sched_getaffinity(0))
  except (AttributeError, OSError): return os.cpu_count() or 1

@functools.cache
def configured_threads() -> int:
  """The thread count for HET-on-CPU and MESH kernels: TINYHET_CPU_THREADS (or the config file's cpu_threads), else every
  available CPU. Read once per process: kernels are compiled for it."""
  from tinyhet.config import load_config
  n = load_config().cpu_threads
  return n if n > 0 else available_cpus()

def pool() -> CpuPool: return cpu_pool(configured_threads())

def pool_threads(device: str | None) -> int:
  """The configured thread count if `device` runs its kernels on the worker pool (HET on a CPU, MESH), else 0."""
  from tinygrad import Device
  if device is not None and not isinstance(device, str): return 0     # a multi-device tensor
  name = Device.canonicalize(device) if device is not None else Device.DEFAULT
  runs_parallel = isinstance(getattr(Device[name], "runtime_t", None), type) and issubclass(Device[name].runtime_t, PoolProgram)
  return configured_threads() if runs_parallel else 0

def kernel_threads(device: str | None) -> Context:
  """The compile context for kernels on `device`: split over the configured threads on HET (CPU) and MESH, whose runtime
  runs the parts in parallel; unsplit elsewhere (tinygrad's own CPU device would run the parts one after another and only
  pay for the split; GPU backends ignore the setting)."""
  return Context(NUM_CPU_THREADS=pool_threads(device) or 1)

def _fill(cmd: Command, fn: int, args: list[int], core_slot: int | None, parts: int):
  if len(args) > MAX_ARGS: raise RuntimeError(f"CPU programs take at most {MAX_ARGS} arguments, got {len(args)}")
  cmd.fn, cmd.nargs, cmd.parts = fn, len(args), parts
  cmd.core_slot = -1 if core_slot is None else core_slot
  cmd.args[:len(args)] = args

class PoolProgram(CPUProgram):
  """A compiled CPU kernel whose parts (core_id 0..N-1) run on the worker pool instead of one after another."""
  def __call__(self, *bufs, global_size=(1, 1, 1), local_size=(1, 1, 1), vals=(), wait=False, timeout=None):
    if self.lvp: return super().__call__(*bufs, global_size=global_size, local_size=local_size, vals=vals, wait=wait, timeout=timeout)
    st = time.perf_counter()
    args = [int(b.va_addr) for b in bufs] + [0 if v is None else int(v) for v in vals]
    cmd = (Command * 1)()
    _fill(cmd[0], self.addr, args, self.runtimevars.get("core_id"), int(global_size[0]))
    pool().run(cmd)
    return time.perf_counter() - st if wait else None

class PoolGraph(GraphRunner):
  """A TinyJit capture on HET (CPU) or MESH as one array of launches, run by the pool in one call. Input buffers, bound
  Variables and symbolic launch sizes are patched into the array before each run, as tinygrad's CUDA graph does."""
  def __init__(self, linear: UOp, input_uops: tuple[UOp, ...] = ()):
    super().__init__(linear, input_uops)
    self.cmds = (Command * len(self.calls))()
    self.arg_pos: list[dict[int, int]] = []     # per launch: call argument index -> position in the kernel's arguments
    for j, ((_, prg, bufs, device_vars), rt) in enumerate(zip(self.calls, self.runtimes)):
      info = prg.arg
      pos = {g: i for i, g in enumerate(info.globals)}
      args = [int(bufs[g].get_buf(bufs[g].device).va_addr) for g in info.globals]
      args += [int(device_vars.get(v.expr, 0)) for v in info.vars]
      core = info.runtimevars.get("core_id")
      global_size, _ = info.launch_dims({v: 0 for v in self.vars})
      _fill(self.cmds[j], rt.addr, args, None if core is None else len(info.globals) + core, int(global_size[0]))
      self.arg_pos.append(pos)
    self.n_globals = [len(c[1].arg.globals) for c in self.calls]

  def __call__(self, input_uops: tuple[UOp, ...], var_vals: dict[str, int], wait=False) -> float | None:
    st = time.perf_counter()
    for j, replace in enumerate(self.uop_replace):
      for p, slot in replace:
        if (i := self.arg_pos[j].get(p)) is not None:
          buf = input_uops[slot].buffer
          self.cmds[j].args[i] = int(buf.get_buf(buf.device).va_addr)
    for j, i, v in self.updated_vars(var_vals): self.cmds[j].args[self.n_globals[j] + i] = int(v)
    for j, global_dims, _ in self.updated_launch_dims(var_vals): self.cmds[j].parts = int(global_dims[0])
    pool().run(self.cmds)
    return time.perf_counter() - st if wait else None

def use_pool(device) -> None:
  """Give a tinygrad CPU device (HET on a CPU, MESH) the pool's runtime and graph."""
  device.runtime_t, device.graph = PoolProgram, PoolGraph
