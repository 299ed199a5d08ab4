"""bench/spec.py on a tiny random model and tiny sizes: one JSON object, a row per task, mode and batch, every ngram row's
greedy tokens equal its off row's, drafts accepted on the copy task."""
import json, subprocess, sys

def test_bench_spec_short_run():
  out = subprocess.run([sys.executable, "-m", "tinyhet.bench", "spec", "--model", "random:max_context=256", "--batch", "1,2", "--k", "2",
                        "--new-tokens", "12", "--max-prompt", "48", "--rounds", "2", "--json"], capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  r = json.loads(out.stdout.strip().splitlines()[-1])
  rows = {(x["task"], x["mode"], x["batch"]): x for x in r["rows"]}
  assert set(rows) == {(t, m, b) for t in ("copy", "chat") for m in ("off", "ngram") for b in (1, 2)}
  assert all(x["tokens_equal"] is True and x["decode_tok_s"] > 0 for x in r["rows"])
  assert all(rows[t, "off", b]["accept_len"] == 1.0 for t in ("copy", "chat") for b in (1, 2))
  assert rows["copy", "ngram", 1]["accept_len"] > 1.0 and r["k"] == 2 and r["new_tokens"] == 12
  assert r["policy"] == "adaptive" and all(t > 0 for t in r["step_ms"].values()) and "1" in r["step_ms"]

def test_bench_spec_refuses_a_bad_k():
  out = subprocess.run([sys.executable, "-m", "tinyhet.bench", "spec", "--k", "9"], capture_output=True, text=True, timeout=60)
  assert out.returncode != 0 and "--k must be in 1..8" in out.stderr and "Traceback" not in out.stderr

def test_bench_spec_refuses_no_rounds():
  out = subprocess.run([sys.executable, "-m", "tinyhet.bench", "spec", "--rounds", "0"], capture_output=True, text=True, timeout=60)
  assert out.returncode != 0 and "--rounds must be at least 1" in out.stderr and "Traceback" not in out.stderr

def test_bench_spec_draft_model_rows():
  """--draft-model adds the draft mode's rows; the model drafting for itself with every draft verified (--fixed): its
  tokens equal off's and its drafts are kept."""
  spec = "random:max_context=256"
  out = subprocess.run([sys.executable, "-m", "tinyhet.bench", "spec", "--model", spec, "--draft-model", spec, "--fixed", "--batch", "1",
                        "--k", "3", "--tasks", "chat", "--new-tokens", "12", "--max-prompt", "48", "--rounds", "1", "--json"],
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  r = json.loads(out.stdout.strip().splitlines()[-1])
  rows = {x["mode"]: x for x in r["rows"]}
  assert set(rows) == {"off", "ngram", "draft"} and r["draft_model"].startswith("random:") and r["policy"] == "fixed"
  assert rows["draft"]["tokens_equal"] is True and rows["draft"]["accept_len"] > 2.0
