"""NUMA placement of host memory through the kernel's memory-policy calls (mbind, move_pages), by ctypes and the syscall
numbers (libc does not wrap them; libnuma is not needed).

  online_nodes()                 the NUMA nodes with memory, from /sys/devices/system/node/online
  interleave(addr, nbytes)       pages of the range, when first touched, alternate over the nodes (MPOL_INTERLEAVE)
  page_nodes(addr, nbytes)       the node each page of the range is on now (move_pages in query mode; -errno if not present)
  policy_of(addr)                the range's policy as /proc/self/numa_maps shows it ("interleave:0-1", "default", ...)
  bind(addr, nbytes, node)       pages of the range, when first touched, land on that node (MPOL_BIND)
  cpu_nodes()                    the node of each CPU, from /sys/devices/system/node/node*/cpulist

A policy set before any page is touched decides where the pages land; pages already there stay (mbind without MPOL_MF_MOVE).
"""
from __future__ import annotations
import ctypes, os, platform

MPOL_DEFAULT, MPOL_PREFERRED, MPOL_BIND, MPOL_INTERLEAVE = 0, 1, 2, 3
_SYSCALLS = {"x86_64": {"mbind": 237, "move_pages": 279}, "aarch64": {"mbind": 235, "move_pages": 239}}
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long

def _nr(name: str) -> int:
  table = _SYSCALLS.get(platform.machine())
  if table is None: raise OSError(f"NUMA placement: no syscall numbers for {platform.machine()}")
  return table[name]

def parse_node_list(text: str) -> list[int]:
  """'0', '0-3', '0,2-3' (the kernel's node list format) -> [0, 2, 3]."""
  out: list[int] = []
  for part in text.strip().split(","):
    if not part: continue
    lo, dash, hi = part.partition("-")
    if not lo.isdigit() or (dash and not hi.isdigit()) or (hi and int(hi) < int(lo)): raise ValueError(f"not a node list: {text!r}")
    out.extend(range(int(lo), int(hi or lo) + 1))
  return out

def online_nodes() -> list[int]:
  try:
    with open("/sys/devices/system/node/has_memory") as f: return parse_node_list(f.read())
  except OSError: return [0]

def interleave(addr: int, nbytes: int, nodes: list[int] | None = None) -> None:
  """Interleave the pages of [addr, addr + nbytes) over nodes (default: every node with memory) as they are first touched.
  addr must be page-aligned. Raises OSError with the kernel's reason."""
  _mbind(addr, nbytes, MPOL_INTERLEAVE, online_nodes() if nodes is None else nodes)

def _mbind(addr: int, nbytes: int, mode: int, nodes: list[int]) -> None:
  if not nodes or min(nodes) < 0 or max(nodes) >= 1024: raise ValueError(f"mbind: bad node list {nodes}")
  mask = (ctypes.c_ulong * 16)()
  for n in nodes: mask[n // 64] |= 1 << (n % 64)
  if _libc.syscall(_nr("mbind"), ctypes.c_void_p(addr), ctypes.c_ulong(nbytes), mode, mask, ctypes.c_ulong(1024 + 1), 0) != 0:
    e = ctypes.get_errno()
    name = {MPOL_INTERLEAVE: "MPOL_INTERLEAVE", MPOL_BIND: "MPOL_BIND"}.get(mode, f"mode {mode}")
    raise OSError(e, f"mbind({name}) of {nbytes} bytes at {addr:#x}: {os.strerror(e)}")

def bind(addr: int, nbytes: int, node: int) -> None:
  """The pages of [addr, addr + nbytes) land on `node` when first touched (page-aligned addr). OSError with the reason."""
  _mbind(addr, nbytes, MPOL_BIND, [node])

def cpu_nodes() -> dict[int, int]:
  """CPU -> its NUMA node ({} where /sys does not say: one node, or no NUMA)."""
  out: dict[int, int] = {}
  base = "/sys/devices/system/node"
  try: names = [n for n in os.listdir(base) if n.startswith("node") and n[4:].isdigit()]
  except OSError: return out
  for name in names:
    try:
      with open(f"{base}/{name}/cpulist") as f: out.update((cpu, int(name[4:])) for cpu in parse_node_list(f.read()))
    except (OSError, ValueError): continue
  return out

def page_nodes(addr: int, nbytes: int, page: int = 4096) -> list[int]:
  """The node of each page of the range (a negative errno for a page not present: -2 ENOENT, -14 EFAULT)."""
  count = -(-nbytes // page)
  pages = (ctypes.c_void_p * count)(*[addr + i * page for i in range(count)])
  status = (ctypes.c_int * count)()
  if _libc.syscall(_nr("move_pages"), 0, ctypes.c_ulong(count), pages, None, status, 0) != 0:
    e = ctypes.get_errno()
    raise OSError(e, f"move_pages query of {count} pages at {addr:#x}: {os.strerror(e)}")
  return list(status)

def policy_of(addr: int) -> str | None:
  """The memory policy of the mapping that starts at addr, from /proc/self/numa_maps; None if no mapping starts there."""
  try:
    with open("/proc/self/numa_maps") as f:
      for line in f:
        start, _, rest = line.partition(" ")
        if int(start, 16) == addr: return rest.split()[0]
  except OSError: return None
  return None
