"""`tinyhet serve`: the router. An OpenAI-compatible HTTP API (tinyhet.service.http_api) in front of prefill and decode nodes
(tinyhet.service.router), given as --prefill/--decode/--both addresses, a cluster file's nodes, or placed by Ray (--ray)."""
from __future__ import annotations
import json, sys, threading
from tinyhet.cli.common import ArgumentParser, host_port, int_in, number_in
from tinyhet.cli.node import MAX_SEQS

def parse_args(argv):
  ap = ArgumentParser(prog="tinyhet serve", description=__doc__.splitlines()[0])
  ap.add_argument("--listen", default="127.0.0.1:8000", type=host_port(listen=True), help="host:port of the HTTP API (port 0: any free port)")
  ap.add_argument("--prefill", action="append", default=[], metavar="HOST:PORT", type=host_port(), help="a `tinyhet node --role prefill` (repeats)")
  ap.add_argument("--decode", action="append", default=[], metavar="HOST:PORT", type=host_port(), help="a `tinyhet node --role decode` (repeatable)")
  ap.add_argument("--both", action="append", default=[], metavar="HOST:PORT", type=host_port(), help="a `tinyhet node --role both` (repeatable)")
  ap.add_argument("--model", default=None, help="the model every node serves (its tokenizer is loaded here; default: the embedded SmolLM2)")
  ap.add_argument("--cluster", default=None, help="the planner's cluster file, with each node's role and address (tinyhet.planner.cluster_nodes): "
                  "its nodes join those of --prefill/--decode/--both, and tinyhet.planner.plan.route decides per request whether to disaggregate")
  ap.add_argument("--cluster-model", default=None, help="the model's name in the planner's catalog or the cluster file (with --cluster)")
  ap.add_argument("--max-queue", type=int_in(0, 1 << 20), default=64, help="requests waiting for KV room at most; past it: 503 with Retry-After")
  ap.add_argument("--queue-timeout", type=number_in(0, 86400, "seconds"), default=60.0, help="seconds a request waits for KV room before 503")
  ap.add_argument("--api-key", action="append", default=[], metavar="KEY", help="a key /v1/* accepts as 'Authorization: Bearer KEY' (repeatable; "
                  "also TINYHET_API_KEY, comma-separated); without any, the API is open. /health, /ready and /metrics are always open")
  ap.add_argument("--admin-key", default=None, metavar="KEY", help="the key of /admin/* and of /ready's node list, as 'Authorization: Bearer KEY' "
                  "(also TINYHET_ADMIN_KEY; it must differ from TINYHET_TOKEN and every API key); without it, /admin/* is off")
  ap.add_argument("--max-body", default="8M", metavar="BYTES", help="the largest request body accepted (413 past it; e.g. 8M)")
  ap.add_argument("--stdin-stop", action="store_true", help="exit when stdin closes (for a parent process that owns the router)")
  add_ray_args(ap)
  args = ap.parse_args(argv)
  if args.ray is not None:
    try: check_ray_args(args)
    except ValueError as e: ap.error(str(e))
    if args.prefill or args.decode or args.both: ap.error("--ray places the nodes itself: leave out --prefill, --decode and --both")
  elif not (args.decode or args.both or args.cluster):
    ap.error("give at least one decode-capable node: --decode HOST:PORT, --both HOST:PORT, or --cluster FILE with role and address keys")
  if args.cluster and not args.cluster_model: ap.error("--cluster needs --cluster-model (the model's name in the planner's catalog)")
  from tinyhet.config import ConfigError, parse_bytes
  try: args.max_body = parse_bytes(args.max_body, "--max-body")
  except ConfigError as e: ap.error(str(e))
  if not 1 <= args.max_body <= 1 << 30: ap.error("--max-body must be between 1 byte and 1G")
  return args

def fail(message: str) -> int:
  print(f"tinyhet serve: {message}", file=sys.stderr)
  return 2

def add_flag_nodes(nodes: dict[str, str], args) -> str | None:
  """The --prefill/--decode/--both nodes join the cluster file's (address -> role); what is wrong, or None."""
  for role in ("prefill", "decode", "both"):
    for a in getattr(args, role):
      if nodes.get(a, role) != role: return f"{a} is given as a {nodes[a]} node and with --{role}: give each node one role"
      nodes[a] = role
  return None

def main(argv=None) -> int:
  args = parse_args(argv)
  if args.ray is not None:
    from tinyhet.service import ray_cluster
    ray_cluster.import_ray()                    # without Ray: one line saying what to install, before anything starts
  import os, signal, socket
  import uvicorn
  from tinyhet.model import spec as service_model
  from tinyhet.config import load_config
  from tinyhet.service.router import Cluster
  from tinyhet.runtime.transport import Endpoint
  from tinyhet.service.metrics import Metrics
  planner, nodes, names = None, {}, {}
  if args.cluster:
    from tinyhet.planner.cluster_file import parse_cluster, read_toml
    from tinyhet.planner.cluster_nodes import node_names, serving_nodes
    data = read_toml(args.cluster)
    cluster_desc = parse_cluster(data, args.cluster)
    cluster_desc.model(args.cluster_model)      # an unknown model stops here, with the planner's message
    planner, nodes, names = (cluster_desc, args.cluster_model), serving_nodes(data, args.cluster), node_names(data)
  if (why := add_flag_nodes(nodes, args)): return fail(why)
  if args.ray is None and not any(role in ("decode", "both") for role in nodes.values()):
    return fail(f"no decode-capable node: give role = \"decode\" or \"both\" and an address to a node of {args.cluster}, or add --decode HOST:PORT")
  model_id, tok = service_model.model_id(args.model), service_model.load_tokenizer(args.model)
  metrics = Metrics()
  if args.ray is not None: ray_cluster.share_token()      # before the router's endpoint reads it
  ep = Endpoint(f"router-{socket.gethostname()}-{os.getpid()}", config=load_config())   # the shared token, transport and RDMA port
  cluster = Cluster(ep, nodes, model_id, metrics, args.max_queue, args.queue_timeout, planner, names=names)
  host, _, port = args.listen.rpartition(":")
  try: sock = socket.create_server((host, int(port)), backlog=1024)
  except OSError as e: return fail(f"cannot listen on {args.listen}: {e.strerror or e}: choose another --listen address or port")
  from tinyhet.service.http_api import Service, parse_keys
  from tinyhet.service.http_guard import check_admin_key
  api_keys = parse_keys(args.api_key, os.environ.get("TINYHET_API_KEY"))
  try: admin_key = check_admin_key(args.admin_key or os.environ.get("TINYHET_ADMIN_KEY"), os.environ.get("TINYHET_TOKEN"), api_keys)
  except ValueError as e: return fail(str(e))
  app = Service(cluster, tok, model_id, metrics, api_keys=api_keys, admin_key=admin_key, max_body=args.max_body).app()
  replicas = None
  if args.ray is not None:
    replicas = ray_cluster.start(args, cluster, args.model)
    replicas.mount(app, admin_key)
    nodes = {"ray": args.ray, "replicas": replicas.want}
  server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
  print(json.dumps({"address": f"{host}:{sock.getsockname()[1]}", "model": model_id, "nodes": nodes}), flush=True)
  if args.stdin_stop:
    threading.Thread(target=lambda: (sys.stdin.read(), setattr(server, "should_exit", True)), daemon=True).start()
  signal.signal(signal.SIGTERM, lambda *_: setattr(server, "should_exit", True))
  try: server.run(sockets=[sock])
  finally:
    if replicas is not None: replicas.close()
    cluster.close()
    ep.close()
  return 0

if __name__ == "__main__": sys.exit(main())

def add_ray_args(ap) -> None:
  ap.add_argument("--ray", default=None, metavar="ADDRESS", help="the nodes as Ray actors on this cluster (as ray.init takes it; auto: the local)")
  ap.add_argument("--replicas", default="prefill=1,decode=1", help="with --ray: nodes per role, e.g. prefill=1,decode=2,both=0")
  ap.add_argument("--kv-memory", default=None, help="with --ray: each decode node's KV pool (e.g. 4G; default: --kv-fraction of its host's memory)")
  ap.add_argument("--kv-fraction", type=number_in(0, 0.9), default=0.25, help="with --ray: the share of a decode host's Ray memory its KV pool takes")
  ap.add_argument("--max-seqs", type=int_in(1, MAX_SEQS), default=16, help="with --ray: sequences each decode node decodes together at most")
  ap.add_argument("--max-restarts", type=int_in(-1, 1000), default=5, help="with --ray: Ray restarts of one actor before the router replaces it")

def check_ray_args(args) -> None:
  """The --ray options, before anything starts: ValueError saying what to change."""
  from tinyhet.service.ray_cluster import parse_replicas
  parse_replicas(args.replicas)
  # --max-seqs, --kv-fraction and --max-restarts are checked as they are parsed (add_args)
  if args.kv_memory is not None:
    from tinyhet.config import ConfigError, parse_bytes
    try: parse_bytes(args.kv_memory, "--kv-memory")
    except ConfigError as e: raise ValueError(str(e)) from None
