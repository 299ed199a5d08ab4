"""The command line as a user meets it: help, unknown commands, and errors as one line naming the fix."""
import argparse, json, math, os, subprocess, sys
import pytest
from hypothesis import given, strategies as st
from tinyhet.cli.common import host_port, int_in, number_in

def tinyhet(*args, env=None):
  e = {**{k: v for k, v in os.environ.items() if not k.startswith("TINYHET_")}, "TINYHET_KEEP_ALIVE": "0"}
  return subprocess.run([sys.executable, "-m", "tinyhet", *args], capture_output=True, text=True, timeout=300, env={**e, **(env or {})})

def test_help_and_unknown_command():
  out = tinyhet("--help")
  assert out.returncode == 0 and all(c in out.stdout for c in ("run", "node", "plan", "bench", "info"))
  bad = tinyhet("teleport")
  assert bad.returncode == 2 and "unknown command 'teleport'" in bad.stderr

def test_info_json():
  out = tinyhet("info", "--json")
  assert out.returncode == 0, out.stderr
  info = json.loads(out.stdout)
  assert info["transports"]["tcp"] == "available" and "verbs" in info["transports"] and "token" in info["config"]
  assert "secret" not in out.stdout

@pytest.mark.parametrize("args, env, message", [
  (["run", "--decode-node", "127.0.0.1:1", "--quiet"], {}, "cannot connect to 127.0.0.1:1"),
  (["info"], {"TINYHET_TRANSPORT": "bogus"}, "environment variable TINYHET_TRANSPORT: transport = 'bogus' is not one of"),
  (["run", "--model", "/nonexistent.gguf", "--no-disagg", "--quiet"], {}, "does not exist"),
  (["node", "--role", "prefill", "--listen", "nonsense"], {}, "is not host:port"),
  (["node", "--role", "decode", "--listen", "nonsense"], {}, "is not host:port"),
  (["node", "--role", "prefill", "--listen", "127.0.0.1:0", "--model", "random:layers=2"], {}, "'layers=2' is not one of n_layers=N"),
  (["serve", "--prefill", "127.0.0.1:1"], {}, "give at least one decode-capable node"),
  (["run", "--max-tokens", "0"], {}, "argument --max-tokens: must be an integer from 1 to"),
  (["run", "--model", "/nonexistent.gguf"], {}, "model file /nonexistent.gguf does not exist"),      # with the decode node it starts
  (["node", "--role", "decode", "--model", "/nonexistent.gguf"], {}, "model file /nonexistent.gguf does not exist"),
  (["run", "--temperature", "nan"], {}, "--temperature must be 0 (greedy) or a finite number"),
  (["run", "--temperature", "inf"], {}, "--temperature must be 0 (greedy) or a finite number"),
  (["run", "--temperature", "-1"], {}, "--temperature must be 0 (greedy) or a finite number"),
  (["run", "--temperature", "1e-320"], {}, "--temperature must be 0 (greedy) or a finite number"),     # denormal
  (["run", "--top-p", "1.5"], {}, "--top-p must be a number in (0, 1]"),
  (["run", "--top-p", "nan"], {}, "--top-p must be a number in (0, 1]"),
  (["run", "--kv-memory", "lots"], {}, "--kv-memory: 'lots' is not a size"),
  # the admin key is its own credential: neither the nodes' token nor an API key
  (["serve", "--decode", "127.0.0.1:1", "--listen", "127.0.0.1:0"], {"TINYHET_ADMIN_KEY": "x"}, "TINYHET_ADMIN_KEY must differ from TINYHET_TOKEN"),
  (["serve", "--decode", "127.0.0.1:1", "--listen", "127.0.0.1:0", "--admin-key", "k", "--api-key", "k"], {}, "must differ from every API key"),
])
def test_errors_are_one_line_without_traceback(args, env, message):
  out = tinyhet(*args, env={"TINYHET_TOKEN": "x", **env})
  assert out.returncode != 0 and message in out.stderr, out.stderr
  assert "Traceback" not in out.stderr
  assert len([line for line in out.stderr.splitlines() if line.strip()]) == 1, out.stderr     # one error, said once

@pytest.mark.parametrize("args, says", [
  (["node", "--role", "decode", "--max-seqs", "0"], "argument --max-seqs: must be an integer from 1 to 4096, not '0'"),
  (["node", "--role", "both", "--max-context", "-3"], "argument --max-context: must be an integer from 2 to"),
  (["node", "--role", "decode", "--listen", "127.0.0.1:65536"], "argument --listen: '127.0.0.1:65536' is not host:port with a port from 0 to 65535"),
  (["node", "--role", "decode", "--kv-memory", "0"], "--kv-memory: '0' must be positive"),
  (["node", "--role", "decode", "--model", "random:", "--kv-memory", "1"], "--kv-memory 1: a KV budget of 1 bytes holds no block"),
  (["serve", "--decode", "127.0.0.1:7470", "--max-queue", "-1"], "argument --max-queue: must be an integer from 0 to"),
  (["serve", "--decode", "127.0.0.1:7470", "--queue-timeout", "nan"], "argument --queue-timeout: must be a number of seconds above 0"),
  (["serve", "--decode", "127.0.0.1:0"], "argument --decode: '127.0.0.1:0' is not host:port with a port from 1 to 65535"),
  (["run", "--seed", "-1"], "argument --seed: must be an integer from 0 to"),
  (["serve", "--decode", "127.0.0.1:7470", "--max-body", "lots"], "--max-body: 'lots' is not a size"),
  (["serve", "--decode", "127.0.0.1:7470", "--max-body", "2G"], "--max-body must be between 1 byte and 1G"),
])
def test_numeric_options_are_refused_as_they_are_parsed(args, says):
  """Before anything loads: exit status 2 and one line naming the option and what it may be (a node with --max-seqs 0 used
  to start, admit nothing, and hang its clients)."""
  out = tinyhet(*args)
  assert out.returncode == 2 and says in out.stderr and out.stderr.count("\n") == 1, out.stderr

@given(lo=st.integers(-10, 10), span=st.integers(0, 20), text=st.one_of(st.integers(-40, 40).map(str), st.text(max_size=4)))
def test_int_in_takes_exactly_the_integers_in_its_range(lo, span, text):
  try: want = int(text, 10) if lo <= int(text, 10) <= lo + span else None
  except ValueError: want = None
  try: assert int_in(lo, lo + span)(text) == want is not None
  except argparse.ArgumentTypeError as e: assert want is None and f"from {lo} to {lo + span}" in str(e)

@given(x=st.one_of(st.floats(allow_nan=True, allow_infinity=True).map(repr), st.text(max_size=4)))
def test_number_in_takes_only_finite_numbers_in_range(x):
  try: v = float(x)
  except ValueError: v = math.nan
  try: assert number_in(0, 10)(x) == v and 0 < v <= 10
  except argparse.ArgumentTypeError: assert not 0 < v <= 10

@given(port=st.integers(-5, 70000), listen=st.booleans())
def test_host_port_ports(port, listen):
  ok = (0 if listen else 1) <= port <= 65535
  try: assert host_port(listen)(f"h:{port}") == f"h:{port}" and ok
  except argparse.ArgumentTypeError: assert not ok
  for bad in (f":{port}", "h:²", "h:", "h"):
    with pytest.raises(argparse.ArgumentTypeError): host_port(listen)(bad)

def test_bench_transfer_quick_json():
  """The transfer benchmark end to end (it checks the bytes it moved itself), in the JSON shape the README documents."""
  out = tinyhet("bench", "transfer", "--quick", "--json", "--total", "16M")
  assert out.returncode == 0, out.stderr
  r = json.loads(out.stdout)
  assert r["baselines"]["memcpy_gbps"] > 0 and r["baselines"]["socket_gbps"] > 0
  got = {(x["transport"], x["block_bytes"]) for x in r["results"]}
  assert {("shm", 1 << 20), ("tcp", 1 << 20), ("tcp", 64 << 10)} <= got
  assert all(x["gbps"] > 0 and x["ratio_to_baseline"] > 0 and x["write_latency_us"] > 0 for x in r["results"])
  # both latencies are one way, to the receiver's notice: the ratio is of like to like
  assert r["baselines"]["socket_4k_us"] > 0 and all(x["latency_ratio_to_socket"] > 0 for x in r["results"])
  assert "verbs" in r["unavailable"] or any(x["transport"] == "verbs" for x in r["results"])
