import dataclasses, math
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from tinygrad import Tensor, dtypes
from tinygrad.helpers import GlobalCounters
import llama_numpy as ref
from tinyhet.model.layers import rope_frequencies
from tinyhet.model.llama import (LLAMA3_70B, LLAMA3_8B, LLAMA31_70B, SMOLLM2_135M, DenseKVCache, LayerWeights, Llama, LlamaWeights, RopeScaling,
                                 small_config)
from tinyhet.model.sampling import Sampler
from tinyhet.model.weights import HF_LAYER_NAMES, hf_rows_to_interleaved

def model_from_hf(cfg, w: dict[str, np.ndarray]) -> Llama:
  """The tinygrad model on the numpy reference's weights (Hugging Face layout, Q/K rows permuted back for interleaved RoPE)."""
  t = lambda name: Tensor(w[name]).realize()
  layers = []
  for l in range(cfg.n_layers):
    p = f"model.layers.{l}."
    hf = {field: t(p + name + ".weight") for field, name in HF_LAYER_NAMES.items()}
    hf["wq"], hf["wk"] = hf_rows_to_interleaved(hf["wq"], cfg.n_heads).realize(), hf_rows_to_interleaved(hf["wk"], cfg.n_kv_heads).realize()
    layers.append(LayerWeights(**hf))
  emb = t("model.embed_tokens.weight")
  return Llama(cfg, LlamaWeights(emb, layers, t("model.norm.weight"), emb if cfg.tie_embeddings else t("lm_head.weight")))

def rel(a, b) -> float: return float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max())

def ids(*xs): return Tensor([list(xs)], dtype=dtypes.int32)

CONFIGS = {
  "gqa": small_config(),
  "mqa-tied": small_config(n_kv_heads=1, tie_embeddings=True),
  "gqa3-scaled": small_config(dim=96, n_heads=6, n_kv_heads=2, rope_theta=500000.0,
                              rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_context=32)),
  "3layers-odd": small_config(n_layers=3, dim=48, n_heads=3, n_kv_heads=3, hidden_dim=80, vocab_size=100, rope_theta=100000.0),
}
PROMPT = [3, 17, 99, 5, 9, 71, 42, 7, 1, 63, 11]

@pytest.fixture(scope="module", params=list(CONFIGS))
def tiny(request):
  cfg = CONFIGS[request.param]
  w = ref.random_hf_weights(cfg, seed=1)
  return cfg, w, model_from_hf(cfg, w)

def test_forward_matches_numpy_reference(tiny):
  cfg, w, m = tiny
  expected = ref.forward(cfg, w, PROMPT)
  cache = DenseKVCache(cfg, 1, 16, dtypes.float32)
  logits = m.forward(ids(*PROMPT), Tensor([list(range(len(PROMPT)))], dtype=dtypes.int32), cache).numpy()
  assert logits.shape == (1, cfg.vocab_size) and logits.dtype == np.float32
  assert rel(logits[0], expected[-1]) < 1e-4

def test_token_by_token_equals_full_sequence_and_jit_equals_eager(tiny):
  cfg, w, m = tiny
  expected = ref.forward(cfg, w, PROMPT)
  full = m.forward(ids(*PROMPT), Tensor([list(range(len(PROMPT)))], dtype=dtypes.int32), DenseKVCache(cfg, 1, 16, dtypes.float32)).numpy()
  eager_cache, jit_cache = DenseKVCache(cfg, 1, 16, dtypes.float32), DenseKVCache(cfg, 1, 16, dtypes.float32)
  step = m.make_decode_step(jit_cache)
  for pos, tok in enumerate(PROMPT):
    eager = m.forward(ids(tok), ids(pos), eager_cache).numpy()
    jitted = step(ids(tok), ids(pos)).numpy()
    assert rel(eager[0], expected[pos]) < 1e-4, pos
    np.testing.assert_allclose(jitted, eager, rtol=1e-6, atol=1e-6)
  assert rel(eager[0], full[0]) < 1e-5

def test_float16_kv_matches_reference_rounded_the_same_way(tiny):
  cfg, w, m = tiny
  expected = ref.forward(cfg, w, PROMPT, kv_dtype=np.float16)
  logits = m.forward(ids(*PROMPT), Tensor([list(range(len(PROMPT)))], dtype=dtypes.int32), DenseKVCache(cfg, 1, 16, dtypes.float16)).numpy()
  assert rel(logits[0], expected[-1]) < 1e-4

def test_batch_rows_at_different_positions():
  cfg = CONFIGS["gqa"]
  w = ref.random_hf_weights(cfg, seed=2)
  m = model_from_hf(cfg, w)
  a, b = [5, 6, 7, 8, 9], [40, 41, 42]
  cache = DenseKVCache(cfg, 2, 12, dtypes.float32)
  # a batch needs equal T per call: prefill row b's first 3 tokens alongside row a's first 3, then a's last 2 alone in row 0
  # while row 1 re-sends its token 2 (same position, same value: an idempotent overwrite)
  m.forward(Tensor([a[:3], b], dtype=dtypes.int32), Tensor([[0, 1, 2], [0, 1, 2]], dtype=dtypes.int32), cache).realize()
  m.forward(Tensor([a[3:], b[1:]], dtype=dtypes.int32), Tensor([[3, 4], [1, 2]], dtype=dtypes.int32), cache).realize()
  out = m.forward(Tensor([[11], [12]], dtype=dtypes.int32), Tensor([[5], [3]], dtype=dtypes.int32), cache).numpy()
  assert rel(out[0], ref.forward(cfg, w, [*a, 11])[-1]) < 1e-4
  assert rel(out[1], ref.forward(cfg, w, [*b, 12])[-1]) < 1e-4

def test_prefill_calls_on_layer_in_order_before_the_next_layer(tiny):
  cfg, w, m = tiny
  calls = []
  def on_layer(l, k, v):
    calls.append((l, k.shape, v.shape, k.dtype, v.dtype, k.uop.is_realized, v.uop.is_realized, GlobalCounters.kernel_count, k.numpy(), v.numpy()))
  GlobalCounters.reset()
  logits = m.prefill(ids(*PROMPT), on_layer=on_layer, kv_dtype=dtypes.float16).numpy()
  end = GlobalCounters.kernel_count
  T = len(PROMPT)
  assert [c[0] for c in calls] == list(range(cfg.n_layers))
  for l, ks, vs, kd, vd, kr, vr, *_ in calls:
    assert ks == vs == (T, cfg.n_kv_heads, cfg.head_dim) and kd == vd == dtypes.float16 and kr and vr, l
  # a layer's worth of kernels runs between consecutive callbacks (the first layer also builds the causal mask once): layer l+1
  # is computed after callback l, not before it
  counts = [c[7] for c in calls] + [end]
  between = [b - a for a, b in zip(counts, counts[1:])]
  assert counts[0] > 0 and min(between) >= 5 and max(between[:-1]) - min(between[:-1]) <= 2, between
  # the K, V handed over are the ones a cache holds after a plain forward, and the logits are forward's: layer 0's bit for
  # bit; later layers' within a float16 rounding step (prefill replays captured layers, tinyhet.model.layer_jit, whose kernels fuse
  # RoPE apart from the attention: the float32 sums round differently in the last bit, which can move a float16 K or V by one)
  cache = DenseKVCache(cfg, 1, T, dtypes.float16)
  fwd = m.forward(ids(*PROMPT), Tensor([list(range(T))], dtype=dtypes.int32), cache).numpy()
  for l, *_, k, v in calls:
    for got, want in ((k, cache.k[l].numpy()[0]), (v, cache.v[l].numpy()[0])):
      if l == 0: np.testing.assert_array_equal(got, want)
      else: np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=2**-10, atol=2**-14)
  assert rel(logits, fwd) < 1e-5 and rel(logits[0], ref.forward(cfg, w, PROMPT, kv_dtype=np.float16)[-1]) < 1e-4

def test_decode_from_transferred_kv_matches_reference_generate(tiny):
  """The disaggregated path in miniature: prefill hands K, V over layer by layer, a fresh cache on the 'decode side' is filled
  from them alone, and decoding there gives reference_generate's tokens and logits."""
  cfg, w, m = tiny
  T, n = len(PROMPT), 6
  decode_cache = DenseKVCache(cfg, 1, T + n, dtypes.float16)
  def receive(l, k, v):
    decode_cache.k[l][:, :T].assign(k.reshape(1, *k.shape)).realize()
    decode_cache.v[l][:, :T].assign(v.reshape(1, *v.shape)).realize()
  logits = m.prefill(ids(*PROMPT), on_layer=receive).numpy()
  step = m.make_decode_step(decode_cache)
  tokens = [int(logits[0].argmax())]
  for i in range(n - 1):
    logits = step(ids(tokens[-1]), ids(T + i)).numpy()
    tokens.append(int(logits[0].argmax()))
  assert tokens == m.reference_generate(PROMPT, n, kv_dtype=dtypes.float16)
  seq = PROMPT + tokens[:-1]
  assert rel(logits[0], ref.forward(cfg, w, seq, kv_dtype=np.float16)[-1]) < 1e-4

def test_reference_generate_greedy_matches_numpy_and_sampling_is_seeded():
  cfg = CONFIGS["gqa"]
  w = ref.random_hf_weights(cfg, seed=3)
  m = model_from_hf(cfg, w)
  seq = list(PROMPT)
  for _ in range(5): seq.append(int(ref.forward(cfg, w, seq, kv_dtype=np.float16)[-1].argmax()))
  stats = {}
  assert m.reference_generate(PROMPT, 5, stats=stats) == seq[len(PROMPT):] == m.reference_generate(PROMPT, 5, jit=False)
  assert stats["decode_tokens"] == 4 and stats["prefill_s"] > 0
  a, b = (m.reference_generate(PROMPT, 8, temperature=1.5, top_p=0.9, seed=s) for s in (7, 7))
  assert a == b and len(a) == 8
  assert m.reference_generate(PROMPT, 8, stop_ids=(seq[len(PROMPT) + 1],)) == seq[len(PROMPT):len(PROMPT) + 2]

def test_rope_frequencies_match_the_llama31_formula():
  for cfg in (LLAMA31_70B, CONFIGS["gqa3-scaled"], LLAMA3_70B):
    np.testing.assert_allclose(rope_frequencies(cfg), ref.inv_freq(cfg), rtol=1e-12)
  f = rope_frequencies(LLAMA31_70B)
  assert f[0] == 1.0 and math.isclose(f[-1], ref.inv_freq(LLAMA3_70B)[-1] / 8)   # fastest kept, slowest divided by the factor

def test_presets():
  assert LLAMA3_70B.kv_bytes_per_token(dtypes.float16) == 2 * 80 * 8 * 128 * 2 == 320 * 1024
  assert (LLAMA3_70B.dim, LLAMA3_70B.n_heads, LLAMA3_70B.n_kv_heads, LLAMA3_70B.head_dim, LLAMA3_70B.hidden_dim, LLAMA3_70B.vocab_size,
          LLAMA3_70B.rope_theta) == (8192, 64, 8, 128, 28672, 128256, 500000.0)
  assert 70.0e9 < LLAMA3_70B.n_params() < 71.0e9 and 8.0e9 < LLAMA3_8B.n_params() < 8.1e9 and 134e6 < SMOLLM2_135M.n_params() < 135e6
  assert LLAMA31_70B.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192)
  with pytest.raises(ValueError, match="multiple"): dataclasses.replace(LLAMA3_70B, n_kv_heads=7)

# ---- sampling ----------------------------------------------------------------------------------------------------------------

logits_st = st.lists(st.floats(-20, 20, allow_nan=False, width=32), min_size=2, max_size=40).map(lambda x: np.array(x, np.float32))

@given(logits_st, st.integers(0, 2**32 - 1))
def test_greedy_is_argmax(logits, seed):
  assert Sampler(0.0, 0.5, seed)(logits) == int(np.argmax(logits))

@settings(max_examples=50)
@given(logits_st, st.floats(0.1, 3.0), st.floats(0.01, 1.0), st.integers(0, 2**32 - 1))
def test_top_p_keeps_the_smallest_sufficient_set(logits, temperature, top_p, seed):
  s = Sampler(temperature, top_p, seed)
  p = s.probabilities(logits)
  assert math.isclose(p.sum(), 1.0, rel_tol=1e-5)        # float32, as the batch sampler computes it
  full = Sampler(temperature, 1.0).probabilities(logits)
  kept = np.flatnonzero(p)
  assert full[kept].min() >= full[np.setdiff1d(np.arange(len(p)), kept)].max(initial=0)   # the most likely ones
  assert full[kept].sum() >= top_p - 1e-5 and full[kept].sum() - full[kept].min() < top_p + 1e-5   # and no more than needed
  draws = [s(logits) for _ in range(5)]
  assert all(d in kept for d in draws) and draws == [t(logits) for t in [Sampler(temperature, top_p, seed)] for _ in range(5)]

def test_sampler_rejects_bad_settings():
  with pytest.raises(ValueError, match="temperature"): Sampler(-1.0)
  with pytest.raises(ValueError, match="top_p"): Sampler(1.0, 0.0)
  for seed in (-1, 2**64, 1.5, True, "7"):
    with pytest.raises(ValueError, match="seed"): Sampler(1.0, 1.0, seed)

logits8 = st.lists(st.floats(-20, 20, allow_nan=False, width=32), min_size=8, max_size=8).map(lambda x: np.array(x, np.float32))

@settings(max_examples=50, deadline=None)
@given(st.lists(logits8, min_size=2, max_size=10), st.floats(0.1, 3.0), st.floats(0.05, 1.0),
       st.integers(0, 2**63 - 1), st.integers(0, 200), st.data())
def test_a_sampled_stream_continues_anywhere(steps, temperature, top_p, seed, start, data):
  """Each draw depends on (seed, position) only: a stream cut at any token and continued by a fresh sampler (another node,
  after a recovery) gives the clean run's tokens; a counting sampler and explicit positions agree."""
  clean = Sampler(temperature, top_p, seed, position=start)
  want = [clean(x) for x in steps]
  cut = data.draw(st.integers(0, len(steps)))
  first = Sampler(temperature, top_p, seed, position=start)
  resumed = [first(x) for x in steps[:cut]] + [Sampler(temperature, top_p, seed)(x, start + i) for i, x in enumerate(steps) if i >= cut]
  assert resumed == want and clean.position == start + len(steps)

def test_sampled_draws_follow_the_distribution():
  logits = np.array([2.0, 1.0, 0.5, -1.0, 0.0, -3.0], np.float32)
  s = Sampler(0.7, 0.9, 5)
  p, n = s.probabilities(logits), 4000
  counts = np.bincount([s(logits) for _ in range(n)], minlength=len(p))
  assert counts[p == 0].sum() == 0                            # never a token top_p cut
  assert np.abs(counts / n - p).max() < 4 * np.sqrt(p.max() * (1 - p.max()) / n) + 1e-9, (counts / n, p)   # within 4 sigma
  assert len({Sampler(1.0, 1.0, seed).uniform(9) for seed in range(50)}) == 50 and Sampler(1.0, 1.0, 3).uniform(9) == Sampler(0.5, 1, 3).uniform(9)
  assert Sampler(1.0, 1.0, None).seed != Sampler(1.0, 1.0, None).seed   # no seed: a random one, kept so another node can continue

def test_reference_generate_resumes_a_sampled_stream():
  """What the router does after a lost node: the prompt plus the tokens so far, prefilled again, with the same seed, goes on
  with the tokens a clean run gives."""
  m = model_from_hf(CONFIGS["gqa"], ref.random_hf_weights(CONFIGS["gqa"], seed=1))
  sampled = dict(temperature=0.9, top_p=0.95, seed=11)
  want = m.reference_generate(PROMPT, 8, **sampled)
  assert m.reference_generate(PROMPT, 3, **sampled) + m.reference_generate(PROMPT + want[:3], 5, **sampled) == want

# ---- SmolLM2 (the embedded model), loaded once for the module ----------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2():
  from tinyhet.model.weights import load_model
  return load_model(device="CPU", max_context=512, quiet=True)

# recorded once from reference_generate on the embedded SmolLM2-135M-Instruct Q4_1 (greedy, float16 KV)
PARIS_IDS = [504, 3575, 282, 4649, 314, 7042, 30, 2]

@pytest.mark.slow
def test_smollm2_answers_in_english(smollm2):
  model, tok = smollm2
  prompt = tok.encode_prompt("What is the capital of France?")
  out = model.reference_generate(prompt, 8, stop_ids=tok.stop_ids)
  assert out == PARIS_IDS
  assert tok.decode(out) == "The capital of France is Paris."

@pytest.mark.slow
def test_smollm2_layerwise_prefill_then_decode_from_its_kv(smollm2):
  """The disaggregated path in miniature on the real model: K, V handed over by prefill fill a fresh cache, decoding there
  continues with the reference's tokens."""
  model, tok = smollm2
  prompt = tok.encode_prompt("What is the capital of France?")
  T, n = len(prompt), 4
  cache = DenseKVCache(model.cfg, 1, T + len(PARIS_IDS))   # the shape reference_generate used above: its decode kernels are reused
  def receive(l, k, v):
    cache.k[l][:, :T].assign(k.reshape(1, *k.shape)).realize()
    cache.v[l][:, :T].assign(v.reshape(1, *v.shape)).realize()
  toks = [int(model.prefill(Tensor([prompt], dtype=dtypes.int32), on_layer=receive).numpy()[0].argmax())]
  step = model.make_decode_step(cache)
  for i in range(n - 1): toks.append(int(step(ids(toks[-1]), ids(T + i)).numpy()[0].argmax()))
  assert toks == PARIS_IDS[:n]

@pytest.mark.parametrize("packed", [None, 2, 3, 8])   # float32, Q4_0, Q4_1, Q8_0
def test_random_weights_run_and_packed_equal_their_float_copy(packed):
  from tinyhet.model.llama import random_weights
  from tinyhet.model.packed import PackedWeight
  cfg = small_config()
  w = random_weights(cfg, "CPU", packed=packed, seed=4)
  deq = lambda m: m.dequantize().realize() if isinstance(m, PackedWeight) else m
  floats = LlamaWeights(deq(w.tok_embeddings), [LayerWeights(**{f.name: deq(getattr(l, f.name)) for f in dataclasses.fields(l)}) for l in w.layers],
                        w.norm, deq(w.output))
  a = Llama(cfg, w).forward(ids(*PROMPT), Tensor([list(range(len(PROMPT)))], dtype=dtypes.int32), DenseKVCache(cfg, 1, 16)).numpy()
  b = Llama(cfg, floats).forward(ids(*PROMPT), Tensor([list(range(len(PROMPT)))], dtype=dtypes.int32), DenseKVCache(cfg, 1, 16)).numpy()
  assert np.isfinite(a).all() and 0.1 < np.abs(a).max() < 100 and rel(a, b) < 1e-5

@pytest.mark.slow
def test_70b_runner_single_device_then_disaggregated():
  """examples/llama3_70b.py end to end on the Llama-3-8B shapes with one layer (the 70B shapes need ~2 GB per layer pair):
  the single-device path here, then the runner's default path (prefill here, decode in a second process of the script),
  which gives the same tokens. One in-process run stands for both the smoke test and the reference (one model load fewer)."""
  import io, contextlib, importlib.util, json, pathlib, subprocess, sys
  script = pathlib.Path(__file__).parent.parent / "examples" / "llama3_70b.py"
  spec = importlib.util.spec_from_file_location("llama3_70b", script)
  runner = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(runner)
  common = ["--random-weights", "--preset", "Llama-3-8B", "--layers", "1", "--prompt-tokens", "8", "--decode-tokens", "3", "--context", "512",
            "--batch", "4", "--json"]
  out = io.StringIO()
  with contextlib.redirect_stdout(out): assert runner.main([*common, "--single-device"]) == 0
  text = out.getvalue()
  alone = json.loads(text.strip().splitlines()[-1])
  assert alone["kv_bytes_per_token_all_layers"] == 2 * 32 * 8 * 128 * 2 and alone["kv_bytes_for_context_and_batch"] == 128 * 1024 * 512 * 4
  assert len(alone["tokens"]) == 4 and len(alone["decode_step_s"]) == 3 and "prefill runs on HET, decode on HET" in text
  r = subprocess.run([sys.executable, str(script), *common], capture_output=True, text=True, timeout=900)
  assert r.returncode == 0, r.stderr[-2000:]
  disagg = json.loads(r.stdout.strip().splitlines()[-1])
  assert disagg["tokens"] == alone["tokens"] and disagg["decode_device"].startswith("MESH") and disagg["kv_bytes_moved"] > 0
