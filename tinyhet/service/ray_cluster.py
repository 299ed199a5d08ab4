"""`tinyhet serve --ray ADDRESS --replicas prefill=N,decode=M[,both=K]`: the router here, its nodes as Ray actors.

Ray carries only control: where each node runs, its start, its address, its liveness and its restarts. Each actor starts
one real `tinyhet node --role R` process on its host (the actor's child, dying with it) and reports the address that node
printed; the KV path stays tinyhet's (the node processes' transports: tcp, shm, verbs where both hosts have RDMA).

Placement (choose_host): a decode or both actor goes to a host with the custom resource `tinyhet_decode` (when no host
has it, the host with the most memory), at most one per host, and its KV pool is --kv-fraction of that host's Ray memory
unless --kv-memory says otherwise. A prefill actor goes to a host with `tinyhet_prefill` (else one with a GPU, num_gpus=1;
else any), on a host without a decode node when the cluster has one. The router picks the host and pins the actor to it
(NodeAffinitySchedulingStrategy, hard), so a restart lands on the same host and its KV sizing holds.
Restarts: an actor whose process dies (kill -9, its node crashed) is restarted by Ray (max_restarts); its new node has a
new address, which the router's Cluster learns on the next poll while its recovery moves or queues the requests of the
old one. An actor that cannot come back (its host left the cluster, restarts used up) is replaced on another host; a
host that joins gets the replicas still missing. GET/POST /admin/replicas (the admin key, TINYHET_ADMIN_KEY, as a bearer
token: not the nodes' TINYHET_TOKEN; without an admin key the endpoint is off) shows and changes the counts at run time;
a replica dropped is first taken out of routing, then stopped once its requests end.
"""
from __future__ import annotations
import json, os, secrets, subprocess, sys, threading, time
from dataclasses import dataclass, field

ROLES = ("prefill", "decode", "both")
RAY_VERSION = "2.60.0"
INSTALL_HINT = f"--ray needs Ray: pip install -e '.[ray]' (or pip install 'ray=={RAY_VERSION}')"

def parse_replicas(text: str) -> dict[str, int]:
  """'prefill=1,decode=2' -> {'prefill': 1, 'decode': 2, 'both': 0}; ValueError saying what to write."""
  want = dict.fromkeys(ROLES, 0)
  for part in filter(None, (p.strip() for p in text.split(","))):
    role, eq, n = part.partition("=")
    if role not in ROLES or not eq or not n.isdigit():
      raise ValueError(f"{part!r} in --replicas: write ROLE=COUNT with ROLE one of {', '.join(ROLES)}, e.g. prefill=1,decode=2")
    want[role] = int(n)
  check_counts(want)
  return want

def check_counts(want: dict) -> None:
  if set(want) - set(ROLES) or not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 1024 for v in want.values()):
    raise ValueError(f"replica counts are integers 0..1024 for the roles {', '.join(ROLES)}")
  if want.get("decode", 0) + want.get("both", 0) < 1: raise ValueError("ask for at least one decode or both replica: decode=1")

def import_ray():
  try:
    import ray
    return ray
  except ImportError:
    raise SystemExit(f"tinyhet serve: {INSTALL_HINT}") from None

def share_token() -> str:
  """The router and every node prove one secret: TINYHET_TOKEN from this environment, or a fresh one passed to the actors."""
  if not os.environ.get("TINYHET_TOKEN"): os.environ["TINYHET_TOKEN"] = secrets.token_hex(16)
  return os.environ["TINYHET_TOKEN"]

def choose_host(role: str, hosts: list[dict], taken: dict[str, list[str]]) -> tuple[dict | None, dict]:
  """(the host for a new replica of role, the Ray resources it asks for), or (None, {"why": ...}) when no host fits now.
  hosts: ray.nodes() entries of live hosts; taken: host id -> roles of the replicas already there."""
  def total(h, k): return h.get("Resources", {}).get(k, 0)
  def roles(h): return taken.get(h["NodeID"], [])
  if role in ("decode", "both"):
    marked = [h for h in hosts if total(h, "tinyhet_decode") >= 1]
    pool, res = (marked, {"tinyhet_decode": 1}) if marked else (hosts, {})
    pool = [h for h in pool if not {"decode", "both"} & set(roles(h))]               # one decode node per host
    if not pool: return None, {"why": "every host that may hold a decode node has one: add a host with the resource tinyhet_decode"}
    return max(pool, key=lambda h: ("prefill" not in roles(h), total(h, "memory"))), res
  key = "tinyhet_prefill" if any(total(h, "tinyhet_prefill") for h in hosts) else "GPU" if any(total(h, "GPU") for h in hosts) else None
  def room(h): return total(h, key) - roles(h).count("prefill") if key else 1
  pool = [h for h in hosts if room(h) >= 1]
  if not pool: return None, {"why": f"every host with {key} holds a prefill node already: add a host with the resource {key}"}
  best = max(pool, key=lambda h: (not {"decode", "both"} & set(roles(h)), room(h)))    # apart from decode nodes when the cluster allows
  return best, ({"num_gpus": 1} if key == "GPU" else {"tinyhet_prefill": 1} if key else {})

class NodeActor:
  """One `tinyhet node` process on the actor's host. The actor dies when its node does (and the node with its actor:
  --stdin-stop sets the parent-death signal), so Ray's restart of the actor is a restart of the node."""
  def __init__(self, role: str, args: list[str], env: dict):
    import ray
    self.host = ray.util.get_node_ip_address()
    cmd = [sys.executable, "-m", "tinyhet", "node", "--role", role, "--listen", f"{self.host}:0", "--quiet", "--stdin-stop", *args]
    self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, **env})
    line = self.proc.stdout.readline()
    if not line: raise RuntimeError(f"tinyhet node --role {role} did not start (exit {self.proc.wait()}): see its stderr in the Ray worker log")
    ctx = ray.get_runtime_context()
    self.info = {**json.loads(line), "pid": os.getpid(), "node_pid": self.proc.pid, "host": self.host, "node_id": ctx.get_node_id(),
                 "reconstructed": ctx.was_current_actor_reconstructed}
    threading.Thread(target=self._follow, name="tinyhet-node-follow", daemon=True).start()

  def _follow(self):
    for _ in self.proc.stdout: pass       # keep its stdout drained
    self.proc.wait()
    os._exit(1)                           # the node is gone: so is this actor, and Ray restarts both

  def describe(self) -> dict: return self.info

@dataclass(eq=False)
class Replica:
  role: str
  actor: object
  node_id: str                  # the Ray node (host) it is pinned to
  started: float = field(default_factory=time.monotonic)
  info: dict = field(default_factory=dict)
  address: str | None = None    # its node's address, as the router's Cluster knows it
  poll: object = None           # an outstanding describe() call
  restarts: int = 0             # Ray restarts seen (each brings a new node at a new address)

class Replicas:
  """Keeps the asked number of nodes per role running on the Ray cluster and the router's Cluster pointed at them."""
  def __init__(self, ray, cluster, want: dict, model: str | None, args, interval: float = 0.5):
    self.ray, self.cluster, self.want, self.interval = ray, cluster, dict(want), interval
    self.node_args = ["--max-seqs", str(args.max_seqs)] + (["--model", model] if model else [])
    self.kv_memory, self.kv_fraction, self.max_restarts = args.kv_memory, args.kv_fraction, args.max_restarts
    # the nodes must prove the router's token and see the same settings (arena size, transport, ...); the router's own keys stay here
    self.env = {k: v for k, v in os.environ.items() if k.startswith(("TINYHET_", "HET_")) and k not in ("TINYHET_ADMIN_KEY", "TINYHET_API_KEY")}
    self.remote = ray.remote(NodeActor)
    self.replicas: list[Replica] = []
    self.draining: list[tuple[Replica, object, float]] = []      # (replica, its Node in the router, when it was dropped)
    self.pending: dict[str, str] = {}                             # role -> why a missing replica is not placed
    self.failed_at: dict[str, float] = {}                         # role -> when a replica of it died before serving
    self.lock = threading.Lock()
    self.stopped = threading.Event()
    self.thread = threading.Thread(target=self._run, name="tinyhet-ray-replicas", daemon=True)
    self.thread.start()

  # ---- the loop
  def _run(self):
    said = ""
    while not self.stopped.is_set():
      try:
        self.reconcile()
        said = ""
      except Exception as e:                          # one bad poll must not end the loop (the cluster may come back)
        if (msg := f"tinyhet serve: ray: {type(e).__name__}: {str(e)[:300]}") != said: print(msg, flush=True)
        said = msg
      self.stopped.wait(self.interval)

  def reconcile(self):
    with self.lock:
      hosts = [n for n in self.ray.nodes() if n.get("Alive")]
      for r in list(self.replicas):
        # a host that left: its actors cannot come back there (Ray may take a while to call them dead), so they are replaced now
        if r.node_id not in {h["NodeID"] for h in hosts}: self._gone(r, "its host left the Ray cluster")
        else: self._poll(r)
      for role in ROLES:
        mine = [r for r in self.replicas if r.role == role]
        for r in sorted(mine, key=lambda r: -r.started)[:max(0, len(mine) - self.want[role])]: self._drop(r)
        self.pending.pop(role, None)
        if time.monotonic() - self.failed_at.get(role, -1e9) < 10:
          self.pending[role] = "a replica died before its node started (see the Ray worker log): trying again in 10 s"
          continue
        for _ in range(self.want[role] - len(mine)):
          if not self._place(role, hosts): break
      self._finish_drains()

  def _poll(self, r: Replica):
    ray = self.ray
    if r.poll is None: r.poll = r.actor.describe.remote()
    ready, _ = ray.wait([r.poll], timeout=0)
    if not ready: return
    ref, r.poll = r.poll, None
    try: info = ray.get(ref)
    except ray.exceptions.ActorUnavailableError: return               # restarting: ask again next time
    except ray.exceptions.RayActorError as e:                         # dead for good (restarts used up, its node would not start)
      return self._gone(r, str(e).splitlines()[0][:300], failed=not r.address)
    if info["address"] != r.address:                                  # first start, or Ray restarted it: a new node, a new address
      if r.address:
        r.restarts += 1
        self.cluster.remove_node(r.address)
      r.address, r.info = info["address"], info
      self.cluster.add_node(r.address, r.role)

  def _gone(self, r: Replica, why: str, failed: bool = False):
    print(f"tinyhet serve: ray: the {r.role} replica on host {r.node_id[:12]} is gone ({why}); placing another", flush=True)
    self.replicas.remove(r)
    try: self.ray.kill(r.actor, no_restart=True)
    except Exception: pass                                            # dead already
    if r.address: self.cluster.remove_node(r.address)
    if failed: self.failed_at[r.role] = time.monotonic()              # its node never started: wait before trying again

  def _drop(self, r: Replica):
    """Out of routing now; the actor stops once the requests it holds are done (or after a minute)."""
    self.replicas.remove(r)
    node = self.cluster.remove_node(r.address) if r.address else None
    self.draining.append((r, node, time.monotonic()))

  def _finish_drains(self):
    for item in list(self.draining):
      r, node, t = item
      if node is not None and (node.assigned or node.inflight_tokens or node.clients) and time.monotonic() - t < 60: continue
      self.ray.kill(r.actor, no_restart=True)
      self.draining.remove(item)

  # ---- placement
  def _place(self, role: str, hosts: list[dict]) -> bool:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    from tinyhet.config import parse_bytes
    taken: dict[str, list[str]] = {}
    for r in self.replicas: taken.setdefault(r.node_id, []).append(r.role)
    host, res = choose_host(role, hosts, taken)
    if host is None:
      self.pending[role] = res["why"]
      return False
    args = list(self.node_args)
    if role != "prefill":
      kv = parse_bytes(self.kv_memory, "--kv-memory") if self.kv_memory else int(host["Resources"].get("memory", 4 << 30) * self.kv_fraction)
      args += ["--kv-memory", str(max(kv, 1 << 20))]
    gpus = res.pop("num_gpus", 0)
    actor = self.remote.options(num_cpus=1, num_gpus=gpus, resources=res, max_restarts=self.max_restarts, max_task_retries=-1,
                                scheduling_strategy=NodeAffinitySchedulingStrategy(host["NodeID"], soft=False)).remote(role, args, self.env)
    self.replicas.append(Replica(role, actor, host["NodeID"]))
    return True

  # ---- the admin endpoint
  def state(self) -> dict:
    """The counts asked for, why any is not placed, and each replica: its host, its node's address (None while it starts:
    `starting_s` long; a replica that stays there waits for Ray, whose `ray status` says for what), its restarts."""
    with self.lock:
      now = time.monotonic()
      return {"want": dict(self.want), "pending": dict(self.pending),
              "replicas": [{"role": r.role, "node_id": r.node_id, "address": r.address, "restarts": r.restarts, "pid": r.info.get("pid"),
                            "node_pid": r.info.get("node_pid"), "host": r.info.get("host"),
                            "starting_s": None if r.address else round(now - r.started, 1)} for r in self.replicas],
              "draining": [r.address for r, _, _ in self.draining]}

  def set_want(self, want: dict) -> None:
    with self.lock:
      new = {**self.want, **want}
      check_counts(new)
      self.want = new

  def mount(self, app, admin_key: bytes | None) -> None:
    """GET /admin/replicas (the counts, where each replica runs) and POST /admin/replicas {"decode": 2, ...} on the router,
    for the admin key only (tinyhet.service.http_guard: compared as bytes); admin_key None: the endpoint answers 403."""
    from starlette.routing import Route
    from tinyhet.service.http_guard import error_response, is_admin, parse_body
    async def replicas(request):
      from starlette.responses import JSONResponse
      if admin_key is None:
        return error_response(403, "the admin endpoint is off: start tinyhet serve with TINYHET_ADMIN_KEY (or --admin-key) set", "permission_error")
      if not is_admin(request.scope, admin_key):
        return error_response(401, "the admin endpoint needs the admin key: send 'Authorization: Bearer $TINYHET_ADMIN_KEY'", "authentication_error",
                              code="invalid_api_key")
      if request.method == "POST":
        try:
          body = parse_body(await request.body())
          if not isinstance(body, dict): raise ValueError('send a JSON object of counts, e.g. {"decode": 2}')
          self.set_want(body)
        except (ValueError, UnicodeDecodeError) as e: return error_response(400, f"replicas: {e}", code=getattr(e, "code", None))
        threading.Thread(target=self.reconcile, daemon=True).start()        # act now rather than at the next poll
      return JSONResponse(self.state())
    app.router.routes.append(Route("/admin/replicas", replicas, methods=["GET", "POST"]))

  def close(self):
    self.stopped.set()
    self.thread.join(timeout=10)
    with self.lock:
      for r in self.replicas + [d[0] for d in self.draining]:
        try: self.ray.kill(r.actor, no_restart=True)
        except Exception: pass
      self.replicas, self.draining = [], []

def start(args, cluster, model: str | None) -> Replicas:
  """Join the Ray cluster at args.ray and start placing the replicas args.replicas asks for."""
  ray = import_ray()
  want = parse_replicas(args.replicas)
  host, _, port = args.ray.rpartition(":")
  if host and port.isdigit() and "://" not in args.ray:      # Ray itself retries an address nobody answers on for minutes
    import socket
    try: socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as e:
      raise SystemExit(f"tinyhet serve: no Ray cluster answers at {args.ray} ({e.strerror or e}): give the head's address "
                       "(`ray status` on it shows it) or `auto` on a host of the cluster") from None
  try: ray.init(address=args.ray, logging_level="WARNING", log_to_driver=False)
  except ConnectionError as e:
    raise SystemExit(f"tinyhet serve: cannot join the Ray cluster at {args.ray!r} ({str(e).splitlines()[0]}): start it with `ray start --head` "
                     "or give its address") from None
  return Replicas(ray, cluster, want, model, args)
