"""The PyTorch float32 baseline of the benchmarks: Meta's reference Llama forward over tinyhet's weights."""
from __future__ import annotations
import dataclasses, math
import numpy as np

class TorchLlama:
  """Meta's reference Llama forward in PyTorch, float32, with a preallocated KV cache for `batch` rows (llama/model.py,
  without the parallel layers). Weights are the tinyhet LlamaWeights' (Meta layout: interleaved RoPE pairs)."""

  def __init__(self, cfg, weights, max_context: int, batch: int = 1):
    import torch
    self.torch, self.cfg = torch, cfg
    from tinyhet.model.packed import PackedWeight
    t = lambda x: torch.from_numpy(np.ascontiguousarray((x.dequantize() if isinstance(x, PackedWeight) else x.float()).numpy()))
    self.emb, self.norm, self.out = t(weights.tok_embeddings), t(weights.norm), None
    self.out = self.emb if weights.output is weights.tok_embeddings else t(weights.output)
    from tinyhet.model.layers import rope_frequencies
    from tinyhet.model.llama import LayerWeights
    self.layers = [{f.name: t(getattr(lw, f.name)) for f in dataclasses.fields(LayerWeights)} for lw in weights.layers]
    freqs = torch.from_numpy(rope_frequencies(cfg)).float()
    self.freqs_cis = torch.polar(torch.ones(max_context, len(freqs)), torch.outer(torch.arange(max_context).float(), freqs))
    shape = (batch, max_context, cfg.n_kv_heads, cfg.head_dim)
    self.cache_k = [torch.zeros(shape) for _ in self.layers]
    self.cache_v = [torch.zeros(shape) for _ in self.layers]

  def rms(self, x, w): return x * self.torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg.norm_eps) * w

  def rope(self, x, fc):
    xc = self.torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return self.torch.view_as_real(xc * fc.view(1, x.shape[1], 1, -1)).flatten(3)

  def forward(self, tokens, start_pos: int):
    torch, cfg = self.torch, self.cfg
    F = torch.nn.functional
    B, T = tokens.shape
    x = self.emb[tokens]
    fc = self.freqs_cis[start_pos:start_pos + T]
    mask = torch.full((T, T), float("-inf")).triu(1) if T > 1 else None
    G = cfg.n_heads // cfg.n_kv_heads
    for l, w in enumerate(self.layers):
      h = self.rms(x, w["attn_norm"])
      q = self.rope(F.linear(h, w["wq"]).view(B, T, cfg.n_heads, cfg.head_dim), fc)
      k = self.rope(F.linear(h, w["wk"]).view(B, T, cfg.n_kv_heads, cfg.head_dim), fc)
      self.cache_k[l][:B, start_pos:start_pos + T] = k
      self.cache_v[l][:B, start_pos:start_pos + T] = F.linear(h, w["wv"]).view(B, T, cfg.n_kv_heads, cfg.head_dim)
      keys = self.cache_k[l][:B, :start_pos + T].repeat_interleave(G, dim=2).transpose(1, 2)
      values = self.cache_v[l][:B, :start_pos + T].repeat_interleave(G, dim=2).transpose(1, 2)
      scores = q.transpose(1, 2) @ keys.transpose(2, 3) / math.sqrt(cfg.head_dim)
      if mask is not None: scores = scores + torch.cat([torch.zeros(T, start_pos), mask], dim=1)
      att = (scores.softmax(-1) @ values).transpose(1, 2).reshape(B, T, -1)
      x = x + F.linear(att, w["wo"])
      h = self.rms(x, w["ffn_norm"])
      x = x + F.linear(F.silu(F.linear(h, w["w_gate"])) * F.linear(h, w["w_up"]), w["w_down"])
    return F.linear(self.rms(x[:, -1], self.norm), self.out)
