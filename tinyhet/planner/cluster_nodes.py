"""Where a cluster file's nodes listen: the processes `tinyhet serve --cluster FILE` routes to, and the role each was
started with. Two keys of a [nodes.NAME] table (tinyhet.planner.cluster_file reads the rest, and the planner ignores these two):

  [nodes.spark]
  device = "dgx-spark"
  role = "prefill"                   # prefill | decode | both: the `tinyhet node --role` it runs
  address = "10.0.0.1:7471"          # its `tinyhet node --listen` HOST:PORT; with replicas = N, a list of N addresses
  public_key = "3b6a27bc..."         # optional: its key (`tinyhet keygen`); a node started with TINYHET_CLUSTER=FILE refuses
                                     # this name to any other key, and trusts the prefill and both nodes' KV (trusted_writers)

A node gives both keys or neither (a node without them is in the file for the planner only). Every problem raises
ClusterFileError naming the file, the key and the fix.

With the roles given, the router asks the planner's cost model one question per request (plan.disaggregation_pays): for the
prefill node and the decode node it picked, is the first token sooner prefilled on the prefill node and streamed, or
prefilled on the decode node itself. (planner.route answers within the planner's own plan, which may give every role to
one machine, a choice the file's roles have already made otherwise.)
"""
from __future__ import annotations
from tinyhet.planner.catalog import ClusterFileError
from tinyhet.runtime.settings import PUBLIC_KEY

ROLES = ("prefill", "decode", "both")

def check_address(address) -> str | None:
  """Why `address` is not a HOST:PORT a node listens on, or None."""
  if not isinstance(address, str): return f"is {type(address).__name__} ({address!r}), not a string"
  host, _, port = address.rpartition(":")
  if not host or any(c.isspace() for c in address): return f"is {address!r}, not HOST:PORT"
  if not port.isdigit() or not 0 < int(port) < 65536: return f"has port {port!r}, not one from 1 to 65535"
  return None

def key_problem(key) -> str | None:
  """Why `key` is not a public key as `tinyhet keygen` prints it, or None."""
  return None if isinstance(key, str) and PUBLIC_KEY.fullmatch(key) else f"is {key!r}, not 64 hex digits"

def serving_nodes(data: dict, source: str = "<cluster>") -> dict[str, str]:
  """address -> role for every node of a parsed cluster file (tinyhet.planner.cluster_file.read_toml) that gives its address, in the
  file's order. Checks only these keys: tinyhet.planner.cluster_file.parse_cluster checks the rest."""
  def fail(key: str, problem: str, fix: str): raise ClusterFileError(source, key, problem, fix)
  nodes, where = {}, {}
  for name, spec in (data.get("nodes") or {}).items():
    if isinstance(spec, dict) and "public_key" in spec and (why := key_problem(spec["public_key"])):
      fail(f"nodes.{name}.public_key", why, "paste the line `tinyhet keygen --out FILE` printed for that node's key")
    if not isinstance(spec, dict) or ("address" not in spec and "role" not in spec): continue
    key = f"nodes.{name}"
    if "role" not in spec: fail(f"{key}.role", "missing (the node has an address)", f'add role = "decode" (one of {", ".join(ROLES)})')
    if spec["role"] not in ROLES: fail(f"{key}.role", f"is {spec['role']!r}", f"use one of {', '.join(ROLES)}: the node's --role")
    if "address" not in spec:
      fail(f"{key}.address", "missing (the node has a role)", 'add address = "HOST:PORT", the --listen address of its `tinyhet node`')
    addresses, replicas = spec["address"], spec.get("replicas", 1)
    if isinstance(addresses, list):
      if isinstance(replicas, int) and len(addresses) != replicas:
        fail(f"{key}.address", f"lists {len(addresses)} addresses for {replicas} replicas", "give one address per replica")
    elif isinstance(replicas, int) and replicas > 1:
      fail(f"{key}.address", f"is one address for {replicas} replicas", 'give a list, one per replica: address = ["h1:7470", "h2:7470"]')
    for address in addresses if isinstance(addresses, list) else [addresses]:
      if (why := check_address(address)): fail(f"{key}.address", why, 'write the node\'s --listen address, e.g. address = "10.0.0.2:7470"')
      if address in where: fail(f"{key}.address", f"{address} is also nodes.{where[address]}'s address", "give each node process its own address")
      nodes[address], where[address] = spec["role"], name
  return nodes

def node_names(data: dict) -> dict[str, str]:
  """address -> the [nodes.NAME] it belongs to, for a file serving_nodes accepted."""
  out = {}
  for name, spec in (data.get("nodes") or {}).items():
    if isinstance(spec, dict) and "address" in spec:
      for a in spec["address"] if isinstance(spec["address"], list) else [spec["address"]]: out[a] = name
  return out
