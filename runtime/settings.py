"""What the transports need to know, passed in as one frozen object: runtime/ reads no configuration file and no
environment of its own. tinyhet.config fills these fields (defaults < tinyhet.toml < TINYHET_* variables) and checks
them with the same rules, so a bad value is reported once, in the same words, whichever layer meets it first."""
from __future__ import annotations
import dataclasses, re
from dataclasses import dataclass, field

TRANSPORTS = ("auto", "verbs", "tcp", "shm")
PUBLIC_KEY = re.compile(r"[0-9a-f]{64}")      # an Ed25519 public key as peer_keys names it (tinyhet.runtime.identity)

# field -> (check, what a good value is); the message reads "<field> = <value> <what>"
RULES = {
  "transport": (lambda v: v in TRANSPORTS, f"is not one of {', '.join(TRANSPORTS)}"),
  "token": (lambda v: isinstance(v, str), "must be a string"),
  "tcp_streams": (lambda v: isinstance(v, int) and 1 <= v <= 64, "must be between 1 and 64"),
  "rdma_device": (lambda v: isinstance(v, str) and re.fullmatch(r"[A-Za-z0-9_.:-]{0,63}", v) is not None,
                  "is not an RDMA device name (as `ibv_devices` lists them, e.g. mlx5_0; empty = the first with an active port)"),
  "rdma_port": (lambda v: isinstance(v, int) and 1 <= v <= 255, "must be a port number between 1 and 255 (see `ibv_devinfo`)"),
  "rdma_gid_index": (lambda v: isinstance(v, int) and -1 <= v <= 255,
                     "must be -1 (auto) or a GID table index between 0 and 255 (see `show_gids` or /sys/class/infiniband/DEV/ports/N/gids)"),
  "key_file": (lambda v: isinstance(v, str), "must be a path (a string)"),
  "peer_keys": (lambda v: isinstance(v, dict) and all(isinstance(k, str) and 0 < len(k.encode()) <= 200 and isinstance(x, str)
                                                      and PUBLIC_KEY.fullmatch(x) for k, x in v.items()),
                "must map node names to public keys (64 hex digits each, as `tinyhet keygen` prints)"),
}

def problem(name: str, value) -> str | None:
  """None when value is good for the field name, else what a good one is."""
  ok, rule = RULES[name]
  return None if ok(value) else rule

@dataclass(frozen=True)
class TransportSettings:
  transport: str = "auto"     # verbs | tcp | shm | auto (verbs with an RDMA device, shm on this host, tcp otherwise)
  token: str = ""             # shared secret a peer proves before any byte lands; empty = a random one per endpoint
  tcp_streams: int = 4        # parallel TCP connections per peer
  rdma_device: str = ""       # verbs: RDMA device name (ibv_devices); empty = the first with an active port
  rdma_port: int = 1          # verbs: port number on that device (1-based, as ibv_devinfo shows it)
  rdma_gid_index: int = -1    # verbs: source GID index on RoCE; -1 = auto (RoCE v2, IPv4-mapped first)
  key_file: str = ""          # this node's Ed25519 private key (PEM); empty = a new key pair per endpoint (its name bound to nothing)
  peer_keys: dict = field(default_factory=dict)   # node name -> public key (hex): that name is refused to any other key

  def __post_init__(self):
    for f in dataclasses.fields(self):
      value = getattr(self, f.name)
      if (why := problem(f.name, value)) is not None: raise ValueError(f"transport settings: {f.name} = {value!r} {why}")

  @staticmethod
  def of(obj) -> TransportSettings:
    """These settings read from any object with the same attribute names (tinyhet.config.Config has them all), so a
    caller passes its whole configuration and this layer takes only its part; None gives the defaults."""
    if obj is None or isinstance(obj, TransportSettings): return obj or TransportSettings()
    missing = [f.name for f in dataclasses.fields(TransportSettings) if not hasattr(obj, f.name)]
    if missing: raise TypeError(f"{type(obj).__name__} is not transport settings: it has no {', '.join(missing)}")
    return TransportSettings(**{f.name: getattr(obj, f.name) for f in dataclasses.fields(TransportSettings)})
