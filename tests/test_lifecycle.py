"""Process lifecycle with real processes: SIGTERM stops `tinyhet run` and the decode node it started, and a node stopped
with its whole process group; a process whose cleanup sticks after SIGTERM still ends; a node started by a parent that is
killed outright exits on its own (PR_SET_PDEATHSIG, its stdin closing)."""
import os, pathlib, signal, subprocess, sys, time
import pytest

ROOT = pathlib.Path(__file__).parent.parent

def children() -> dict[int, int]:
  """pid -> parent pid of every live (not zombie) process."""
  out = {}
  for d in pathlib.Path("/proc").iterdir():
    if not d.name.isdigit(): continue
    try: stat = (d / "stat").read_text()
    except OSError: continue
    state, ppid = stat[stat.rindex(")") + 2:].split()[:2]
    if state != "Z": out[int(d.name)] = int(ppid)
  return out

def descendants(pid: int) -> set[int]:
  tree, found, todo = children(), set(), [pid]
  while todo:
    p = todo.pop()
    for c, pp in tree.items():
      if pp == p and c not in found:
        found.add(c)
        todo.append(c)
  return found

def alive(pids: set[int]) -> set[int]: return pids & set(children())

def wait_for(cond, timeout: float, what: str):
  deadline = time.monotonic() + timeout
  while not (got := cond()):
    if time.monotonic() > deadline: pytest.fail(f"{what} within {timeout} s")
    time.sleep(0.1)
  return got

def start_run(tmp_path, *flags):
  """`tinyhet run` with its stderr in a file; returns it once the decode node it starts has been running for a moment."""
  err = open(tmp_path / "stderr", "w")
  # TINYHET_KEEP_ALIVE=0: the run loads the model in its own process and starts its own decode node (nothing resident)
  env = {**{k: v for k, v in os.environ.items() if not k.startswith("TINYHET_")}, "TINYHET_KEEP_ALIVE": "0"}
  run = subprocess.Popen([sys.executable, "-m", "tinyhet", "run", "hi", "--max-tokens", "2", *flags], stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=err, cwd=ROOT, env=env)
  node = wait_for(lambda: descendants(run.pid), 60, "tinyhet run started no decode node")
  time.sleep(3)                 # the node is importing / loading its model: a time when it used to ignore the parent going away
  return run, node | descendants(run.pid)

def test_sigterm_to_run_stops_it_and_its_decode_node(tmp_path):
  run, tree = start_run(tmp_path)
  run.send_signal(signal.SIGTERM)
  try: assert run.wait(15) == 143, (tmp_path / "stderr").read_text()[-3000:]
  except subprocess.TimeoutExpired: pytest.fail("tinyhet run ignored SIGTERM for 15 s")
  finally: run.kill()
  wait_for(lambda: not alive(tree), 30, f"processes {alive(tree)} of the run were still alive")
  assert "Traceback" not in (tmp_path / "stderr").read_text()

def test_node_dies_with_a_parent_killed_outright(tmp_path):
  run, tree = start_run(tmp_path, "--quiet")    # quiet: the node writes nothing, so no broken pipe ends it by accident
  run.kill()                    # SIGKILL: the parent runs no cleanup at all
  run.wait(10)
  wait_for(lambda: not alive(tree), 30, f"processes {alive(tree)} outlived their killed parent")

def test_node_stops_on_sigterm_to_its_process_group(tmp_path):
  """As a shell's job control, `timeout` or systemd stop it: SIGTERM reaches the node and tinygrad's compile workers at once.
  The node used to hang for good in its exit (tinygrad's Pool.terminate waited for a lock that a killed worker held)."""
  err = open(tmp_path / "stderr", "w")
  env = {**{k: v for k, v in os.environ.items() if not k.startswith("TINYHET_")}, "TINYHET_TOKEN": "t"}
  node = subprocess.Popen([sys.executable, "-m", "tinyhet", "node", "--role", "decode", "--model", "random:", "--kv-memory", "16M",
                           "--listen", "127.0.0.1:0", "--quiet"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err, cwd=ROOT,
                          env=env, start_new_session=True, text=True)
  try:
    assert "address" in node.stdout.readline(), (tmp_path / "stderr").read_text()[-3000:]    # ready: warmed up, its workers idle
    tree = descendants(node.pid)
    os.killpg(node.pid, signal.SIGTERM)
    try: node.wait(15)
    except subprocess.TimeoutExpired: pytest.fail("the node ignored SIGTERM to its process group for 15 s")
  finally:
    try: os.killpg(node.pid, signal.SIGKILL)
    except ProcessLookupError: pass
    node.wait(10)
  wait_for(lambda: not alive(tree), 30, f"processes {alive(tree)} of the node were still alive")
  assert "Traceback" not in (tmp_path / "stderr").read_text()

STUCK = """
import signal, sys, threading, time
from tinyhet.cli.common import exit_after_signal
signal.signal(signal.SIGTERM, lambda *_: threading.Event().wait())      # a cleanup that never ends
exit_after_signal(7, grace=float(sys.argv[1]))
print("ready", flush=True)
time.sleep(60)
"""

def test_a_process_stuck_after_sigterm_ends_within_its_grace():
  p = subprocess.Popen([sys.executable, "-c", STUCK, "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
  try:
    assert p.stdout.readline() == "ready\n", p.stderr.read()
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    try: assert p.wait(10) == 7
    except subprocess.TimeoutExpired: pytest.fail("stuck after SIGTERM for 10 s with a grace of 1 s")
    assert time.monotonic() - t0 >= 0.9 and "ending now" in p.stderr.read()
  finally: p.kill()
