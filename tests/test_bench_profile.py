"""tinyhet bench profile: the matrix products are named by their shape, and on a small random model (one short prefill, one
decode step) its groups add up to the kernels it timed."""
import json, subprocess, sys
from tinyhet.bench.profile import group

def test_kernel_names_group_by_kind():
  assert group("qmatmul_q4_1_512_1536_576_p2_tiled", 49152) == ("matmul q4_1 512x1536x576 p2_tiled", 2.0 * 512 * 1536 * 576)
  assert group("qmatmul_q8_0_1_49152_576_p2", 49152)[0].startswith("logits q8_0 1x49152x576")
  assert group("qmatmul_q6_k_16_576_1536_p2_int8k", 49152)[0] == "matmul q6_k 16x576x1536 p2_int8k"
  assert group("qmatmul_q4_1_1_1536_576_p2_int8v", 49152)[0] == "matmul q4_1 1x1536x576 p2_int8v"
  assert group("qmatmul_q5_0_8_576_576_p2_r16", 49152)[0] == "matmul q5_0 8x576x576 p2_r16"
  assert group("cpu_attention_prefill_bs16_cap32", 49152) == ("attention (C)", 0.0)
  # the kernels that round x once before the int8 and bf16 tiled products: a group of their own, not tinygrad's
  assert group("round_x_int8_g32_o8_16_576_p2", 49152) == ("rounding x int8 16x576 p2", 0.0)
  assert group("round_x_bf16_512_2048_p1", 49152) == ("rounding x bf16 512x2048 p1", 0.0)
  assert group("r_3_256_128_2", 49152) == ("tinygrad r_3_256_128_2", 0.0)

def test_profile_of_a_small_model_accounts_for_its_kernels():
  out = subprocess.run([sys.executable, "-m", "tinyhet.bench", "profile", "--model", "random:n_layers=2,dim=64,max_context=128", "--prompts",
                        "32", "--batch", "4", "--context", "20", "--reps", "2", "--json"], capture_output=True, text=True, timeout=600,
                       env={**__import__("os").environ, "TINYHET_CPU_THREADS": "2"})
  assert out.returncode == 0, out.stderr[-2000:]
  rep = json.loads(out.stdout.strip().splitlines()[-1])
  for r in (rep["prefill"]["32"], rep["decode"]):
    groups = r["groups"]
    assert abs(sum(g["ms"] for g in groups.values()) - r["kernels_ms"]) < 1e-6 * max(1.0, r["kernels_ms"])
    assert r["wall_ms"] > 0 and all(g["launches"] >= 1 and g["ms"] >= 0 for g in groups.values())
  # the random model's float32 weights take tinygrad's matmul kernels; attention is the C kernels' (prefill tiles, decode rows)
  assert any(k.startswith("attention") for k in rep["prefill"]["32"]["groups"]) and any(k.startswith("attention") for k in rep["decode"]["groups"])
