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
import functools, hashlib, os, time
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
  wide_thread_split()       # kernels for it may split into more than tinygrad's 32 parts

TINYGRAD_MAX_PARTS = 32   # the largest split tinygrad's heuristic tries (codegen/opt/heuristic.py: threads in [32, 16, 12, ...])

def more_parts(k, split_k, ops_per_part: int = 128 << 10):
  """tinygrad's heuristic split k (copied before it ran: k) into at most 32 parts, trying only 32, 16, 12, 8, 6, 5, 4, 3, 2;
  where that is fewer than the threads (its renderer's global_max, NUM_CPU_THREADS at compile time), redo its last step
  with the most parts n <= threads that divide a loop and keep >= 128K operations each, its own rule (24 threads: 24
  parts, not 16; 64: 64, not 32). Returns the kernel to use."""
  from tinygrad.codegen.opt import KernelOptError, Opt, OptOps
  from tinygrad.helpers import prod
  from tinygrad.uop.ops import AxisType, resolve
  ren = split_k.ren
  if not (ren.has_threads and ren.global_max): return split_k
  threads, opts = ren.global_max[0], list(split_k.applied_opts)
  have = opts[-1].arg if opts and opts[-1].op is OptOps.THREAD else 1
  if have >= threads: return split_k
  base = opts[:-1] if have > 1 else opts
  try:
    kk = k.copy()
    for o in base: kk.apply_opt(o)
  except KernelOptError: return split_k
  for n in range(threads, have, -1):
    if resolve(prod(kk.full_shape) // ops_per_part < n): continue
    for axis in kk.axes_of(AxisType.WEAK):
      if kk.full_shape[axis] % n: continue
      try:
        out = kk.copy()
        out.apply_opt(Opt(OptOps.THREAD, axis, n))
        return out
      except KernelOptError: break
  return split_k

@functools.cache
def wide_thread_split() -> None:
  """Install more_parts around tinygrad's hand_coded_optimizations (postrange imports it by name when it optimizes a kernel,
  so the module attribute is the hook); once per process."""
  import inspect
  from tinygrad.codegen.opt import heuristic
  from tinygrad.engine import worker
  original = heuristic.hand_coded_optimizations
  def hand_coded_optimizations(k):
    before = k.copy()
    return more_parts(before, original(k))
  # its version, part of a program's key in the disk cache of generated programs (tinyhet.device.program_cache)
  hand_coded_optimizations.tinyhet_hook = hashlib.sha256(inspect.getsource(more_parts).encode()).hexdigest()[:16]
  heuristic.hand_coded_optimizations = hand_coded_optimizations
  # tinygrad generates the code of a list of kernels in a pool of spawned processes, which import tinygrad alone: without
  # this their kernels split as tinygrad's heuristic does (24 threads: 16 parts), only the ones generated here as above
  if worker._init_worker is not compile_worker_init:
    worker._tinygrad_init_worker, worker._init_worker = worker._init_worker, compile_worker_init
    worker.terminate_worker_pool()          # one started before: its workers lack the hook

def compile_worker_init() -> None:
  """The initializer of tinygrad's code-generation worker processes: tinygrad's own, then the hook (wide_thread_split)."""
  from tinygrad.engine import worker
  wide_thread_split()                     # in this new process: the hook, and worker._tinygrad_init_worker set
  worker._tinygrad_init_worker()
