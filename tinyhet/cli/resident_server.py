"""The resident process of `tinyhet run` (`tinyhet run --resident-serve`, started by tinyhet.cli.resident): loads the model
and its decode node once (tinyhet.cli.run_session), then answers runs from its Unix socket, one at a time, until its
keep-alive passes with none, `tinyhet run --stop`, or SIGTERM. The protocol is in tinyhet.cli.resident."""
from __future__ import annotations
import json, os, select, signal, socket
from tinyhet.cli.common import RunError
from tinyhet.cli.resident import _resident_pid, parse_keep_alive, socket_path

class ClientGone(Exception):
  """The client of the running generation went away: nobody reads its tokens, so it stops."""

class _Sender:
  """What the resident process writes to its client: JSON lines; a client gone away is noted here (a progress line that
  cannot be sent is no error) and raised as ClientGone by text()."""
  def __init__(self, conn: socket.socket): self.conn, self.gone = conn, False

  def send(self, **msg):
    if self.gone: return
    try: self.conn.sendall((json.dumps(msg) + "\n").encode())
    except OSError: self.gone = True

  def hung_up(self) -> bool:
    """The client closed its socket. POLLHUP, not EOF: on a Unix socket it means both directions are shut, so a client that
    only ends its sending side after the request (`nc -N`) still gets its answer."""
    poll = select.poll()
    poll.register(self.conn, select.POLLHUP)
    return bool(poll.poll(0))

  def text(self, piece: str):
    """A piece of generated text; raises ClientGone once the client is gone, which cancels the generation (DecodeClient
    cancels the decode node's stream and releases its sequence when on_token raises)."""
    if not self.gone and self.hung_up(): self.gone = True
    self.send(text=piece)
    if self.gone: raise ClientGone()

  # a file-like face for the prefill progress lines (they go to the client's stderr)
  def write(self, text: str): self.send(stderr=text)
  def flush(self): pass
  def isatty(self) -> bool: return False

def _stop(*_): raise KeyboardInterrupt()     # SIGTERM: leave the accept loop and clean up as Ctrl-C does

def serve(args) -> int:
  """The resident process: load once, then answer runs until keep-alive seconds pass with none, or --stop, or SIGTERM."""
  import secrets
  from tinyhet.cli.run_args import parse_args
  from tinyhet.cli.run_session import LocalDecodeNode, Session
  os.environ.setdefault("TINYHET_TOKEN", secrets.token_hex(16))
  path, keep_alive = socket_path(args), parse_keep_alive(args.keep_alive)
  child = LocalDecodeNode(args)
  session = Session(args, child)
  listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  tmp = path.with_suffix(f".{os.getpid()}.tmp")
  tmp.unlink(missing_ok=True)
  listener.bind(str(tmp))
  tmp.chmod(0o600)
  listener.listen(8)
  os.replace(tmp, path)                  # clients see the socket only once it accepts
  me = path.stat().st_ino
  signal.signal(signal.SIGTERM, _stop)
  print(f"resident tinyhet pid {os.getpid()} on {path}, keep-alive {keep_alive:.0f} s", flush=True)
  served = 0
  try:
    while True:
      listener.settimeout(keep_alive if keep_alive > 0 else None)
      try: conn, _ = listener.accept()
      except socket.timeout:
        print(f"no run for {keep_alive:.0f} s: stopping", flush=True)
        return 0
      with conn:
        out = _Sender(conn)
        try:
          conn.settimeout(10)
          request = json.loads(conn.makefile("r", encoding="utf-8").readline() or "null")
          conn.settimeout(None)
          if not isinstance(request, dict) or not (request.get("stop") is True or isinstance(request.get("argv"), list)):
            raise RunError('a request is one JSON line: {"argv": [...]} or {"stop": true}')
          if request.get("stop") is True:
            out.send(stopped=True, pid=os.getpid())
            print("stopped by `tinyhet run --stop`", flush=True)
            return 0
          run_args = parse_args([str(a) for a in request["argv"]])
          figures = session.answer(run_args, out.text, progress_out=out)
          served += 1
          out.send(done={**figures, "resident": {"pid": os.getpid(), "runs": served}})
        except ClientGone: print("the client went away: its generation stopped", flush=True)
        except (RunError, ValueError, OSError) as e: out.send(error=str(e))
        except SystemExit as e: out.send(error=f"bad arguments (status {e.code})")
  except KeyboardInterrupt: return 0
  finally:
    try:
      if path.stat().st_ino == me: path.unlink()     # only our own socket: a newer process may have replaced it
    except FileNotFoundError: pass
    if _resident_pid(path.with_suffix(".pid")) == os.getpid(): path.with_suffix(".pid").unlink(missing_ok=True)
    session.close()
    child.close()
