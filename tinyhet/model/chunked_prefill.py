"""A long prompt's prefill in chunks: chunk after chunk of C tokens goes through every layer, its K, V written into place in a
paged pool per layer (kernels/paged_attention.py's layout, kv_scatter: only the chunk's slots), its queries attending over
the pool with the flash-decoding kernel (one query row per chunk token, its context the tokens before it: an online softmax
over the K, V blocks, no (C, S) or (T, T) matrix realized). Memory: weights + the pools (the prompt's KV) + O(C x width) for
the chunk's activations and attention partials, whatever the prompt's length.

"The KV of the tokens before" is general: run(..., pools, table, start) continues a sequence whose first `start` tokens'
K, V are already in `pools` at the blocks of `table` (a cached prefix, or the chunks before); without them the prefill makes
pools of its own, blocks 0..n-1 in order.

Each chunk-layer is two captures (TinyJit, replayed through layer_jit.Replay), made once per chunk length, pool size and
weight signature: qkv (RMSNorm, projections, RoPE of the chunk's positions, K and V scattered into the pool) and finish
(attention over the pool up to the chunk's end, a symbolic block count, then the rest of the layer). The positions, the
context lengths and the block count are inputs, so one capture serves every chunk of a prompt and every later prompt of
that many blocks.

on_layer(l, k, v) gets a layer's K, V (T, n_kv, head_dim) once its last chunk has been stored (read back out of the pool),
so the stream to a decode node overlaps the last chunk's compute. (Sending each chunk's K, V as it is made, with notices per
chunk, is not built yet.)
"""
from __future__ import annotations
import numpy as np
from tinygrad import Tensor, dtypes
from tinygrad.device import Buffer
from tinygrad.dtype import DType
from tinygrad.helpers import ceildiv
from tinyhet.kernels.kv_pack import unpack_kv
from tinyhet.kernels.paged_attention import kv_scatter, max_blocks_var, paged_attention
from tinyhet.model.layer_jit import FINISH, QKV, Replay, allocated, layer_from, layer_tensors, signature

DEFAULT_CHUNK = 512
BLOCK = 16        # tokens per block of the prefill's own pools (any size works; 16 is the decode node's default)

def chunk_plan(T: int, chunk: int, start: int = 0) -> list[tuple[int, int]]:
  """(first position, tokens) of each chunk of a T-token prompt continuing `start` cached tokens; every chunk is `chunk`
  long but the last, which is the rest."""
  if chunk < 1 or T < 1 or start < 0: raise ValueError(f"chunk_plan: chunk {chunk} and T {T} must be positive, start {start} >= 0")
  return [(start + i, min(chunk, T - i)) for i in range(0, T, chunk)]

class ChunkJit:
  """The captured halves of a chunk-layer for chunks of C tokens over pools of nb blocks, per weight signature."""
  def __init__(self, model, C: int, nb: int, kv_dtype: DType, block_size: int = BLOCK):
    cfg, dev = model.cfg, model.device
    self.model, self.C, self.nb, self.kv_dtype, self.bs = model, C, nb, kv_dtype, block_size
    self.halves: dict[tuple, Replay] = {}
    self.q = allocated(Tensor.empty(1, C, cfg.n_heads, cfg.head_dim, device=dev))
    self.x = [allocated(Tensor.empty(1, C, cfg.dim, device=dev)) for _ in range(3)]   # the chunk's input, then two in turn
    self.cos = allocated(Tensor.empty(1, C, cfg.head_dim // 2, device=dev))
    self.sin = allocated(Tensor.empty(1, C, cfg.head_dim // 2, device=dev))
    self.pos = allocated(Tensor.empty(C, dtype=dtypes.int32, device=dev))         # the chunk's positions
    self.lens = allocated(Tensor.empty(C, dtype=dtypes.int32, device=dev))        # each row's context: position + 1
    self.tokens = allocated(Tensor.empty(1, C, dtype=dtypes.int32, device=dev))   # the chunk's tokens (pads: 0)
    self.embed = Replay(lambda tokens, pos, x_out, cos_out, sin_out: Tensor.realize(
      x_out.assign(model.embed(tokens)), *(o.assign(t) for o, t in zip((cos_out, sin_out), model.rope(pos.reshape(1, C))))))
    self.max_blocks = max_blocks_var(nb)

  def half(self, layer: int, names: tuple[str, ...]) -> Replay:
    model, kv_dtype, C, template = self.model, self.kv_dtype, self.C, self.model.w.layers[layer]
    cfg = model.cfg
    key = (names, signature(template, names))
    if key in self.halves: return self.halves[key]
    if names == QKV:
      def qkv(x, cos, sin, q_out, pool, table, pos, *weights):
        q, k, v = model._qkv(0, x, (cos, sin), layer_from(template, QKV, weights))
        k, v = (t.cast(kv_dtype).reshape(C, cfg.n_kv_heads, cfg.head_dim) for t in (k, v))   # rounded as the decode node holds them
        Tensor.realize(q_out.assign(q), kv_scatter(pool, k, v, table, pos))
      self.halves[key] = Replay(qkv)
    else:
      def finish(x, q, pool, table, lens, x_out, *weights, kv_max_blocks):
        att = paged_attention(q.reshape(C, cfg.n_heads, cfg.head_dim), pool, table, lens, kv_max_blocks)
        x_out.assign(model._finish_layer(0, x, att.reshape(1, C, cfg.n_heads, cfg.head_dim), layer_from(template, FINISH, weights))).realize()
      self.halves[key] = Replay(finish)
    return self.halves[key]

def chunk_jit(model, C: int, nb: int, kv_dtype: DType) -> ChunkJit:
  jits = model.__dict__.setdefault("_chunk_jits", {})
  cj = jits.pop((C, nb, kv_dtype), None) or ChunkJit(model, C, nb, kv_dtype)
  jits[(C, nb, kv_dtype)] = cj
  while len(jits) > 2: jits.pop(next(iter(jits)))
  return cj

def prompt_pools(model, n_tokens: int, kv_dtype: DType, block_size: int = BLOCK) -> tuple[list[Tensor], int]:
  """Pools for a prompt's own K, V (one per layer, blocks 0..nb-1 in order) and nb."""
  cfg, nb = model.cfg, ceildiv(n_tokens, block_size)
  shape = (nb, 2, cfg.n_kv_heads, block_size * cfg.head_dim)
  return [Tensor.zeros(*shape, dtype=kv_dtype, device=model.device).contiguous().realize() for _ in range(cfg.n_layers)], nb

def _write(t: Tensor, a: np.ndarray) -> None:
  # into the buffer a capture reads, in place (an assign may hand the tensor another buffer)
  data = memoryview(bytearray(a.tobytes()))
  t.uop.buffer.copy_from(Buffer("PYTHON", len(data), dtypes.uint8, opaque=data))

def chunked_prefill(model, tokens: Tensor, chunk: int, kv_dtype: DType, on_layer=None, progress=None, n_valid: int | None = None,
                    pools: list[Tensor] | None = None, table: list[int] | None = None, start: int = 0, before_layer=None) -> Tensor:
  """tokens (1, T) int32 at positions start..start+T-1 -> logits (1, vocab) of row n_valid - 1 (default T - 1), realized.
  pools/table: per-layer pools holding the K, V of positions 0..start-1 at the blocks of `table` (its entries cover at
  least start + T positions); None makes the prompt's own (start must be 0). The last chunk is padded to the chunk length
  (its pads land in slots past the prompt, masked for the prompt's rows). before_layer(l), if given, runs before layer l of
  the first chunk (a pulled prefix's layer l is waited for there: tinyhet.kv.pull)."""
  cfg, dev = model.cfg, model.device
  T = tokens.shape[1]
  n_valid = T if n_valid is None else n_valid
  C = min(chunk, T)
  plan = chunk_plan(T, C, start)
  span = start + len(plan) * C                                  # positions the pools must hold, the last chunk's pads included
  if pools is None:
    if start: raise ValueError("chunked_prefill: start > 0 needs the pools holding the tokens before")
    pools, nb = prompt_pools(model, span, kv_dtype)
    table = list(range(nb))
  elif table is None or len(table) * (pools[0].shape[3] // cfg.head_dim) < span:
    raise ValueError(f"chunked_prefill: the block table must cover {span} positions")
  nb = len(table)
  cj = chunk_jit(model, C, nb, kv_dtype)
  tables = Tensor([table] * C, dtype=dtypes.int32, device=dev).realize()           # every row reads the sequence's one table
  bs = pools[0].shape[3] // cfg.head_dim
  toks = tokens.numpy().astype(np.int32).reshape(-1)
  last_row = None
  for ci, (p0, n) in enumerate(plan):
    ids = np.zeros(C, np.int32)
    ids[:n] = toks[p0 - start:p0 - start + n]
    positions = np.arange(p0, p0 + C, dtype=np.int32)
    for buf, a in ((cj.tokens, ids), (cj.pos, positions), (cj.lens, positions + 1)): _write(buf, a)
    cj.embed(cj.tokens, cj.pos, cj.x[0], cj.cos, cj.sin)
    x, mb = cj.x[0], cj.max_blocks.bind(ceildiv(p0 + C, bs))
    for l in range(cfg.n_layers):
      w = model.w.layers[l]
      if before_layer is not None and ci == 0: before_layer(l)
      cj.half(l, QKV)(x, cj.cos, cj.sin, cj.q, pools[l], tables, cj.pos, *layer_tensors(w, QKV))
      if on_layer is not None and ci == len(plan) - 1:            # the layer's K, V are all in place: hand them out
        k, v = unpack_kv(pools[l][:ceildiv(start + T, bs)] if table == list(range(nb)) else pools[l][Tensor(table[:ceildiv(start + T, bs)])],
                         start + T, cfg.head_dim)
        on_layer(l, k.contiguous().realize(), v.contiguous().realize())
      out = cj.x[1] if x is not cj.x[1] else cj.x[2]
      cj.half(l, FINISH)(x, cj.q, pools[l], tables, cj.lens, out, *layer_tensors(w, FINISH), kv_max_blocks=mb)
      x = out
      if progress is not None and ci == len(plan) - 1: progress(l + 1)
    if p0 - start <= n_valid - 1 < p0 - start + n: last_row = x[:, n_valid - 1 - (p0 - start)].reshape(1, 1, cfg.dim).contiguous().realize()
  return model._logits(last_row).realize()
