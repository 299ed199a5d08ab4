"""Prefill one layer at a time without paying tinygrad's scheduler for every layer: each layer of a prompt of T tokens is
the same two computations on other weights, so both are captured once with TinyJit, the layer's weights passed in as
inputs, and replayed for every layer and every later prompt of that length (prompts are padded to a few lengths).

Without it, each layer's realize() ran tinygrad's graph rewrites and scheduling again: measured ~80 ms of Python per layer
of SmolLM2 at 32 tokens (2.7 s of a 2.9 s prefill), where the kernels took ~6 ms. That was the TTFT of a short prompt.

  qkv     x, rope -> q; K and V assigned into per-layer buffers in the KV dtype (what the transfer sends: fresh buffers,
          so a layer's K, V stay intact while they are sent and the next layers run)
  finish  x, q, K, V -> the next x, assigned into one of two buffers used in turn (a replay writes its output buffer
          again: the layer's input must not be that buffer)
Attention inside the prompt is causal over the T positions, reading K and V back from the KV dtype, as the dense cache of
the one-prompt path does: on CPU devices by the C prefill tiles of kernels/cpu_attention.py over K, V packed into blocks
(the qkv half packs them into the layer's own pool of BLOCK-token blocks, which on_chunk hands to a sender as they lie)
(tinygrad's (T, T) scores, max, exp and p @ V were half of a 512-token SmolLM2 prefill's time; `tinyhet bench profile`),
elsewhere by tinygrad's kernels with a causal mask. Layers whose weights differ in type or shape from layer 0's (a GGUF may store some in another
type) get captures of their own: one pair per weight signature. Once captured, a half is replayed straight from its
capture (`Replay`), without TinyJit's per-call work of re-deriving each input's view.
"""
from __future__ import annotations
import dataclasses, sys, weakref
import numpy as np
from tinygrad import Tensor, TinyJit, dtypes
from tinygrad.device import Buffer
from tinygrad.dtype import DType
from tinygrad.uop.ops import Ops
from tinyhet.device.cpu_threads import pool_threads
from tinyhet.kernels import cpu_attention
from tinyhet.kernels.kv_pack import pack_kv
from tinyhet.kernels.kv_quant import carrier, round_kv
from tinyhet.kernels.paged_attention import paged_attention
from tinyhet.model.layers import attention
from tinyhet.model.packed import PackedWeight

# the weights each half reads (a capture's inputs are all used): Qwen2's biases and Qwen3's q/k norms where the layer has them
QKV = ("attn_norm", "wq", "wk", "wv", "bq", "bk", "bv", "q_norm", "k_norm")
FINISH = ("wo", "ffn_norm", "w_gate", "w_up", "w_down")

def layer_tensors(w, names: tuple[str, ...]) -> list[Tensor]:
  """Some of a layer's weights as Tensors (a packed matrix is its blocks), inputs of a captured half-layer; those the layer
  lacks (None) are left out."""
  return [getattr(w, n).blocks if isinstance(getattr(w, n), PackedWeight) else getattr(w, n) for n in w.present(names)]

def layer_from(template, names: tuple[str, ...], tensors: tuple[Tensor, ...]):
  """The LayerWeights `template` with the weights `names` it has replaced by `tensors` (in layer_tensors' order)."""
  new = {}
  for n, t in zip(template.present(names), tensors, strict=True):
    old = getattr(template, n)
    new[n] = type(old)(t, old.shape, old.ggml_type) if isinstance(old, PackedWeight) else t   # PackedWeight or BF16Weight
  return dataclasses.replace(template, **new)

BLOCK = 16   # tokens per block of the packed K, V the CPU attention kernels read

def tiled_inputs(T: int, device: str) -> tuple[Tensor, Tensor]:
  """The block table (1, ceil(T / BLOCK)) of a prompt's own packed blocks, 0..n-1, and each row's context length (T,),
  position + 1 (causal), as the C attention kernels take them."""
  nb = -(-T // BLOCK)
  return (Tensor(np.arange(nb, dtype=np.int32).reshape(1, nb), device=device).realize(),
          Tensor(np.arange(1, T + 1, dtype=np.int32), device=device).realize())

def tiled_attention(q: Tensor, pool: Tensor, tiled: tuple[int, Tensor, Tensor]) -> Tensor:
  """Causal attention of a prompt's q (1, T, H, D) over its own K, V packed into the paged layout (pack_kv's pool of BLOCK
  tokens a block, (nb, 2, KVH, BLOCK * D) in the KV dtype's carrier), by the C prefill tiles: each tile of rows reads a
  block once for the group's heads. -> (1, T, H, D) float32."""
  threads, table, lens = tiled
  _, T, H, D = q.shape
  return paged_attention(q.reshape(T, H, D), pool, table, lens, table.shape[1], threads=threads, shared_table=True).reshape(1, T, H, D)

KEEP = 16  # captures kept per model, the most recently used: every bucket up to the chunk length (tinyhet.model.buckets; a warmed-up
           # node holds them all); each holds its intermediate buffers (off CPU devices the (T, T) scores among them)

def layer_jit(model, T: int, kv_dtype: DType) -> LayerJit:
  """The model's capture for prompts of T tokens (made on first use), most recently used last."""
  jits = model.__dict__.setdefault("_layer_jits", {})
  lj = jits.pop((T, kv_dtype), None) or LayerJit(model, T, kv_dtype)
  jits[(T, kv_dtype)] = lj
  while len(jits) > KEEP: jits.pop(next(iter(jits)))
  return lj

def write_into(t: Tensor, a: np.ndarray) -> None:
  """a into the buffer of t that a capture reads, in place (an assign may hand the tensor another buffer)."""
  # host memory (CPU, MESH, HET on a CPU) by a numpy copy into a view of it: a copy through tinygrad costs ~1.6 ms of Python
  # (five a chunk), and a new Tensor a schedule
  buf = t.uop.buffer
  if hasattr(buf.allocator, "_as_buffer"):
    np.frombuffer(buf.as_memoryview(force_zero_copy=True), dtype=a.dtype)[:a.size] = a.reshape(-1)
    return
  data = memoryview(bytearray(a.tobytes()))
  buf.copy_from(Buffer("PYTHON", len(data), dtypes.uint8, opaque=data))

def allocated(t: Tensor) -> Tensor:
  """An empty Tensor with its memory allocated: TinyJit takes only real buffers as inputs (an unallocated one is left out)."""
  t.uop.buffer.ensure_allocated()
  return t

def signature(w, names: tuple[str, ...]) -> tuple:
  """What a capture of a half-layer is specific to besides T: each weight's kind, type and shape. A GGUF may store a layer's
  weight in another type than layer 0's (llama.cpp's Q4_K_M keeps some in Q6_K): such a layer gets captures of its own."""
  mats = ((n, getattr(w, n)) for n in w.present(names))
  return tuple((n, type(m).__name__, getattr(m, "ggml_type", None), tuple(m.shape), str(m.dtype)) for n, m in mats)

class Replay:
  """One half-layer's TinyJit, called through TinyJit until it has captured, then replayed straight from its capture: TinyJit's
  own call re-derives every input's view with a graph rewrite (~1-2 ms of Python a call, 60 calls a SmolLM2 prefill), which
  the inputs of one signature (same shapes, dtypes, devices: `signature`) do not need. capture_first: capture on the first
  call (TinyJit runs a first call uncaptured): for a computation called once a prefill, whose inputs are realized buffers."""
  captures = 0                               # made in this process, every Replay's (tinyhet.engine.warm_up counts them)
  open: weakref.WeakSet = weakref.WeakSet()   # called but not captured yet (a half whose signature one layer has: a second prefill captures it)

  def __init__(self, fn, capture_first: bool = False):
    self.jit = TinyJit(fn)
    if capture_first: self.jit.cnt = 1

  def __call__(self, *inputs: Tensor, **variables):
    if self.jit.captured is None:
      out = self.jit(*inputs, **variables)
      if self.jit.captured is None: Replay.open.add(self)
      else:
        Replay.captures += 1
        Replay.open.discard(self)
      return out
    bases = [t.uop.base for t in inputs]
    # an input that is not a plain buffer (a realized tensor still behind its last computation): TinyJit's own call
    if any(b.op is not Ops.BUFFER for b in bases): return self.jit(*inputs, **variables)
    # bound Variables (a chunk's block count) by name, as TinyJit passes them
    return self.jit.captured(bases, {var.expr: val for var, val in (u.unbind() for u in variables.values())})

class LayerJit:
  """The two captured halves of a prefill layer for one prompt length and KV dtype, per weight signature."""
  def __init__(self, model, T: int, kv_dtype: DType):
    self.model, self.T, self.kv_dtype, cfg = model, T, kv_dtype, model.cfg
    dev, threads = model.device, pool_threads(model.device)
    # on a CPU device attention runs in kernels/cpu_attention.py's prefill tiles (block table and lengths below); elsewhere
    # tinygrad's kernels over the (T, T) scores with this causal mask
    self.tiled = (threads, *tiled_inputs(T, dev)) if threads and cpu_attention.supported(dev, carrier(kv_dtype), cfg.head_dim, BLOCK) else None
    self.allowed = None if self.tiled else Tensor.ones(T, T, dtype=dtypes.bool, device=dev).tril().reshape(1, T, T).realize()
    self.halves: dict[tuple, Replay] = {}
    # the prompt's ends, captured too: each cost ~5-16 ms of tinygrad scheduling per prefill (~10% of 100 tokens' TTFT)
    positions = Tensor.arange(T, dtype=dtypes.int32).reshape(1, T).to(dev).realize()
    self.rope = tuple(t.realize() for t in model.rope(positions))      # cos, sin of positions 0..T-1: the same every prompt
    self.embed = Replay(lambda tokens, x_out: x_out.assign(model.embed(tokens)).realize())
    self.logits = Replay(lambda x, row: model._logits(x[:, row]).realize())
    self.row = allocated(Tensor.empty(1, dtype=dtypes.int32, device=dev))    # the index of the prompt's last row
    self.q = allocated(Tensor.empty(1, T, cfg.n_heads, cfg.head_dim, device=dev))
    self.x = [allocated(Tensor.empty(1, T, cfg.dim, device=dev)) for _ in range(2)]
    self.kv = [self._new_kv() for _ in range(2 * cfg.n_layers)]      # a run's K and V (kv_buffers)
    # on a CPU device each layer's K, V packed as the qkv half computes them, in the paged layout the C attention reads and
    # a decode node of BLOCK-token blocks and this KV dtype holds: on_chunk sends them as they lie (no pack on the host)
    self.pools = [self._new_pool() for _ in range(cfg.n_layers)] if self.tiled else []

  def half(self, layer: int, names: tuple[str, ...]) -> Replay:
    """The capture of half `names` for this layer's weight signature, made with this layer as its template."""
    model, kv_dtype, allowed, template = self.model, self.kv_dtype, self.allowed, self.model.w.layers[layer]
    key = (names, signature(template, names))
    if key in self.halves: return self.halves[key]
    if names == QKV and self.tiled:   # a CPU device: K, V also packed into the layer's pool (the finish half attends over it)
      def qkv_packed(x: Tensor, cos: Tensor, sin: Tensor, q_out: Tensor, k_out: Tensor, v_out: Tensor, pool_out: Tensor, *weights: Tensor):
        q, k, v = model._qkv(0, x, (cos, sin), layer_from(template, QKV, weights))
        k, v = (round_kv(t.reshape(o.shape), kv_dtype) for o, t in ((k_out, k), (v_out, v)))
        Tensor.realize(q_out.assign(q), k_out.assign(k), v_out.assign(v), pool_out.assign(pack_kv(k, v, BLOCK)))
      self.halves[key] = Replay(qkv_packed)
    elif names == QKV:
      def qkv(x: Tensor, cos: Tensor, sin: Tensor, q_out: Tensor, k_out: Tensor, v_out: Tensor, *weights: Tensor):
        q, k, v = model._qkv(0, x, (cos, sin), layer_from(template, QKV, weights))
        Tensor.realize(q_out.assign(q), *(o.assign(round_kv(t.reshape(o.shape), kv_dtype)) for o, t in ((k_out, k), (v_out, v))))
      self.halves[key] = Replay(qkv)
    elif self.tiled:   # the C kernels' causal prefill tiles over the layer's pool (no (T, T) scores)
      def finish_tiled(x: Tensor, q: Tensor, pool: Tensor, x_out: Tensor, *weights: Tensor):
        x_out.assign(model._finish_layer(0, x, tiled_attention(q, pool, self.tiled), layer_from(template, FINISH, weights))).realize()
      self.halves[key] = Replay(finish_tiled)
    else:
      def finish(x: Tensor, q: Tensor, k: Tensor, v: Tensor, x_out: Tensor, *weights: Tensor):
        # K, V read back as float32 in their own kernels, as DenseKVCache does (float16 inside attention is slow scalar code)
        k, v = k.reshape(1, *k.shape), v.reshape(1, *v.shape)
        att = attention(q, k.float().contiguous(), v.float().contiguous(), allowed)
        x_out.assign(model._finish_layer(0, x, att, layer_from(template, FINISH, weights))).realize()
      self.halves[key] = Replay(finish)
    return self.halves[key]

  def kv_buffers(self) -> list[Tensor]:
    """2 * n_layers buffers (T, KVH, D) for a run's K and V, the shape on_layer hands out (a view made per layer, k[0], cost
    ~0.3 ms of tinygrad's Python each). They are handed out and must stay intact while anyone holds them, so a run reuses
    the previous run's only where nothing but this list refers to them any more; making a Tensor costs ~0.4 ms of Python,
    60 of them ~25 ms of a SmolLM2 prefill."""
    for i in range(len(self.kv)):
      if sys.getrefcount(self.kv[i]) > 2: self.kv[i] = self._new_kv()     # 2: this list and getrefcount's argument; more: held elsewhere
    return self.kv

  def pool_buffers(self) -> list[Tensor]:
    """n_layers pools (ceil(T / BLOCK), 2, KVH, BLOCK * D) of a run's packed K, V (CPU devices), reused as kv_buffers are:
    a sender keeps a layer's pool until its write has landed (on_chunk)."""
    for i in range(len(self.pools)):
      if sys.getrefcount(self.pools[i]) > 2: self.pools[i] = self._new_pool()
    return self.pools

  def _new_pool(self) -> Tensor:
    cfg, nb = self.model.cfg, -(-self.T // BLOCK)
    return allocated(Tensor.empty(nb, 2, cfg.n_kv_heads, BLOCK * cfg.head_dim, dtype=carrier(self.kv_dtype), device=self.model.device))

  def _new_kv(self) -> Tensor:
    cfg = self.model.cfg
    return allocated(Tensor.empty(self.T, cfg.n_kv_heads, cfg.head_dim, dtype=carrier(self.kv_dtype), device=self.model.device))

  def prefill(self, tokens: Tensor, on_layer, progress, n_valid: int, on_hidden=None, on_chunk=None) -> Tensor:
    """tokens (1, T) int32 -> logits (1, vocab) of row n_valid - 1, every layer through the captures (see run). The logits
    are the capture's output buffer: the next prefill of this length overwrites them. on_hidden(x, 0, n_valid): the last
    layer's rows (1, T, dim), as chunked_prefill's. on_chunk(l, pool, 0, nb, 0, 1), where given and K, V are packed (CPU
    devices): layer l's packed blocks of the prompt (pads past n_valid left out) as one piece, as chunked_prefill's; True:
    it took them (on_layer is not called for that layer), False: on_layer gets the layer."""
    tokens = tokens.to(self.model.device).realize()
    self.embed(tokens, self.x[1])                              # layer 0 then writes self.x[0] (run alternates the two)
    take = (lambda l, pool: on_chunk(l, pool, 0, -(-n_valid // BLOCK), 0, 1)) if on_chunk is not None else None
    x = self.run(self.x[1], self.rope, on_layer, progress, take)
    if on_hidden is not None: on_hidden(x, 0, n_valid)
    write_into(self.row, np.array([n_valid - 1], np.int32))   # a Tensor per prompt length was a schedule on every new length's path
    return self.logits(x, self.row)

  def run(self, x: Tensor, rope: tuple[Tensor, Tensor], on_layer, progress, take=None) -> Tensor:
    """All layers on x (1, T, dim), realized; on_layer(l, k, v) with the layer's K, V (T, KVH, D) in the KV dtype as soon as
    they exist, unless take(l, pool), given the layer's packed pool (CPU devices), took them. Returns the last layer's
    output (one of this object's two buffers: use it before the next run)."""
    cfg = self.model.cfg
    kv, pools = self.kv_buffers(), self.pool_buffers()
    cos, sin = rope
    for l in range(cfg.n_layers):
      w = self.model.w.layers[l]
      k, v = kv[2 * l], kv[2 * l + 1]
      packed = (pools[l],) if pools else ()                  # the qkv half packs K, V there; the finish half attends over it
      self.half(l, QKV)(x, cos, sin, self.q, k, v, *packed, *layer_tensors(w, QKV))
      if (take is None or not packed or not take(l, pools[l])) and on_layer is not None: on_layer(l, k, v)
      out = self.x[l % 2] if x is not self.x[l % 2] else self.x[(l + 1) % 2]
      self.half(l, FINISH)(x, self.q, *(packed or (k, v)), out, *layer_tensors(w, FINISH))
      x = out
      if progress is not None: progress(l + 1)
    return x
