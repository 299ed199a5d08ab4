"""verbs transport: RDMA over pyverbs (rdma-core). Work in progress: detection only."""
from __future__ import annotations

def unavailable_reason() -> str | None:
  """None when pyverbs imports and lists at least one RDMA device; else why verbs cannot be used here."""
  try:
    import pyverbs.device as d
    from pyverbs.pyverbs_error import PyverbsRDMAError
  except ImportError as e:
    return f"pyverbs is not importable ({e}); install Debian's python3-pyverbs (make setup does) or pyverbs matching the system's rdma-core"
  try: names = [x.name.decode() for x in d.get_device_list()]
  except PyverbsRDMAError as e: return f"no RDMA support in this kernel ({e}): no InfiniBand/RoCE driver is loaded"
  return None if names else "no RDMA device found (rdma-core sees none)"
