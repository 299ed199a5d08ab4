"""A loaded server's output throughput, in closed form: what a colocated server and a disaggregated pair sustain.

Colocated (one server prefilling and decoding its own requests, as vLLM does): its decode batch grows with the load
until the KV memory is full (roofline.max_batch), the engine's cap (servesim.COLOCATED_SEQS) or the clients
(`concurrency`) stop it; each step reads the weights once for the whole batch, so the step stays bandwidth-bound until
the batch's FLOPs catch up (the step is max(compute, bytes)). Without chunking, every prompt's prefill pass stalls the
running batch: over one turn of the batch, b sequences each cost their prefill pass (batched up to the token budget)
and the batch takes output_len - 1 steps, so

  throughput = b x output_len / (b x prefill_s + (output_len - 1) x step(b))

With chunked prefill (Sarathi, vLLM's chunked prefill), the prompts' tokens ride in the decode steps instead: a step
carries b decode tokens and b x prompt_len / (output_len - 1) prompt tokens, and costs max(FLOPs of both, bytes read
once) (the prompt's FLOPs hide under a bandwidth-bound step), so throughput = b x output_len / ((output_len - 1) x step).

Disaggregated: prefill servers batch prompts to the token budget and never decode; decode servers never prefill, so
their batch grows to what their pool holds; each request's KV cache crosses the link between them. The pair sustains
the least of the three rates. tinyhet/planner/servesim.py simulates the same servers request by request (queues, p90s); the
tests hold the two to each other.
"""
from __future__ import annotations
from tinyhet.planner.catalog import Link, Model
from tinyhet.planner.roofline import (Node, at_efficiency, comm_time, decode_context, decode_step_parts, decode_step_time, max_batch,
                                      prefill_batch_time, prefill_flops)
from tinyhet.planner.servesim import COLOCATED_SEQS, PREFILL_TOKEN_BUDGET

def colocated_batch(node: Node, model: Model, prompt_len: int, output_len: int, concurrency: int | None = None) -> int:
  """The decode batch a loaded colocated server runs: memory, the engine's cap, or the clients, whichever is least."""
  b = min(max_batch(node, model, prompt_len + output_len), COLOCATED_SEQS)
  return max(1, min(b, concurrency) if concurrency else b)

def colocated_throughput(node: Node, model: Model, prompt_len: int, output_len: int, concurrency: int | None = None,
                         rate: float | None = None, chunked: bool = False, prompts_per_pass: int | None = None) -> float:
  """Output tokens/s of one replica of `node` serving whole requests under load (module docstring); at a `rate` of
  requests/s below what it sustains, the rate's tokens. Without chunking a prefill pass takes `prompts_per_pass` prompts
  (default: as many as the batch turns over, up to the token budget: the most; 1: the least, prompts arriving apart)."""
  b, context = colocated_batch(node, model, prompt_len, output_len, concurrency), decode_context(prompt_len, output_len)
  steps = max(output_len - 1, 1)
  if chunked:
    prompt_tokens = b * prompt_len / steps  # prompt tokens per step, so that prompts enter as fast as sequences leave
    compute, memory, _ = decode_step_parts(node, model, b, context)
    compute += prompt_tokens * prefill_flops(model, prompt_len) / prompt_len / node.flops(model.dtype)
    memory += (model.weights_touched(b + prompt_tokens) - model.weights_touched(b) + prompt_tokens * model.kv_bytes_per_token) / node.bandwidth
    step = at_efficiency(node, (compute, memory, comm_time(node, model, b + prompt_tokens)))
    cap = b * output_len / (steps * step)
  else:
    k = prompts_per_pass or max(1, min(b, PREFILL_TOKEN_BUDGET // prompt_len))
    cap = b * output_len / (b * prefill_batch_time(node, model, k, prompt_len) / k + (output_len - 1) * decode_step_time(node, model, b, context))
  return min(cap, rate * output_len) if rate else cap

def prefill_rate(node: Node, model: Model, prompt_len: int) -> float:
  """Requests/s one prefill-only replica sustains: prompts batched up to the token budget."""
  k = max(1, PREFILL_TOKEN_BUDGET // prompt_len)
  return k / prefill_batch_time(node, model, k, prompt_len)

def decode_rate(node: Node, model: Model, prompt_len: int, output_len: int) -> float:
  """Requests/s one decode-only replica sustains: its batch as large as its pool holds, no prefill stalling it."""
  b = max(1, max_batch(node, model, prompt_len + output_len))
  return b / (max(output_len - 1, 1) * decode_step_time(node, model, b, decode_context(prompt_len, output_len)))

def disaggregated_throughput(prefill: list[Node], decode: list[Node], model: Model, prompt_len: int, output_len: int, link: Link) -> float:
  """Output tokens/s of prefill replicas feeding decode replicas over `link` (each prefill replica's NIC sends its share
  of the KV caches): the least of what prefill, decode and the links sustain."""
  p = sum(prefill_rate(n, model, prompt_len) for n in prefill)
  d = sum(decode_rate(n, model, prompt_len, output_len) for n in decode)
  kv = len(prefill) * link.bandwidth / (prompt_len * model.kv_bytes_per_token)
  return output_len * min(p, d, kv)
