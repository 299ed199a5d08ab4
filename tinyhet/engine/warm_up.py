"""Warm-up: every capture a node can need, built at start, so that no request pays tinygrad's scheduling and compiles.

  warm = WarmUp.for_decode_node(decode)        # or for_prefill(model, kv_dtype); attaches itself to the model (model.warm)
  while warm.step(): ...                        # one capture per call, on the thread that owns the model (tinygrad's)
  warm.pick("prefill", 40)                      # the length a request of 40 tokens runs at now

Every length a request brings rounds up to a bucket (tinyhet.model.buckets) and every batch to a decode bucket, so the
captures are a fixed list: the decode step of each batch bucket up to the node's batch, the prefill of each length bucket up
to the model's context (one LayerJit up to the chunk length, past it the one or two chunk captures of the bucket's pool),
and the chunk captures a cached prefix's suffix runs at over the KV pool (on a prefill node: over the one set of pools a
pulled prefix lands in, made by the warm-up too). tinygrad owns one thread (its compile cache is a
sqlite connection bound to it), so the node builds them on its batching thread, one per call, while it has nothing else to
do: a request that comes meanwhile waits at most for the one capture under way, and runs at the smallest ready bucket that
holds it (pick) until its own is built; only one that no ready bucket holds builds its own (counted in `cold`). The kernels
themselves persist across processes in tinygrad's disk cache (CACHELEVEL, CACHEDB; default ~/.cache/tinygrad/cache.db), and so
do their generated programs (tinyhet.device.program_cache), so a restarted node compiles and generates nothing and pays only
the scheduling and the captures.
"""
from __future__ import annotations
import time
from collections import deque
from tinygrad.helpers import ceildiv
from tinyhet.model.buckets import below_chunk, sizes
from tinyhet.model.layer_jit import Replay

class WarmUp:
  def __init__(self, model, items: list[tuple[str, int, object]]):
    """items: (kind, size, build) in the order to build them; build() makes that capture."""
    self.todo = deque(items)
    self.total = len(items)
    self.ready: dict[str, set[int]] = {}
    self.cold = 0                   # requests that ran at a bucket not built yet (no ready one held them): each built it, or waited for it
    self.seconds = 0.0              # spent building so far
    self.captures_before = Replay.captures
    self.captures = 0               # captures made by the warm-up
    model.warm = self

  @property
  def done(self) -> bool: return not self.todo

  def step(self) -> bool:
    """Build the next capture; False once there is none left."""
    if not self.todo: return False
    kind, size, build = self.todo.popleft()
    t0, before = time.perf_counter(), Replay.captures
    build()
    self.seconds += time.perf_counter() - t0
    self.captures += Replay.captures - before
    self.ready.setdefault(kind, set()).add(size)
    return bool(self.todo)

  def pick(self, kind: str, size: int) -> int:
    """The size a request of bucket `size` runs at: its own once built (or once the warm-up is over: nothing more comes), else
    the smallest ready bucket above it; with none, its own, built on the request's path."""
    ready = self.ready.get(kind, set())
    if self.done or size in ready: return size
    if (up := [b for b in ready if b > size]): return min(up)
    self.cold += 1
    return size

  def status(self) -> dict:
    return {"done": self.done, "built": self.total - len(self.todo), "of": self.total, "captures": self.captures,
            "seconds": round(self.seconds, 3), "cold": self.cold}

  # ***** what a node needs *****

  @staticmethod
  def for_prefill(model, kv_dtype, block_size: int | None = None) -> WarmUp:
    """A prefill node's captures: the prefill of every length bucket up to the model's context, and the chunks of a pulled
    prefix's suffix (pulled_items; block_size: the decode nodes', default the config's kv_block_size)."""
    prefill, pulled = prefill_items(model, kv_dtype), pulled_items(model, kv_dtype, block_size)
    # the chunk length's prompt and pulled chunk first (every shorter one can run there meanwhile), then the shorter ones,
    # the pulled chunks before the prompts past the chunk length (every later turn of a conversation pulls)
    short = [item for item in prefill if item[1] <= chunk_of(model)]
    return WarmUp(model, short[:1] + pulled[:1] + short[1:] + pulled[1:] + prefill[len(short):])

  @staticmethod
  def for_decode_node(decode, prefill_jobs: bool = False) -> WarmUp:
    """A decode node's captures: its decode step at every batch bucket up to its batch; its own prefill of a whole prompt
    up to the chunk length; and the chunks over its KV pool that every other prompt of its own runs in (a longer one, a
    piece of one spread over steps: Scheduler.schedule_step, a prefix-cache hit's suffix). prefill_jobs: the node also
    prefills for other nodes (`--role both`): the prefill of every length bucket."""
    from tinyhet.engine.decode_engine import BATCH_BUCKETS, batch_bucket
    model, engine, cache, chunk = decode.model, decode.engine, decode.cache, chunk_of(decode.model)
    top = batch_bucket(decode.scheduler.max_num_seqs)
    steps = [("decode", B, lambda B=B: engine.warm_up((B,), decode.cond)) for B in sorted({*(b for b in BATCH_BUCKETS if b <= top), top})]
    prefill = prefill_items(model, cache.kv_dtype, None if prefill_jobs else chunk)
    suffix = [("suffix", C, lambda C=C: warm_suffix(model, cache, C)) for C in (chunk, *below_chunk(chunk))]
    pulled = pulled_items(model, cache.kv_dtype, cache.block_size) if prefill_jobs else []    # its prefill jobs pull prefixes too
    # a draft model's decode step at every bucket a draft step may take: the drafting rows and the catch-up rows of one
    draft = [] if decode.draft is None else [("draft", B, lambda B=B: decode.draft.warm(B))
                                             for B in BATCH_BUCKETS if B <= max(top, batch_bucket(decode.draft.catch_up))]
    # the batch of one and the longest prefill and chunk first (every shorter prompt can run there meanwhile), then the
    # rest smallest first
    return WarmUp(model, steps[:1] + prefill[:1] + suffix[:1] + prefill[1:] + steps[1:] + suffix[1:] + pulled + draft)

def chunk_of(model) -> int:
  from tinyhet.model.llama import _config_chunk
  return model.prefill_chunk or _config_chunk()

def prefill_items(model, kv_dtype, upto: int | None = None) -> list:
  """The prefill of every length bucket (up to `upto` tokens, default the model's context), the longest up to the chunk
  length first: it holds every shorter prompt while the rest are built."""
  chunk = chunk_of(model)
  lengths = [T for T in sizes(chunk, model.cfg.max_context) if upto is None or T <= upto]
  short = [T for T in lengths if T <= chunk]
  items = [("prefill", T, lambda T=T: warm_prefill(model, T, kv_dtype)) for T in [short[-1], *short[:-1]]]
  return items + [("prefill", T, lambda T=T: warm_long(model, T, chunk, kv_dtype)) for T in lengths if T > chunk]

def warm_prefill(model, T: int, kv_dtype) -> None:
  """Capture the layers of a T-token prefill (T <= the chunk length): twice, since its ends capture on their second call."""
  from tinygrad import Tensor, dtypes
  for _ in range(2): model.prefill(Tensor([[0] * T], dtype=dtypes.int32, device=model.device), kv_dtype=kv_dtype).numpy()

def warm_long(model, T: int, chunk: int, kv_dtype) -> None:
  """Capture the chunks of a T-token bucket past the chunk length: each chunk length of its plan over a pool of its blocks,
  one chunk each (the last chunk's position), not the whole prompt."""
  from tinyhet.device.cpu_threads import kernel_threads
  from tinyhet.model.chunked_prefill import BLOCK, chunked_prefill, padded_plan, prompt_pools
  pools, nb = prompt_pools(model, T, kv_dtype)
  with kernel_threads(model.device):
    for C in sorted({C for _, _, C in padded_plan(T, chunk, 0, below_chunk(chunk))}):
      start = nb * BLOCK - C                  # the pool's last C positions
      chunk_twice(lambda: chunked_prefill(model, [[0] * C], chunk, kv_dtype, pools=pools, table=list(range(nb)), start=start,
                                          buckets=below_chunk(chunk)).numpy())

def warm_suffix(model, cache, C: int) -> None:
  """Capture a C-token chunk over the KV pool at the width prefill_suffix_logits uses, every row in the padding rows' block
  (the decode engine's scratch block: nothing reads what lands there)."""
  from tinyhet.device.cpu_threads import kernel_threads
  from tinyhet.engine.decode_engine import PAD_SEQ
  from tinyhet.model.chunked_prefill import chunked_prefill
  chunk = chunk_of(model)
  width = cache.cap + ceildiv(chunk, cache.block_size)
  with kernel_threads(model.device):
    chunk_twice(lambda: chunked_prefill(model, [[0] * C], chunk, cache.kv_dtype, pools=cache.pools,
                                        table=cache.block_manager.block_table(PAD_SEQ)[:1] * width, start=0, buckets=below_chunk(chunk)).numpy())

def pulled_items(model, kv_dtype, block_size: int | None = None) -> list:
  """The chunks a pulled prefix's suffix runs in on a prefill node (tinyhet.engine.prefill.prefill_pulled_logits): every
  chunk length over the one set of pools pull_width's blocks wide, the chunk length first (the first one made makes the
  pools). None where config.pull_pool_bytes (or the arena) holds no block: every pulled prompt then runs at its own bucket."""
  from tinyhet.engine.prefill import pull_width
  if block_size is None:
    from tinyhet.config import load_config
    block_size = load_config().kv_block_size
  chunk, width = chunk_of(model), pull_width(model, block_size, kv_dtype)
  if width < 1: return []
  return [("pulled", C, lambda C=C: warm_pulled(model, C, width, block_size, kv_dtype)) for C in (chunk, *below_chunk(chunk))]

def warm_pulled(model, C: int, width: int, block_size: int, kv_dtype) -> None:
  """Capture a C-token chunk of a pulled prefix's suffix over the pools and the table prefill_pulled_logits uses (the pools
  made by the first such capture, kept for the requests: tinyhet.engine.prefill.pull_pools)."""
  from tinyhet.device.cpu_threads import kernel_threads
  from tinyhet.engine.prefill import pull_pools
  from tinyhet.model.chunked_prefill import chunked_prefill
  chunk = chunk_of(model)
  with kernel_threads(model.device):
    chunk_twice(lambda: chunked_prefill(model, [[0] * C], chunk, kv_dtype, pools=pull_pools(model, width, block_size, kv_dtype)[0],
                                        table=list(range(width)), start=0, buckets=below_chunk(chunk)).numpy())

def chunk_twice(run) -> None:
  """A chunk's halves capture on their second call, the next layer's: a weight signature that only one layer has needs a
  second chunk."""
  before = Replay.captures
  run()
  if Replay.captures == before or Replay.open: run()
