"""tinyhet's options: one frozen object, filled from defaults, then a TOML file, then environment variables.

File: the path in TINYHET_CONFIG, else ./tinyhet.toml if it exists. Keys are the field names below, e.g.

  het_backend = "CUDA"
  arena_bytes = "8G"
  transport = "tcp"
  [peers]
  decode0 = "10.0.0.2:7470"

Environment variables override the file: TINYHET_NODE, HET_BACKEND, TINYHET_ARENA_BYTES, TINYHET_HUGEPAGES, TINYHET_TRANSPORT, TINYHET_TOKEN,
TINYHET_PEERS ("name=host:port,name2=host:port"), TINYHET_TCP_STREAMS, TINYHET_KV_BLOCK_SIZE, TINYHET_KV_DTYPE,
TINYHET_RDMA_DEVICE, TINYHET_RDMA_PORT, TINYHET_RDMA_GID_INDEX, TINYHET_CPU_THREADS, TINYHET_STAGING_BUFFERS, TINYHET_PREFILL_BUDGET,
TINYHET_WARM_UP, TINYHET_KEY_FILE, TINYHET_PEER_KEYS ("name=hex,..."), TINYHET_TRUSTED_WRITERS ("name,name2"; empty: none), TINYHET_CLUSTER,
TINYHET_KV_DISK, TINYHET_KV_DISK_SIZE, TINYHET_SPECULATIVE.

Identity (tinyhet.runtime.identity): key_file is this node's Ed25519 private key (`tinyhet keygen --out F`); peer_keys binds
node names to public keys, so a name is refused to every other key. cluster names a cluster file whose [nodes.NAME]
tables give `public_key = "hex"` (merged under peer_keys, which win) and `role`: its prefill and both nodes are the
default trusted_writers, the peers whose KV a decode node may cache and share (without a cluster file: none).

RDMA (the verbs transport): rdma_device names the device as `ibv_devices` lists it (e.g. "mlx5_0"); empty takes the first
device whose port rdma_port is ACTIVE. rdma_gid_index picks the source GID on RoCE; -1 chooses one (a RoCE v2 GID,
IPv4-mapped first). On InfiniBand the GID index is not used (peers are addressed by LID).
"""
from __future__ import annotations
import dataclasses, os, pathlib, re, tomllib
from dataclasses import dataclass, field
from tinyhet.runtime.settings import TRANSPORTS, problem as transport_problem  # noqa: F401  (TRANSPORTS: one definition, importable from here too)

HET_BACKENDS = ("auto", "CUDA", "NV", "AMD", "METAL", "CL", "CPU", "PYTHON")   # PYTHON: tinygrad's emulator, for tests
KV_DTYPES = ("float16", "float32", "bfloat16", "q8_0", "fp8_e4m3", "fp8_e5m2")   # kernels/kv_quant.py: the formats
WARM_UP_MODES = ("background", "before", "off")
NUMA_MODES = ("off", "interleave", "replicate")   # replicate: the weights copied per node, each pool thread reading its node's

class ConfigError(ValueError):
  """A bad option: the message names the option, where it came from, and what is allowed."""

@dataclass(frozen=True)
class Config:
  node: str = ""                         # this node's name as peers see it; empty = "<hostname>-<pid>"
  het_backend: str = "auto"              # tinygrad backend HET computes on; auto = the first GPU backend that opens, else CPU
  arena_bytes: int = 8 << 30             # registered memory per device: address space reserved up front, memory only where touched
  hugepages: bool = True                 # ask for 2 MiB pages (falls back to normal pages and says so)
  transport: str = "auto"                # verbs | tcp | shm | auto (verbs with an RDMA device, shm on this host, tcp otherwise)
  token: str = ""                        # shared secret a peer proves before any byte lands; empty = a random one per node
  peers: dict[str, str] = field(default_factory=dict)   # node name -> "host:port"
  tcp_streams: int = 4                   # parallel TCP connections per peer
  kv_block_size: int = 16                # tokens per paged-KV block
  kv_dtype: str = "float16"              # dtype of the KV cache on the decode node
  rdma_device: str = ""                  # verbs: RDMA device name (ibv_devices); empty = the first with an active port
  rdma_port: int = 1                     # verbs: port number on that device (1-based, as ibv_devinfo shows it)
  rdma_gid_index: int = -1               # verbs: source GID index on RoCE; -1 = auto (RoCE v2, IPv4-mapped first)
  cpu_threads: int = 0                   # threads for HET-on-CPU and MESH kernels; 0 = every CPU this process may run on
  numa: str = "off"                      # off | interleave: the arenas' pages alternate over the nodes | replicate: weights per node
  prefill_chunk: int = 512               # a prompt longer than this is prefilled in chunks of this many tokens (tiled attention)
  staging_buffers: int = 2               # host buffers a GPU's packed layers leave through, copied asynchronously; 0 = copy on the prefill thread
  key_file: str = ""                     # this node's Ed25519 private key (PEM, owner-only); empty = a new key pair per process
  peer_keys: dict[str, str] = field(default_factory=dict)   # node name -> public key (hex): the name is refused to any other key
  trusted_writers: tuple[str, ...] | None = None   # peers whose written KV a decode node may cache; None = the cluster file's prefill nodes
  cluster: str = ""                      # a cluster file: its nodes' public_key entries and prefill roles (see above)
  prefill_budget: int = 128              # prompt tokens a step prefills at most while sequences decode (stall-free; see Scheduler.schedule_step)
  # 128: the budget that held both of `bench latency --parts load`'s targets (TPOT p99 <= 2x p50 at concurrency 1, 4, 16;
  # requests/s at 4 >= at 1) in a model: the real Scheduler driven closed-loop (16 and 32 requests, prompts of 100-2,000
  # tokens, 32 out) with SmolLM2 Q4_1's measured one-thread piece costs (shared cores: ratios only, not a result). At 128 it
  # held on 17 of 20 length draws (the bench's seed 0: c4/c1 1.04, p99/p50 1.55 at c4, 1.35 at c16); at 16 requests/s at 4
  # was 0.72-0.77x concurrency 1's (a 16-token piece costs 3.55 ms a token against 1.57 whole); at 96, 5 of 20 (c4/c1
  # 0.95-1.00); past 128 the pieces pad to the 192 bucket, and at 192 the prefill queue drains between prompts, so half of
  # concurrency 4's steps are decode alone and its TPOT p99/p50 is 12-14 (3 of 20). The price: TPOT p50 at concurrency 4 is
  # ~3x budget 16's (a 128-token piece rides every step). A quiet run of the bench decides (docs/serving.md).
  # a prefill node's pools for pulled prefixes: one set as wide as the model's context (built at warm-up with their captures,
  # so no pulled turn zeroes pools or captures on its path) where every layer's fits in this many bytes, else as many blocks as
  # fit, longer prompts' pools sized to their bucket on their path. SmolLM2 (23 KB a token) takes 200 MB for its 8,192 tokens
  # and a chunk; a 70B model's 320 KB a token stops at ~3,300 tokens (tinyhet.engine.prefill.pull_width)
  pull_pool_bytes: int = 1 << 30
  warm_up: str = "background"            # background: a node builds every capture while idle | before: before it says ready | off
  kv_disk: str = ""                      # a decode node's KV disk tier: the folder evicted cached blocks go to (tinyhet.kv.disk_tier); empty = none
  kv_disk_size: int = 64 << 30           # the disk tier's bound: past it the oldest segment files are deleted
  speculative: str = "off"              # a decode node's default for requests that do not say: off | ngram | draft (docs/speculative.md)

  def __post_init__(self): validate(self, "config")

def parse_bytes(text: str | int, what: str = "size") -> int:
  """'512M', '8G', '1GiB', '4096' -> bytes."""
  if isinstance(text, int) and not isinstance(text, bool): n = text
  else:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*", str(text), re.IGNORECASE)
    if m is None: raise ConfigError(f"{what}: {text!r} is not a size (use e.g. 4096, 512M, 8G)")
    n = int(float(m.group(1)) * 1024 ** "_kmgt".index((m.group(2) or "_").lower()))
  if n <= 0: raise ConfigError(f"{what}: {text!r} must be positive")
  return n

def parse_bool(text: str | bool, what: str) -> bool:
  if isinstance(text, bool): return text
  if str(text).strip().lower() in ("1", "true", "yes", "on"): return True
  if str(text).strip().lower() in ("0", "false", "no", "off", ""): return False
  raise ConfigError(f"{what}: {text!r} is not a boolean (use 1/0, true/false)")

def parse_peers(text: str | dict, what: str) -> dict[str, str]:
  if isinstance(text, dict): items = list(text.items())
  else: items = [tuple(p.split("=", 1)) if "=" in p else (p, None) for p in str(text).split(",") if p.strip()]
  peers = {}
  for name, addr in items:
    if addr is None or not isinstance(addr, str) or not re.fullmatch(r"[^\s:]+:\d{1,5}", addr.strip()):
      raise ConfigError(f"{what}: peer {name!r} needs an address 'host:port', got {addr!r}")
    peers[str(name).strip()] = addr.strip()
  return peers

def validate(cfg: Config, source: str):
  def bad(name, msg):
    err = ConfigError(f"{source}: {name} = {getattr(cfg, name)!r} {msg}")
    err.key = name
    raise err
  def check(name):      # the transports' own fields: one rule and one message, in runtime/settings.py
    if (why := transport_problem(name, getattr(cfg, name))) is not None: bad(name, why)
  if cfg.node and (len(cfg.node.encode()) > 200 or ":" in cfg.node or any(c.isspace() for c in cfg.node)):
    bad("node", "must be at most 200 bytes, without ':' or spaces")
  if cfg.het_backend.upper() not in [b.upper() for b in HET_BACKENDS]: bad("het_backend", f"is not one of {', '.join(HET_BACKENDS)}")
  check("transport")
  if cfg.kv_dtype not in KV_DTYPES: bad("kv_dtype", f"is not one of {', '.join(KV_DTYPES)}")
  if not isinstance(cfg.arena_bytes, int) or cfg.arena_bytes < 1 << 20: bad("arena_bytes", "must be at least 1 MiB")
  check("tcp_streams")
  if not isinstance(cfg.kv_block_size, int) or not 1 <= cfg.kv_block_size <= 1024: bad("kv_block_size", "must be between 1 and 1024")
  check("rdma_device")
  check("rdma_port")
  if not isinstance(cfg.cpu_threads, int) or not 0 <= cfg.cpu_threads <= 1024:
    bad("cpu_threads", "must be between 0 (every CPU this process may run on) and 1024")
  if cfg.numa not in NUMA_MODES: bad("numa", f"is not one of {', '.join(NUMA_MODES)}")
  if not isinstance(cfg.prefill_chunk, int) or not 16 <= cfg.prefill_chunk <= 65536: bad("prefill_chunk", "must be between 16 and 65536 tokens")
  if not isinstance(cfg.staging_buffers, int) or not 0 <= cfg.staging_buffers <= 64:
    bad("staging_buffers", "must be between 0 (copy each layer on the prefill thread) and 64")
  check("rdma_gid_index")
  check("key_file")
  check("peer_keys")
  if cfg.trusted_writers is not None and (not isinstance(cfg.trusted_writers, tuple)
                                          or not all(isinstance(n, str) and 0 < len(n.encode()) <= 200 for n in cfg.trusted_writers)):
    bad("trusted_writers", "must be a list of node names")
  if not isinstance(cfg.prefill_budget, int) or not 1 <= cfg.prefill_budget <= 65536: bad("prefill_budget", "must be between 1 and 65536 tokens")
  if not isinstance(cfg.pull_pool_bytes, int) or isinstance(cfg.pull_pool_bytes, bool) or cfg.pull_pool_bytes < 0:
    bad("pull_pool_bytes", "must be a size of 0 (every pulled prompt's pools sized to its bucket) or more (e.g. 1G)")
  if cfg.warm_up not in WARM_UP_MODES: bad("warm_up", f"is not one of {', '.join(WARM_UP_MODES)}")
  if not isinstance(cfg.kv_disk, str) or "\0" in cfg.kv_disk: bad("kv_disk", "must be a directory path")
  if cfg.speculative not in ("off", "ngram", "draft"): bad("speculative", "is not one of off, ngram, draft")
  if not isinstance(cfg.kv_disk_size, int) or isinstance(cfg.kv_disk_size, bool) or cfg.kv_disk_size < 1 << 20:
    bad("kv_disk_size", "must be at least 1 MiB (e.g. 512M, 200G)")

# field -> (environment variable, parser)
_PARSERS = {
  "node": ("TINYHET_NODE", lambda v, w: str(v)),
  "het_backend": ("HET_BACKEND", lambda v, w: str(v)),
  "arena_bytes": ("TINYHET_ARENA_BYTES", parse_bytes),
  "hugepages": ("TINYHET_HUGEPAGES", parse_bool),
  "transport": ("TINYHET_TRANSPORT", lambda v, w: str(v).lower()),
  "token": ("TINYHET_TOKEN", lambda v, w: str(v)),
  "peers": ("TINYHET_PEERS", parse_peers),
  "tcp_streams": ("TINYHET_TCP_STREAMS", lambda v, w: _int(v, w)),
  "kv_block_size": ("TINYHET_KV_BLOCK_SIZE", lambda v, w: _int(v, w)),
  "kv_dtype": ("TINYHET_KV_DTYPE", lambda v, w: str(v)),
  "rdma_device": ("TINYHET_RDMA_DEVICE", lambda v, w: str(v).strip()),
  "rdma_port": ("TINYHET_RDMA_PORT", lambda v, w: _int(v, w)),
  "rdma_gid_index": ("TINYHET_RDMA_GID_INDEX", lambda v, w: _int(v, w)),
  "cpu_threads": ("TINYHET_CPU_THREADS", lambda v, w: _int(v, w)),
  "prefill_chunk": ("TINYHET_PREFILL_CHUNK", lambda v, w: _int(v, w)),
  "numa": ("TINYHET_NUMA", lambda v, w: str(v)),
  "staging_buffers": ("TINYHET_STAGING_BUFFERS", lambda v, w: _int(v, w)),
  "key_file": ("TINYHET_KEY_FILE", lambda v, w: str(v)),
  "peer_keys": ("TINYHET_PEER_KEYS", lambda v, w: parse_keys(v, w)),
  "trusted_writers": ("TINYHET_TRUSTED_WRITERS", lambda v, w: parse_names(v, w)),
  "cluster": ("TINYHET_CLUSTER", lambda v, w: str(v)),
  "prefill_budget": ("TINYHET_PREFILL_BUDGET", lambda v, w: _int(v, w)),
  "pull_pool_bytes": ("TINYHET_PULL_POOL_BYTES", lambda v, w: 0 if str(v).strip() == "0" else parse_bytes(v, w)),
  "warm_up": ("TINYHET_WARM_UP", lambda v, w: str(v).lower()),
  "kv_disk": ("TINYHET_KV_DISK", lambda v, w: str(v)),
  "kv_disk_size": ("TINYHET_KV_DISK_SIZE", parse_bytes),
  "speculative": ("TINYHET_SPECULATIVE", lambda v, w: str(v).lower()),
}

def parse_keys(text: str | dict, what: str) -> dict[str, str]:
  """'name=hex,name2=hex' or a TOML table -> {name: public key}; checked by validate."""
  if isinstance(text, dict): return {str(k): v for k, v in text.items()}
  items = [p.split("=", 1) for p in str(text).split(",") if p.strip()]
  if any(len(i) != 2 for i in items): raise ConfigError(f"{what}: {text!r} is not name=public_key,name2=public_key")
  return {k.strip(): v.strip() for k, v in items}

def parse_names(text: str | list, what: str) -> tuple[str, ...]:
  if isinstance(text, list) and all(isinstance(n, str) for n in text): return tuple(text)
  if isinstance(text, str): return tuple(n.strip() for n in text.split(",") if n.strip())
  raise ConfigError(f"{what}: {text!r} is not a list of node names")

def cluster_identity(path: str) -> tuple[dict[str, str], tuple[str, ...]]:
  """A cluster file's bindings (node name -> public_key) and its prefill/both nodes' names (the default trusted writers).
  Only these keys are read here; tinyhet.planner.cluster_file checks the rest of the file."""
  try: nodes = tomllib.loads(pathlib.Path(path).read_text()).get("nodes") or {}
  except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e: raise ConfigError(f"cluster file {path}: {e}") from None
  keys, writers = {}, []
  for name, spec in nodes.items() if isinstance(nodes, dict) else ():
    if not isinstance(spec, dict): continue
    if "public_key" in spec:
      if (why := transport_problem("peer_keys", {name: spec["public_key"]})) is not None:
        raise ConfigError(f"cluster file {path}: nodes.{name}.public_key = {spec['public_key']!r}: {why}")
      keys[name] = spec["public_key"]
    if spec.get("role") in ("prefill", "both"): writers.append(name)
  return keys, tuple(writers)

def _int(v, what) -> int:
  try: return int(v)
  except (TypeError, ValueError): raise ConfigError(f"{what}: {v!r} is not an integer") from None

def config_path(env: dict[str, str] | None = None) -> pathlib.Path | None:
  env = os.environ if env is None else env
  if (p := env.get("TINYHET_CONFIG")):
    if not pathlib.Path(p).is_file(): raise ConfigError(f"TINYHET_CONFIG={p!r}: no such file")
    return pathlib.Path(p)
  return pathlib.Path("tinyhet.toml") if pathlib.Path("tinyhet.toml").is_file() else None

def load_config(path: str | pathlib.Path | None = None, env: dict[str, str] | None = None, **overrides) -> Config:
  """Defaults < file < environment < keyword overrides. Raises ConfigError naming the bad key and its source."""
  env = os.environ if env is None else env
  values: dict = {}
  sources: dict[str, str] = {}
  path = pathlib.Path(path) if path is not None else config_path(env)
  if path is not None:
    try: data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e: raise ConfigError(f"config file {path}: {e}") from None
    for key, value in data.items():
      if key not in _PARSERS: raise ConfigError(f"config file {path}: unknown key {key!r} (known: {', '.join(_PARSERS)})")
      values[key] = _PARSERS[key][1](value, f"config file {path}: {key}")
      sources[key] = f"config file {path}"
  for key, (var, parse) in _PARSERS.items():
    if var in env: values[key], sources[key] = parse(env[var], var), f"environment variable {var}"
  for key, value in overrides.items():
    if key not in _PARSERS: raise ConfigError(f"unknown option {key!r} (known: {', '.join(_PARSERS)})")
    if value is not None: values[key], sources[key] = value, "argument"
  if values.get("cluster"):         # its keys under this node's own peer_keys; its prefill nodes, unless trusted_writers names them
    keys, writers = cluster_identity(values["cluster"])
    values["peer_keys"] = {**keys, **values.get("peer_keys", {})}
    values.setdefault("trusted_writers", writers)
  try: return Config(**values)
  except TypeError as e: raise ConfigError(str(e)) from None
  except ConfigError as e:          # name where the bad value came from (a file, an environment variable)
    if getattr(e, "key", None) in sources: raise ConfigError(f"{sources[e.key]}: {str(e).split(': ', 1)[1]}") from None
    raise

def describe(cfg: Config) -> list[tuple[str, str]]:
  """(option, value) rows for `tinyhet info`; the token is never shown."""
  return [(f.name, "(set)" if f.name == "token" and cfg.token else repr(getattr(cfg, f.name))) for f in dataclasses.fields(cfg)]
