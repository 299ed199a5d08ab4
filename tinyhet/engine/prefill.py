"""Prefill a prompt one layer at a time (Llama.prefill: captured layers, padded to a bucket), each layer's K, V handed to
on_layer as soon as it exists, and sample the first token; and the figures of a transfer that ran beside it (GenerationStats,
transfer_figures). The clients that send those layers: tinyhet.engine.client.DecodeClient (`tinyhet run`) and the service's
prefill node (tinyhet.service.prefill_node)."""
from __future__ import annotations
import sys, time
from dataclasses import dataclass, field
import numpy as np
from tinygrad import Tensor, dtypes
from tinyhet.model.llama import Llama, _config_chunk
from tinyhet.model.sampling import Sampler

@dataclass
class LayerTimes:
  """When one layer's KV went where, in seconds from the request's start."""
  layer: int
  computed_s: float       # its K, V realized on HET (a layer sent in chunks: its last chunk's)
  posted_s: float         # packed and handed to the transport (by the writer thread; in chunks: its first chunk, often before computed_s)
  landed_s: float         # every byte in the decode node's blocks: the receiver's notice or the writer's completion, whichever came first

@dataclass
class GenerationStats:
  prompt_tokens: int = 0
  ttft_s: float = 0.0               # request start -> first token sampled AND every layer landed (the decode node can go on)
  prefill_s: float = 0.0            # request start -> first token sampled on HET
  kv_bytes: int = 0                 # bytes written to the decode node (whole blocks, all layers)
  kv_writes: int = 0                # transport writes of them: one a layer, or one a chunk of a layer (a chunked prefill's pieces)
  transfer_s: float = 0.0           # time bytes were moving: the union over layers of [posted, landed]
  transfer_gbps: float = 0.0        # kv_bytes / transfer_s
  kv_tail_s: float = 0.0            # first token sampled -> last layer landed (0 when every layer landed before)
  landed_clock: str = "writer"      # "receiver" when the decode node shares this host's clock and its notice times were used
  decode_tokens: int = 0
  decode_tok_s: float = 0.0
  transport: str = ""
  preemptions: int = 0
  cached_tokens: int = 0            # prompt tokens the decode node had cached (it then prefilled only the rest itself, no transfer)
  staging_waits: int = 0            # times prefill waited for a staging buffer (all in flight); layers on a GPU only
  handoff_s: float = 0.0            # time the prefill thread spent handing layers off (packing, copying or staging, queueing)
  timeline: list[LayerTimes] = field(default_factory=list)
  last_logits: list[float] | None = None   # with return_logits: the logits the last token was sampled from

def prefill_bucket(n: int, chunk: int | None = None) -> int:
  """The padded prompt length: tinygrad compiles kernels per shape, so prompts share the captures of their bucket
  (tinyhet.model.buckets: powers of two and 1.5x steps, the chunk length, then its multiples; at most a third is padding past
  16 tokens). chunk: the prefill's chunk length (default: the config's prefill_chunk)."""
  from tinyhet.model.buckets import bucket
  return bucket(n, chunk or _config_chunk())

def busy_time(intervals: list[tuple[float, float]]) -> float:
  """Length of the union of [start, end) intervals: how long at least one transfer was in flight."""
  total, end = 0.0, float("-inf")
  for a, b in sorted(intervals):
    if b <= end: continue
    total += b - max(a, end)
    end = b
  return total

def prefill_logits(model: Llama, prompt_ids: list[int], kv_dtype=dtypes.float16, on_layer=None, progress=None, on_chunk=None,
                   on_hidden=None) -> np.ndarray:
  """Prefill the prompt padded to its bucket on the model's device: the logits (vocab,) of its last token. on_layer(l, k, v)
  gets each layer's K, V (to send, or to store); progress(layers done), if given, as each layer finishes (see
  prefill_progress); on_chunk(...): a chunked prefill's chunks of each layer as they exist (Llama.prefill); on_hidden(x, p0,
  n): the last layer's rows (a prompt's logprobs: tinyhet.engine.prompt_logprobs.PromptLogprobs)."""
  T = prefill_bucket(len(prompt_ids), model.prefill_chunk or None)
  if (warm := getattr(model, "warm", None)) is not None: T = warm.pick("prefill", T)   # while it warms up: a ready bucket (engine/warm_up.py)
  padded = list(prompt_ids) + [0] * (T - len(prompt_ids))
  if progress is not None: progress(0)
  return model.prefill(Tensor([padded], dtype=dtypes.int32, device=model.device), on_layer=on_layer, kv_dtype=kv_dtype,
                       n_valid=len(prompt_ids), progress=progress, on_chunk=on_chunk, on_hidden=on_hidden).numpy()[0]

def prefill_first_token(model: Llama, prompt_ids: list[int], sampler: Sampler, kv_dtype=dtypes.float16, on_layer=None,
                        progress=None, on_chunk=None, on_hidden=None) -> tuple[int, np.ndarray]:
  """prefill_logits, then the first token sampled from them: (token, logits). The disaggregated path passes on_layer to send
  each layer; without it this is the same prefill with no transfer."""
  logits = prefill_logits(model, prompt_ids, kv_dtype, on_layer, progress, on_chunk, on_hidden)
  return sampler(logits, len(prompt_ids), prompt_ids), logits

def prefill_progress(n_tokens: int, n_layers: int, after_s: float = 2.0, out=None):
  """A progress callback for a long prefill: once it has run after_s seconds, a line on stderr at each quarter of the layers
  (in place on a terminal, every layer): layers done and prompt tokens/s so far. Short prefills print nothing. progress(0)
  marks the start of the prefill. out: where the lines go (default sys.stderr; any object with write, flush and isatty)."""
  out = out or sys.stderr
  t0, tty, shown = [time.perf_counter()], out.isatty(), [0]
  def progress(done: int):
    if done == 0:                                   # the prefill starts now (prefill_first_token says so)
      t0[0] = time.perf_counter()
      return
    dt = time.perf_counter() - t0[0]
    if dt < after_s: return
    if not tty and done < n_layers and done < shown[0] + max(1, n_layers // 4): return
    shown[0] = done
    line = f"tinyhet: prefill: {done}/{n_layers} layers of {n_tokens} tokens, {n_tokens * done / n_layers / dt:.0f} tokens/s"
    print(f"\r{line}" if tty else line, end="\n" if not tty or done == n_layers else "", file=out, flush=True)
  return progress

def ttft_no_transfer(model: Llama, prompt_ids: list[int], kv_dtype=dtypes.float16) -> float:
  """Seconds to the first token of the same padded prefill on the same device with no transfer: the baseline of the TTFT
  overhead of disaggregation."""
  t0 = time.perf_counter()
  prefill_first_token(model, prompt_ids, Sampler(), kv_dtype)
  return time.perf_counter() - t0

def transfer_figures(stats: GenerationStats, t0: float, t_first: float, computed: dict[int, float], posted: dict[int, float],
                     confirmed: dict[int, float], kv_bytes: int, receiver: dict[int, float] | None = None):
  """Fill stats' TTFT, moving time, rate and per-layer timeline from perf_counter times per layer: computed (K, V realized),
  posted (handed to the transport), confirmed (the writer learned the write finished) and, when the receiver shares this
  clock, its notice times. A layer has landed at the earlier of confirmed and the receiver's notice: a shm copy ends before
  the receiver reads its notice; a tcp write lands when the receiver says so, not when its ACK gets this busy process's
  attention. The rate is over the time bytes were moving (the union of [posted, landed]), not over the time spent waiting."""
  landed = dict(confirmed)
  if receiver is not None and receiver.keys() == landed.keys():
    landed = {l: min(landed[l], receiver[l]) for l in landed}
    stats.landed_clock = "receiver"
  last = max(landed.values())
  stats.kv_bytes = kv_bytes
  stats.ttft_s = max(t_first, last) - t0
  stats.kv_tail_s = max(0.0, last - t_first)
  stats.transfer_s = busy_time([(posted[l], landed[l]) for l in landed])
  stats.transfer_gbps = kv_bytes / stats.transfer_s / 1e9 if stats.transfer_s > 0 else 0.0
  stats.timeline = [LayerTimes(l, computed[l] - t0, posted[l] - t0, landed[l] - t0) for l in sorted(landed)]

def prefill_suffix_logits(model: Llama, cache, seq_id: int, token_ids: list[int], start: int, end: int | None = None,
                          on_hidden=None) -> np.ndarray | None:
  """Prefill token_ids[start:] of a sequence whose first `start` tokens' K, V are in its paged-cache blocks already (a prefix
  cache hit, or a recompute's): captured chunk prefills (tinyhet.model.chunked_prefill) continuing from the K, V in the
  cache's pools, the suffix's K, V written into the sequence's own blocks, its last chunk at the shortest captured length
  that holds it (buckets.below_chunk: an 8-token suffix runs as 16, not as 512). The block manager must hold len(token_ids)
  slots for it; the last chunk's pads past its blocks land in PAD_SEQ's block (the decode engine's scratch block). One
  capture per chunk length serves every sequence: the table is as wide as the longest sequence's. The logits (vocab,) of
  its last token. end: only token_ids[start:end] (one chunk of a prompt spread over steps, start 0 included: tinyhet.engine.
  scheduler.Scheduler.schedule_step); short of the sequence's last token no logits are computed (None): nothing is sampled
  there. on_hidden: the suffix's last-layer rows (chunked_prefill's)."""
  from tinyhet.device.cpu_threads import kernel_threads
  from tinyhet.engine.decode_engine import PAD_SEQ
  from tinyhet.model.chunked_prefill import chunked_prefill
  bm = cache.block_manager
  if end is None:
    if not 0 < start < len(token_ids): raise ValueError(f"a suffix prefill needs 0 < start < {len(token_ids)}, got {start}")
  elif not 0 <= start < end <= len(token_ids): raise ValueError(f"a prefill piece needs 0 <= start < end <= {len(token_ids)}, got {start}, {end}")
  if bm.length(seq_id) != len(token_ids):
    raise ValueError(f"a suffix prefill of sequence {seq_id}: its blocks hold {bm.length(seq_id)} tokens, not the {len(token_ids)} given")
  if PAD_SEQ not in bm: raise RuntimeError("a suffix prefill needs the decode engine's scratch block (PAD_SEQ): make the DecodeEngine first")
  chunk = model.prefill_chunk or _config_chunk()
  width = cache.cap + -(-chunk // cache.block_size)           # the longest sequence's blocks and a chunk's pads past them
  table = bm.block_table(seq_id)
  table = table + bm.block_table(PAD_SEQ)[:1] * (width - len(table))
  last = end is None or end == len(token_ids)
  with kernel_threads(model.device):
    logits = chunked_prefill(model, np.array([token_ids[start:end]], np.int32), chunk, cache.kv_dtype, pools=cache.pools, table=table,
                             start=start, buckets=suffix_buckets(model, chunk), on_hidden=on_hidden, want_logits=last)
  return logits.numpy()[0] if last else None

def prefill_sequence_logits(model: Llama, cache, seq_id: int, token_ids: list[int], first: int | None = None, end: int | None = None,
                            on_hidden=None):
  """A decode node's own prefill of a sequence whose blocks its cache holds: token_ids[first:end] (default: all past its
  prefix-cache hit) over the K, V before them. A whole prompt up to the chunk length runs as a prefill node's does (captured
  layers, each layer's K, V packed into the blocks); anything else in chunks straight into the blocks (prefill_suffix_logits:
  the captures of the chunk lengths over the pool serve every prompt). The logits (vocab,) of token end - 1, or None while
  end falls short of the sequence's last token (a piece of a prompt spread over steps: Scheduler.schedule_step). on_hidden:
  the last layer's rows (a prompt's logprobs, PromptLogprobs; a prefix-cache hit's rows, which exist nowhere, by a prefill
  of the prefix alone, its K, V dropped)."""
  hit = cache.block_manager.cached_length(seq_id)
  first, end = hit if first is None else first, len(token_ids) if end is None else end
  if first == 0 and end == len(token_ids) <= (model.prefill_chunk or _config_chunk()):
    return prefill_logits(model, token_ids, cache.kv_dtype, cache.layer_storer(seq_id), on_hidden=on_hidden)
  if on_hidden is not None and first == hit > 0: prefill_logits(model, token_ids[:hit], cache.kv_dtype, on_hidden=on_hidden)
  logits = prefill_suffix_logits(model, cache, seq_id, token_ids, first, end, on_hidden)
  return logits if end == len(token_ids) else None

def suffix_buckets(model, chunk: int, kind: str = "suffix") -> tuple[int, ...]:
  """The lengths a suffix's last chunk may run at: every bucket below the chunk length, or while the model warms up the
  ready ones of its kind (tinyhet.engine.warm_up: "suffix" over a decode node's KV pool, "pulled" over a prefill node's
  pull pools)."""
  from tinyhet.model.buckets import below_chunk
  warm = getattr(model, "warm", None)
  return below_chunk(chunk) if warm is None or warm.done else tuple(b for b in below_chunk(chunk) if b in warm.ready.get(kind, ()))

def pull_width(model: Llama, block_size: int, kv_dtype) -> int:
  """The one table width (blocks) of a prefill node's pulled prefixes: the model's context and a chunk's pads past it, so
  one set of pools and one capture per suffix chunk length (built by the warm-up: tinyhet.engine.warm_up.pulled_items)
  serve every turn of every conversation, the attention running over a symbolic block count (a wide table costs no
  compute). Bounded by config.pull_pool_bytes (every layer's pool together) and by half of what the device's arena has
  free when first asked (the prompts' own pools and activations need the rest): past them, as many blocks as fit; a
  prompt longer than that runs over pools of its own bucket (prefill_pulled_logits). 0: none fit. Fixed at the first call
  per block size and KV dtype, so the warm-up's width is the requests'."""
  widths = model.__dict__.setdefault("_pull_widths", {})
  if (key := (block_size, kv_dtype)) not in widths:
    from tinyhet.config import load_config
    from tinyhet.device.backend import arena_free_bytes
    from tinyhet.kernels.kv_quant import tile_len
    cfg, chunk = model.cfg, model.prefill_chunk or _config_chunk()
    block_bytes = 2 * cfg.n_kv_heads * tile_len(kv_dtype, block_size, cfg.head_dim) * kv_dtype.itemsize * cfg.n_layers
    room = load_config().pull_pool_bytes
    if (free := arena_free_bytes(model.device)) is not None: room = min(room, free // 2)
    widths[key] = min(-(-(cfg.max_context + chunk) // block_size), room // block_bytes)
  return widths[key]

def pull_pools(model: Llama, nb: int, block_size: int, kv_dtype) -> tuple[list[Tensor], bool]:
  """(pools, made now): pools of nb blocks for a pulled prefix, the previous request's again where nothing else holds them
  any more (making 2 x n_layers zeroed pools cost ~0.3 s of a SmolLM2 turn). Kept: the set pull_width's blocks wide for
  good (the warm-up makes it), and one other, the bucket of the last prompt longer than that. Their stale blocks past a
  prompt are never read: a chunk's K, V are written before its attention reads them, and positions past the prompt are
  masked."""
  from tinyhet.model.chunked_prefill import prompt_pools
  kept = model.__dict__.setdefault("_pull_pools", {})
  key = (nb, block_size, kv_dtype)
  pools = kept.get(key)
  # in use elsewhere (a pull still holding the list, or a pool itself): more references than kept's, the loop's and the call's
  if pools is None or sys.getrefcount(pools) > 3 or any(sys.getrefcount(p) > 3 for p in pools):
    pools = prompt_pools(model, nb * block_size, kv_dtype, block_size)[0]
    for k in [k for k in kept if k[0] != pull_width(model, k[1], k[2])]: del kept[k]   # a longer prompt's bucket: the next one replaces it
    kept[key] = pools
    return pools, True
  return pools, False

def prefill_pulled_logits(model: Llama, prompt_ids: list[int], cached: int, block_size: int, kv_dtype, start_pull, on_layer=None, on_chunk=None):
  """Prefill prompt_ids[cached:] over a prefix whose K, V are pulled from a decode node: pools of the decode node's block size
  (blocks 0.. the prefix's, pulled by start_pull(pools) -> tinyhet.kv.pull.PrefixPull, each layer waited for just before the
  suffix's first chunk computes it), then the chunked prefill continues from there (tinyhet.model.chunked_prefill), its
  last chunk at the shortest bucket that holds it (as a decode node's own suffix: prefill_suffix_logits). The pools and
  their table are pull_width's blocks wide whatever the prompt (one that does not fit: its bucket's), so the warm-up's
  captures serve every turn of a growing conversation; a request that builds a capture or pools on its path anyway (a
  decode node of another block size or KV dtype, a prompt past the width, a bucket not built yet) counts in the warm-up's
  cold. on_layer(l, k, v) gets the suffix's K, V only (tokens cached..n-1); on_chunk, where given, each chunk's blocks of
  a layer in the pools as they are stored (chunked_prefill's: blocks cached // block_size.., a sender writes them as they
  lie, KVSender.send_chunk), so no layer is unpacked for the sender. Returns (logits (vocab,), the pull's figures)."""
  from tinygrad.helpers import ceildiv
  from tinyhet.device.cpu_threads import kernel_threads
  from tinyhet.model.chunked_prefill import chunked_prefill, padded_plan
  from tinyhet.model.layer_jit import Replay
  n, suffix = len(prompt_ids), list(prompt_ids[cached:])
  if cached % block_size or not 0 < cached < n: raise ValueError(f"a pulled prefix is whole blocks short of the prompt, got {cached} of {n}")
  chunk = model.prefill_chunk or _config_chunk()
  buckets = suffix_buckets(model, chunk, "pulled")
  last = padded_plan(len(suffix), chunk, cached, buckets)[-1]
  span, width = last[0] + last[2], pull_width(model, block_size, kv_dtype)   # positions the pools hold, the last chunk's pads included
  nb = width if span <= width * block_size else prefill_bucket(ceildiv(span, block_size))
  captures = Replay.captures
  (pools, made), pull = pull_pools(model, nb, block_size, kv_dtype), None
  try:
    pull = start_pull(pools)
    with kernel_threads(model.device):
      logits = chunked_prefill(model, np.array([suffix], np.int32), chunk, kv_dtype, on_layer, None, len(suffix), pools, list(range(nb)),
                               cached, buckets, before_layer=pull.wait, layer_from=cached, on_chunk=on_chunk).numpy()[0]
  except BaseException:
    drop_pull_pools(model, pools)   # half filled, maybe still being filled: no later job gets them
    if pull is not None: pull.abort()   # no read may still fill pools after they are gone; its host staging freed
    raise
  if (warm := getattr(model, "warm", None)) is not None and (made or Replay.captures > captures): warm.cold += 1
  return logits, pull.finish()

def drop_pull_pools(model: Llama, pools: list[Tensor]) -> None:
  """Forget pools a failed pull was filling: the next pull_pools makes new ones."""
  kept = model.__dict__.get("_pull_pools", {})
  for key in [k for k, v in kept.items() if v is pools]: del kept[key]
