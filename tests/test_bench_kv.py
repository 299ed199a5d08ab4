"""bench kv's attention figures: every dense baseline form computes the paged kernel's attention, and the fastest is the one
the ratio is against."""
from tinyhet.bench.kv import DENSE_VARIANTS, attention_bench

def test_dense_baselines_agree_with_paged_and_the_fastest_is_the_baseline():
  ms = attention_bench([5, 20, 33], (2, 4, 2, 16), 4, 1, quiet=True)
  assert set(ms["dense_variants"]) == {"/".join(v) for v in DENSE_VARIANTS}
  assert ms["dense"] == min(ms["dense_variants"].values()) == ms["dense_variants"][ms["dense_variant"]]
  assert ms["paged_vs_dense_max_abs_diff"] < 1e-3 and ms["paged"] > 0
