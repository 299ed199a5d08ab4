"""tinyhet: one LLM across unlike machines. Prefill on a compute-dense accelerator (device HET), decode on a big-memory
CPU node (device MESH), KV cache streamed between them layer by layer over RDMA, TCP or shared memory.

`import tinyhet` makes Device["HET"] and Device["MESH"] available in tinygrad (see tinyhet.device.backend)."""
from __future__ import annotations
import sys, types, weakref
from tinyhet.config import Config, ConfigError, load_config
from tinyhet.device.memory import local_node

def _install_devices():
  """tinygrad has no device registry: Device["X"] imports tinygrad.runtime.ops_x and takes its XDevice class. Put two small
  modules under those names whose classes load tinyhet.device.backend (and tinygrad) only when a device is opened, so that
  `import tinyhet` stays light."""
  for name in ("het", "mesh"):
    cls_name = f"{name.capitalize()}Device"
    def new(cls, device: str = name.upper(), cls_name=cls_name):
      from tinyhet.device import backend as devices
      return getattr(devices, cls_name)(device)
    mod = types.ModuleType(f"tinygrad.runtime.ops_{name}", f"tinyhet's {name.upper()} device (see tinyhet.device.backend)")
    setattr(mod, cls_name, type(cls_name, (), {"__new__": new, "__doc__": f"Device[{name.upper()!r}], built by tinyhet.device.backend"}))
    sys.modules.setdefault(mod.__name__, mod)

_install_devices()

__all__ = ["Config", "ConfigError", "load_config", "local_node", "register", "serve", "connect"]
__version__ = "0.1.0"

def register(t):
  """Realize tensor t into registered memory of its device (a no-op when it already lives there) and expose it.

  Returns (tensor, descriptor): the tensor backed by registered memory, and the RegionDescriptor a peer can write into
  or read from. HET and MESH tensors are registered already; a CPU tensor is copied into a registered CPU arena."""
  from tinygrad import Tensor
  from tinyhet.device import backend as devices
  node = local_node()
  dev = t.device if isinstance(t.device, str) else None
  if dev is None: raise ValueError("tinyhet.register takes a tensor on one device, not a sharded one")
  kind = dev.split(":")[0]
  if kind in ("HET", "MESH") and ":" in dev and not dev.split(":", 1)[1].isdigit():
    raise ValueError(f"{dev} is another node's memory; register it on that node")
  if kind not in ("HET", "MESH", "CPU"):
    raise ValueError(f"tensors on {dev} are not in registered memory: create them on Device['HET'], whose allocations are registered")
  t = t.contiguous().realize()
  if kind == "CPU":
    buf = t.uop.buffer
    addr = (buf.base._buf.va_addr + buf.offset) if buf._base is not None else buf._buf.va_addr
    if (inside := node.allocation_at(addr, t.nbytes())) is not None:   # already registered (e.g. registered before)
      return t, node.expose(inside[0], inside[1], t.nbytes())
    region = node.arena("CPU").alloc(max(1, t.nbytes()), align=4096)
    out = Tensor.from_blob(region.addr, t.shape, dtype=t.dtype, device="CPU")
    out.assign(t).realize()
    weakref.finalize(out.uop.buffer, _free_region, node, region)      # the region lives as long as the buffer
    return out, node.expose(region, 0, t.nbytes())
  region, offset = devices.region_of(t.uop.buffer)
  return t, node.expose(region, offset, t.nbytes())

def _free_region(node, region):
  node.forget(region)
  region.free()

def serve(host: str = "127.0.0.1", port: int = 0) -> str:
  """Let peers write into this node's registered memory and allocate MESH memory here; returns host:port."""
  return local_node().serve(host, port)

def connect(name: str, address: str):
  """Name a peer, making its memory reachable as Device[f"MESH:{name}"]."""
  local_node().add_peer(name, address)
