"""What every `tinyhet` subcommand shares: argparse with one-line errors, types for numeric and address options, and ending a
process that was told to stop."""
import argparse, math, os, signal, sys, threading, time

class ArgumentParser(argparse.ArgumentParser):
  """argparse, with a bad option said in one line (argparse prints the whole usage block before it)."""
  def error(self, message: str):
    self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")

class RunError(RuntimeError):
  """A run that cannot go on, said in the user's words (the CLI prints it as one line)."""

# ---- argparse types for numeric options: a bad value is refused at parse time, naming the option and what it may be

def int_in(lo: int, hi: int):
  """An integer from lo to hi; argparse says `argument --x: must be an integer from lo to hi, not '0'` and exits 2."""
  def parse(text: str) -> int:
    try: value = int(text, 10)
    except ValueError: value = None
    if value is None or not lo <= value <= hi: raise argparse.ArgumentTypeError(f"must be an integer from {lo} to {hi}, not {text!r}")
    return value
  return parse

def number_in(lo: float, hi: float, unit: str = ""):
  """A finite number above lo (exclusive) and at most hi (unit: how the message calls it, e.g. "seconds")."""
  what = f"a number of {unit}" if unit else "a number"
  def parse(text: str) -> float:
    try: value = float(text)
    except ValueError: value = math.nan
    if not lo < value <= hi: raise argparse.ArgumentTypeError(f"must be {what} above {lo:g} and at most {hi:g}, not {text!r}")
    return value
  return parse

def host_port(listen: bool = False):
  """host:port with a port from 1 (0 where listening: any free port) to 65535; the text is kept as given."""
  lo = 0 if listen else 1
  def parse(text: str) -> str:
    host, _, port = text.rpartition(":")
    if not host or not (port.isascii() and port.isdigit()) or not lo <= int(port) <= 65535:
      raise argparse.ArgumentTypeError(f"{text!r} is not host:port with a port from {lo} to 65535")
    return text
  return parse

# ---- ending a process

STOP_GRACE = 10.0     # seconds a signalled process has for its own cleanup before it is ended regardless

def exit_after_signal(code: int, grace: float = STOP_GRACE, orphaned=lambda: False):
  """Make SIGTERM and SIGINT end this process within `grace` seconds even when the main thread cannot run Python (a long
  kernel, a wait in C): Python handlers run only between bytecodes of the main thread, but the wakeup fd is written by
  the C handler at once, and this thread watches it. Call from the main thread, after the process's own handlers.
  orphaned(): true when the process that owned this one is gone (its death sent the signal): nobody waits for a clean
  shutdown then, so the process ends at once (a node killed while compiling its kernels took the whole grace)."""
  r, w = os.pipe()
  os.set_blocking(w, False)
  signal.set_wakeup_fd(w, warn_on_full_buffer=False)
  def watch():
    while os.read(r, 1)[0] not in (signal.SIGTERM, signal.SIGINT): pass
    if orphaned(): exit_now(code)
    time.sleep(grace)
    print(f"tinyhet: still stopping after {grace:g} s: ending now", file=sys.stderr, flush=True)
    exit_now(code)
  threading.Thread(target=watch, daemon=True, name="tinyhet-stop-deadline").start()

def exit_now(code: int):
  """End a process that was told to stop (SIGTERM, its parent gone) once its own cleanup is done: tinygrad's compile
  workers are ended, and the interpreter's teardown is skipped, because the signal may have cut a device's opening short
  and tinygrad's exit hook would then trip over the half-opened device (a traceback at exit)."""
  end_compile_workers()
  for f in (sys.stdout, sys.stderr):
    try: f.flush()
    except (OSError, ValueError): pass
  os._exit(code)

def end_compile_workers(wait: float = 1.0):
  """End tinygrad's compile worker processes. Its Pool.terminate() alone can wait forever: it first takes the task queue's
  lock, which an idle worker holds while it waits for a task, and a signal sent to the whole process group (a shell's job
  control, `timeout`, systemd) has killed that worker with the lock held. So terminate() gets `wait` seconds (it stops
  the pool from replacing workers first), then whatever worker is left is killed."""
  import multiprocessing.util
  if (worker := sys.modules.get("tinygrad.engine.worker")) is None: return     # tinygrad never started a pool here
  t = threading.Thread(target=worker.terminate_worker_pool, daemon=True, name="tinyhet-end-workers")
  t.start()
  t.join(wait)
  for p in multiprocessing.active_children():
    p.kill()
    p.join(wait)
  # the pool's queue locks are named semaphores that os._exit would leave behind, and multiprocessing's resource tracker
  # would say so on stderr after we are gone; their finalizers (priority 0) unlink them. Not while terminate() is stuck:
  # the pool's own finalizer is the one stuck in it.
  if not t.is_alive(): multiprocessing.util._run_finalizers(0)
