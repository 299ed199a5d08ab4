"""Helpers for transport tests: a real memory node in another process, and a raw client that speaks the handshake."""
import hashlib, json, os, socket, subprocess, sys
from tinyhet.runtime import wire
from tinyhet.runtime.descriptor import RegionDescriptor

TOKEN = "test-token"

class MemoryNode:
  """tinyhet.runtime.memory_node in a subprocess (optionally inside a network namespace)."""
  def __init__(self, name="memnode", listen="127.0.0.1:0", netns=None, arena_bytes=64 << 20, token=TOKEN):
    cmd = [sys.executable, "-m", "tinyhet.runtime.memory_node", "--name", name, "--token", token, "--listen", listen,
           "--arena-bytes", str(arena_bytes)]
    if netns: cmd = ["ip", "netns", "exec", netns, *cmd]
    self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
    line = self.proc.stdout.readline()
    if not line: raise RuntimeError(f"memory node did not start (exit {self.proc.wait()})")
    info = json.loads(line)
    self.address, self.node, self.pid = info["address"], info["node"], info["pid"]

  def ask(self, **req) -> dict:
    self.proc.stdin.write(json.dumps(req) + "\n")
    reply = json.loads(self.proc.stdout.readline())
    if "error" in reply: raise RuntimeError(reply["error"])
    return reply

  def expose(self, nbytes: int) -> tuple[RegionDescriptor, int]:
    r = self.ask(cmd="expose", nbytes=nbytes)
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

def sha(data) -> str: return hashlib.sha256(data).hexdigest()

def raw_tcp_session(address: str, token: str = TOKEN, node: str = "raw", streams: int = 1) -> socket.socket:
  """A TCP socket past the handshake as stream 0 of a tcp session: the caller then sends frames by hand."""
  host, _, port = address.rpartition(":")
  sock = socket.create_connection((host, int(port)), timeout=10)
  hello = wire.recv_json(sock)
  nonce = wire.new_nonce()
  wire.send_json(sock, {"node": node, "transport": "tcp", "nonce": nonce, "proof": wire.proof(token, hello["nonce"], "client", node),
                        "session": os.urandom(8).hex(), "stream": 0, "streams": streams})
  ok = wire.recv_json(sock)
  if "error" in ok: raise ConnectionRefusedError(ok["error"])
  return sock
