"""`tinyhet bench latency --parts fresh` at a tiny size: four real `tinyhet run`s (two fresh processes, a resident one)
on the tiny Hugging Face fixture; its JSON and its table line."""
import json, os, pathlib, subprocess, sys

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "hf" / "tf5-llama"

def test_the_fresh_part_reports_both_ttfts_and_their_ratio_and_leaves_no_resident_process(tmp_path):
  env = {**{k: v for k, v in os.environ.items() if not k.startswith("TINYHET_")}, "CACHEDB": str(tmp_path / "cache.db")}
  cmd = [sys.executable, "-m", "tinyhet", "bench", "latency", "--parts", "fresh", "--model", str(FIXTURE), "--run-tokens", "30"]
  out = json.loads(subprocess.run([*cmd, "--json"], env=env, capture_output=True, text=True, timeout=600, check=True).stdout.splitlines()[-1])
  r = out["fresh"]
  assert r["prompt_tokens"] > 10 and r["fresh_ttft_s"] > 0 and r["resident_ttft_s"] > 0
  assert abs(r["ratio"] - r["fresh_ttft_s"] / r["resident_ttft_s"]) < 1e-9
  # the resident process it started lived in its own run directory, and is gone: none runs this test's model now
  ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
  assert not any("--resident-serve" in line and str(FIXTURE) in line for line in ps.splitlines()), ps
