"""The CPU node model (tinyhet/planner/cpu_node.py, cpu_step.py) and bench bignode's fitting: pure arithmetic, no model load."""
import pytest
from hypothesis import given, settings, strategies as st
from tinyhet.bench.bignode import fit_bandwidth, fit_dispatch, fit_two
from tinyhet.planner.cpu_node import FORMATS, SHAPES, CpuNode, Kernel, dispatch_time, kernel_parts, kernel_time, read_bandwidth
from tinyhet.planner.cpu_step import CoreFigures, decode_step

FAST = settings(max_examples=60, deadline=None)
FIG = CoreFigures({(t, m, "decode"): (1e-10, 2e-10) for t in ("Q4_1", "Q8_0") for m in (1, 16)}, (1e-6, 1e-10), (1e-5, 1e-9), 9, (2e-5, 1e-6))

def node(threads=4, bw=20e9, core=10e9, base=1e-6, per=1e-7, sockets=1):
  return CpuNode("n", sockets, threads, bw, core, 100e9, dispatch_base=base, dispatch_per_part=per)

def test_part_rule_is_the_kernels():
  from tinyhet.kernels import quant_matmul as qmm
  for rows, threads in [(192, 192), (576, 192), (28672, 192), (8, 4), (1536, 2)]:
    assert kernel_parts(rows, threads) == qmm.kernel_parts(rows, threads)

@FAST
@given(st.integers(1, 64), st.floats(1e9, 1e12), st.floats(1e9, 1e12), st.integers(1, 4096))
def test_more_bandwidth_and_threads_never_slower(threads, bw, extra, rows):
  k = Kernel("k", rows, kernel_parts(rows, threads), 1e-3, 1e8)
  t = kernel_time(node(threads, bw), k).total
  assert kernel_time(node(threads, bw + extra), k).total <= t
  k2 = Kernel("k", rows, kernel_parts(rows, threads + 1), 1e-3, 1e8)
  assert kernel_time(node(threads + 1, bw, per=0.0), k2).total <= t * (1 + 1e-9)

@FAST
@given(st.integers(1, 192), st.floats(1e-6, 1.0), st.floats(1e3, 1e10))
def test_no_dispatch_is_the_roofline(threads, compute, nbytes):
  n = node(threads, base=0.0, per=0.0)
  k = Kernel("k", threads * 16, threads, compute, nbytes)
  assert kernel_time(n, k).total == pytest.approx(max(compute / threads, nbytes / min(threads * n.core_bandwidth, n.socket_bandwidth)))

def test_replicas_double_two_sockets_bandwidth():
  two = CpuNode("2s", 2, 96, 300e9, 10e9, 100e9, numa="replicate")
  assert read_bandwidth(two, 192) == pytest.approx(600e9) and read_bandwidth(two, 96) == pytest.approx(300e9)
  assert read_bandwidth(two, 192, "off") == pytest.approx(300e9)
  assert dispatch_time(node(base=1e-6, per=1e-7), 3) == pytest.approx(1.2e-6)

@pytest.mark.parametrize("bad, match", [(dict(sockets=0), "sockets"), (dict(numa="x"), "numa"), (dict(socket_bandwidth=0), "bandwidth")])
def test_bad_node_refused_in_one_line(bad, match):
  kw = dict(name="n", sockets=1, cores_per_socket=2, socket_bandwidth=1e9, core_bandwidth=1e9) | bad
  with pytest.raises(ValueError, match=match) as e: CpuNode(**kw)
  assert "\n" not in str(e.value)

def test_step_refuses_missing_figures_and_bad_batch():
  with pytest.raises(ValueError, match="no per-core figure for the decode kernel of Q4_K"):
    decode_step(node(), SHAPES["llama-3-70b"], FORMATS["Q4_K_M"], "float", 1, 100, FIG)
  with pytest.raises(ValueError, match="batch"): decode_step(node(), SHAPES["smollm2-135m"], FORMATS["Q4_1-embedded"], "float", 0, 100, FIG)
  s = decode_step(node(), SHAPES["smollm2-135m"], FORMATS["Q4_1-embedded"], "float", 16, 4096, FIG)
  assert s.seconds > 0 and sum(s.buckets().values()) >= s.seconds * (1 - 1e-9)

@FAST
@given(st.floats(1e-9, 1e-3), st.floats(1e-12, 1e-8))
def test_fit_two_gives_back_known_parameters(p, q):
  pts = [(m * k, b, p * m * k + q * b) for m, k, b in [(1, 576, 3e5), (1, 1536, 9e5), (16, 576, 2e5), (16, 1536, 6e6)]]
  got = fit_two(pts)
  assert got == (pytest.approx(p, rel=1e-6), pytest.approx(q, rel=1e-6))

def test_fit_dispatch_and_bandwidth_give_back_known_parameters():
  assert fit_dispatch([(1, 2e-7), (2, 6e-7), (4, 1.4e-6)]) == (pytest.approx(2e-7), pytest.approx(4e-7))
  assert fit_bandwidth([(1, 10e9), (2, 18e9)]) == (10e9, 18e9)
  with pytest.raises(ValueError, match="1 thread"): fit_bandwidth([(2, 18e9)])
