"""The command line as a user meets it: help, unknown commands, and errors as one line naming the fix."""
import json, os, subprocess, sys
import pytest

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
  (["run", "--max-tokens", "0"], {}, "--max-tokens must be at least 1"),
  (["run", "--model", "/nonexistent.gguf"], {}, "model file /nonexistent.gguf does not exist"),      # with the decode node it starts
  (["node", "--role", "decode", "--model", "/nonexistent.gguf"], {}, "model file /nonexistent.gguf does not exist"),
  (["run", "--temperature", "nan"], {}, "--temperature must be 0 (greedy) or a finite number"),
  (["run", "--temperature", "inf"], {}, "--temperature must be 0 (greedy) or a finite number"),
  (["run", "--temperature", "-1"], {}, "--temperature must be 0 (greedy) or a finite number"),
  (["run", "--temperature", "1e-320"], {}, "--temperature must be 0 (greedy) or a finite number"),     # denormal
  (["run", "--top-p", "1.5"], {}, "--top-p must be a number in (0, 1]"),
  (["run", "--top-p", "nan"], {}, "--top-p must be a number in (0, 1]"),
  (["run", "--kv-memory", "lots"], {}, "--kv-memory: 'lots' is not a size"),
])
def test_errors_are_one_line_without_traceback(args, env, message):
  out = tinyhet(*args, env={"TINYHET_TOKEN": "x", **env})
  assert out.returncode != 0 and message in out.stderr, out.stderr
  assert "Traceback" not in out.stderr
  assert len([line for line in out.stderr.splitlines() if line.strip()]) == 1, out.stderr     # one error, said once

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
