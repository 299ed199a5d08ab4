"""The Llama family (Llama 2/3/3.1, SmolLM2, Mistral) and its close kin Qwen2/2.5 (biases on the q, k, v projections) and Qwen3
(RMSNorm of each query and key head before RoPE) in tinygrad, written like llama2.c's run.c: one straight forward pass.

Conventions
- Weights are stored like torch's Linear, (out_features, in_features), in any float dtype or as GGUF blocks (PackedWeight);
  activations are float32 and a matmul reads the weight as stored (a float16 weight as float16, a Q4_1 weight as its
  blocks), converting inside the kernel.
- Q and K rows are in Meta's (and GGUF's) order: RoPE rotates the interleaved pairs (2i, 2i+1) of each head, as run.c does.
  Hugging Face checkpoints permute those rows for their rotate-half RoPE; tinyhet.model.weights permutes them back on load.
- The KV cache is behind a small protocol (KVCache): the model hands it post-RoPE K and V of each layer and gets attention
  back. DenseKVCache is the reference (one contiguous buffer per layer); the paged cache of the decode node implements the
  same protocol.
- Positions are a tensor, not a Python int: RoPE gathers cos/sin rows by position, so a jitted decode step (TinyJit)
  replays the same kernels for every new position.
"""
from __future__ import annotations
import dataclasses, math, time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol
from tinygrad import Tensor, TinyJit, dtypes
from tinygrad.dtype import DType
from tinyhet.device.cpu_threads import kernel_threads, pool_threads
from tinyhet.model.layers import Matrix, apply_rope, attention, linear, rms_norm, rope_tables, stored_format
from tinyhet.model.packed import PackedWeight, lookup

@dataclass(frozen=True)
class RopeScaling:
  """Llama 3.1's RoPE frequency scaling (Hugging Face rope_type "llama3")."""
  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_context: int = 8192

@dataclass(frozen=True)
class LlamaConfig:
  """The shape of a Llama-family model. Presets below; tinyhet.model.weights reads one from GGUF metadata or config.json."""
  dim: int                 # model width
  n_layers: int
  n_heads: int             # query heads
  n_kv_heads: int          # key/value heads (grouped-query attention: n_heads % n_kv_heads == 0)
  head_dim: int
  hidden_dim: int          # SwiGLU width
  vocab_size: int
  norm_eps: float = 1e-5
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling | None = None
  max_context: int = 2048
  tie_embeddings: bool = False     # the output projection is the token embedding
  rope_freq_factors: tuple[float, ...] | None = None  # GGUF's rope_freqs.weight (Llama 3.1): divides each frequency; overrides rope_scaling
  name: str = ""
  arch: str = "llama"      # the family as transformers names it (model_type): llama, mistral, qwen2, qwen3
  qkv_bias: bool = False   # Qwen2: q, k, v projections add a bias
  qk_norm: bool = False    # Qwen3: each head of q and k is RMSNorm-ed (weights of head_dim) before RoPE

  def __post_init__(self):
    if self.n_heads % self.n_kv_heads: raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
    if self.head_dim % 2: raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
    if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.head_dim // 2:
      raise ValueError(f"rope_freq_factors has {len(self.rope_freq_factors)} entries, expected head_dim/2 = {self.head_dim // 2}")

  def kv_bytes_per_token(self, kv_dtype: DType = dtypes.float16) -> int:
    """K and V of every layer for one token: 2 * n_layers * n_kv_heads * head_dim * itemsize."""
    return 2 * self.n_layers * self.n_kv_heads * self.head_dim * kv_dtype.itemsize

  def n_params(self) -> int:
    per_layer = 2 * self.dim + self.dim * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads) + 3 * self.dim * self.hidden_dim
    per_layer += (self.n_heads + 2 * self.n_kv_heads) * self.head_dim * self.qkv_bias + 2 * self.head_dim * self.qk_norm
    return self.vocab_size * self.dim * (1 if self.tie_embeddings else 2) + self.n_layers * per_layer + self.dim

SMOLLM2_135M = LlamaConfig(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64, hidden_dim=1536, vocab_size=49152, norm_eps=1e-5,
                           rope_theta=100000.0, max_context=8192, tie_embeddings=True, name="SmolLM2-135M")
LLAMA3_8B = LlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128, hidden_dim=14336, vocab_size=128256, norm_eps=1e-5,
                        rope_theta=500000.0, max_context=8192, name="Llama-3-8B")
LLAMA31_8B = dataclasses.replace(LLAMA3_8B, rope_scaling=RopeScaling(), max_context=131072, name="Llama-3.1-8B")
LLAMA3_70B = LlamaConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, head_dim=128, hidden_dim=28672, vocab_size=128256, norm_eps=1e-5,
                         rope_theta=500000.0, max_context=8192, name="Llama-3-70B")
LLAMA31_70B = dataclasses.replace(LLAMA3_70B, rope_scaling=RopeScaling(), max_context=131072, name="Llama-3.1-70B")
PRESETS = {c.name: c for c in (SMOLLM2_135M, LLAMA3_8B, LLAMA31_8B, LLAMA3_70B, LLAMA31_70B)}

def small_config(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, hidden_dim=96, vocab_size=256, max_context=64, **kw) -> LlamaConfig:
  """A tiny Llama for tests: 2 layers, dim 64, grouped-query attention (4 query heads share 2 KV heads) by default."""
  return LlamaConfig(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=dim // n_heads, hidden_dim=hidden_dim,
                     vocab_size=vocab_size, max_context=max_context, name=kw.pop("name", "small"), **kw)

# ---- weights ---------------------------------------------------------------------------------------------------------------


@dataclass
class LayerWeights:
  attn_norm: Tensor   # (dim,)
  wq: Matrix          # (n_heads*head_dim, dim), rows in Meta/GGUF order
  wk: Matrix          # (n_kv_heads*head_dim, dim), rows in Meta/GGUF order
  wv: Matrix          # (n_kv_heads*head_dim, dim)
  wo: Matrix          # (dim, n_heads*head_dim)
  ffn_norm: Tensor    # (dim,)
  w_gate: Matrix      # (hidden_dim, dim)   run.c's w1
  w_up: Matrix        # (hidden_dim, dim)   run.c's w3
  w_down: Matrix      # (dim, hidden_dim)   run.c's w2
  bq: Tensor | None = None       # (n_heads*head_dim,) Qwen2's biases, float32, q and k in the rows' (Meta/GGUF) order
  bk: Tensor | None = None       # (n_kv_heads*head_dim,)
  bv: Tensor | None = None       # (n_kv_heads*head_dim,)
  q_norm: Tensor | None = None   # (head_dim,) Qwen3's per-head RMSNorm weights, in the rows' order
  k_norm: Tensor | None = None   # (head_dim,)

  def present(self, names: tuple[str, ...]) -> tuple[str, ...]:
    """Those of `names` this layer has (the optional biases and norms are None where the family has none)."""
    return tuple(n for n in names if getattr(self, n) is not None)

@dataclass
class LlamaWeights:
  tok_embeddings: Matrix    # (vocab, dim)
  layers: list[LayerWeights]
  norm: Tensor              # (dim,)
  output: Matrix            # (vocab, dim); the same object as tok_embeddings when the config ties them

  def tensors(self) -> list[Matrix]:
    ts = [self.tok_embeddings, self.norm] + [getattr(l, f.name) for l in self.layers for f in dataclasses.fields(LayerWeights)
                                             if getattr(l, f.name) is not None]
    return ts if self.output is self.tok_embeddings else [*ts, self.output]

  def nbytes(self) -> int: return sum(t.nbytes() for t in self.tensors())

def random_weights(cfg: LlamaConfig, device: str | None = None, dtype: DType = dtypes.float32, seed: int = 0,
                   packed: int | None = None) -> LlamaWeights:
  """Random weights generated on `device` (tinygrad's RNG runs there: nothing of the full size passes through numpy).
  Matrices are uniform with variance 1/fan_in, so activations keep their scale through the layers, in `dtype`, or as GGUF
  blocks when `packed` names a type (tinyhet.model.packed.Q4_0, Q4_1, Q8_0); norms are 1 + noise, float32."""
  Tensor.manual_seed(seed)
  def lin(o, i):
    if packed is not None: return PackedWeight.random(o, i, packed, device)
    if dtype == dtypes.bfloat16:   # as its bits: tinygrad's bfloat16 kernels do not compile with clang < 15 (tinyhet.model.bf16_weight)
      from tinyhet.model.bf16_weight import BF16Weight, round_to_bf16
      return BF16Weight(round_to_bf16(Tensor.uniform(o, i, low=-math.sqrt(3 / i), high=math.sqrt(3 / i), device=device)), (o, i)).realize()
    return Tensor.uniform(o, i, low=-math.sqrt(3 / i), high=math.sqrt(3 / i), device=device, dtype=dtype).realize()
  def norm(n): return Tensor.uniform(n, low=0.8, high=1.2, device=device).realize()
  def bias(n): return Tensor.uniform(n, low=-0.2, high=0.2, device=device).realize() if cfg.qkv_bias else None
  def head_norm(): return norm(cfg.head_dim) if cfg.qk_norm else None
  qd, kvd = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
  layers = [LayerWeights(attn_norm=norm(cfg.dim), wq=lin(qd, cfg.dim), wk=lin(kvd, cfg.dim), wv=lin(kvd, cfg.dim), wo=lin(cfg.dim, qd),
                         ffn_norm=norm(cfg.dim), w_gate=lin(cfg.hidden_dim, cfg.dim), w_up=lin(cfg.hidden_dim, cfg.dim),
                         w_down=lin(cfg.dim, cfg.hidden_dim), bq=bias(qd), bk=bias(kvd), bv=bias(kvd), q_norm=head_norm(), k_norm=head_norm())
            for _ in range(cfg.n_layers)]
  emb = lin(cfg.vocab_size, cfg.dim)
  return LlamaWeights(tok_embeddings=emb, layers=layers, norm=norm(cfg.dim), output=emb if cfg.tie_embeddings else lin(cfg.vocab_size, cfg.dim))

LAYER_JIT_MAX_T = 1024   # prefills up to this length replay captured layers (tinyhet.model.layer_jit); longer ones are kernel-bound

def _config_chunk() -> int:
  from tinyhet.config import load_config
  return load_config().prefill_chunk

# ---- KV cache ----------------------------------------------------------------------------------------------------------------

class KVCache(Protocol):
  kv_dtype: DType   # K and V are stored in this dtype; attention reads them back after a cast to float32

  def update_and_attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, positions: Tensor) -> Tensor:
    """q: (B, T, n_heads, head_dim); k, v: (B, T, n_kv_heads, head_dim), post-RoPE, float32; positions: (B, T) int32, the
    absolute positions of these tokens. Stores k, v (cast to kv_dtype) at those positions, then returns causal attention
    of q over each sequence's cached tokens 0..position (including the ones just stored): (B, T, n_heads, head_dim) float32.
    Softmax in float32, scale 1/sqrt(head_dim)."""
    ...

class DenseKVCache:
  """The reference KV cache: per layer one contiguous (batch, max_context, n_kv_heads, head_dim) buffer for K and one for V;
  the token at position p of row b lives at [b, p]. Attention reads all max_context slots and masks those after the position."""

  def __init__(self, cfg: LlamaConfig, batch: int, max_context: int, kv_dtype: DType = dtypes.float16, device: str | None = None):
    self.cfg, self.batch, self.max_context, self.kv_dtype, self.device = cfg, batch, max_context, kv_dtype, device
    shape = (batch, max_context, cfg.n_kv_heads, cfg.head_dim)
    self.k = [Tensor.zeros(*shape, dtype=kv_dtype, device=device).contiguous().realize() for _ in range(cfg.n_layers)]
    self.v = [Tensor.zeros(*shape, dtype=kv_dtype, device=device).contiguous().realize() for _ in range(cfg.n_layers)]

  @property
  def nbytes(self) -> int: return self.batch * self.max_context * self.cfg.kv_bytes_per_token(self.kv_dtype)

  def update_and_attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, positions: Tensor) -> Tensor:
    B, T = positions.shape
    S = self.max_context
    slots = Tensor.arange(S).reshape(1, S, 1)
    lands = slots == positions.reshape(B, 1, T)                              # (B, S, T): token t is written to slot s
    written = lands.any(-1).reshape(B, S, 1, 1)                              # (B, S, 1, 1)
    for cache, new in ((self.k[layer], k), (self.v[layer], v)):
      new = new.cast(self.kv_dtype).contiguous()                             # (B, T, KVH, D), cast once, not in every slot
      if T == 1: scattered = new                                             # (B, 1, KVH, D) broadcasts over the slots
      else:   # the one token landing in a slot, summed in float32 (exact: the rest are zeros)
        scattered = lands.reshape(B, S, T, 1, 1).where(new.float().reshape(B, 1, T, *new.shape[2:]), 0.0).sum(2).cast(self.kv_dtype)
      cache.assign(written.where(scattered, cache))                          # (B, S, KVH, D): new tokens in, the rest kept
    allowed = slots.reshape(1, 1, S) <= positions.reshape(B, T, 1)           # (B, T, S): causal over the cached positions
    # K, V read back as float32 in their own small kernels: float16 arithmetic fused into the attention kernels compiles to
    # slow scalar code on CPUs (measured 8x slower scores)
    return attention(q, self.k[layer].float().contiguous(), self.v[layer].float().contiguous(), allowed)

# ---- the model ---------------------------------------------------------------------------------------------------------------

class Llama:
  """A Llama-family decoder. `forward` runs any batch through a KVCache; `prefill` runs one prompt a layer at a time and
  hands each layer's K, V to a callback as soon as they exist; `reference_generate` is plain single-device generation."""

  def __init__(self, cfg: LlamaConfig, weights: LlamaWeights, device: str | None = None):
    if len(weights.layers) != cfg.n_layers: raise ValueError(f"config has {cfg.n_layers} layers, weights have {len(weights.layers)}")
    self.cfg, self.w = cfg, weights
    self.prefill_chunk = 0   # prompts longer than this prefill in chunks of it (tinyhet.model.chunked_prefill); 0 = the config's prefill_chunk
    self.device = weights.tok_embeddings.device if device is None else device
    self.rope_cos, self.rope_sin = rope_tables(cfg, cfg.max_context, self.device)   # (max_context, head_dim/2)

  def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
    """cos, sin rows of these positions, (B, T, head_dim/2), realized once per forward: a gather by a tensor index is a
    search over the table's rows, which fused into every layer's kernels would be repeated there."""
    return self.rope_cos[positions].contiguous(), self.rope_sin[positions].contiguous()

  def _qkv(self, l: int, x: Tensor, rope: tuple[Tensor, Tensor], w: LayerWeights | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Layer l's attention inputs (or those of weights w): RMSNorm, projections (+ Qwen2's biases), Qwen3's per-head q/k
    RMSNorm, RoPE. x: (B, T, dim) -> q (B, T, H, D), k, v (B, T, KVH, D) float32. Every forward, prefill and decode step
    of every engine computes its q, k, v here."""
    cfg, w = self.cfg, w or self.w.layers[l]
    B, T, _ = x.shape
    h = rms_norm(x, w.attn_norm, cfg.norm_eps)                               # (B, T, dim)
    q, k, v = linear(h, w.wq), linear(h, w.wk), linear(h, w.wv)              # (B, T, H*D), (B, T, KVH*D) x2
    if w.bq is not None: q, k, v = q + w.bq, k + w.bk, v + w.bv              # Qwen2
    q = q.reshape(B, T, cfg.n_heads, cfg.head_dim)                           # (B, T, H, D)
    k = k.reshape(B, T, cfg.n_kv_heads, cfg.head_dim)                        # (B, T, KVH, D)
    v = v.reshape(B, T, cfg.n_kv_heads, cfg.head_dim)                        # (B, T, KVH, D)
    if w.q_norm is not None: q, k = rms_norm(q, w.q_norm, cfg.norm_eps), rms_norm(k, w.k_norm, cfg.norm_eps)   # Qwen3: over each head's D
    cos, sin = rope                                                          # (B, T, D/2)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

  def _finish_layer(self, l: int, x: Tensor, att: Tensor, w: LayerWeights | None = None) -> Tensor:
    """Attention output projection and the SwiGLU feed-forward, each with its residual. att: (B, T, H, D) -> (B, T, dim)."""
    cfg, w = self.cfg, w or self.w.layers[l]
    B, T = att.shape[:2]
    x = x + linear(att.reshape(B, T, cfg.n_heads * cfg.head_dim), w.wo)      # (B, T, dim)
    h = rms_norm(x, w.ffn_norm, cfg.norm_eps)
    # gate realized on its own: fused with up into one kernel, tinygrad's CPU code ran both reductions at half the speed
    gate = linear(h, w.w_gate)                                               # (B, T, hidden)
    if stored_format(w.w_gate) is None or not pool_threads(x.device): gate = gate.contiguous()   # (the C kernels' output is a buffer)
    return x + linear(gate.silu() * linear(h, w.w_up), w.w_down)

  def _logits(self, x: Tensor, all_rows: bool = False) -> Tensor:
    """x: (B, T, dim) -> logits of the last position (B, vocab) float32; all_rows: of every position (B, T, vocab)."""
    return linear(rms_norm(x if all_rows else x[:, -1], self.w.norm, self.cfg.norm_eps), self.w.output)

  def embed(self, tokens: Tensor) -> Tensor:
    e = self.w.tok_embeddings
    return e.rows(tokens) if isinstance(e, PackedWeight) else lookup(e, tokens).float()   # (B, T, dim)

  def forward(self, tokens: Tensor, positions: Tensor, cache: KVCache, all_rows: bool = False) -> Tensor:
    """tokens, positions: (B, T) int32 -> logits (B, vocab) float32 of the last position of each row (all_rows: (B, T, vocab),
    every position's, as a prompt's logprobs need). The K, V of these tokens
    land in `cache` at their positions; attention sees each row's cached tokens up to the query's position. Lazy: realize it."""
    x, rope = self.embed(tokens), self.rope(positions)
    for l in range(self.cfg.n_layers):
      q, k, v = self._qkv(l, x, rope)
      x = self._finish_layer(l, x, cache.update_and_attend(l, q, k, v, positions))
    return self._logits(x, all_rows)

  def make_decode_step(self, cache: KVCache) -> Callable[[Tensor, Tensor], Tensor]:
    """A TinyJit-compiled forward for a fixed batch and T=1 through `cache`: step(tokens (B,1) int32, positions (B,1) int32)
    -> logits (B, vocab), realized. The first two calls run and capture the kernels, later calls replay them. The returned
    Tensor's buffer is reused by the next call: read it (.numpy()) before calling again."""
    @TinyJit
    def jitted(tokens: Tensor, positions: Tensor) -> Tensor: return self.forward(tokens, positions, cache).realize()
    def step(tokens: Tensor, positions: Tensor) -> Tensor:
      with kernel_threads(self.device): return jitted(tokens, positions)
    return step

  def prefill(self, tokens: Tensor, on_layer: Callable[[int, Tensor, Tensor], None] | None = None, cache: KVCache | None = None,
              kv_dtype: DType | None = None, n_valid: int | None = None, progress: Callable[[int], None] | None = None, on_chunk=None,
              on_hidden=None) -> Tensor:
    """Runs one prompt, tokens (1, T) int32 at positions 0..T-1, realizing one layer at a time. As soon as layer l's K and V
    are realized, on_layer(l, k, v) gets them as (T, n_kv_heads, head_dim) tensors in kv_dtype (post-RoPE), before the rest of
    layer l and before any of layer l+1 is computed, so the caller can start sending them. Attention inside the prompt reads
    K, V after the kv_dtype cast, so decoding from the transferred K, V gives the numbers this pass gives. With `cache`, K and V
    are also stored there (and kv_dtype is the cache's). Returns logits (1, vocab) float32, realized.
    n_valid: only the first n_valid tokens are the prompt; the rest pad it to a length whose kernels are compiled already
    (tinygrad compiles per shape; causal attention keeps pads out of the prompt's numbers). The logits are position
    n_valid-1's, and on_layer gets all T rows: the caller sends the ones it needs. progress(layers done) is called as each layer
    finishes (a long prefill shows where it is). on_chunk: the hand-off of K, V the prefill packs into blocks itself: a chunked
    prefill's per chunk (tinyhet.model.chunked_prefill), a captured prompt's on a CPU device per layer (layer_jit); layers it
    takes are not given to on_layer; other prefills ignore it. on_hidden(x, p0, n): the last layer's rows of each
    chunk (1, C, dim), its first n rows positions p0..p0+n-1 (chunked_prefill; a prompt's logprobs). Without a cache, up to
    LAYER_JIT_MAX_T tokens or past the chunk length, the logits are a capture's output buffer (layer_jit, chunked_prefill),
    overwritten by the next prefill of that length: read them first."""
    if tokens.ndim != 2 or tokens.shape[0] != 1: raise ValueError(f"prefill takes one prompt, tokens of shape (1, T); got {tokens.shape}")
    if n_valid is not None and not (0 < n_valid <= tokens.shape[1] and cache is None):
      raise ValueError(f"n_valid={n_valid} must be in 1..{tokens.shape[1]}, and without a cache (it would store the pads)")
    with kernel_threads(self.device): return self._prefill(tokens, on_layer, cache, kv_dtype, n_valid, progress, on_chunk, on_hidden)

  def _prefill(self, tokens: Tensor, on_layer, cache: KVCache | None, kv_dtype: DType | None, n_valid: int | None = None, progress=None,
               on_chunk=None, on_hidden=None) -> Tensor:
    kv_dtype = cache.kv_dtype if cache is not None else (kv_dtype or dtypes.float16)
    T = tokens.shape[1]
    chunk = self.prefill_chunk or _config_chunk()
    if cache is None and T > chunk:                # a long prompt: chunks through a paged pool, tiled attention (no (T, T) scores)
      from tinyhet.model.chunked_prefill import chunked_prefill
      from tinyhet.model.buckets import below_chunk
      return chunked_prefill(self, tokens, chunk, kv_dtype, on_layer, progress, n_valid, on_chunk=on_chunk, on_hidden=on_hidden,
                             buckets=below_chunk(chunk))
    if cache is None and T <= LAYER_JIT_MAX_T:     # the prompt's own K, V only: every layer replays one capture
      from tinyhet.model.layer_jit import layer_jit
      return layer_jit(self, T, kv_dtype).prefill(tokens, on_layer, progress, n_valid or T, on_hidden, on_chunk)
    positions = Tensor.arange(T, dtype=dtypes.int32).reshape(1, T).to(self.device).realize()
    x, rope = self.embed(tokens.to(self.device)).realize(), self.rope(positions)   # (1, T, dim)
    # attention through a dense cache of the prompt even when the caller keeps none: tinygrad's kernels for that form ran
    # ~1.4x faster here than a causal mask over the (T, T) scores (measured at T=1024 on the CPU)
    from tinyhet.kernels.kv_quant import carrier, round_kv   # a coded format (8-bit, bfloat16 bits): its values in float32
    if cache is None: cache = DenseKVCache(self.cfg, 1, T, carrier(kv_dtype), self.device)
    for l in range(self.cfg.n_layers):
      q, k, v = self._qkv(l, x, rope)
      k, v = round_kv(k, kv_dtype).realize(), round_kv(v, kv_dtype).realize()   # (1, T, KVH, D), what the decode node will hold
      if on_layer is not None: on_layer(l, k[0], v[0])
      att = cache.update_and_attend(l, q, k.float(), v.float(), positions)
      x = self._finish_layer(l, x, att).realize()
      if progress is not None: progress(l + 1)
    if on_hidden is not None: on_hidden(x, 0, n_valid or T)
    if n_valid is not None and n_valid != T:     # the last prompt row, picked by a tensor index: no kernel specialized to n_valid
      x = x[:, Tensor([n_valid - 1], dtype=dtypes.int32, device=self.device)]
    return self._logits(x).realize()

  def reference_generate(self, prompt_ids: list[int], max_tokens: int, temperature: float = 0.0, top_p: float = 1.0, seed: int | None = 0,
                         stop_ids: tuple[int, ...] = (), kv_dtype: DType = dtypes.float16, jit: bool = True,
                         on_token: Callable[[int], None] | None = None, stats: dict | None = None, options: dict | None = None) -> list[int]:
    """Plain single-device generation with a DenseKVCache: prefill the prompt in one forward, then decode one token at a
    time (a TinyJit step when jit), sampling on the host (greedy when temperature == 0). Stops after max_tokens or at a stop id
    (which is included). Returns the generated ids; `stats`, when given, gets prefill_s, decode_s, decode_tokens."""
    from tinyhet.model.sampling import Sampler
    if not prompt_ids: raise ValueError("reference_generate needs at least one prompt token")
    if len(prompt_ids) + max_tokens > self.cfg.max_context:
      raise ValueError(f"prompt ({len(prompt_ids)}) + max_tokens ({max_tokens}) exceeds the model's context ({self.cfg.max_context})")
    sampler, out = Sampler(temperature, top_p, seed, **{"output_from": len(prompt_ids), **(options or {})}), []   # options: sampling.OPTIONS
    cache = DenseKVCache(self.cfg, 1, len(prompt_ids) + max_tokens, kv_dtype, self.device)
    T = len(prompt_ids)
    t0 = time.perf_counter()
    with kernel_threads(self.device):
      logits = self.forward(Tensor([prompt_ids], dtype=dtypes.int32, device=self.device),
                            Tensor.arange(T, dtype=dtypes.int32).reshape(1, T).to(self.device), cache).numpy()
    t1 = time.perf_counter()
    def eager(tok: Tensor, pos: Tensor) -> Tensor:
      with kernel_threads(self.device): return self.forward(tok, pos, cache).realize()
    step = self.make_decode_step(cache) if jit else eager
    for i in range(max_tokens):
      out.append(token := sampler(logits[0], T + i, list(prompt_ids) + out))
      if on_token is not None: on_token(token)
      if token in stop_ids or i == max_tokens - 1: break
      logits = step(Tensor([[token]], dtype=dtypes.int32, device=self.device), Tensor([[T + i]], dtype=dtypes.int32, device=self.device)).numpy()
    if stats is not None: stats.update(prefill_s=t1 - t0, decode_s=time.perf_counter() - t1, decode_tokens=len(out) - 1)
    return out
