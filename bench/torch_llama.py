"""The PyTorch baseline of the benchmarks: Meta's reference Llama forward over tinyhet's weights, written as a user who wants
it fast on a CPU would: weights in bfloat16 (or float32), scaled_dot_product_attention with grouped-query heads (no K, V
copies per query head), a preallocated KV cache written in place, and torch.compile of the decode step where it helps."""
from __future__ import annotations
import dataclasses
import numpy as np

class TorchLlama:
  """Meta's reference Llama forward in PyTorch (llama/model.py, without the parallel layers) in `dtype` (torch.bfloat16 or
  torch.float32), with a preallocated KV cache (batch, kv heads, max_context, head_dim) for `batch` rows. Weights are the
  tinyhet LlamaWeights' (Meta layout: interleaved RoPE pairs). RoPE and the norms' statistics run in float32."""

  def __init__(self, cfg, weights, max_context: int, batch: int = 1, dtype=None):
    import torch
    self.torch, self.cfg, self.dtype = torch, cfg, dtype or torch.bfloat16
    from tinyhet.model.packed import PackedWeight
    def t(x):
      a = np.ascontiguousarray((x.dequantize() if isinstance(x, PackedWeight) else x.float()).numpy())
      return torch.from_numpy(a).to(self.dtype)
    self.emb, self.norm = t(weights.tok_embeddings), t(weights.norm)
    self.out = self.emb if weights.output is weights.tok_embeddings else t(weights.output)
    from tinyhet.model.layers import rope_frequencies
    from tinyhet.model.llama import LayerWeights
    if cfg.qkv_bias or cfg.qk_norm: raise ValueError(f"the torch baseline runs the Llama layout, not {cfg.arch}'s q/k/v biases or q/k norms")
    self.layers = [{f.name: t(getattr(lw, f.name)) for f in dataclasses.fields(LayerWeights) if getattr(lw, f.name) is not None}
                   for lw in weights.layers]
    freqs = torch.from_numpy(rope_frequencies(cfg)).float()
    self.freqs_cis = torch.polar(torch.ones(max_context, len(freqs)), torch.outer(torch.arange(max_context).float(), freqs))
    shape = (batch, cfg.n_kv_heads, max_context, cfg.head_dim)
    self.cache_k = [torch.zeros(shape, dtype=self.dtype) for _ in self.layers]
    self.cache_v = [torch.zeros(shape, dtype=self.dtype) for _ in self.layers]
    self.gqa = bool(cfg.n_heads != cfg.n_kv_heads)     # a plain bool: under dynamic shapes cfg's ints compare to a SymBool SDPA refuses
    self.step = self.forward

  def compile(self) -> None:
    """torch.compile the forward (inductor, dynamic shapes: the context grows every step); the caller keeps it only where
    it measures faster."""
    self.step = self.torch.compile(self.forward, dynamic=True)

  def rms(self, x, w):
    xf = x.float()
    return (xf * self.torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.cfg.norm_eps)).to(self.dtype) * w

  def rope(self, x, fc):
    xc = self.torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return self.torch.view_as_real(xc * fc.view(1, x.shape[1], 1, -1)).flatten(3).to(self.dtype)

  def forward(self, tokens, start_pos: int):
    torch, cfg = self.torch, self.cfg
    F = torch.nn.functional
    B, T = tokens.shape
    x = self.emb[tokens]                                                       # (B, T, dim)
    fc = self.freqs_cis[start_pos:start_pos + T]
    end = start_pos + T
    mask = None
    if T > 1:                                                                   # the prompt's rows see the cache and each other causally
      mask = torch.ones(T, end, dtype=torch.bool).tril(start_pos)
    for l, w in enumerate(self.layers):
      h = self.rms(x, w["attn_norm"])
      q = self.rope(F.linear(h, w["wq"]).view(B, T, cfg.n_heads, cfg.head_dim), fc).transpose(1, 2)        # (B, H, T, D)
      k = self.rope(F.linear(h, w["wk"]).view(B, T, cfg.n_kv_heads, cfg.head_dim), fc).transpose(1, 2)     # (B, KV, T, D)
      v = F.linear(h, w["wv"]).view(B, T, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
      self.cache_k[l][:B, :, start_pos:end] = k
      self.cache_v[l][:B, :, start_pos:end] = v
      att = F.scaled_dot_product_attention(q, self.cache_k[l][:B, :, :end], self.cache_v[l][:B, :, :end], attn_mask=mask,
                                           enable_gqa=self.gqa)                    # (B, H, T, D)
      x = x + F.linear(att.transpose(1, 2).reshape(B, T, -1), w["wo"])
      h = self.rms(x, w["ffn_norm"])
      x = x + F.linear(F.silu(F.linear(h, w["w_gate"])) * F.linear(h, w["w_up"]), w["w_down"])
    return F.linear(self.rms(x[:, -1], self.norm), self.out).float()
