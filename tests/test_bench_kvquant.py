"""bench/kvquant.py on a short run: one JSON object, float16 the baseline, q8_0's capacity and wire figures from its layout,
decode timed at batches 1 and 16 with each ratio to float16's at the same batch (bench e2e --kv-dtypes: test_bench_e2e_kv.py)."""
import json, subprocess, sys
import pytest
from tinyhet.bench import results

def bench(*args, timeout=600):
  out = subprocess.run([sys.executable, "-m", "tinyhet.bench", *args, "--json"], capture_output=True, text=True, timeout=timeout)
  assert out.returncode == 0, out.stderr[-2000:]
  return json.loads(out.stdout.strip().splitlines()[-1])

def test_bench_kvquant_short_run():
  r = bench("kvquant", "--contexts", "48", "--tokens", "3", "--ppl-tokens", "64", "--dtypes", "float16,q8_0", "--batches", "1,16", "--rounds", "2")
  base, q8 = r["rows"]
  assert base["kv_dtype"] == "float16" and base["same_tokens_48"] == 3 and base["logit_max_abs_err_48"] == 0.0
  assert q8["capacity_x"] >= 1.85 and q8["wire_x"] == 34 / 64 and 0 <= q8["same_tokens_48"] <= 3
  assert r["ppl_tokens"] == 64 and q8["perplexity"] > 1 and q8["prefill_s"] > 0 and r["batches"] == [1, 16] and r["rounds"] == 2
  for B in (1, 16):
    assert base[f"decode_tok_s_b{B}"] > 0 and q8[f"decode_tok_s_b{B}"] > 0 and base[f"decode_b{B}_x"] == 1.0
    assert q8[f"decode_b{B}_x"] == pytest.approx(q8[f"decode_tok_s_b{B}"] / base[f"decode_tok_s_b{B}"])
  # make tables renders it (docs/benchmarks.md): every figure of a row a column, the batch-16 ones too
  columns, rows = results.table_of(r)
  assert {"decode_tok_s_b1", "decode_tok_s_b16", "decode_b1_x", "decode_b16_x", "prefill_x"} <= set(columns) and len(rows) == 2

def test_bench_kvquant_refuses_an_unknown_dtype_and_a_bad_batch():
  bad = ((["--dtypes", "float16,q4_0"], "kv_dtype 'q4_0' is not one of"), (["--batches", "1,0"], "--batches"), (["--rounds", "0"], "--rounds"))
  for args, said in bad:
    out = subprocess.run([sys.executable, "-m", "tinyhet.bench", "kvquant", *args], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and said in out.stderr and "Traceback" not in out.stderr
