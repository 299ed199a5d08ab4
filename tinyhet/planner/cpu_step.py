"""A decode step on a CPU node (cpu_node.py), kernel by kernel, from one core's figures (CoreFigures), and what bounds it.

A step of `batch` sequences at `context` tokens each runs, per layer: seven matrix products (q, k, v, o, gate, up, down;
each split in kernel_parts(rows, threads) parts), one paged-attention launch over batch x kv_heads x splits work items
(every thread a part; a second, merging launch when the context is split), tinygrad's small kernels (norms, RoPE, SiLU,
residuals, the KV scatter: unsplit at these sizes) and the host's work between them; then the logits' product.

Where the time goes is put in buckets, and the largest one is the step's wall:
  bandwidth            kernels whose bytes take longer than their compute
  compute              kernels bound by their cores with every thread busy (the time falls with more cores)
  too few rows         compute-bound kernels with fewer parts than threads (MIN_ROWS_PER_PART rows, or fewer work items)
  x rounded per part   compute-bound kernels where the work every part repeats (x into its scratch) is most of a part's
  dispatch             the pool's cost to start and meet the parts
  serial               the host's time and the unsplit small kernels
"""
from __future__ import annotations
import math
from dataclasses import dataclass, field
from tinyhet.planner.cpu_node import (KV_BYTES, CpuNode, Format, Kernel, KernelTime, Shape, TYPE_BYTES, _check, attention_splits,
                                      dispatch_time, kernel_parts, kernel_time, matmul_kernel)

BUCKETS = ("bandwidth", "compute", "too few rows", "x rounded per part", "dispatch", "serial")

@dataclass(frozen=True)
class CoreFigures:
  """One core's figures (seconds), fitted by bench/bignode.py from runs at one thread.
  matmul[(type, rows of x, kernel)] = (s a part repeats whole, s per weight byte) with the matrix in cache;
  attention = (s a launch, s per KV byte); small = (s per layer, s per layer per element of the batch's hidden state),
  small_launches its launches per layer; host = (s per layer, s per layer per sequence) outside the kernels."""
  matmul: dict = field(default_factory=dict)
  attention: tuple[float, float] = (0.0, 0.0)
  small: tuple[float, float] = (0.0, 0.0)
  small_launches: int = 0
  host: tuple[float, float] = (0.0, 0.0)
  source: str = ""

  def matmul_figure(self, type_: str, rows_x: int, kernel: str) -> tuple[float, float]:
    key = (type_, rows_x, kernel)
    if key not in self.matmul:
      have = ", ".join(f"{t}/{m}/{k}" for t, m, k in sorted(self.matmul)) or "none"
      raise ValueError(f"no per-core figure for the {kernel} kernel of {type_} at {rows_x} rows of x (have: {have}): "
                       "bench bignode measures only the kernels of the embedded SmolLM2 (Q4_1, Q8_0)")
    return self.matmul[key]

@dataclass(frozen=True)
class Launch:
  kernel: Kernel
  time: KernelTime
  count: int      # launches per step

  @property
  def total(self) -> float: return self.count * self.time.total

@dataclass(frozen=True)
class Step:
  """A predicted decode step: its launches, the serial time, and the buckets of cpu_step's docstring."""
  launches: list[Launch]
  serial: float
  batch: int
  threads: int

  @property
  def seconds(self) -> float: return sum(x.total for x in self.launches) + self.serial
  @property
  def tok_s(self) -> float: return self.batch / self.seconds

  def buckets(self) -> dict[str, float]:
    out = dict.fromkeys(BUCKETS, 0.0)
    out["serial"] = self.serial
    for x in self.launches:
      t, k = x.time, x.kernel
      out["dispatch"] += x.count * t.dispatch
      if t.memory >= t.compute: out["bandwidth"] += x.count * t.memory
      elif k.repeated_s and 2 * k.repeated_s * math.ceil(min(k.parts, k.rows) / self.threads) >= t.compute:
        out["x rounded per part"] += x.count * t.compute
      elif min(k.parts, k.rows) < self.threads: out["too few rows"] += x.count * t.compute
      else: out["compute"] += x.count * t.compute
    return out

  def wall(self) -> str:
    """The largest bucket and its share of the step, e.g. "bandwidth (71%)"."""
    b = self.buckets()
    top = max(b, key=b.get)
    return f"{top} ({b[top] / self.seconds:.0%})"

  def groups(self) -> dict[str, float]:
    """Seconds per kernel group of a step: matmul per (label, type), attention, small kernels."""
    out: dict[str, float] = {}
    for x in self.launches: out[x.kernel.name] = out.get(x.kernel.name, 0.0) + x.total
    return out

def matmul_launches(node: CpuNode, shape: Shape, fmt: Format, mode: str, batch: int, fig: CoreFigures) -> list[Launch]:
  out = []
  for label, n, k, count in shape.matrices():
    for type_, share in fmt.of(label):
      kern = matmul_kernel(type_, mode, batch)
      repeated, per_byte = fig.matmul_figure(type_, batch, kern)
      nbytes = n * k * TYPE_BYTES[type_]
      kernel = Kernel(f"{label} {type_} {kern}", n, kernel_parts(n, node.threads), per_byte * nbytes, nbytes, repeated)
      launches = count * share
      out.append(Launch(kernel, kernel_time(node, kernel), launches))
  return out

def attention_launches(node: CpuNode, shape: Shape, batch: int, context: int, fig: CoreFigures) -> list[Launch]:
  """The paged attention of every layer: its KV is not replicated (numa interleave where the weights are replicated)."""
  splits = attention_splits(batch, node.threads, math.ceil((context + 1) / 16))
  nbytes = batch * context * 2 * shape.kv_heads * shape.head_dim * KV_BYTES
  a, per_byte = fig.attention
  numa = "interleave" if node.numa == "replicate" and node.sockets > 1 else None
  kernel = Kernel("attention", batch * shape.kv_heads * splits, node.threads, a + per_byte * nbytes, nbytes, numa=numa)
  out = [Launch(kernel, kernel_time(node, kernel), shape.layers)]
  if splits > 1:
    merge = Kernel("attention merge", batch * shape.heads, node.threads, 0.0, batch * shape.heads * splits * (shape.head_dim + 2) * 4)
    out.append(Launch(merge, kernel_time(node, merge), shape.layers))
  return out

def serial_time(node: CpuNode, shape: Shape, batch: int, fig: CoreFigures) -> float:
  """The host's time outside the kernels and tinygrad's small unsplit kernels (with their launches)."""
  host = shape.layers * (fig.host[0] + fig.host[1] * batch)
  small = shape.layers * (fig.small[0] + fig.small[1] * batch * shape.hidden + fig.small_launches * dispatch_time(node, 1))
  return host + small

def decode_step(node: CpuNode, shape: Shape, fmt: Format, mode: str, batch: int, context: int, fig: CoreFigures) -> Step:
  """The predicted decode step of `batch` sequences at `context` tokens of `shape` in file format `fmt` on `node`."""
  _check(batch >= 1, f"batch must be >= 1, got {batch}")
  _check(context >= 1, f"context must be >= 1 token, got {context}")
  launches = matmul_launches(node, shape, fmt, mode, batch, fig) + attention_launches(node, shape, batch, context, fig)
  return Step(launches, serial_time(node, shape, batch, fig), batch, node.threads)
