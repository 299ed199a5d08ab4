"""The resident tinyhet behind `tinyhet run` (tinyhet.cli.resident): later runs reuse the process the first one started (same
pid, the same greedy tokens), bad requests on its socket get an error and leave it serving, a client killed mid-generation
stops its generation, `--stop` ends it and removes its socket; keep-alive durations and the options that pick a process."""
import json, os, select, socket, subprocess, sys, time
from types import SimpleNamespace
import pytest
from hypothesis import given, strategies as st
from tinyhet.cli import resident

@given(n=st.integers(0, 10**6), unit=st.sampled_from(["", "s", "m", "h"]))
def test_keep_alive_durations(n, unit):
  scale = {"": 1, "s": 1, "m": 60, "h": 3600}[unit]
  if n * scale < 366 * 86400: assert resident.parse_keep_alive(f"{n}{unit}") == n * scale
  else:
    with pytest.raises(ValueError, match="--keep-alive"): resident.parse_keep_alive(f"{n}{unit}")

@pytest.mark.parametrize("bad", ["-1", "5x", "", "m", "nan", "inf", "1e9"])
def test_bad_keep_alive_is_refused_in_one_line(bad):
  with pytest.raises(ValueError, match="--keep-alive must be a duration"): resident.parse_keep_alive(bad)

def test_options_that_change_what_is_loaded_pick_another_process(monkeypatch, tmp_path):
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  base = dict(model=None, float_weights=False, kv_memory="512M", transport=None)
  a = resident.identity(SimpleNamespace(**base))
  assert a == resident.identity(SimpleNamespace(**base))
  for change in (dict(model="other.gguf"), dict(float_weights=True), dict(kv_memory="1G"), dict(transport="tcp")):
    assert resident.identity(SimpleNamespace(**{**base, **change})) != a
  monkeypatch.setenv("TINYHET_CPU_THREADS", "1")
  assert resident.identity(SimpleNamespace(**base)) != a
  assert resident.socket_path(SimpleNamespace(**base)).parent == tmp_path / "tinyhet" / "run"
  assert oct((tmp_path / "tinyhet" / "run").stat().st_mode & 0o777) == "0o700"

COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"      # raw text that a small model goes on counting: no early end

def run(env, *args, timeout=600):
  return subprocess.run([sys.executable, "-m", "tinyhet", "run", *args], capture_output=True, text=True, timeout=timeout, env=env)

def gone(pid: int, timeout: float) -> bool:
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    try: os.kill(pid, 0)
    except ProcessLookupError: return True
    time.sleep(0.1)
  return False

def kill(pid: int | None):
  if pid is None: return
  try: os.kill(pid, 9)
  except ProcessLookupError: pass

def residents(cache) -> set[int]:
  """Pids of the resident processes started with XDG_CACHE_HOME=cache."""
  found = set()
  for d in os.listdir("/proc"):
    try:
      if d.isdigit() and b"--resident-serve" in open(f"/proc/{d}/cmdline", "rb").read() and \
         f"XDG_CACHE_HOME={cache}".encode() in open(f"/proc/{d}/environ", "rb").read().split(b"\0"): found.add(int(d))
    except OSError: pass
  return found

def test_first_runs_start_one_resident_process_that_later_runs_reuse(tmp_path):
  """Two first runs at once start one resident process (one of them may reach it while the other loads); a later run
  reuses it, and so on (one resident process for all of this test: it loads the model once)."""
  env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "TINYHET_KEEP_ALIVE": "120"}
  prompt = ["--json", "--quiet", "--max-tokens", "4", "The capital of France is"]
  firsts = [subprocess.Popen([sys.executable, "-m", "tinyhet", "run", *prompt], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(2)]
  outs = [r.communicate(timeout=600) for r in firsts]
  pids = residents(tmp_path)
  try:
    for r, (out, err) in zip(firsts, outs): assert r.returncode == 0, err
    a, a2 = sorted((json.loads(out) for out, _ in outs), key=lambda o: o["resident"]["runs"])
    pids |= {a["resident"]["pid"], a2["resident"]["pid"]}
    assert len(pids) == 1, f"two resident processes: {pids}"
    (pid,) = pids
    assert [a["resident"]["runs"], a2["resident"]["runs"]] == [1, 2] and pid != os.getpid() and a2["generated_ids"] == a["generated_ids"]
    os.kill(pid, 0)                                   # still there after the runs that started it ended
    second = run(env, *prompt)
    assert second.returncode == 0, second.stderr
    b = json.loads(second.stdout)
    assert b["resident"] == {"pid": pid, "runs": 3} and b["generated_ids"] == a["generated_ids"] and len(a["generated_ids"]) == 4
    # the resident decode node kept the first runs' blocks: a later one prefills only the uncached suffix, there
    assert a["cached_tokens"] == 0 and b["cached_tokens"] >= len(b["prompt_ids"]) - 16, (a["cached_tokens"], b["cached_tokens"], len(b["prompt_ids"]))
    (sock_path,) = (tmp_path / "tinyhet" / "run").glob("*.sock")
    for bad in (b"not json\n", b'{"argv": "a string"}\n', b"[1, 2]\n", b'{"argv": ["--max-tokens", "zero"]}\n'):
      with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(30)
        s.connect(str(sock_path))
        s.sendall(bad)
        reply = json.loads(s.makefile().readline())
        assert "error" in reply, (bad, reply)
    with socket.socket(socket.AF_UNIX) as s:           # a client that shuts its sending side after the request is still answered
      s.settimeout(120)
      s.connect(str(sock_path))
      s.sendall(json.dumps({"argv": prompt}).encode() + b"\n")
      s.shutdown(socket.SHUT_WR)
      replies = [json.loads(line) for line in s.makefile()]
      assert replies[-1]["done"]["generated_ids"] == a["generated_ids"], replies[-1]
    # a client killed mid-generation: the resident process stops that generation (not counted as served) and the next run
    # is answered at once, not after the tokens nobody reads
    rate = max(a["decode_tok_s"], 1.0)
    n = min(1500, max(100, int(rate * 60)))        # ~a minute of decoding at the rate just measured
    long = subprocess.Popen([sys.executable, "-m", "tinyhet", "run", "--quiet", "--raw", "--max-tokens", str(n), COUNTING], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
      assert select.select([long.stdout], [], [], 120)[0] and long.stdout.read1(1), "no token reached the client within 120 s"
    finally:
      long.kill()
      long.wait(10)
    t0 = time.monotonic()
    third = run(env, *prompt)
    took = time.monotonic() - t0
    assert third.returncode == 0, third.stderr
    c = json.loads(third.stdout)
    assert c["resident"] == {"pid": pid, "runs": 5} and c["generated_ids"] == a["generated_ids"]
    assert took < n / rate / 2, f"the next run took {took:.1f} s: the {n}-token generation of the killed client went on"
    stop = run(env, "--stop")
    assert stop.returncode == 0 and "stopped 1 resident tinyhet process" in stop.stderr
    assert gone(pid, 30), "the resident process did not stop"
    assert not sock_path.exists()
    pids = set()
  finally:
    for pid in pids: kill(pid)

def test_stop_reaches_a_resident_process_still_loading(tmp_path):
  env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "TINYHET_KEEP_ALIVE": "120"}
  client = subprocess.Popen([sys.executable, "-m", "tinyhet", "run", "--quiet", "hi"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  run_dir = tmp_path / "tinyhet" / "run"
  deadline = time.monotonic() + 30
  while not list(run_dir.glob("*.pid")) and time.monotonic() < deadline: time.sleep(0.05)
  (pidfile,) = run_dir.glob("*.pid")
  pid = int(pidfile.read_text())
  client.kill()
  client.wait(10)
  try:
    stop = run(env, "--stop")
    assert stop.returncode == 0 and "stopped 1 resident tinyhet process" in stop.stderr, stop.stderr
    assert gone(pid, 30), "the loading resident process did not stop"
  finally: kill(pid)
