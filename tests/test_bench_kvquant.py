"""bench/kvquant.py on a short run: one JSON object, float16 the baseline, q8_0's capacity and wire figures from its layout."""
import json, subprocess, sys

def test_bench_kvquant_short_run():
  out = subprocess.run([sys.executable, "-m", "tinyhet.bench", "kvquant", "--contexts", "48", "--tokens", "3", "--ppl-tokens", "64",
                        "--dtypes", "float16,q8_0", "--json"], capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-2000:]
  r = json.loads(out.stdout.strip().splitlines()[-1])
  base, q8 = r["rows"]
  assert base["kv_dtype"] == "float16" and base["same_tokens_48"] == 3 and base["logit_max_abs_err_48"] == 0.0
  assert q8["capacity_x"] >= 1.85 and q8["wire_x"] == 34 / 64 and 0 <= q8["same_tokens_48"] <= 3
  assert r["ppl_tokens"] == 64 and q8["perplexity"] > 1 and q8["prefill_s"] > 0 and q8["decode_tok_s_b1"] > 0

def test_bench_kvquant_refuses_an_unknown_dtype():
  out = subprocess.run([sys.executable, "-m", "tinyhet.bench", "kvquant", "--dtypes", "float16,q4_0"], capture_output=True, text=True, timeout=120)
  assert out.returncode != 0 and "kv_dtype 'q4_0' is not one of" in out.stderr and "Traceback" not in out.stderr
