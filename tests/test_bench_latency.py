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

def test_the_pieces_part_prices_each_budget_against_the_whole_prompt_and_the_decode_step():
  # in-process, the small random model (--quick): a 200-token prompt whole and in pieces of 16 and 64 tokens, decode steps of 1 and 4
  env = {k: v for k, v in os.environ.items() if not k.startswith("TINYHET_")}
  cmd = [sys.executable, "-m", "tinyhet", "bench", "latency", "--quick", "--parts", "pieces", "--json"]
  r = json.loads(subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=True).stdout.splitlines()[-1])["pieces"]
  assert r["prompt_tokens"] == 200 and r["whole_ms_per_token"] > 0 and set(r["decode_ms"]) == {"1", "4"}
  assert [x["budget"] for x in r["rows"]] == [16, 64]
  for x in r["rows"]:
    assert abs(x["vs_whole"] - x["ms_per_token"] / r["whole_ms_per_token"]) < 1e-9
    assert abs(x["step_ms"] - (r["decode_ms"]["4"] + x["budget"] * x["ms_per_token"])) < 1e-6 and x["step_vs_decode"] > 1

def test_every_load_round_runs_a_prefix_of_one_draw_of_prompt_lengths():
  # requests/s at concurrency 4 against 1 compares the same prompts' lengths (the first 16 of one draw), not two draws
  import numpy as np
  from bench.latency import round_lengths
  r = round_lengths(np.random.default_rng(3), 100, 2000, 16, [1, 4, 16])
  assert len(r[1]) == len(r[4]) == 16 and len(r[16]) == 32 and r[1] == r[4] == r[16][:16]
  assert all(100 <= n <= 2000 for n in r[16])
