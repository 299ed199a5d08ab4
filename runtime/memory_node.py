"""A process that owns an arena, exposes regions of it and answers questions about their bytes: the far end of the
transport tests and of `tinyhet bench transfer`. It speaks JSON lines on stdin/stdout:

  start: prints {"address": "host:port", "pid": N, "node": NAME, "public_key": HEX}
  {"cmd": "expose", "nbytes": N}                          -> {"desc": HEX, "region": I}
        optional "owner": NAME, "allowed": [[offset, nbytes], ...], "access": "rw" | "read" | "write" (a grant, Endpoint.expose)
  {"cmd": "fill", "region": I, "seed": S}                 -> {}            (deterministic random bytes)
  {"cmd": "sha", "region": I, "offset": O, "nbytes": N}   -> {"sha": HEX}
  {"cmd": "notices", "count": K, "timeout": T}            -> {"notices": [[peer, value, nbytes], ...]} or {"error": ...}
                              with "times": true, also {"times": [perf_counter when each notice was delivered, ...]}
  {"cmd": "quit"}
"""
import argparse, hashlib, json, subprocess, sys
from tinyhet.runtime.arena import Arena
from tinyhet.runtime.settings import TransportSettings
from tinyhet.runtime.transport import Endpoint

def fill(view: memoryview, seed: int):
  import numpy as np
  np.frombuffer(view, np.uint8)[:] = np.random.default_rng(seed).integers(0, 256, len(view), dtype=np.uint8)

def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--name", default="memnode")
  ap.add_argument("--token", required=True)
  ap.add_argument("--listen", default="127.0.0.1:0")
  ap.add_argument("--arena-bytes", type=int, default=64 << 20)
  ap.add_argument("--handshake-timeout", type=float, default=None, help="seconds a peer has for its whole handshake")
  ap.add_argument("--max-unauthenticated", type=int, default=None, help="connections allowed in their handshake at once")
  ap.add_argument("--max-fds", type=int, default=None, help="lower this process's open-file limit (RLIMIT_NOFILE) once started")
  ap.add_argument("--spare-address-space", type=int, default=None,
                  help="cap this process's address space (RLIMIT_AS) at what it maps once started plus this many bytes")
  # its transport settings come from these flags only (not tinyhet.toml or TINYHET_*): the tests and the bench start it
  # and must get the same node whatever the developer's environment says
  ap.add_argument("--rdma-device", default="", help="verbs: RDMA device to serve on (empty: the first with an active port)")
  ap.add_argument("--rdma-port", type=int, default=1, help="verbs: port number on that device")
  ap.add_argument("--rdma-gid-index", type=int, default=-1, help="verbs: source GID index on RoCE (-1: auto)")
  ap.add_argument("--key-file", default="", help="this node's Ed25519 private key (PEM); default: a new key pair")
  ap.add_argument("--peer-key", action="append", default=[], metavar="NAME=HEX", help="bind a peer name to its public key (repeatable)")
  ap.add_argument("--transport", default="auto", help="what this node serves beyond tcp and shm: verbs only when this is verbs")
  args = ap.parse_args(argv)
  try:
    peer_keys = dict(k.split("=", 1) for k in args.peer_key)
    settings = TransportSettings(token=args.token, rdma_device=args.rdma_device, rdma_port=args.rdma_port, rdma_gid_index=args.rdma_gid_index,
                                 key_file=args.key_file, peer_keys=peer_keys, transport=args.transport)
    ep = Endpoint(args.name, settings=settings)
  except ValueError as e: ap.error(str(e))
  if args.handshake_timeout is not None: ep.handshake_timeout = args.handshake_timeout
  if args.max_unauthenticated is not None: ep.max_unauthenticated = args.max_unauthenticated
  arena = Arena(args.arena_bytes, args.name, hugepages=False)
  host, _, port = args.listen.rpartition(":")
  address = ep.listen(host, int(port))
  regions = []
  out = sys.stdout
  import resource
  if args.max_fds is not None: resource.setrlimit(resource.RLIMIT_NOFILE, (args.max_fds, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
  if args.spare_address_space is not None:      # new threads' stacks stop fitting: "can't start new thread"
    mapped = next(int(x.split()[1]) << 10 for x in open("/proc/self/status") if x.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (mapped + args.spare_address_space, resource.getrlimit(resource.RLIMIT_AS)[1]))
  out.write(json.dumps({"address": address, "node": ep.name, "pid": __import__("os").getpid(), "public_key": ep.identity.public}) + "\n")
  out.flush()
  for line in sys.stdin:
    req = json.loads(line)
    try:
      if req["cmd"] == "expose":
        regions.append(arena.alloc(req["nbytes"], align=4096))
        allowed = [tuple(a) for a in req["allowed"]] if req.get("allowed") is not None else None
        reply = {"desc": ep.expose(regions[-1], req.get("owner"), allowed, req.get("access", "rw")).to_hex(), "region": len(regions) - 1}
      elif req["cmd"] == "fill":
        fill(regions[req["region"]].view(), req["seed"])
        reply = {}
      elif req["cmd"] == "sha":
        reply = {"sha": hashlib.sha256(regions[req["region"]].view(req.get("offset", 0), req.get("nbytes"))).hexdigest()}
      elif req["cmd"] == "notices":
        got = [ep.wait_notice(req.get("timeout", 10)) for _ in range(req["count"])]
        reply = {"notices": [[n.peer, n.value, n.nbytes] for n in got], **({"times": [n.time for n in got]} if req.get("times") else {})}
      elif req["cmd"] == "quit": break
      else: reply = {"error": f"unknown command {req['cmd']!r}"}
    except Exception as e: reply = {"error": f"{type(e).__name__}: {e}"}
    out.write(json.dumps(reply) + "\n")
    out.flush()
  ep.close()

class MemoryNodeProcess:
  """This module in a child process (optionally in a network namespace, or pinned to one CPU), driven over its stdin."""
  def __init__(self, token: str, name: str = "memnode", listen: str = "127.0.0.1:0", arena_bytes: int = 64 << 20,
               netns: str | None = None, preexec_fn=None, extra: tuple[str, ...] = ()):
    cmd = [sys.executable, "-m", "tinyhet.runtime.memory_node", "--name", name, "--token", token, "--listen", listen,
           "--arena-bytes", str(arena_bytes), *extra]
    if netns: cmd = ["ip", "netns", "exec", netns, *cmd]
    self.token = token
    self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1, preexec_fn=preexec_fn)
    line = self.proc.stdout.readline()
    if not line: raise RuntimeError(f"memory node did not start (exit {self.proc.wait()})")
    info = json.loads(line)
    self.address, self.node, self.pid, self.public_key = info["address"], info["node"], info["pid"], info["public_key"]

  def ask(self, **req) -> dict:
    self.proc.stdin.write(json.dumps(req) + "\n")
    reply = json.loads(self.proc.stdout.readline())
    if "error" in reply: raise RuntimeError(f"memory node: {reply['error']}")
    return reply

  def expose(self, nbytes: int, **grant):
    """A new region of nbytes, exposed (grant: owner, allowed, access as Endpoint.expose takes them): (descriptor, index)."""
    from tinyhet.runtime.descriptor import RegionDescriptor
    r = self.ask(cmd="expose", nbytes=nbytes, **grant)
    return RegionDescriptor.from_hex(r["desc"]), r["region"]

  def sha(self, region: int, offset: int = 0, nbytes: int | None = None) -> str:
    return self.ask(cmd="sha", region=region, offset=offset, nbytes=nbytes)["sha"]

  def close(self):
    if self.proc.poll() is None:
      try: self.ask(cmd="quit")
      except (OSError, ValueError, RuntimeError): pass
      try: self.proc.wait(10)
      except subprocess.TimeoutExpired: self.proc.kill()
    self.proc.stdin.close()
    self.proc.stdout.close()

if __name__ == "__main__": main()
