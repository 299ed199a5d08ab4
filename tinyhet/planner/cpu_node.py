"""A CPU decode node kernel by kernel: each decode-path kernel's time from one core's figures, a read-bandwidth roofline
per socket and the worker pool's cost per launch, for any thread count, batch, context and model shape.

roofline.py sees a CPU node as one device (FLOP/s, bytes/s). Here the node is sockets x cores, and a decode step is the
kernels tinyhet runs (kernels/quant_matmul.py and its int8/bf16 tiled kernels, kernels/cpu_attention.py, tinygrad's small
kernels) each split in parts the way the kernel splits it today:

  kernel time = max(compute, memory) + dispatch
    compute   = one core's time x (rows of the largest part / rows) + the work every part repeats (a tiled int8/bf16
                kernel rounds all of x into its own scratch: that does not shrink with the parts)
    memory    = bytes read / bandwidth of the parts' cores: per socket min(active cores x one core's read rate, the
                socket's), summed; weights replicated per socket (numa = replicate) read locally, otherwise a socket's
                reads from the other node's memory cross the link between them (at most its bandwidth per direction)
    dispatch  = the pool's cost to start a kernel of p parts and meet its parts at the barrier: base + per_part x (p - 1)
  step time   = the kernels + the host's time outside them (Python, the capture's input patching: serial)

Caches are not modelled: every step reads the weights and the KV from memory (right for a 70B model, pessimistic for a
model that fits in the last-level cache). CoreFigures come from `tinyhet bench bignode` (bench/bignode.py) on this
machine at one thread. Every function is arithmetic; bad inputs raise ValueError in one line.
"""
from __future__ import annotations
import math
from dataclasses import dataclass, field

MIN_ROWS_PER_PART = 16                 # kernels/quant_matmul.py's (tests/test_cpu_node.py holds them equal)
INT8_TILED_MIN_M = {32: 4, 256: 16}    # kernels/quant_matmul.py's: rows of x from which the int8 mode's tiled kernel runs
BF16_TILED_MIN_M = 4
NUMA_MODES = ("replicate", "interleave", "off")
# bytes per weight of each GGML type (a block's bytes / its weights) and the weights per block
TYPE_BYTES = {"Q4_0": 18 / 32, "Q4_1": 20 / 32, "Q5_0": 22 / 32, "Q5_1": 24 / 32, "Q8_0": 34 / 32, "Q4_K": 144 / 256,
              "Q5_K": 176 / 256, "Q6_K": 210 / 256, "F16": 2.0, "BF16": 2.0}
BLOCK = {"Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32, "Q8_0": 32, "Q4_K": 256, "Q5_K": 256, "Q6_K": 256, "F16": 0, "BF16": 0}
KV_BYTES = 2                           # float16 KV
MODES = ("float", "int8")

def _check(ok: bool, what: str):
  if not ok: raise ValueError(what)

@dataclass(frozen=True)
class CpuNode:
  """sockets x cores_per_socket cores; bandwidths in bytes/s (reading), dispatch in seconds. Pool threads are pinned in
  order: threads 0..cores_per_socket-1 on socket 0, the next on socket 1, ..."""
  name: str
  sockets: int
  cores_per_socket: int
  socket_bandwidth: float
  core_bandwidth: float
  link_bandwidth: float = 0.0      # between two sockets, per direction
  numa: str = "replicate"
  dispatch_base: float = 0.0
  dispatch_per_part: float = 0.0
  source: str = ""

  def __post_init__(self):
    _check(self.sockets >= 1 and self.cores_per_socket >= 1, f"cpu node {self.name}: sockets and cores_per_socket must be >= 1, "
           f"got {self.sockets} and {self.cores_per_socket}")
    _check(self.socket_bandwidth > 0 and self.core_bandwidth > 0, f"cpu node {self.name}: bandwidths must be > 0 bytes/s")
    _check(self.numa in NUMA_MODES, f"cpu node {self.name}: numa {self.numa!r} is not one of {', '.join(NUMA_MODES)}")
    _check(self.sockets == 1 or self.numa == "replicate" or self.link_bandwidth > 0,
           f"cpu node {self.name}: {self.sockets} sockets with numa {self.numa} need link_bandwidth > 0")
    _check(self.dispatch_base >= 0 and self.dispatch_per_part >= 0, f"cpu node {self.name}: dispatch costs must be >= 0 s")

  @property
  def threads(self) -> int: return self.sockets * self.cores_per_socket

def cores_per_socket_used(node: CpuNode, parts: int) -> list[int]:
  """Cores busy on each socket when a kernel runs in `parts` parts (threads 0..parts-1, pinned in order)."""
  _check(parts >= 1, f"parts must be >= 1, got {parts}")
  busy = min(parts, node.threads)
  return [max(0, min(node.cores_per_socket, busy - s * node.cores_per_socket)) for s in range(node.sockets)]

def read_bandwidth(node: CpuNode, parts: int, numa: str | None = None) -> float:
  """Bytes/s that `parts` parts read. replicate: each socket reads its own copy; interleave: half of a socket's reads are
  the other node's pages (at most the link per direction); off: every page on node 0 (its memory serves all)."""
  numa = numa or node.numa
  used = cores_per_socket_used(node, parts)
  want = [c * node.core_bandwidth for c in used]
  if node.sockets == 1 or numa == "replicate": return sum(min(w, node.socket_bandwidth) for w in want)
  if numa == "interleave": return min(sum(min(w, node.socket_bandwidth, 2 * node.link_bandwidth) for w in want), node.sockets * node.socket_bandwidth)
  remote = sum(min(w, node.link_bandwidth) for w in want[1:])
  return min(min(want[0], node.socket_bandwidth) + remote, node.socket_bandwidth)

def dispatch_time(node: CpuNode, parts: int) -> float:
  """Seconds the pool adds to one launch of `parts` parts (waking parts - 1 workers, meeting them at the barrier)."""
  _check(parts >= 1, f"parts must be >= 1, got {parts}")
  return node.dispatch_base + node.dispatch_per_part * (min(parts, node.threads) - 1)

@dataclass(frozen=True)
class Kernel:
  """One launch: `rows` units of work split in `parts` contiguous ranges, `compute_s` of them on one core with the data
  in cache, `repeated_s` of work each part does whole (x rounded into its scratch), `nbytes` read from memory."""
  name: str
  rows: int
  parts: int
  compute_s: float
  nbytes: float
  repeated_s: float = 0.0
  numa: str | None = None          # the bytes' placement, when not the node's (the KV is not replicated)

  def __post_init__(self):
    _check(self.rows >= 1 and self.parts >= 1, f"kernel {self.name}: rows and parts must be >= 1, got {self.rows} and {self.parts}")
    _check(min(self.compute_s, self.nbytes, self.repeated_s) >= 0, f"kernel {self.name}: times and bytes must be >= 0")

@dataclass(frozen=True)
class KernelTime:
  compute: float
  memory: float
  dispatch: float
  @property
  def total(self) -> float: return max(self.compute, self.memory) + self.dispatch

def kernel_time(node: CpuNode, k: Kernel) -> KernelTime:
  """The kernel's (compute, memory, dispatch) seconds on `node` (see the module's docstring)."""
  active = min(k.parts, k.rows, node.threads)
  per_part_rows = math.ceil(k.rows / min(k.parts, k.rows))
  rounds = math.ceil(min(k.parts, k.rows) / node.threads)   # more parts than threads: a thread takes several
  compute = rounds * (k.compute_s * per_part_rows / k.rows + k.repeated_s)
  return KernelTime(compute, k.nbytes / read_bandwidth(node, active, k.numa), dispatch_time(node, k.parts))

def kernel_parts(rows: int, threads: int) -> int:
  """kernels/quant_matmul.py's split: every thread, unless a part would get fewer than MIN_ROWS_PER_PART weight rows."""
  _check(rows >= 1 and threads >= 1, f"rows and threads must be >= 1, got {rows} and {threads}")
  return max(1, min(threads, rows // MIN_ROWS_PER_PART))

def attention_splits(rows: int, threads: int, cap: int) -> int:
  """kernels/paged_attention.py's decode_splits for the C kernel: parts along each row's context when the rows alone do
  not give every thread a part."""
  if threads <= 1 or rows % threads == 0 or rows >= 4 * threads: return 1
  return max(1, min(threads, cap))

# --- the model's shape and its files' formats --------------------------------------------------------------------------

@dataclass(frozen=True)
class Shape:
  """A Llama-style decoder's decode path: per layer q, k, v, o, gate, up, down; the logits once."""
  name: str
  layers: int
  hidden: int
  ffn: int
  heads: int
  kv_heads: int
  head_dim: int
  vocab: int

  def matrices(self) -> list[tuple[str, int, int, int]]:
    """(label, rows N, columns K, launches per step) of every matrix product of a decode step."""
    q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
    L = self.layers
    return [("q", q, self.hidden, L), ("k", kv, self.hidden, L), ("v", kv, self.hidden, L), ("o", self.hidden, q, L),
            ("gate", self.ffn, self.hidden, L), ("up", self.ffn, self.hidden, L), ("down", self.hidden, self.ffn, L),
            ("output", self.vocab, self.hidden, 1)]

  @property
  def weight_elements(self) -> int: return sum(n * k * c for _, n, k, c in self.matrices())

SHAPES = {s.name: s for s in [
  Shape("smollm2-135m", 30, 576, 1536, 9, 3, 64, 49152),
  Shape("llama-3-70b", 80, 8192, 28672, 64, 8, 128, 128256),
]}

@dataclass(frozen=True)
class Format:
  """A file's types: `types` per matrix label as (type, share of the layers) pairs; labels not named use `default`."""
  name: str
  default: str
  types: dict = field(default_factory=dict)

  def of(self, label: str) -> list[tuple[str, float]]:
    return self.types.get(label, [(self.default, 1.0)])

# llama.cpp's Q4_K_M: attn_v and ffn_down in Q6_K in half the layers (its use_more_bits: the first and last eighth and
# every third between), the output in Q6_K; the other quantized files keep the output in Q6_K below 8 bits
FORMATS = {f.name: f for f in [
  Format("Q4_K_M", "Q4_K", {"v": [("Q6_K", 0.5), ("Q4_K", 0.5)], "down": [("Q6_K", 0.5), ("Q4_K", 0.5)], "output": [("Q6_K", 1.0)]}),
  Format("Q6_K", "Q6_K"),
  Format("Q8_0", "Q8_0"),
  Format("F16", "F16"),
  Format("BF16", "BF16"),
  Format("Q4_1", "Q4_1", {"output": [("Q6_K", 1.0)]}),
  Format("Q4_1-embedded", "Q4_1", {"output": [("Q8_0", 1.0)]}),   # the embedded SmolLM2: tied output stored Q8_0
]}

def weight_bytes(shape: Shape, fmt: Format) -> float:
  return sum(n * k * c * TYPE_BYTES[t] * share for label, n, k, c in shape.matrices() for t, share in fmt.of(label))

def matmul_kernel(type_: str, mode: str, rows_x: int) -> str:
  """Which kernel quant_matmul runs: "decode" or "tiled" (float x), "decode8" (the K-quants' int8 decode kernel, x per
  super-block), "int8t" or "bf16t" (tiled, x rounded by every part into its scratch)."""
  _check(type_ in TYPE_BYTES, f"unknown type {type_!r}: use one of {', '.join(TYPE_BYTES)}")
  _check(mode in MODES, f"mode {mode!r} is not one of {', '.join(MODES)}")
  _check(rows_x >= 1, f"rows of x must be >= 1, got {rows_x}")
  if mode == "int8" and BLOCK[type_] and rows_x >= INT8_TILED_MIN_M[BLOCK[type_]]: return "int8t"
  if mode == "int8" and type_ == "BF16" and rows_x >= BF16_TILED_MIN_M: return "bf16t"
  if mode == "int8" and BLOCK[type_] == 256: return "decode8"
  return "decode" if rows_x <= 32 else "tiled"
