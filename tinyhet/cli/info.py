"""`tinyhet info`: the configuration, the HET backend, the transports this machine can use (and why not), and arenas."""
import json, sys

def main(argv=None) -> int:
  from tinyhet.cli.common import ArgumentParser
  ap = ArgumentParser(prog="tinyhet info", description=__doc__)
  ap.add_argument("--json", action="store_true")
  args = ap.parse_args(argv)
  from tinyhet.config import describe
  from tinyhet.runtime.transport import available_transports
  from tinyhet.device.memory import local_node
  from tinyhet.device.backend import resolve_backend
  import tinyhet  # noqa: F401
  node = local_node()
  transports = available_transports(node.config)
  backend = resolve_backend(node.config.het_backend)
  info = {"node": node.name, "config": dict(describe(node.config)), "het_backend": backend,
          "transports": {t: ("available" if why is None else f"unavailable: {why}") for t, why in transports.items()},
          "arena_pages": node.arena("MESH").pages}
  if args.json:
    print(json.dumps(info))
    return 0
  print(f"node        {info['node']}")
  print(f"HET         {backend} (HET_BACKEND={node.config.het_backend})")
  print(f"arenas      {node.config.arena_bytes >> 20} MiB each, {info['arena_pages']}")
  for t, state in info["transports"].items(): print(f"{t:<12}{state}")
  print("config      " + ", ".join(f"{k}={v}" for k, v in info["config"].items()))
  return 0

if __name__ == "__main__": sys.exit(main())
