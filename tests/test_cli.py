"""The command line as a user meets it: help, unknown commands, and errors as one line naming the fix."""
import json, os, subprocess, sys
import pytest

def tinyhet(*args, env=None):
  e = {k: v for k, v in os.environ.items() if not k.startswith("TINYHET_")}
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
  (["node", "--role", "prefill"], {}, "not built yet"),
  (["node", "--role", "decode", "--listen", "nonsense"], {}, "is not host:port"),
  (["run", "--max-tokens", "0"], {}, "--max-tokens must be at least 1"),
])
def test_errors_are_one_line_without_traceback(args, env, message):
  out = tinyhet(*args, env={"TINYHET_TOKEN": "x", **env})
  assert out.returncode != 0 and message in out.stderr, out.stderr
  assert "Traceback" not in out.stderr
