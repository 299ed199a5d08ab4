"""A resident tinyhet for `tinyhet run`, as ollama keeps its model loaded: the first run starts a background process that
loads the model on HET, starts its decode node (MESH) and keeps both, with every compiled kernel and TinyJit capture, for
the runs that follow; they only send their prompt and print what comes back, so a short prompt's first token comes in
well under a second instead of after ~10 s of loading, scheduling and compiling.

  what stays running   one `tinyhet run --resident-serve` process (and its decode node child) per set of options that
                       change what is loaded: --model, --float-weights, --kv-memory, --transport, and the TINYHET_* /
                       HET_BACKEND settings; `ps` shows them as `tinyhet run --resident-serve`
  how long             --keep-alive (TINYHET_KEEP_ALIVE, default 5m) after its last run; 0 keeps nothing resident:
                       every run loads the model in its own process, as before
  how to stop it       `tinyhet run --stop` stops every resident tinyhet of this user; or kill its pid (in its log)
  where                a Unix socket only this user may open, and the process's log, in ~/.cache/tinyhet/run
                       ($XDG_CACHE_HOME/tinyhet/run)

Requests are served one at a time, in order; the protocol is JSON lines: the client sends {"argv": [...]} (its own command
line, parsed again by the resident process) or {"stop": true}; the resident process answers {"text": ...} pieces,
{"stderr": ...} lines (prefill progress), then {"done": figures} or {"error": "one line"}. A client that goes away mid-run
(killed, Ctrl-C, its socket closed) stops its generation at the next token: the send fails or the socket has hung up, the
decode node's stream is cancelled and its sequence released, and the next client is served at once.
"""
from __future__ import annotations
import fcntl, hashlib, json, os, signal, socket, subprocess, sys, time
from pathlib import Path
from tinyhet.cli.common import RunError

KEEP_ALIVE_DEFAULT = "5m"
_UNITS = {"s": 1, "m": 60, "h": 3600}

def parse_keep_alive(text: str) -> float:
  """'300', '300s', '5m', '1h', '0' -> seconds (0: nothing stays resident)."""
  t = str(text).strip().lower()
  scale = _UNITS.get(t[-1:], None)
  try: value = float(t[:-1] if scale else t) * (scale or 1)
  except ValueError: value = -1.0
  if not (0 <= value < 366 * 86400): raise ValueError(f"--keep-alive must be a duration like 0, 300, 30s, 5m or 1h, not {text!r}")
  return value

def run_dir() -> Path:
  d = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tinyhet" / "run"
  d.mkdir(parents=True, exist_ok=True)
  d.chmod(0o700)             # the sockets accept prompts from whoever can open them: this user only
  return d

# settings that change what a resident process has loaded or how it runs: a run with other values gets its own process
_ENV = ("TINYHET_CONFIG", "TINYHET_CPU_THREADS", "TINYHET_TRANSPORT", "TINYHET_KV_DTYPE", "TINYHET_KV_BLOCK_SIZE", "TINYHET_ARENA_BYTES",
        "TINYHET_HUGEPAGES", "TINYHET_TCP_STREAMS", "HET_BACKEND", "TINYHET_INT8_ACTIVATIONS")

def identity(args) -> str:
  from tinyhet import __version__
  model = str(Path(args.model).resolve()) if args.model else None
  key = [__version__, sys.executable, model, bool(args.float_weights), args.kv_memory, args.transport, [os.environ.get(v) for v in _ENV]]
  return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]

def socket_path(args) -> Path: return run_dir() / f"{identity(args)}.sock"

def _connect(path: Path) -> socket.socket | None:
  s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  try:
    s.connect(str(path))
    return s
  except OSError:
    s.close()
    return None

def _messages(sock: socket.socket):
  with sock.makefile("r", encoding="utf-8") as f:
    for line in f: yield json.loads(line)

def start(args, path: Path, say) -> socket.socket:
  """Start the resident process for these options and connect to it once it listens."""
  log = path.with_suffix(".log")
  cmd = [sys.executable, "-m", "tinyhet", "run", "--resident-serve", "--keep-alive", str(args.keep_alive), "--kv-memory", args.kv_memory] + \
        (["--model", args.model] if args.model else []) + (["--transport", args.transport] if args.transport else []) + \
        (["--float-weights"] if args.float_weights else [])
  with open(log, "w") as logf:     # its own session: a Ctrl-C at this terminal does not reach it
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
  path.with_suffix(".pid").write_text(str(proc.pid))    # --stop finds it by this while it loads (it has no socket yet)
  say(f"starting a resident tinyhet (pid {proc.pid}; it stays {args.keep_alive} after the last run; `tinyhet run --stop` stops it; log {log})")
  return _wait_for(path, lambda: proc.poll() is None, say)

def _wait_for(path: Path, alive, say) -> socket.socket:
  """Connect once the resident process listens on path, showing its log meanwhile; RunError if it exits first."""
  log, shown = path.with_suffix(".log"), 0
  while True:
    text = log.read_text(errors="replace")     # what it says while it loads (the model, its decode node) is shown here
    for line in text[shown:text.rfind("\n") + 1].splitlines(): say(line)
    shown = max(shown, text.rfind("\n") + 1)
    if (s := _connect(path)) is not None: return s
    if not alive():
      if (s := _connect(path)) is not None: return s
      lines = [x.strip() for x in log.read_text(errors="replace").splitlines() if x.strip()]
      last = lines[-1].removeprefix("tinyhet run: ") if lines else "it exited"
      raise RunError(f"the resident tinyhet did not start: {last} (log: {log})")
    time.sleep(0.05)

def connect_or_start(args, path: Path, say) -> socket.socket:
  """The resident process's socket, starting the process if there is none. Two first runs at once: the lock file makes the
  second wait for the first's process (as does a run after one killed while its process loads) instead of starting another."""
  if (s := _connect(path)) is not None: return s
  with open(path.with_suffix(".lock"), "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)            # released when the file closes, or when this process dies
    if (s := _connect(path)) is not None: return s
    pidfile = path.with_suffix(".pid")
    if _resident_pid(pidfile) is not None:        # one is loading: its starter went away, or gave up
      say("waiting for the resident tinyhet that is loading")
      return _wait_for(path, lambda: _resident_pid(pidfile) is not None, say)
    return start(args, path, say)

def client_run(args, argv: list[str], say) -> dict:
  """Run one prompt on the resident process for these options (started if there is none); the text is printed as it comes.
  Returns the run's figures."""
  path = socket_path(args)
  sock = connect_or_start(args, path, say)
  with sock:
    sock.sendall((json.dumps({"argv": argv}) + "\n").encode())
    for msg in _messages(sock):
      if "text" in msg:
        if not args.json: print(msg["text"], end="", flush=True)
      elif "stderr" in msg:
        if not args.quiet: print(msg["stderr"], end="", file=sys.stderr, flush=True)
      elif "done" in msg: return msg["done"]
      elif "error" in msg: raise RunError(msg["error"])
  raise RunError(f"the resident tinyhet closed the connection before the answer (its log: {path.with_suffix('.log')})")

def _resident_pid(pidfile: Path) -> int | None:
  """The pid in a pid file if that process is still a resident tinyhet (a pid may have been reused since)."""
  try:
    pid = int(pidfile.read_text())
    return pid if b"--resident-serve" in Path(f"/proc/{pid}/cmdline").read_bytes() else None
  except (OSError, ValueError): return None

def stop_all(say) -> int:
  """Stop every resident tinyhet of this user, loading ones included; returns how many were stopped."""
  n, stopped = 0, set()
  for path in sorted(run_dir().glob("*.sock")):
    if (s := _connect(path)) is None:
      path.unlink(missing_ok=True)          # left by a process that was killed
      continue
    with s:
      s.sendall(b'{"stop": true}\n')
      for msg in _messages(s):
        if msg.get("stopped"): n, stopped = n + 1, stopped | {msg.get("pid")}
  for pidfile in sorted(run_dir().glob("*.pid")):   # still loading (no socket yet): SIGTERM
    if (pid := _resident_pid(pidfile)) is not None and pid not in stopped and not pidfile.with_suffix(".sock").exists():
      os.kill(pid, signal.SIGTERM)
      n += 1
    if _resident_pid(pidfile) is None: pidfile.unlink(missing_ok=True)
  say(f"stopped {n} resident tinyhet process{'es' if n != 1 else ''}")
  return n
