"""The decode node's paged KV cache: per-layer block pools on a tinygrad device, a BlockManager, and update_and_attend (the
model's KVCache protocol) over paged attention (kernels/paged_attention.py).

Pool byte layout (per layer, one realized buffer that never moves): shape (num_blocks, 2, n_kv_heads, block_size * head_dim)
in kv_dtype's pool dtype (kernels/kv_quant.py: an 8-bit format's tile is its bytes, q8_0's with its scales), so block b is
the contiguous span [b * block_nbytes, (b + 1) * block_nbytes) holding its K tiles then its V tiles;
inside, K is stored transposed per head ((head_dim, block_size)) and V row-major ((block_size, head_dim)). kernels/kv_pack.py
packs a prefilled layer into exactly these bytes; block_spans gives where a sequence's blocks are (consecutive ids coalesce).

A step, as the engine drives it:
  seqs, is_prefill = scheduler.schedule()            # allocates / appends the token slots in the block manager
  positions = cache.begin_step([s.seq_id for s in seqs], T)   # the step's block tables, in the batch's row order
  model forward(tokens, positions) -> cache.update_and_attend(layer, q, k, v, positions) per layer
Under TinyJit, give the jitted step **cache.jit_kwargs() (the bound block count) so one capture serves every length:
  step = TinyJit(lambda tokens, positions, **kv: model.forward(tokens, positions, cache).realize())
  logits = step(tokens, positions, **cache.jit_kwargs())
"""
from __future__ import annotations
from collections.abc import Sequence
import numpy as np
from tinygrad import Tensor, UOp, dtypes
from tinygrad.device import Buffer
from tinygrad.dtype import DType
from tinygrad.helpers import ceildiv
from tinyhet.kv.block_manager import BlockManager
from tinyhet.device.cpu_threads import pool_threads
from tinyhet.kernels import cpu_attention
from tinyhet.kernels.kv_quant import code_of, is_coded, is_q8, kv_format, kv_name, tile_len
from tinyhet.kernels.paged_attention import decode_splits, kv_scatter, max_blocks_var, paged_attention, uses_c

SCRATCH_BYTES = 256 << 20   # attention keeps (rows, n_heads, splits, head_dim + 2) float32 partials, whatever the length: rows past this go in chunks

def create_pool(num_blocks: int, n_kv_heads: int, head_dim: int, block_size: int, dtype: DType, device: str = "CPU") -> Tensor:
  """One layer's block pool: a realized, zeroed buffer of shape (num_blocks, 2, n_kv_heads, block_size * head_dim) on device.
  Every pool is made here, so the device that holds KV (MESH: registered memory) is chosen in one place. In registered host
  memory on a device whose kernels run on the worker pool, the zeroing is the pool's first touch (first_touch): block range
  t of the pool is written first by pool thread t, so its pages are on that thread's NUMA node."""
  shape = (num_blocks, 2, n_kv_heads, tile_len(dtype, block_size, head_dim))
  if (threads := pool_threads(device)) > 1:
    pool = Tensor.empty(*shape, dtype=dtype, device=device)
    pool.uop.buffer.ensure_allocated()
    if first_touch(pool, threads) is not None: return pool
  return Tensor.zeros(*shape, dtype=dtype, device=device).contiguous().realize()

def first_touch(pool: Tensor, threads: int) -> list[int] | None:
  """Zero a realized pool in registered host memory in `threads` shares of whole pages, share t by the CPU pool's thread t
  (runtime/cpu_pool.py: CpuPool.touch), before anything else writes it: the shares' pages land on the threads' nodes
  (where no mbind policy, numa = interleave, decides instead). The CPU each share ran on, or None (not registered host
  memory: the caller zeroes it another way)."""
  from tinyhet.device.backend import NotRegistered, region_of
  from tinyhet.device.cpu_threads import pool as cpu_pool
  try: region, offset = region_of(pool.uop.base.buffer)
  except NotRegistered: return None
  return cpu_pool().touch(region.addr + offset, pool.uop.base.buffer.nbytes, threads)

def _host_view(buf: Buffer, sync: bool = True) -> memoryview | None:
  # zero-copy view of a host-memory buffer (CPU, MESH); None where the device needs a copy. sync=False: no wait for the
  # device's queue (tinygrad's synchronize asserts its ALLOW_DEVICE_USAGE flag, which is process-wide: a capture compiling
  # on another thread switches it off), for bytes no queued kernel touches
  return buf.as_memoryview(force_zero_copy=True, no_sync=not sync) if hasattr(buf.allocator, "_as_buffer") else None

def _write(buf: Buffer, offset: int, data: bytes | memoryview, sync: bool = True) -> None:
  data = memoryview(data).cast("B")
  if offset < 0 or offset + len(data) > buf.nbytes: raise IndexError(f"write of {len(data)} bytes at {offset} outside a {buf.nbytes}-byte buffer")
  if (mv := _host_view(buf, sync)) is not None: mv[offset:offset + len(data)] = data
  else: buf.view(len(data), dtypes.uint8, offset).ensure_allocated().copy_from(Buffer("PYTHON", len(data), dtypes.uint8, opaque=data))

def _read(buf: Buffer, offset: int, nbytes: int, sync: bool = True) -> bytes:
  if (mv := _host_view(buf, sync)) is not None: return bytes(mv[offset:offset + nbytes])
  return bytes(buf.view(nbytes, dtypes.uint8, offset).ensure_allocated().as_memoryview())

class PagedKVCache:
  """KV for many sequences of different, growing lengths, in fixed-size blocks of per-layer pools."""
  def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, num_blocks: int, block_size: int = 16,
               kv_dtype: DType | str = dtypes.float16, device: str = "CPU", max_seq_len: int = 8192, prefix_cache: bool = False,
               model_id: str = ""):
    self.n_layers, self.n_kv_heads, self.head_dim, self.block_size = n_layers, n_kv_heads, head_dim, block_size
    self.kv_dtype: DType = kv_format(kv_dtype)
    if is_coded(self.kv_dtype) and not cpu_attention.supported(device, self.kv_dtype, head_dim, block_size):
      raise ValueError(f"kv_dtype {kv_name(self.kv_dtype)} needs the CPU C attention kernels (a CPU device, head_dim and block size "
                       f"multiples of 16, q8_0's head_dim of 32): not {device}, head_dim {head_dim}, block {block_size}")
    self.max_seq_len = max_seq_len
    self.cap = ceildiv(max_seq_len, block_size)   # block-table width: the most blocks one sequence can hold
    self.block_manager = BlockManager(num_blocks, block_size, prefix_cache, model_id)   # prefix_cache: see BlockManager
    self.pools = [create_pool(num_blocks, n_kv_heads, head_dim, block_size, self.kv_dtype, device) for _ in range(n_layers)]
    self.block_nbytes = self.bytes_per_block(1, n_kv_heads, head_dim, block_size, self.kv_dtype)
    self._tables: dict[int, Tensor] = {}     # decode batch size -> (B, cap) int32, rewritten in place each step (fixed buffers for TinyJit)
    self._inputs: dict[int, tuple[Tensor, Tensor]] = {}   # decode batch size -> its tokens and positions, (B, 1) int32, the same way
    self._splits: dict[int, Tensor] = {}     # decode batch size -> (1,) int32, the step's attention parts a row (C kernels), the same way
    self._max_blocks = max_blocks_var(self.cap)
    # the CPU C attention kernels' thread count for these pools (None: they do not run them), and the most parts a decode
    # row's context is cut into there (decode_splits of one row): past 1, a decode step reads its count at run time
    dev = self.pools[0].device
    threads = pool_threads(dev) if isinstance(dev, str) else None
    self.c_threads = max(1, threads) if uses_c(dev, self.pools[0], head_dim, threads) else None
    self._most_parts = 1 if self.c_threads is None else decode_splits(1, 1, self.cap, self.c_threads)
    self._step: tuple | None = None          # (batch, tokens per sequence, tables, bound block count, part count buffer or None)

  @staticmethod
  def bytes_per_block(n_layers: int, n_kv_heads: int, head_dim: int, block_size: int, kv_dtype: DType) -> int:
    """Bytes one block costs across all layers: size the pool as arena_bytes // this."""
    return n_layers * 2 * n_kv_heads * tile_len(kv_dtype, block_size, head_dim) * kv_dtype.itemsize

  # ***** the model's KVCache protocol *****

  def begin_step(self, seq_ids: Sequence[int], n_tokens: int = 1, counts: Sequence[int] | None = None,
                 split_rows: int | None = None) -> np.ndarray:
    """Set the batch of the next forward: row b of q/k/v/positions is seq_ids[b], each with n_tokens new tokens whose slots
    the block manager already holds (Scheduler.schedule, or allocate / append_slot): the last n_tokens of each sequence.
    Returns those positions, (B, n_tokens) int32, the positions to give the model. A position outside a sequence's blocks
    would be stored in another sequence's block: pass these.
    counts: several new tokens of a sequence as a decode step (n_tokens 1) of one row each, speculative decoding's verify
    step (tinyhet.engine.speculative): sequence seq_ids[i] takes counts[i] consecutive rows, its last counts[i] slots in
    order, and the positions returned are (sum(counts), 1). Such a step's tables are the fixed buffer of its row count, as
    a plain decode step of that many rows has, so it replays that step's TinyJit capture; each row attends to its own
    position's prefix, which holds the K, V the sequence's earlier rows store in the same step (a layer's writes come
    before its reads).
    split_rows: a decode step's rows cut their context into the parts a step of this many rows would (decode_splits; default
    its own row count): a verify step passes the bucket of its sequences' plain step, so each row's attention sums as
    there (on the CPU C kernels, which read the count at run time; kernels/cpu_attention.py)."""
    tables = [self.block_manager.block_table(s) for s in seq_ids]
    if not tables: raise ValueError("begin_step: empty batch")
    ends = np.array([self.block_manager.length(s) for s in seq_ids], dtype=np.int32)
    if counts is not None and (n_tokens != 1 or len(counts) != len(tables) or min(counts) < 1):
      raise ValueError(f"begin_step: counts takes n_tokens=1 and one count of at least 1 per sequence, got {list(counts)[:8]}")
    need = np.full(len(tables), n_tokens, dtype=np.int32) if counts is None else np.asarray(counts, dtype=np.int32)
    if (short := ends < need).any():
      i = int(np.argmax(short))
      raise ValueError(f"begin_step: sequence {seq_ids[i]} holds fewer than n_tokens={int(need[i])} tokens")
    if (longest := max(len(t) for t in tables)) > self.cap:
      raise ValueError(f"begin_step: a sequence holds {longest} blocks, more than max_seq_len {self.max_seq_len} allows; "
                       "make the cache with a larger max_seq_len")
    rows = np.zeros((len(tables), self.cap), dtype=np.int32)   # padding entries point at block 0: read, then masked
    for i, t in enumerate(tables): rows[i, :len(t)] = t
    rows = np.repeat(rows, need, axis=0)
    buf = self._tables.get(len(rows)) if n_tokens == 1 else None
    if buf is None:
      buf = Tensor.zeros(len(rows), self.cap, dtype=dtypes.int32, device=self.pools[0].device).contiguous().realize()
      # kept only for decode steps (one row per token: as many sizes as batch buckets), which TinyJit replays from fixed
      # buffers; a recompute's rows are its length, which preemptions make unbounded, and it is not jitted
      if n_tokens == 1: self._tables[len(rows)] = buf
    _write(buf.uop.buffer, 0, rows.tobytes())
    parts = None
    if n_tokens == 1 and self._most_parts > 1:
      if (parts := self._splits.get(len(rows))) is None:
        parts = self._splits[len(rows)] = Tensor.zeros(1, dtype=dtypes.int32, device=self.pools[0].device).contiguous().realize()
      _write(parts.uop.buffer, 0, np.array([decode_splits(split_rows or len(rows), 1, self.cap, self.c_threads)], dtype=np.int32).tobytes())
    self._step = (len(rows) // n_tokens, n_tokens, buf, self._max_blocks.bind(longest), parts)
    if counts is None: return ends[:, None] - n_tokens + np.arange(n_tokens, dtype=np.int32)[None]
    first = np.repeat(np.cumsum(need) - need, need)             # each row's sequence's first row
    return (np.repeat(ends - need, need) + np.arange(len(rows), dtype=np.int32) - first).astype(np.int32)[:, None]

  def step_inputs(self, tokens, positions) -> tuple[Tensor, Tensor]:
    """A decode step's tokens and positions, (B, 1) int32 each, as Tensors on the pool's device: written in place into
    buffers kept per batch size, which a TinyJit-ed step reads as they are (a Tensor made from an array costs a transfer for
    tinygrad to schedule: ~2.6 ms of Python each, measured, a third of a SmolLM2 decode step's kernels on 2 cores)."""
    B = len(tokens)
    bufs = self._inputs.get(B)
    if bufs is None:
      dev = self.pools[0].device
      bufs = self._inputs[B] = tuple(Tensor.zeros(B, 1, dtype=dtypes.int32, device=dev).contiguous().realize() for _ in range(2))
    for buf, a in zip(bufs, (tokens, positions)): _write(buf.uop.buffer, 0, np.ascontiguousarray(a, dtype=np.int32).reshape(B, 1).tobytes())
    return bufs

  def jit_kwargs(self) -> dict[str, UOp]:
    """Keyword arguments to pass into a TinyJit-ed step: the bound block count (a Variable reaches a JIT only as an argument)."""
    if self._step is None: raise RuntimeError("jit_kwargs: call begin_step first")
    return {"kv_max_blocks": self._step[3]}

  def update_and_attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, positions: Tensor) -> Tensor:
    """q: (B, T, n_heads, head_dim); k, v: (B, T, n_kv_heads, head_dim), post-RoPE, float32; positions: (B, T) int32, the
    absolute positions of these tokens. Stores k, v (cast to kv_dtype) at those positions, then returns causal attention
    of q over each sequence's cached tokens 0..position (including the ones just stored): (B, T, n_heads, head_dim) float32.
    Softmax in float32, scale 1/sqrt(head_dim)."""
    B, T, H, D = q.shape
    if self._step is None or self._step[:2] != (B, T):
      raise RuntimeError(f"update_and_attend: batch {(B, T)} was not announced; call begin_step(seq_ids, n_tokens={T}) before the forward")
    _, _, tables, max_blocks, parts = self._step
    R = B * T
    pos = positions.reshape(R).cast(dtypes.int32)
    pool = kv_scatter(self.pools[layer], k.reshape(R, self.n_kv_heads, D), v.reshape(R, self.n_kv_heads, D), tables, pos)
    q, n = q.reshape(R, H, D), (pos + 1).contiguous()
    # on a CPU device the C kernels (kernels/cpu_attention.py); one sequence's T > 1 rows share its table: tiles of rows
    threads = self.c_threads
    c = threads is not None
    if c and B == 1 and T > 1: return paged_attention(q, pool, tables, n, max_blocks, threads=threads, shared_table=True).reshape(B, T, H, D)
    # flash-decoding: a short batch's context is cut across the threads (the C kernels keep a row's kv heads in one part);
    # a decode step's C kernels take the step's part count at run time (begin_step's split_rows), the most a row here
    if parts is not None: splits = self._most_parts          # only a C kernels' decode step has a part count buffer
    else: splits = decode_splits(R, 1, self.cap, threads) if c else decode_splits(R, self.n_kv_heads, self.cap)
    chunk = max(1, SCRATCH_BYTES // (H * splits * (D + 2) * 4))
    if R <= chunk: return paged_attention(q, pool, tables, n, max_blocks, splits, threads if c else None, split_count=parts).reshape(B, T, H, D)
    # rows in chunks so the partials stay bounded
    outs = [paged_attention(q[i:i + chunk], pool, tables[i:i + chunk], n[i:i + chunk], max_blocks, splits, threads if c else None,
                            split_count=parts) for i in range(0, R, chunk)]
    return Tensor.cat(*outs).reshape(B, T, H, D)

  # ***** bytes, for transports and tests *****

  def pool_buffer(self, layer: int) -> Buffer:
    """The realized buffer of a layer's pool (register it once with a transport; it never moves)."""
    return self.pools[layer].uop.buffer

  def block_spans(self, seq_id: int, layer: int) -> list[tuple[int, int]]:
    """(byte offset inside the layer's pool buffer, nbytes) of seq_id's blocks in token order; consecutive blocks coalesce."""
    if not 0 <= layer < self.n_layers: raise IndexError(f"layer {layer} out of range (the cache has {self.n_layers})")
    spans: list[tuple[int, int]] = []
    for b in self.block_manager.block_table(seq_id):
      off = b * self.block_nbytes
      if spans and spans[-1][0] + spans[-1][1] == off: spans[-1] = (spans[-1][0], spans[-1][1] + self.block_nbytes)
      else: spans.append((off, self.block_nbytes))
    return spans

  def write_block_bytes(self, layer: int, block_id: int, data: bytes | memoryview, sync: bool = True) -> None:
    """Overwrite one block of a layer with block_nbytes bytes in the pool layout (what a transport write does). sync=False
    (a free block no queued kernel reads or writes): no wait for the device, safe on any thread."""
    if len(memoryview(data).cast("B")) != self.block_nbytes: raise ValueError(f"a block is {self.block_nbytes} bytes, got {len(data)}")
    _write(self.pool_buffer(layer), block_id * self.block_nbytes, data, sync)

  def read_block_bytes(self, layer: int, block_id: int, sync: bool = True) -> bytes:
    return _read(self.pool_buffer(layer), block_id * self.block_nbytes, self.block_nbytes, sync)

  def write_sequence(self, seq_id: int, layer: int, packed: bytes | memoryview) -> None:
    """Write a sequence's packed layer (kernels.kv_pack.pack_kv bytes) into its blocks, span by span."""
    data, pos = memoryview(packed).cast("B"), 0
    spans = self.block_spans(seq_id, layer)
    if len(data) != sum(n for _, n in spans): raise ValueError(f"sequence {seq_id} holds {sum(n for _, n in spans)} bytes per layer, got {len(data)}")
    for off, n in spans:
      _write(self.pool_buffer(layer), off, data[pos:pos + n])
      pos += n

  def layer_storer(self, seq_id: int):
    """on_layer(layer, k, v) for Llama.prefill: each layer's K, V (T, KVH, D) packed into the sequence's blocks as it exists,
    the bytes a prefill node would send (rows past the blocks, a padded prompt's, only reach the last block's slack). With
    numpy straight into the pool where K, V and the pool are host memory (no kernel), else with the pack kernel and a copy."""
    from tinyhet.kernels.kv_pack import pack_kv, pack_kv_host
    from tinyhet.kv.sender import host_array
    blocks = self.block_manager.block_table(seq_id)
    nbytes = len(blocks) * self.block_nbytes
    def store(layer: int, k: Tensor, v: Tensor):
      ka, va, pool = host_array(k), host_array(v), host_array(self.pools[layer])
      if ka is None or va is None or pool is None:
        packed = pack_kv(k, v, self.block_size, self.kv_dtype).contiguous().realize()
        return self.write_sequence(seq_id, layer, packed.uop.buffer.as_memoryview()[:nbytes])
      fmt = dict(q8=is_q8(self.kv_dtype), code=code_of(self.kv_dtype))
      if blocks == list(range(blocks[0], blocks[0] + len(blocks))): pack_kv_host(ka, va, pool[blocks[0]:blocks[0] + len(blocks)], **fmt)
      else:
        tmp = np.empty((len(blocks), *pool.shape[1:]), pool.dtype)
        pack_kv_host(ka, va, tmp, **fmt)
        pool[blocks] = tmp
    return store

  def chunk_storer(self, seq_id: int):
    """on_chunk(layer, pool, b0, b1, piece, n_pieces) for Llama.prefill: blocks b0..b1-1 of a layer as the prefill packed them
    in its own pool (its block i the prompt's block i), copied as they lie into the sequence's blocks b0..b1-1: no unpack and
    no pack (an 8-bit pool's bytes are not dequantized and quantized again). False, nothing copied (layer_storer's on_layer
    then gets the layer), where the pools' block layouts or dtypes differ or either is not host memory."""
    from tinyhet.kv.sender import host_array
    blocks = self.block_manager.block_table(seq_id)
    def store(layer: int, pool: Tensor, b0: int, b1: int, piece: int, n_pieces: int) -> bool:
      src, dst = host_array(pool), host_array(self.pools[layer])
      if src is None or dst is None or src.dtype != dst.dtype or src.shape[1:] != dst.shape[1:] or b1 > len(blocks): return False
      dst[blocks[b0:b1]] = src[b0:b1]
      return True
    return store

  def copy_block(self, src: int, dst: int) -> None:
    """Copy block src to dst in every layer (BlockManager.fork's copy of a partial last block)."""
    for layer in range(self.n_layers): self.write_block_bytes(layer, dst, self.read_block_bytes(layer, src))

  def fork(self, parent: int, child: int) -> None:
    """child shares parent's full blocks and gets a copy of its partial last block."""
    if (copy := self.block_manager.fork(parent, child)) is not None: self.copy_block(*copy)

def kv_blocks_for(cfg, block_size: int, kv_dtype: str, kv_bytes: int) -> int:
  """How many blocks a KV budget of kv_bytes holds (all layers, K and V)."""
  per_block = PagedKVCache.bytes_per_block(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, block_size, kv_format(kv_dtype))
  if kv_bytes < per_block: raise ValueError(f"a KV budget of {kv_bytes} bytes holds no block ({per_block} bytes each)")
  return kv_bytes // per_block
