"""The single-device engine: prefill and decode on one device, with the decode node's paged KV cache and jitted decode step
on that same device, and no transfer. `tinyhet run --no-disagg` and `tinyhet bench e2e`'s single-device rows use it, so
that what separates them from the disaggregated path is disaggregation alone, not a weaker engine.

A request: the prompt is prefilled exactly as the disaggregated path does it (padded to its bucket, one layer at a time);
each layer's K, V are packed into the pool's block layout (kernels/kv_pack.py) and copied into the sequence's blocks on
the device (where the disaggregated path posts a transport write); then the decode node's step (tinyhet.engine.decode_engine:
one TinyJit capture, the block count a bound Variable) decodes over the paged cache (kernels/paged_attention.py).
"""
from __future__ import annotations
import time
from tinyhet.engine.decode_engine import DecodeEngine, decode_rate
from tinyhet.kv.paged_cache import PagedKVCache
from tinyhet.model.llama import Llama
from tinyhet.engine.prefill import prefill_first_token, prefill_suffix_logits
from tinyhet.model.sampling import Sampler

class LocalEngine:
  """One device does everything. kv_tokens sizes the paged pool (the longest prompt + new tokens it will serve)."""
  def __init__(self, model: Llama, kv_tokens: int, block_size: int = 16, kv_dtype: str = "float16", prefix_cache: bool = False,
               model_id: str = ""):
    cfg = model.cfg
    if kv_tokens < 1: raise ValueError(f"kv_tokens must be positive, got {kv_tokens}")
    self.model = model
    self.cache = PagedKVCache(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, -(-kv_tokens // block_size) + 1, block_size, kv_dtype,   # +1: PAD_SEQ's
                              device=model.device, max_seq_len=cfg.max_context, prefix_cache=prefix_cache, model_id=model_id)
    self.engine = DecodeEngine(model, self.cache)
    self.seq_id = 0

  def generate(self, prompt_ids: list[int], max_tokens: int, temperature: float = 0.0, top_p: float = 1.0, seed: int | None = 0,
               stop_ids: tuple[int, ...] = (), on_token=None, progress=None) -> tuple[list[int], dict]:
    """Generated ids (a stop id included) and {"ttft_s", "decode_s", "decode_tokens", "decode_tok_s", "cached_tokens"};
    on_token(id) sees each token as it is sampled. Greedy tokens equal Llama.reference_generate's. With the prefix cache, a
    prompt that starts with a finished one's full blocks prefills only the rest (prefill_suffix_logits)."""
    cfg, cache, bm = self.model.cfg, self.cache, self.cache.block_manager
    if not prompt_ids: raise ValueError("the prompt needs at least one token")
    if len(prompt_ids) + max_tokens > cfg.max_context:
      raise ValueError(f"prompt ({len(prompt_ids)}) + max_tokens ({max_tokens}) exceeds the model's context ({cfg.max_context})")
    if not bm.can_allocate(len(prompt_ids) + max_tokens, list(prompt_ids)):
      raise ValueError(f"prompt ({len(prompt_ids)}) + max_tokens ({max_tokens}) does not fit this engine's KV pool "
                       f"({bm.num_free * bm.block_size} tokens): make the engine with a larger kv_tokens")
    self.seq_id += 1
    seq, T = self.seq_id, len(prompt_ids)
    sampler = Sampler(temperature, top_p, seed)
    t0 = time.perf_counter()
    bm.allocate(seq, T, list(prompt_ids))
    out: list[int] = []
    hit = complete = bm.cached_length(seq)   # tokens whose KV is known stored: a failure caches nothing past them
    try:
      if hit > 0: token = sampler(prefill_suffix_logits(self.model, cache, seq, list(prompt_ids), hit), T)
      else: token, _ = prefill_first_token(self.model, prompt_ids, sampler, cache.kv_dtype, cache.layer_storer(seq), progress,
                                           cache.chunk_storer(seq))   # the prefill's packed blocks copied as they lie
      complete = T
      t1 = time.perf_counter()
      marks = []
      while True:
        out.append(token)
        marks.append(time.perf_counter())
        if on_token is not None: on_token(token)
        if token in stop_ids or len(out) == max_tokens: break
        bm.append_slot(seq)
        token = sampler(self.engine.step([seq], [token])[0])
        complete += 1                          # the step stored its input token's KV
    finally: bm.deallocate(seq, (list(prompt_ids) + out)[:complete])   # its full blocks stay cached, as far as their KV is known stored
    return out, {"ttft_s": t1 - t0, "decode_s": time.perf_counter() - t1, "decode_tokens": len(out) - 1, "decode_tok_s": decode_rate(marks),
                 "cached_tokens": hit}
