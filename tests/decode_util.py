"""A small random-weight decode node in another process, with a test-only digest request, and a writer that plays the
prefill node's part by hand (reserve, write layers, generate) with its own name, endpoint and registered memory."""
import json, os, subprocess, sys
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
'''

TRUSTED_WRITER = "pf-trusted"       # the guarded node's trusted_writers (a name no test's writer takes unless it means to)

class DecodeNodeProcess:
  def __init__(self, blocks: int = 64, bs: int = 4):
    env = {**os.environ, "TINYHET_TOKEN": TOKEN, "TINYHET_NODE": "guarded-decode", "TINYHET_ARENA_BYTES": "256M",
           "TINYHET_TRUSTED_WRITERS": TRUSTED_WRITER}
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
