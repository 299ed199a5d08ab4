"""Roofline costs of one node serving one model: prefill, a decode step, the KV transfer between nodes, memory limits.

A node is a server of `count` identical accelerators: its FLOP/s, bandwidth and memory are `count` times one accelerator's.
Tensor-parallel (the default) adds two all-reduces per layer over the intra-node link; pipeline-parallel (layers split
into `count` stages, for accelerators without a fast link) sends the activations across each stage boundary once, and
its decode steps read the weights once per micro-batch in flight. Each phase takes max(FLOPs / (peak FLOP/s x compute
efficiency), bytes / (peak bandwidth x bandwidth efficiency)) + communication time. Efficiencies are per resource, not per
phase: 1 for spec-sheet peaks; tinyhet/planner/calibration.py fits them to measured figures, so a device slow only in compute
is not made slow at bandwidth-bound decode too.
Every function here is plain arithmetic, no device is touched.
"""
from __future__ import annotations
import math
from dataclasses import dataclass
from tinyhet.planner.catalog import ACTIVATION_BYTES, Device, Link, Model

@dataclass(frozen=True)
class Node:
  """A server of `count` identical accelerators serving one copy of the model (tensor- or pipeline-parallel); `replicas`
  identical such servers. `compute_eff`/`bandwidth_eff` scale the spec-sheet FLOP/s and bytes/s to measured ones (1.0 =
uncalibrated); they apply to whichever phase is bound by that resource."""
  name: str
  device: Device
  count: int = 1
  replicas: int = 1
  intra_link: Link | None = None
  parallel: str = "tensor"         # "tensor" | "pipeline" across the node's accelerators
  memory_usable: float = 0.9       # share of memory for weights + KV (the rest: activations, runtime, OS)
  compute_eff: float = 1.0
  bandwidth_eff: float = 1.0
  calibration: str = ""            # where the efficiencies come from, for the plan's reasons

  @property
  def memory(self) -> float: return self.count * self.device.memory * self.memory_usable
  @property
  def bandwidth(self) -> float: return self.count * self.device.bandwidth
  def flops(self, dtype: str) -> float: return self.count * self.device.flops_for(dtype)
  def unit_names(self) -> list[str]: return [self.name] if self.replicas == 1 else [f"{self.name}.{i}" for i in range(self.replicas)]

def allreduce_time(n: int, nbytes: float, link: Link | None) -> float:
  """All-reduce of `nbytes` over `n` accelerators: 2(n-1)/n of the data crosses each accelerator's link (reduce-scatter +
  all-gather); two hops of latency, as a two-shot all-reduce over a switch or full mesh (a ring would pay 2(n-1))."""
  if n <= 1: return 0.0
  if link is None: raise ValueError(f"a node of {n} accelerators needs an intra-node link")
  return 2 * (n - 1) / n * nbytes / link.bandwidth + 2 * link.latency

def all_to_all_time(n: int, tokens: float, model: Model, link: Link) -> float:
  """One MoE layer's expert-parallel exchange over `n` accelerators: each holds tokens/n of the tokens and experts/n of
  the experts; every token's activation goes to its k experts and back (dispatch, combine), (n-1)/n of the copies to
  another accelerator, each over its own link. Even routing (no hot expert), two hops of latency."""
  per_accelerator = tokens / n * model.experts_active * (n - 1) / n * model.hidden * ACTIVATION_BYTES
  return 2 * (per_accelerator / link.bandwidth + link.latency)

def comm_time(node: Node, model: Model, tokens: float) -> float:
  """Inside a node, per pass over `tokens` tokens. Tensor-parallel: two all-reduces of the activations (tokens x hidden)
  per layer (after attention, after the MLP); an MoE layer's experts are spread over the accelerators instead (expert
  parallelism), so its MLP all-reduce is an all-to-all (all_to_all_time). Pipeline: the activations cross the count-1
  stage boundaries once."""
  if node.count <= 1: return 0.0
  if node.intra_link is None: raise ValueError(f"node {node.name} of {node.count} accelerators needs an intra-node link")
  nbytes = tokens * model.hidden * ACTIVATION_BYTES
  if node.parallel == "pipeline": return (node.count - 1) * (nbytes / node.intra_link.bandwidth + node.intra_link.latency)
  moe = model.moe_layers
  link = node.intra_link
  return (2 * model.layers - moe) * allreduce_time(node.count, nbytes, link) + moe * all_to_all_time(node.count, tokens, model, link)

# --- prefill: every prompt token at once -------------------------------------------------------------------------------

def prefill_flops(model: Model, tokens: int) -> float:
  """2 FLOPs per active parameter per token, plus causal attention: token i attends to i tokens, 2·i·attn_dim FLOPs
  per layer (QK^T and AV), summed over i = 1..T -> attn_dim·T·(T+1) per layer: the quadratic term."""
  return 2 * model.active_params * tokens + model.layers * model.attn_dim * tokens * (tokens + 1)

def prefill_bytes(model: Model, tokens: int) -> float:
  """The weights are read once for the whole prompt (MoE: the experts its tokens touch); the KV cache is written once."""
  return model.weights_touched(tokens) + tokens * model.kv_bytes_per_token

def prefill_parts(node: Node, model: Model, tokens: int) -> tuple[float, float, float]:
  """(compute s, memory s, communication s) of one prompt's prefill at spec-sheet rates."""
  # Pipeline stages stay busy on chunks of the prompt, so the whole node's rates apply.
  return prefill_flops(model, tokens) / node.flops(model.dtype), prefill_bytes(model, tokens) / node.bandwidth, comm_time(node, model, tokens)

def at_efficiency(node: Node, parts: tuple[float, float, float]) -> float:
  """Seconds of a pass from its (compute s, memory s, communication s) at spec-sheet rates, at the node's efficiencies."""
  compute, memory, comm = parts
  return max(compute / node.compute_eff, memory / node.bandwidth_eff) + comm

def prefill_time(node: Node, model: Model, tokens: int) -> float:
  return at_efficiency(node, prefill_parts(node, model, tokens))

def prefill_batch_time(node: Node, model: Model, prompts: int, tokens: int) -> float:
  """Seconds to prefill `prompts` prompts of `tokens` tokens in one pass: FLOPs add up, the weights are read once."""
  compute, memory, _ = prefill_parts(node, model, tokens)
  weights = model.weights_touched(prompts * tokens) / node.bandwidth
  return at_efficiency(node, (prompts * compute, weights + prompts * (memory - model.weights_touched(tokens) / node.bandwidth),
                              comm_time(node, model, prompts * tokens)))

# --- decode: one token per sequence per step ---------------------------------------------------------------------------

def decode_step_parts(node: Node, model: Model, batch: float, context: float) -> tuple[float, float, float]:
  """(compute s, memory s, communication s) of one decode step for `batch` sequences of `context` tokens each: the weights
  (MoE: the experts the batch touches) and every sequence's whole KV cache are read once per step. A pipeline splits the
  batch into up to `count` micro-batches, each reading every stage's weights: count x the time of one micro-batch."""
  stages = node.count if node.parallel == "pipeline" else 1
  per = batch / min(stages, batch)  # sequences per micro-batch
  flops = per * (2 * model.active_params + 2 * context * model.attn_dim * model.layers)
  nbytes = model.weights_touched(per) + per * context * model.kv_bytes_per_token
  return stages * flops / node.flops(model.dtype), stages * nbytes / node.bandwidth, comm_time(node, model, batch)

def decode_step_time(node: Node, model: Model, batch: float, context: float) -> float:
  return at_efficiency(node, decode_step_parts(node, model, max(batch, 1.0), context))

def decode_context(prompt_len: int, output_len: int) -> float:
  """Mean context over a request's decode steps (the KV grows from prompt_len to prompt_len + output_len)."""
  return prompt_len + output_len / 2

def decode_time(node: Node, model: Model, prompt_len: int, output_len: int, batch: float = 1) -> float:
  """Seconds to generate `output_len` tokens after a `prompt_len` prompt, `batch` sequences alike."""
  return output_len * decode_step_time(node, model, batch, decode_context(prompt_len, output_len))

# --- KV transfer between nodes -----------------------------------------------------------------------------------------

def kv_transfer_exposed(model: Model, tokens: int, prefill_s: float, link: Link, overlap: bool = True) -> float:
  """Seconds the KV transfer adds after prefill ends. Streamed layer by layer, layer l's K,V go over the link while layer
  l+1.. computes: with x seconds of transfer and p of prefill per layer, the last layer's transfer shows (x), plus
  whatever the link falls behind over the other layers ((L-1)·max(0, x-p)). Sent after prefill, all L·x shows."""
  x = tokens * model.kv_bytes_per_token / model.layers / link.bandwidth
  if not overlap: return link.latency + model.layers * x
  p = prefill_s / model.layers
  return link.latency + x + (model.layers - 1) * max(0.0, x - p)

# --- memory ------------------------------------------------------------------------------------------------------------

def free_for_kv(node: Node, model: Model) -> float:
  """Bytes left for KV once the weights are in (negative: the weights do not fit)."""
  return node.memory - model.weight_bytes

def max_batch(node: Node, model: Model, context: int) -> int:
  """How many sequences of `context` tokens fit next to the weights."""
  free = free_for_kv(node, model)
  return max(0, math.floor(free / (max(context, 1) * model.kv_bytes_per_token))) if free > 0 else 0

def max_context(node: Node, model: Model) -> int:
  """The longest single sequence the node holds."""
  return max(0, math.floor(free_for_kv(node, model) / model.kv_bytes_per_token))

def cannot_hold(node: Node, model: Model, context: int) -> str | None:
  """Why `node` cannot hold the model with one sequence of `context` tokens, or None when it can."""
  usable = f"{node.memory / 1e9:,.0f} GB usable ({node.count}x {node.device.memory / 1e9:,.0f} GB x {node.memory_usable:g})"
  if free_for_kv(node, model) <= 0:
    return f"{node.name} cannot hold {model.name}: {model.weight_bytes / 1e9:,.0f} GB of weights ({model.dtype}) > {usable}"
  if max_batch(node, model, context) < 1:
    return (f"{node.name} cannot hold {model.name} with a {context}-token sequence: weights {model.weight_bytes / 1e9:,.0f} GB + "
            f"KV {context * model.kv_bytes_per_token / 1e9:,.1f} GB > {usable}; it holds at most {max_context(node, model)} tokens")
  return None

# --- which resource bounds a pass --------------------------------------------------------------------------------------

def binding(node: Node, parts: tuple[float, float, float]) -> str:
  """The resource that bounds a pass at the node's present efficiencies: "compute" or "bandwidth"."""
  compute, memory, _ = parts
  return "compute" if compute / node.compute_eff >= memory / node.bandwidth_eff else "bandwidth"
