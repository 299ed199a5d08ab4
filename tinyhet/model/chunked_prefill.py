"""A long prompt's prefill in chunks: chunk after chunk of C tokens goes through every layer, its K, V written into place in a
paged pool per layer (kernels/paged_attention.py's layout, kv_scatter: only the chunk's slots), its queries attending over
the pool with the flash-decoding kernel (one query row per chunk token, its context the tokens before it: an online softmax
over the K, V blocks, no (C, S) or (T, T) matrix realized). Memory: weights + the pools (the prompt's KV) + O(C x width) for
the chunk's activations and attention partials, whatever the prompt's length.

"The KV of the tokens before" is general: run(..., pools, table, start) continues a sequence whose first `start` tokens'
K, V are already in `pools` at the blocks of `table` (a cached prefix, or the chunks before); without them the prefill makes
pools of its own, blocks 0..n-1 in order. A decode node's own prefill of a cached prefix's suffix runs here too
(tinyhet.engine.prefill.prefill_suffix_logits: the cache's pools, a table as wide as the longest sequence), its last chunk
at the shortest bucket that holds it (tinyhet.model.buckets), so an 8-token suffix replays 16-token captures, not 512-token ones.

Each chunk-layer is two captures (TinyJit, replayed through layer_jit.Replay), made once per chunk length, pool size and
weight signature: qkv (RMSNorm, projections, RoPE of the chunk's positions, K and V scattered into the pool) and finish
(attention over the pool up to the chunk's end, a symbolic block count, then the rest of the layer). The positions, the
context lengths and the block count are inputs, so one capture serves every chunk of a prompt and every later prompt of
that many blocks. The logits of the prompt's last row are a capture too (its row an input).

on_layer(l, k, v) gets a layer's K, V (T, n_kv, head_dim) once its last chunk has been stored (read back out of the pool),
so the stream to a decode node overlaps the last chunk's compute. on_chunk, where given, gets each chunk's blocks of each
layer as soon as they are stored (the prefill's own pool is in the decode node's block layout: a sender writes those blocks
from it as they are, tinyhet.kv.sender.KVSender.send_chunk), so a prompt's first chunks can be on the decode node before
its last one is computed.
"""
from __future__ import annotations
import numpy as np
from tinygrad import Tensor, dtypes
from tinygrad.dtype import DType
from tinygrad.helpers import ceildiv
from tinyhet.device.cpu_threads import pool_threads
from tinyhet.kernels.kv_pack import unpack_kv
from tinyhet.kernels.kv_quant import block_size_of, is_coded, tile_len
from tinyhet.kernels.paged_attention import kv_scatter, max_blocks_var, paged_attention
from tinyhet.model.layer_jit import FINISH, QKV, Replay, allocated, layer_from, layer_tensors, signature, write_into as _write

DEFAULT_CHUNK = 512
BLOCK = 16        # tokens per block of the prefill's own pools (any size works; 16 is the decode node's default)

def chunk_plan(T: int, chunk: int, start: int = 0) -> list[tuple[int, int]]:
  """(first position, tokens) of each chunk of a T-token prompt continuing `start` cached tokens; every chunk is `chunk`
  long but the last, which is the rest."""
  if chunk < 1 or T < 1 or start < 0: raise ValueError(f"chunk_plan: chunk {chunk} and T {T} must be positive, start {start} >= 0")
  return [(start + i, min(chunk, T - i)) for i in range(0, T, chunk)]

def bucket_of(n: int, chunk: int, buckets: tuple[int, ...]) -> int:
  """The captured length a chunk of n tokens (n <= chunk) runs at: the smallest bucket under the chunk length that holds it,
  else the chunk length."""
  return min([b for b in buckets if n <= b < chunk] or [chunk])

def padded_plan(T: int, chunk: int, start: int = 0, buckets: tuple[int, ...] = ()) -> list[tuple[int, int, int]]:
  """chunk_plan's chunks with the length each runs at, (first position, tokens, captured length): a full chunk at the chunk
  length (no longer than T: a short prompt is one chunk of its own length); the last one at bucket_of when `buckets` are
  given (an 8-token suffix pays for 16 tokens, not 512), else at the chunk length."""
  C = min(chunk, T) if not buckets else chunk
  return [(p0, n, bucket_of(n, C, buckets) if buckets else C) for p0, n in chunk_plan(T, C, start)]

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
    self.tables = allocated(Tensor.zeros(C, nb, dtype=dtypes.int32, device=dev).contiguous().realize())   # every row: the sequence's table
    self.table: tuple[int, ...] | None = None                                    # what self.tables holds
    self.row = allocated(Tensor.empty(1, dtype=dtypes.int32, device=dev))        # the prompt's last row inside this chunk
    # captured on their first call (the halves capture on their second, the next layer's): a new chunk length's second use replays
    self.logits = Replay(lambda x, row: model._logits(x[:, row]).realize(), capture_first=True)
    self.embed = Replay(lambda tokens, pos, x_out, cos_out, sin_out: Tensor.realize(
      x_out.assign(model.embed(tokens)), *(o.assign(t) for o, t in zip((cos_out, sin_out), model.rope(pos.reshape(1, C))))), capture_first=True)
    self.max_blocks = max_blocks_var(nb)

  def half(self, layer: int, names: tuple[str, ...]) -> Replay:
    model, kv_dtype, C, template = self.model, self.kv_dtype, self.C, self.model.w.layers[layer]
    cfg = model.cfg
    key = (names, signature(template, names))
    if key in self.halves: return self.halves[key]
    if names == QKV:
      def qkv(x, cos, sin, q_out, pool, table, pos, *weights):
        q, k, v = model._qkv(0, x, (cos, sin), layer_from(template, QKV, weights))
        # rounded as the decode node holds them (an 8-bit or bfloat16 pool: encoded by the scatter itself)
        k, v = ((t if is_coded(kv_dtype) else t.cast(kv_dtype)).reshape(C, cfg.n_kv_heads, cfg.head_dim) for t in (k, v))
        Tensor.realize(q_out.assign(q), kv_scatter(pool, k, v, table, pos))
      self.halves[key] = Replay(qkv)
    else:
      def finish(x, q, pool, table, lens, x_out, *weights, kv_max_blocks):
        # every row reads the one table: on a CPU device the C kernels tile the chunk's rows (kernels/cpu_attention.py)
        att = paged_attention(q.reshape(C, cfg.n_heads, cfg.head_dim), pool, table, lens, kv_max_blocks, threads=pool_threads(x.device),
                              shared_table=True)
        x_out.assign(model._finish_layer(0, x, att.reshape(1, C, cfg.n_heads, cfg.head_dim), layer_from(template, FINISH, weights))).realize()
      self.halves[key] = Replay(finish)
    return self.halves[key]

KEEP = 64  # chunk captures kept per model, the most recently used: every bucket's (tinyhet.model.buckets; a warmed-up node holds them all)

def chunk_jit(model, C: int, nb: int, kv_dtype: DType, pool_shape: tuple[int, ...] = ()) -> ChunkJit:
  """The model's captures for chunks of C tokens over tables of nb blocks and pools of pool_shape (made on first use)."""
  jits, key = model.__dict__.setdefault("_chunk_jits", {}), (C, nb, kv_dtype, pool_shape)
  cj = jits.pop(key, None) or ChunkJit(model, C, nb, kv_dtype)
  jits[key] = cj
  while len(jits) > KEEP: jits.pop(next(iter(jits)))
  return cj

def prompt_pools(model, n_tokens: int, kv_dtype: DType, block_size: int = BLOCK) -> tuple[list[Tensor], int]:
  """Pools for a prompt's own K, V (one per layer, blocks 0..nb-1 in order) and nb."""
  cfg, nb = model.cfg, ceildiv(n_tokens, block_size)
  shape = (nb, 2, cfg.n_kv_heads, tile_len(kv_dtype, block_size, cfg.head_dim))
  return [Tensor.zeros(*shape, dtype=kv_dtype, device=model.device).contiguous().realize() for _ in range(cfg.n_layers)], nb

def chunked_prefill(model, tokens: Tensor, chunk: int, kv_dtype: DType, on_layer=None, progress=None, n_valid: int | None = None,
                    pools: list[Tensor] | None = None, table: list[int] | None = None, start: int = 0, buckets: tuple[int, ...] = (),
                    on_chunk=None, before_layer=None, layer_from: int = 0, on_hidden=None, want_logits: bool = True) -> Tensor | None:
  """tokens (1, T) int32 (a Tensor, or ids on the host) at positions start..start+T-1 -> logits (1, vocab) of row n_valid - 1 (default T - 1).
  pools/table: per-layer pools holding the K, V of positions 0..start-1 at the blocks of `table` (its entries cover at
  least the plan's positions, the last chunk's pads included); None makes the prompt's own (start must be 0). The last
  chunk is padded to its captured length (padded_plan; buckets: the shorter lengths it may take); its pads land in slots past
  the prompt (the table's entries there: a scratch block), masked for the prompt's rows.
  on_chunk(l, pool, b0, b1, piece, n_pieces) -> bool, with pools in order (the prefill's own, or a pulled prefix's: block i
  holds positions of block i) and chunks of whole blocks: called as soon
  as a chunk's K, V of layer l are in pools[l], its blocks b0..b1-1 (the prompt's, pads past n_valid left out; a chunk of
  pads alone is no piece); True: it took them (on_layer is not called for that layer), False at piece 0: on_layer gets the
  layer whole at the end. before_layer(l), if given, runs before layer l of the first chunk (a pulled prefix's layer l is
  waited for there: tinyhet.kv.pull). layer_from: the first position on_layer's K, V hold (a multiple of the block size; a
  pulled prefix's suffix hands out its own tokens only), to start + n_valid - 1. on_hidden(x, p0, n), if given, gets each
  chunk's last-layer rows, x (1, C, dim) realized, its first n rows the prompt's positions p0..p0+n-1 (a prompt's own
  logprobs: tinyhet.engine.prompt_logprobs); x is overwritten by the next chunk. want_logits False: no logits (returns
  None): a piece of a prompt spread over steps short of its end samples nothing, and the output head of one row is ~6% of
  a 16-token chunk of SmolLM2 (measured: 4.4 of 73 ms on one core)."""
  cfg = model.cfg
  T = len(tokens[0]) if not isinstance(tokens, Tensor) else tokens.shape[1]
  n_valid = T if n_valid is None else n_valid
  plan = padded_plan(T, chunk, start, buckets)
  span = plan[-1][0] + plan[-1][2]                            # positions the pools must hold, the last chunk's pads included
  if pools is None:
    if start: raise ValueError("chunked_prefill: start > 0 needs the pools holding the tokens before")
    pools, nb = prompt_pools(model, span, kv_dtype)
    table = list(range(nb))
  elif table is None or len(table) * block_size_of(pools[0].dtype, pools[0].shape[3], cfg.head_dim) < span:
    raise ValueError(f"chunked_prefill: the block table must cover {span} positions")
  nb, bs = len(table), block_size_of(pools[0].dtype, pools[0].shape[3], cfg.head_dim)
  if layer_from % bs or not 0 <= layer_from <= start:
    raise ValueError(f"chunked_prefill: layer_from must be a block boundary in 0..start, got {layer_from}")
  end = start + (n_valid if layer_from else T)                 # on_layer's K, V: positions layer_from..end-1
  real = [c for c in plan if c[0] - start < n_valid]                   # chunks holding prompt rows: the pieces on_chunk sends
  in_order = table == list(range(nb))                          # pool block i holds positions of block i (own pools, a pulled prefix's)
  whole = set() if on_chunk is not None and in_order and all(C % bs == 0 for _, _, C in plan[:-1]) else set(range(cfg.n_layers))
  toks = (tokens.numpy() if isinstance(tokens, Tensor) else np.asarray(tokens)).astype(np.int32).reshape(-1)
  logits = None
  for ci, (p0, n, C) in enumerate(plan):
    cj = chunk_jit(model, C, nb, kv_dtype, tuple(pools[0].shape))
    if cj.table != tuple(table): _write(cj.tables, np.tile(np.asarray(table, np.int32), (C, 1)))   # every row reads the sequence's one table
    cj.table = tuple(table)
    ids = np.zeros(C, np.int32)
    ids[:n] = toks[p0 - start:p0 - start + n]
    positions = np.arange(p0, p0 + C, dtype=np.int32)
    for buf, a in ((cj.tokens, ids), (cj.pos, positions), (cj.lens, positions + 1)): _write(buf, a)
    cj.embed(cj.tokens, cj.pos, cj.x[0], cj.cos, cj.sin)
    x, mb = cj.x[0], cj.max_blocks.bind(ceildiv(p0 + C, bs))
    for l in range(cfg.n_layers):
      w = model.w.layers[l]
      if before_layer is not None and ci == 0: before_layer(l)
      cj.half(l, QKV)(x, cj.cos, cj.sin, cj.q, pools[l], cj.tables, cj.pos, *layer_tensors(w, QKV))
      if l not in whole and ci < len(real):                       # this chunk's blocks of the layer leave now
        b1 = ceildiv(min(p0 + n, start + n_valid), bs)
        if not on_chunk(l, pools[l], p0 // bs, b1, ci, len(real)): whole.add(l)
      if on_layer is not None and l in whole and ci == len(plan) - 1:    # the layer's K, V are all in place: hand them out
        b0, b1 = layer_from // bs, ceildiv(end, bs)
        k, v = unpack_kv(pools[l][b0:b1] if in_order else pools[l][Tensor(table[b0:b1])], end - layer_from, cfg.head_dim)
        on_layer(l, k.contiguous().realize(), v.contiguous().realize())
      out = cj.x[1] if x is not cj.x[1] else cj.x[2]
      cj.half(l, FINISH)(x, cj.q, pools[l], cj.tables, cj.lens, out, *layer_tensors(w, FINISH), kv_max_blocks=mb)
      x = out
      if progress is not None and ci == len(plan) - 1: progress(l + 1)
    if on_hidden is not None and p0 - start < n_valid: on_hidden(x, p0, min(n, start + n_valid - p0))
    if want_logits and p0 - start <= n_valid - 1 < p0 - start + n:
      _write(cj.row, np.array([n_valid - 1 - (p0 - start)], np.int32))
      logits = cj.logits(x, cj.row)
  return logits
