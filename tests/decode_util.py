"""A small random-weight decode node in another process, with test-only requests (test.digest: every block's digest;
test.cached: every cached block's bytes; test.fail: make the next prefill or decode step fail; test.withdraw_reads: take
back a reservation's read grants) and decode.submit, and a writer that plays the prefill node's part by hand (reserve,
write layers, generate) with its own name, endpoint and registered memory."""
import json, os, subprocess, sys, time
import numpy as np
from tinyhet.config import load_config
from tinyhet.kv.notices import notice_value
from tinyhet.runtime.arena import Arena
from tinyhet.runtime.control import ControlClient
from tinyhet.runtime.descriptor import RegionDescriptor
from tinyhet.runtime.transport import Endpoint, Span
from test_e2e import DECODE_NODE, SMALL, TOKEN

DIGEST = '''
import hashlib
def _digest(conn):
  c = decode.cache
  return {"blocks": [[hashlib.sha1(c.read_block_bytes(l, b)).hexdigest()[:16] for b in range(c.block_manager.num_blocks)]
                     for l in range(c.n_layers)], "arena_in_use": node.arena("MESH").in_use}
node.endpoint.handle("test.digest", _digest)
def _writer(conn, seq_id):   # who may write a reserved sequence's blocks, as the prefix cache reads it
  return {k: decode.scheduler.incoming[seq_id].extra[k] for k in ("writer", "trusted_writer")}
node.endpoint.handle("test.writer", _writer)
def _cached(conn):       # every cached block: its hash and each layer's bytes
  c = decode.cache
  with decode.cond: held = list(c.block_manager.hash_block.items())
  return {"blocks": [[h, [c.read_block_bytes(l, b).hex() for l in range(c.n_layers)]] for h, b in held], "key": c.block_manager.model_id}
node.endpoint.handle("test.cached", _cached)
# faults, one-shot, armed by test.fail: a prefill that stores its first layer and fails, a decode step that fails before it runs
FAULTS = set()
_storer, _step = decode.cache.layer_storer, decode.engine.step
def _faulty_storer(seq_id):
  store = _storer(seq_id)
  def run(layer, k, v):
    if layer > 0 and "prefill" in FAULTS:
      FAULTS.discard("prefill")
      raise RuntimeError("injected: the prefill failed after its first layer")
    return store(layer, k, v)
  return run
def _faulty_step(*a, **kw):
  if "step" in FAULTS:
    FAULTS.discard("step")
    raise RuntimeError("injected: the decode step failed")
  return _step(*a, **kw)
import tinyhet.engine.prefill as _prefill_module
_suffix = _prefill_module.prefill_suffix_logits
def _faulty_suffix(*a, **kw):    # a prefix-cache hit's prefill (the rest of the prompt): fails before it runs
  if "prefill" in FAULTS:
    FAULTS.discard("prefill")
    raise RuntimeError("injected: the suffix prefill failed")
  return _suffix(*a, **kw)
decode.cache.layer_storer, decode.engine.step, _prefill_module.prefill_suffix_logits = _faulty_storer, _faulty_step, _faulty_suffix
def _fail(conn, what):           # "clear": no fault armed any more
  if what not in ("prefill", "step", "clear"): raise ValueError(f"no fault {what!r}")
  if what == "clear": FAULTS.clear()
  else: FAULTS.add(what)
  return {}
node.endpoint.handle("test.fail", _fail)
def _withdraw_reads(conn, seq_id, from_layer):   # the holder takes back a reservation's read grants of these layers (a pull then fails)
  seq = decode.scheduler.incoming[seq_id]
  n = decode.model.cfg.n_layers
  for d in seq.extra["descs"][n + from_layer:]: node.endpoint.withdraw(d)
  return {}
node.endpoint.handle("test.withdraw_reads", _withdraw_reads)
from tinyhet.service.node_roles import install_submit
install_submit(decode)
'''

TRUSTED_WRITER = "pf-trusted"       # the guarded node's trusted_writers (a name no test's writer takes unless it means to)

class DecodeNodeProcess:
  def __init__(self, blocks: int = 64, bs: int = 4, trusted: tuple[str, ...] = (TRUSTED_WRITER,)):
    """trusted: the writers whose KV the node caches (tinyhet.config's trusted_writers)."""
    env = {**os.environ, "TINYHET_TOKEN": TOKEN, "TINYHET_NODE": "guarded-decode", "TINYHET_ARENA_BYTES": "256M",
           "TINYHET_TRUSTED_WRITERS": ",".join(trusted)}
    # warmed up before it says it is ready, so that an idle node holds no block (warm-up borrows scratch blocks)
    script = DECODE_NODE.format(small=SMALL, blocks=blocks, bs=bs).replace("decode.run(stop)", DIGEST + "decode.run(stop, warm_up=False)")
    script = script.replace("print(json.dumps(", "decode.warm_up()\nprint(json.dumps(")
    self.proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    line = self.proc.stdout.readline()
    if not line: raise RuntimeError(f"decode node did not start (exit {self.proc.wait()})")
    self.address, self.blocks = json.loads(line)["address"], blocks

  def rss(self) -> int:
    for line in open(f"/proc/{self.proc.pid}/status"):
      if line.startswith("VmRSS:"): return int(line.split()[1]) << 10
    raise RuntimeError("no VmRSS")

  def close(self):
    self.proc.stdin.close()
    try: self.proc.wait(30)
    except subprocess.TimeoutExpired: self.proc.kill()

def writer_when_free(name: str, address: str, within: float = 30.0) -> "Writer":
  """A Writer under name once the node has let go of the connections an earlier Writer of that name (another key) held:
  the node drops a closed connection's name in the background, so a test's fresh peer of the last test's name waits
  for that, not for a fixed time."""
  from tinyhet.runtime.transport import TransportError
  deadline = time.monotonic() + within
  while True:
    try: return Writer(name, address)
    except TransportError as e:
      if "held by another live connection" not in str(e) or time.monotonic() > deadline: raise
      time.sleep(0.05)

class Writer:
  """One peer: a control connection and a transport link to the decode node, and 1 MiB of its own registered memory."""
  def __init__(self, name: str, address: str, transport: str = "tcp"):
    self.address, self.transport = address, transport
    self.ep = Endpoint(name, token=TOKEN, config=load_config(env={}))
    self.arena = Arena(1 << 20, name, hugepages=False)
    self.ep.register(self.arena)
    self.src = self.arena.alloc(1 << 20)
    self.ctl = ControlClient(self.ep, address)
    self.peer = self.ep.connect(address, transport)

  def reserve(self, prompt=(1, 2, 3, 4, 5), new: int = 2) -> dict:
    r = self.ctl.call("decode.reserve", prompt_ids=list(prompt), max_new_tokens=new, timeout=10)
    r["pools"] = [RegionDescriptor.from_hex(h) for h in r["pools"]]
    return r

  def fill(self, data: bytes):
    self.src.view(0, len(data))[:] = data

  def write(self, pool: RegionDescriptor, blocks: list[int], block_bytes: int, notify: int | None = None, first: int = 0):
    """blocks from the fill's blocks first, first + 1, ..."""
    spans = [Span(self.src, (first + i) * block_bytes, pool, b * block_bytes, block_bytes) for i, b in enumerate(blocks)]
    return self.ep.write(self.peer, spans, notify)

  def write_layers(self, r: dict, layers, notify_as: tuple[int, int] | None = None):
    """Write r's blocks of these layers from the current fill, each with its notice; waits until they land."""
    for layer in layers:
      self.write(r["pools"][layer], r["blocks"], r["block_bytes"], notice_value(r["seq_id"], layer)).wait(10)

  def reconnect(self):
    self.peer.close()
    self.peer = self.ep.connect(self.address, self.transport)

  def close(self):
    for f in (self.ctl.close, self.peer.close, self.ep.close): f()
    self.src.free()
    self.arena.close()

def kv_bytes(nbytes: int, seed: int = 0) -> bytes:
  """Plausible float16 K/V bytes."""
  return (np.random.default_rng(seed).standard_normal(nbytes // 2) * 0.5).astype(np.float16).tobytes()

def generate(w: Writer, r: dict, first_token: int = 7, **kw) -> list[int]:
  out = [first_token]
  for item in w.ctl.stream("decode.generate", seq_id=r["seq_id"], first_token=first_token, **kw):
    if "token" in item: out.append(item["token"])
  return out

def clean_request(w: Writer) -> list[int]:
  """The same request every time (prompt, KV bytes, greedy): its tokens are the node's reference answer."""
  r = w.reserve(prompt=(5, 4, 3, 2, 1, 9, 8), new=6)
  w.fill(kv_bytes(len(r["blocks"]) * r["block_bytes"], seed=1))
  w.write_layers(r, range(SMALL["n_layers"]))
  return generate(w, r, timeout=10)

def submit(w: Writer, prompt: list[int], new: int, **kw) -> tuple[list[int], dict]:
  """decode.submit: the node prefills the prompt itself; (every token, the done item)."""
  out, done = [], {}
  for item in w.ctl.stream("decode.submit", prompt_ids=list(prompt), max_new_tokens=new, reply_timeout=10, **kw):
    if "token" in item: out.append(item["token"])
    if item.get("done"): done = item
  return out, done
