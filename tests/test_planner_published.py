"""The planner against published results. Each check calibrates only from the single-node figures its source gives and
predicts figures that are not inputs. Each asserts the bound the README's error table states for it: 20% (the target),
or, for a known miss, the wider bound the table gives with its cause; a prediction that improves still passes, one that
gets worse than the table says fails."""
import dataclasses, math, pathlib
import pytest
from tinyhet.planner.catalog import MODELS
from tinyhet.planner.cluster_file import load_cluster, parse_cluster
from tinyhet.planner.roofline import decode_context, decode_step_time, prefill_time
from tinyhet.planner.servesim import SLO, Unit, max_goodput, simulate
from tinyhet.planner.serving import _requests, plan_serving

def err(predicted: float, published: float) -> float: return predicted / published - 1

# --- DistServe (Zhong et al., OSDI 2024, arXiv 2401.09670), §1 and Figure 1 ------------------------------------------
# "serving a 13B LLM ... synthetic workload with input length = 512 and output length = 64 on one NVIDIA 80GB A100":
# under 90% SLO attainment the existing (colocated, vLLM) system reaches a goodput of about 1.6 requests/s; a GPU serving
# only the prefill phase reaches 5.6 rps, one serving only decoding 10 rps; "by allocating 2 GPUs for prefill and 1 GPU
# for decoding, we can effectively serve the model with an overall goodput of 10 rps, or equally 3.3 rps per GPU, which
# is 2.1x higher than existing systems" (quoted from the paper's text). The figure says "a 13B LLM"; OPT-13B is the 13B
# model the paper evaluates (§6). The SLOs are drawn in the figure, not written in the text: P90 TTFT <= 0.4 s and P90
# TPOT <= 0.04 s, as a write-up of the paper reads them off it ("Goodput under latency SLOs ... Example SLOs: P90 TTFT
# <= 0.4 s, P90 TPOT <= 0.04 s", a study note on DistServe in the public code corpus); a second write-up gives 0.04 for
# the SLO line without telling the two panels apart. Calibration, from the two single-phase figures only: the A100's
# bandwidth efficiency is the one at which a decode-only GPU meets the TPOT SLO at exactly 10 rps (decode is bound by
# bandwidth), its compute efficiency the one at which a prefill-only GPU meets the TTFT SLO at exactly 5.6 rps (a
# 512-token prefill "can fully engage an A100 GPU", §3.1). Predicted: a colocated GPU's goodput, the plan for three GPUs
# (2:1), its goodput per GPU and the gain.

A100S = {"nodes": {"a100": {"device": "a100", "replicas": 3}},
         "links": [{"nodes": ["a100", "a100"], "bandwidth_gb_s": 300, "latency_us": 2}]}  # NVLink 3 inside one server
DISTSERVE_SLO = SLO(ttft_s=0.4, tpot_s=0.04)

def _fit(node, resource, p90, target, lo=1e-3, hi=1.0):
  """The node with `resource`'s efficiency at which the p90 latency `p90(node)` equals `target` (bisection in log space;
  the latency falls as the efficiency rises)."""
  for _ in range(30):
    mid = math.sqrt(lo * hi)
    lo, hi = (lo, mid) if p90(dataclasses.replace(node, **{resource: mid})) < target else (mid, hi)
  return dataclasses.replace(node, **{resource: math.sqrt(lo * hi)})

@pytest.fixture(scope="module")
def distserve():
  cluster = parse_cluster(A100S, "distserve")
  node, model, link = cluster.node("a100"), MODELS["opt-13b"], cluster.link
  n = _requests(cluster, model, 512, 64, None)  # as many requests as the plan's runs
  # one GPU in the phase measured, enough GPUs in the other that it is the bottleneck
  prefill_only = lambda a: simulate([Unit("p", a, "prefill"), *(Unit(f"d{i}", a, "decode") for i in range(3))], model, 512, 64, link,
                                    rate=5.6, requests=n).ttft_p90_s
  decode_only = lambda a: simulate([*(Unit(f"p{i}", a, "prefill") for i in range(3)), Unit("d", a, "decode")], model, 512, 64, link,
                                   rate=10, requests=n).tpot_p90_s
  for _ in range(2):  # decode first (bandwidth), then prefill (compute); once more as calibrated() does
    node = _fit(node, "bandwidth_eff", decode_only, DISTSERVE_SLO.tpot_s)
    node = _fit(node, "compute_eff", prefill_only, DISTSERVE_SLO.ttft_s)
  cluster = dataclasses.replace(cluster, nodes=(node,))
  one_gpu, _ = max_goodput([Unit("a100", node, "both")], model, 512, 64, link, DISTSERVE_SLO, requests=n)
  return cluster, plan_serving(cluster, model, 512, 64, slo=DISTSERVE_SLO), one_gpu

def test_distserve_calibration_is_physical(distserve):
  node = distserve[0].node("a100")
  assert 0.3 < node.compute_eff < 0.5 and 0.4 < node.bandwidth_eff < 0.6  # achieved 41% and 48% of the A100's spec sheet

def test_distserve_plan_is_two_prefill_gpus_for_one_decode_gpu(distserve):
  c = distserve[1].chosen
  assert (len(c.prefill), len(c.decode), len(c.both)) == (2, 1, 0) and c.ratio == "2:1"

def test_distserve_disaggregated_goodput_per_gpu_within_20_percent(distserve):
  assert abs(err(distserve[1].chosen.goodput_rps / 3, 3.3)) < 0.2  # achieved 3.35 (+2%)

def test_distserve_colocated_goodput_within_20_percent(distserve):
  assert abs(err(distserve[2], 1.6)) < 0.2  # one colocated A100, as in the figure: achieved 1.47 (-8%)

def test_distserve_disaggregation_gain_within_20_percent(distserve):
  assert abs(err(distserve[1].chosen.goodput_rps / 3 / distserve[2], 2.1)) < 0.2  # achieved 2.28x (+8%)

def test_distserve_colocated_ttft_bound_goodput_as_achieved(distserve):
  # The same write-up reads ~3 rps as where the colocated GPU's p90 TTFT crosses 0.4 s (the TPOT line, 1.6 rps, is what
  # binds). Achieved 5.4 rps (+80%), a miss: here a colocated GPU puts waiting prompts before its decode steps, so its
  # TTFT is nearly that of a prefill-only GPU (5.6 rps); the figure's vLLM loses TTFT to decoding too. What it does
  # (batching prefills with running decodes, as §2.2 describes "existing systems", or not putting prompts strictly first)
  # is not in the text; the figure read off a chart is itself approximate. The TPOT-bound goodput above is within 20%.
  cluster = distserve[0]
  node, model = cluster.node("a100"), MODELS["opt-13b"]
  g, _ = max_goodput([Unit("a100", node, "both")], model, 512, 64, cluster.link, SLO(ttft_s=0.4), requests=_requests(cluster, model, 512, 64, None))
  assert abs(err(g, 3.0)) < 0.9  # README: a known miss, bound 90% (achieved +80%)

def test_distserve_kv_cache_of_a_512_token_opt_66b_request():
  # DistServe §3.3: "the KV cache size of a single 512-token request on OPT-66B is approximately 1.13GB" (GiB: 2^30 bytes)
  assert abs(err(512 * MODELS["opt-66b"].kv_bytes_per_token / 2**30, 1.13)) < 0.01

# --- Splitwise (Patel et al., ISCA 2024, arXiv 2311.18677), Table IV -------------------------------------------------
# Llama-70B on one DGX-A100 and one DGX-H100 (8 GPUs each, 80 GB), no batching, P50, at the median request of each
# production trace (coding: 1500 prompt tokens, 13 output tokens; conversation: 1020 and 129, §III-A):
#                 TTFT A100 / H100    TBT A100 / H100    E2E A100 / H100
#   coding        185 / 95 ms         52 / 31 ms         856 / 493 ms
#   conversation  155 / 84 ms         40 / 28 ms         4957 / 3387 ms
# Insight VII: the H100 cuts TTFT to 0.51x of the A100's but TBT only to 0.70x. (The table as two independent write-ups
# of the paper reproduce it; the paper's PDF itself was not at hand.) Calibrated here on the coding rows only;
# predicted: the conversation rows, and the H100's rows from the A100's efficiencies and the spec sheets alone.

SPLITWISE = pathlib.Path(__file__).resolve().parents[1] / "examples/clusters/splitwise_dgx.toml"  # those two rows, as calibration

@pytest.fixture(scope="module")
def splitwise():
  return load_cluster(SPLITWISE)

def _rows(node, model, prompt_len, output_len):
  ttft, tbt = prefill_time(node, model, prompt_len), decode_step_time(node, model, 1, decode_context(prompt_len, output_len))
  return ttft, tbt, ttft + (output_len - 1) * tbt

@pytest.mark.parametrize("name, published, bounds", [
  # (TTFT, TBT, E2E) published; the bound on each error the README states (achieved: A100 -19% / +30% / +37%, H100
  # -23% / +11% / +19%; README: why the TBT and so the E2E miss)
  ("a100", (0.155, 0.040, 4.957), (0.25, 0.35, 0.45)),
  ("h100", (0.084, 0.028, 3.387), (0.25, 0.2, 0.25)),
])
def test_splitwise_conversation_rows_from_the_coding_calibration(splitwise, name, published, bounds):
  predicted = _rows(splitwise.node(name), splitwise.model("llama-2-70b"), 1020, 129)
  for p, q, bound in zip(predicted, published, bounds):
    assert abs(err(p, q)) < bound

def test_splitwise_h100_from_the_a100_efficiencies_and_spec_sheets(splitwise):
  a100, model = splitwise.node("a100"), splitwise.model("llama-2-70b")
  h100 = dataclasses.replace(splitwise.node("h100"), compute_eff=a100.compute_eff, bandwidth_eff=a100.bandwidth_eff, calibration="")
  ttft, tbt, _ = _rows(h100, model, 1500, 13)
  assert abs(err(tbt, 0.031)) < 0.05          # decode is bound by bandwidth: the spec-sheet ratio carries over (+3%)
  assert abs(err(ttft, 0.095)) < 0.35  # README: a known miss, bound 35% (achieved -30%): the H100 reaches a smaller share of its peak
  assert tbt / 0.052 > ttft / 0.185  # ... the physics holds: the H100 cuts TTFT more than TBT (published 0.51x and 0.70x)

# --- EXO 1.0 (EXO Labs blog "NVIDIA DGX Spark + Apple Mac Studio", Oct 2025): a heterogeneous prefill/decode result --
# Llama-3.1 8B fp16, an 8,192-token prompt. Published: the DGX Spark alone prefills in 1.47 s and decodes in 2.87 s; the
# M3 Ultra Mac Studio alone 5.57 s and 0.85 s; the Spark prefilling and the Mac decoding, the KV cache streamed layer by
# layer over 10 GbE: 1.47 s and 0.85 s, 2.8x faster than the Mac alone (the times as docs/design.md quotes them; the decode
# time is taken for 32 tokens). Calibrated from the four alone figures only (examples/clusters/spark_m3ultra.toml);
# predicted: the plan, the mixed configuration's TTFT (prefill and what the 1 GiB transfer leaves showing), its decode,
# and the gain over the Mac alone. A validation of the split and the overlap more than of the costs: the mixed phases
# are the alone ones, so what is predicted beyond them is the direction, the transfer and the ratio.

EXO_FILE = pathlib.Path(__file__).resolve().parents[1] / "examples/clusters/spark_m3ultra.toml"

def test_exo_mixed_spark_prefill_mac_decode_from_the_alone_figures():
  from tinyhet.planner.plan import predict
  cluster = load_cluster(EXO_FILE)
  pred = predict(cluster, "llama-3.1-8b", 8192, 32)
  plan, mac = pred.plan.configuration, next(c for c in pred.configurations if c.name == "mac alone")
  assert (plan.kind, plan.prefill, plan.decode) == ("disaggregated", ("spark",), ("mac",))
  assert abs(err(plan.ttft_s, 1.47)) < 0.2        # achieved +8.6%: the Spark's prefill held at 95% of its catalog FLOP/s
  assert abs(err(32 * plan.tpot_s, 0.85)) < 0.2   # achieved 0%
  assert abs(err(mac.e2e_s / plan.e2e_s, 2.8)) < 0.2  # achieved 2.82x (+0.5%)
