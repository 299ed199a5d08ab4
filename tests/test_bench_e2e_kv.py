"""bench e2e --kv-dtypes on a tiny random model: a decode node per KV dtype, a row per KV dtype and transport, q8_0's bytes
(as sent) and transfer time over float16's."""
import json, subprocess, sys
import pytest

def bench(*args, timeout=600):
  out = subprocess.run([sys.executable, "-m", "tinyhet.bench", *args, "--json"], capture_output=True, text=True, timeout=timeout)
  assert out.returncode == 0, out.stderr[-2000:]
  return json.loads(out.stdout.strip().splitlines()[-1])

# head_dim 32: q8_0's group
TINY = "random:n_layers=2,dim=64,n_heads=2,n_kv_heads=1,hidden_dim=96,vocab_size=256,max_context=128"

def test_bench_e2e_per_kv_dtype():
  r = bench("e2e", "--model", TINY, "--kv-dtypes", "float16,q8_0", "--prompt-lens", "20", "--new-tokens", "6", "--rounds", "1",
            "--transports", "shm,tcp")
  assert r["kv_dtypes"] == ["float16", "q8_0"]
  rows = {(x["kv_dtype"], x["transport"]): x for x in r["rows"]}
  assert set(rows) == {(d, t) for d in ("float16", "q8_0") for t in ("shm", "tcp")}
  for t in ("shm", "tcp"):
    f16, q8 = rows["float16", t], rows["q8_0", t]
    assert f16["kv_bytes_x"] == 1.0 and f16["transfer_x"] == 1.0 and f16["kv_bytes"] > 0
    # 20 tokens in two 16-token blocks, per layer K and V: q8_0's blocks are 34/64 of float16's bytes, as sent
    assert q8["kv_bytes"] * 64 == f16["kv_bytes"] * 34 and q8["kv_bytes_x"] == pytest.approx(34 / 64, abs=1e-4)
    assert q8["transfer_x"] == pytest.approx(q8["transfer_s"] / f16["transfer_s"], rel=1e-2) and q8["transfer_s"] > 0
    assert q8["overhead_s"] == pytest.approx(q8["ttft_s"] - q8["ttft_no_transfer_s"], abs=1e-9)
  assert [(d["kv_dtype"], d["prompt_tokens"]) for d in r["decode"]] == [("float16", 20), ("q8_0", 20)]
  assert all(d["decode_tok_s"]["disagg"] > 0 and d["decode_tok_s"]["single_device"] > 0 for d in r["decode"])
  assert r["kv_bytes_per_token_by_dtype"]["q8_0"] * 64 == r["kv_bytes_per_token_by_dtype"]["float16"] * 34

def test_bench_e2e_refuses_an_unknown_kv_dtype():
  out = subprocess.run([sys.executable, "-m", "tinyhet.bench", "e2e", "--kv-dtypes", "float16,q4_0"], capture_output=True, text=True, timeout=120)
  assert out.returncode != 0 and "kv_dtype 'q4_0' is not one of" in out.stderr and "Traceback" not in out.stderr
