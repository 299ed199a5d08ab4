"""The planner: where prefill and decode run. `tinyhet plan --cluster FILE --model NAME`, and the router's Python API:

  cluster = load_cluster("examples/clusters/spark_m3ultra.toml")
  p = predict(cluster, "llama-3-8b", prompt_len=8192, output_len=32)   # every configuration + the plan and its reasons
  d = route(cluster, "llama-3-8b", prompt_len=300, output_len=64)      # disaggregate this one request or not
  s = pd_split(cluster, "llama-3-8b", 1024, 128, rate=4, slo=(1.0, 0.05)) # under load: {"prefill": [...], "decode": [...], "both", "ratio"}

Without a load (`tinyhet plan` with no --rate/--concurrency/--max-throughput), each configuration is predicted for one
request at a time (below). With one, tinyhet/planner/serving.py simulates each configuration under that load (tinyhet/planner/servesim.py).

Configurations: each node alone (its replicas round-robin), naive load balancing (round-robin over every node that holds
the model, each serving whole requests), and disaggregated prefill/decode with the best assignment of nodes to prefill,
decode or neither (a node with replicas may split between both). Each is predicted at a request rate (requests/s;
None: one request at a time): TTFT, time per output token, and the most output tokens/s it sustains. The plan is the
configuration with the lowest end-to-end time (TTFT + output_len x TPOT) among those that sustain the rate.
(How each configuration is predicted, queueing included: tinyhet/planner/configurations.py; the costs: tinyhet/planner/roofline.py.)
"""
from __future__ import annotations
from dataclasses import dataclass
from tinyhet.planner.calibration import reasons as calibration_reasons
from tinyhet.planner.catalog import DEVICES, MODELS, Model, PlanError
from tinyhet.planner.cluster_file import Cluster
from tinyhet.planner.servesim import SLO
from tinyhet.planner.serving import pd_split, plan_serving
from tinyhet.planner.configurations import Configuration, Work, alone, assignments, balanced, best, disaggregated, work

__all__ = ["SLO", "Plan", "Prediction", "RouteDecision", "pd_split", "plan_serving", "predict", "route"]  # pd_split: the router's P:D split

from tinyhet.planner.roofline import (Node, binding, cannot_hold, decode_context, decode_step_parts, decode_step_time, kv_transfer_exposed,
                                      prefill_parts, prefill_time)

@dataclass(frozen=True)
class Plan:
  """The chosen configuration and why."""
  name: str
  reasons: tuple[str, ...]
  configuration: Configuration

@dataclass(frozen=True)
class Prediction:
  """Every configuration predicted for one workload, and the plan."""
  model: Model
  prompt_len: int
  output_len: int
  rate: float | None
  configurations: tuple[Configuration, ...]
  plan: Plan

  def to_json(self) -> dict:
    return {"configurations": [c.to_json() for c in self.configurations], "plan": {"name": self.plan.name, "reasons": list(self.plan.reasons)}}

@dataclass(frozen=True)
class RouteDecision:
  """For one request: prefill on `prefill_node` and stream the KV to `decode_node` (disaggregate), or prefill on
  `decode_node` itself; with the predicted end-to-end seconds of both choices (None where a choice is impossible)."""
  disaggregate: bool
  prefill_node: str
  decode_node: str
  disaggregated_s: float | None
  local_s: float | None
  disaggregated_ttft_s: float | None
  local_ttft_s: float | None
  reason: str

def _check_lengths(prompt_len: int, output_len: int):
  if prompt_len < 1 or output_len < 1: raise PlanError(f"prompt_len and output_len must be at least 1 (got {prompt_len}, {output_len})")

def predict(cluster: Cluster, model: str | Model, prompt_len: int, output_len: int, rate: float | None = None, overlap: bool = True) -> Prediction:
  """Predict every configuration for prompts of `prompt_len` tokens generating `output_len` tokens at `rate` requests/s
  (None: one request at a time), choose the plan and say why. `overlap=False` predicts the KV sent after prefill."""
  model = cluster.model(model) if isinstance(model, str) else model
  _check_lengths(prompt_len, output_len)
  if rate is not None and not rate >= 0: raise PlanError(f"rate must be >= 0 requests/s (got {rate})")
  lam = rate or 0.0
  works = {n.name: work(n, model, prompt_len, output_len) for n in cluster.nodes}
  configs = [alone(w, lam, output_len) for w in works.values()]
  if (b := balanced(list(works.values()), lam, output_len)): configs.append(b)
  tried = [disaggregated(cluster, model, prompt_len, output_len, lam, works, a, overlap) for a in assignments(cluster, works)]
  if (d := best(tried)): configs.append(d)
  chosen = best(configs)
  if chosen is None:
    raise PlanError(f"no node of {cluster.source} can run {model.name} with {prompt_len + output_len} tokens: "
                    + "; ".join(w.holds_request for w in works.values()))
  reasons = explain(cluster, model, prompt_len, output_len, rate, works, configs, chosen, overlap)
  return Prediction(model, prompt_len, output_len, rate, tuple(configs), Plan(chosen.name, tuple(reasons), chosen))

# --- reasons -----------------------------------------------------------------------------------------------------------

def _g(x: float) -> str:
  """3 significant digits, without an exponent for large numbers."""
  return f"{x:.3g}" if abs(x) < 1000 else f"{x:,.0f}"

def _s(x: float) -> str:
  """Seconds, or milliseconds below 0.1 s."""
  return f"{x:.3g} s" if x >= 0.1 else f"{x * 1e3:.3g} ms"

def _seqs(n: int) -> str: return f"{n:,} sequence" + ("" if n == 1 else "s")

def _bound(node: Node, model: Model, parts: tuple[float, float, float]) -> str:
  if binding(node, parts) == "compute": return f"compute-bound at {_g(node.flops(model.dtype) * node.compute_eff / 1e12)} TFLOP/s"
  return f"memory-bound at {_g(node.bandwidth * node.bandwidth_eff / 1e9)} GB/s"

def _prefill_note(node: Node, model: Model, tokens: int) -> str:
  return f"{_s(prefill_time(node, model, tokens))} ({_bound(node, model, prefill_parts(node, model, tokens))})"

def _decode_note(node: Node, model: Model, prompt_len: int, output_len: int) -> str:
  parts = decode_step_parts(node, model, 1, decode_context(prompt_len, output_len))
  step = decode_step_time(node, model, 1, decode_context(prompt_len, output_len))
  return f"{step * 1e3:.3g} ms per token ({_bound(node, model, parts)})"

def disaggregation_threshold(cluster: Cluster, model: Model, prefill: str, decode: str, limit: int = 1 << 24, overlap: bool = True) -> int | None:
  """The shortest prompt from which prefilling on `prefill` and streaming the KV to `decode` gives a first token sooner
  than prefilling on `decode` itself; shorter prompts stay local. 1: always disaggregate; None: never, up to `limit`."""
  p, d, link = cluster.node(prefill), cluster.node(decode), cluster.link(prefill, decode)
  def pays(t: int) -> bool:
    if cannot_hold(d, model, t): return True
    return prefill_time(p, model, t) + kv_transfer_exposed(model, t, prefill_time(p, model, t), link, overlap) < prefill_time(d, model, t)
  if pays(1): return 1
  t = 2
  while t <= limit and not pays(t): t *= 2
  if t > limit: return None
  lo, hi = t // 2, t
  while hi - lo > 1:
    mid = (lo + hi) // 2
    lo, hi = (lo, mid) if pays(mid) else (mid, hi)
  return hi

def _main_group(c: Configuration, role: int, cluster: Cluster, model: Model, prompt_len: int) -> Node:
  """The node doing most of a role (1: prefill, 2: decode) in a configuration."""
  names = [g[0] for g in c.groups if g[role]]
  if role == 1: return min((cluster.node(n) for n in names), key=lambda n: prefill_time(n, model, prompt_len))
  return max((cluster.node(n) for n in names), key=lambda n: n.replicas * n.bandwidth * n.bandwidth_eff)

def explain(cluster: Cluster, model: Model, prompt_len: int, output_len: int, rate: float | None, works: dict[str, Work],
            configs: list[Configuration], chosen: Configuration, overlap: bool = True) -> list[str]:
  """The plan's reasons, most important first."""
  reasons, lam = [], rate or 0.0
  others = [c for c in configs if c is not chosen and c.e2e_s is not None]
  workload = f"a prompt of {prompt_len} tokens and {output_len} output tokens" + (f" at {rate:g} requests/s" if rate else ", one request at a time")
  if chosen.e2e_s is None:
    reasons.append(f"no configuration sustains {rate:g} requests/s; {chosen.name} sustains the most ({_g(chosen.throughput_tok_s)} output tokens/s)")
  else:
    head = f"{chosen.name}: {_s(chosen.e2e_s)} end to end for {workload} (TTFT {_s(chosen.ttft_s)}, {chosen.tpot_s * 1e3:.3g} ms per token)"
    singles = [c for c in others if c.kind == "alone"]
    if chosen.kind != "alone" and singles:
      s = min(singles, key=lambda c: c.e2e_s)
      head += (f", {s.e2e_s / chosen.e2e_s:.2f}x faster than the best single node ({s.name}, {_s(s.e2e_s)})" if s.e2e_s > chosen.e2e_s * 1.01 else
               f", as fast as {s.name} and sustains more ({_g(chosen.throughput_tok_s)} against {_g(s.throughput_tok_s)} output tokens/s)")
    elif others:
      s = min(others, key=lambda c: c.e2e_s)
      head += f"; next: {s.name}, {_s(s.e2e_s)}" + (f" (sustains {_g(s.throughput_tok_s)} output tokens/s)" if s.e2e_s <= chosen.e2e_s * 1.01 else "")
    reasons.append(head)
  if chosen.kind == "disaggregated":
    p, d = _main_group(chosen, 1, cluster, model, prompt_len), _main_group(chosen, 2, cluster, model, prompt_len)
    local = f"{d.name} would take {_prefill_note(d, model, prompt_len)}" if not works[d.name].holds_prompt else f"{d.name} cannot hold the prompt"
    reasons.append(f"prefill on {p.name}: {_prefill_note(p, model, prompt_len)}; " + (local if d is not p else "the other replicas decode"))
    other = f"; {p.name} would take {_decode_note(p, model, prompt_len, output_len)}" if d is not p and not works[p.name].holds_request else ""
    reasons.append(f"decode on {d.name}: {_decode_note(d, model, prompt_len, output_len)}{other}")
    link, t_p = cluster.link(p.name, d.name), prefill_time(p, model, prompt_len)
    streamed, after = kv_transfer_exposed(model, prompt_len, t_p, link, True), kv_transfer_exposed(model, prompt_len, t_p, link, False)
    hidden = 1 - (streamed - link.latency) / max(after - link.latency, 1e-12)
    kv = f"KV cache: {prompt_len * model.kv_bytes_per_token / 1e9:.3g} GB over the {p.name}-{d.name} link ({_g(link.bandwidth * 8 / 1e9)} Gbit/s)"
    if overlap: reasons.append(f"{kv} streamed layer by layer during prefill: {_s(streamed)} of {_s(after)} shows in TTFT ({hidden:.0%} hidden); "
                               f"sent after prefill it would add {_s(after)}")
    else: reasons.append(f"{kv} sent after prefill: adds {_s(after)} (streamed layer by layer: {_s(streamed)})")
    reasons.append(f"{d.name} holds {_seqs(works[d.name].batch_limit)} of {prompt_len + output_len} tokens next to the weights "
                   f"({_g((d.memory - model.weight_bytes) / 1e9)} GB for KV)")
    if d is not p:
      t = disaggregation_threshold(cluster, model, p.name, d.name, overlap=overlap)
      reasons.append("per request: " + ("disaggregation pays for every prompt length, down to 1 token" if t == 1 else
                     f"prompts under {t:,} tokens get their first token sooner prefilled on {d.name}, where they are decoded "
                     "(the router keeps them local)" if t else f"{d.name} prefills every prompt sooner itself; disaggregating pays only in decode"))
  else:
    for name in dict.fromkeys(g[0] for g in chosen.groups):
      n, w = cluster.node(name), works[name]
      reasons.append(f"{name}: prefill {_prefill_note(n, model, prompt_len)}, decode {_decode_note(n, model, prompt_len, output_len)}; "
                     f"holds {_seqs(w.batch_limit)} of {prompt_len + output_len} tokens")
    dis = [c for c in others if c.kind == "disaggregated"]
    if dis:
      c = dis[0]
      p, d = _main_group(c, 1, cluster, model, prompt_len), _main_group(c, 2, cluster, model, prompt_len)
      reasons.append(f"disaggregated ({c.name}) would take {_s(c.e2e_s)}: TTFT {_s(c.ttft_s)} with {p.name} prefilling in "
                     f"{_prefill_note(p, model, prompt_len)}, and {d.name} decoding at {_decode_note(d, model, prompt_len, output_len)}")
  for w in works.values():
    if w.holds_request: reasons.append(w.holds_request + (" (it can prefill the prompt)" if not w.holds_prompt else ""))
  most = max((c for c in configs if c.throughput_tok_s), key=lambda c: c.throughput_tok_s)
  if chosen.throughput_tok_s:
    cap = chosen.throughput_tok_s / output_len
    if rate:
      reasons.append(f"{chosen.name} sustains up to {cap:.3g} requests/s ({_g(chosen.throughput_tok_s)} output tokens/s): "
                     f"{lam / cap:.0%} busy at {rate:g}")
    if most is chosen and not rate: reasons.append(f"it also sustains the most: {_g(chosen.throughput_tok_s)} output tokens/s")
    if most is not chosen:
      reasons.append(f"under load {most.name} sustains the most: {_g(most.throughput_tok_s)} output tokens/s against {_g(chosen.throughput_tok_s)}"
                     + ("" if rate else " (give --rate to plan for a load)"))
  if rate: reasons += [n for c in configs if c is not chosen for n in c.notes if "cannot sustain" in n]
  reasons += calibration_reasons(cluster)
  return reasons

# --- per-request policy ------------------------------------------------------------------------------------------------

def route(cluster: Cluster, model: str | Model, prompt_len: int, output_len: int, plan: Plan | None = None, prefill_queue_s: float = 0.0,
          overlap: bool = True) -> RouteDecision:
  """Decide for one request whether to disaggregate: prefill on one of the plan's prefill nodes and stream the KV to a
  decode node, or prefill on the decode node itself; whichever the predicted end-to-end time is lower for.
  `plan` defaults to the plan for this request's lengths; `prefill_queue_s` is how long the prefill nodes are busy now."""
  model = cluster.model(model) if isinstance(model, str) else model
  _check_lengths(prompt_len, output_len)
  plan = plan or predict(cluster, model, prompt_len, output_len).plan
  c = plan.configuration
  prefill_nodes = [cluster.node(g) for g, p, _ in c.groups if p]
  options = []  # (e2e, ttft, disaggregate, prefill node, decode node)
  for d in (cluster.node(g) for g, _, k in c.groups if k):
    if cannot_hold(d, model, prompt_len + output_len): continue
    decode_s = output_len * decode_step_time(d, model, 1, decode_context(prompt_len, output_len))
    local = prefill_time(d, model, prompt_len)
    options.append((local + decode_s, local, False, d.name, d.name))
    if c.kind != "disaggregated": continue
    for p in prefill_nodes:
      if (p is d and p.replicas == 1) or cannot_hold(p, model, prompt_len): continue
      t_p = prefill_time(p, model, prompt_len)
      ttft = prefill_queue_s + t_p + kv_transfer_exposed(model, prompt_len, t_p, cluster.link(p.name, d.name), overlap)
      options.append((ttft + decode_s, ttft, True, p.name, d.name))
  if not options: raise PlanError(f"no decode node of the plan ({plan.name}) holds {model.name} with {prompt_len + output_len} tokens")
  chosen = min(options)
  same_d = [o for o in options if o[4] == chosen[4]]
  dis = min((o for o in same_d if o[2]), default=None)
  loc = next((o for o in same_d if not o[2]), None)
  if chosen[2]:
    reason = f"prefill on {chosen[3]} and stream to {chosen[4]}: {dis[0]:.3g} s end to end against {loc[0]:.3g} s prefilling on {chosen[4]}"
  elif dis:
    reason = (f"a prompt of {prompt_len} tokens is done sooner prefilled on {chosen[4]}, where it is decoded: {loc[0]:.3g} s against "
              f"{dis[0]:.3g} s disaggregated")
  else:
    reason = f"the plan ({plan.name}) does not disaggregate"
  return RouteDecision(chosen[2], chosen[3], chosen[4], dis[0] if dis else None, loc[0], dis[1] if dis else None, loc[1], reason)

# --- tinyhet plan ------------------------------------------------------------------------------------------------------

def table(pred: Prediction) -> str:
  """The configurations as an aligned table, then the plan and its reasons."""
  m = pred.model
  load = f"{pred.rate:g} requests/s" if pred.rate else "one request at a time"
  lines = [f"{m.name} ({m.dtype}, {m.weight_bytes / 1e9:,.4g} GB of weights, {m.kv_bytes_per_token / 1e6:.3g} MB of KV per token), "
           f"{pred.prompt_len}-token prompts, {pred.output_len} output tokens, {load}", ""]
  fmt = lambda x, scale=1.0: "-" if x is None else _g(x * scale)
  rows = [("configuration", "TTFT s", "ms/token", "end-to-end s", "tokens/s max")]
  rows += [(c.name, fmt(c.ttft_s), fmt(c.tpot_s, 1e3), fmt(c.e2e_s), fmt(c.throughput_tok_s)) for c in pred.configurations]
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  for i, r in enumerate(rows):
    lines.append("  ".join([r[0].ljust(widths[0])] + [v.rjust(w) for v, w in zip(r[1:], widths[1:])]).rstrip())
    if i == 0: lines.append("  ".join("-" * w for w in widths))
  lines += ["", f"plan: {pred.plan.name}"] + [f"  - {r}" for r in pred.plan.reasons]
  return "\n".join(lines) + "\n"

def catalog_text() -> str:
  lines = ["devices (dense TFLOP/s per dtype, memory bandwidth, memory):"]
  for d in DEVICES.values():
    rates = ", ".join(f"{k} {v / 1e12:,.0f}" for k, v in d.flops.items())
    lines.append(f"  {d.name:<14}{rates:<34}{d.bandwidth / 1e9:>8,.0f} GB/s{d.memory / 1e9:>7,.0f} GB   {d.source}")
  lines.append("models:")
  for m in MODELS.values():
    moe = f", {m.active_params / 1e9:.3g} B active" if m.active_params != m.params else ""
    kv = m.kv_bytes_per_token / 1e3
    lines.append(f"  {m.name:<16}{m.params / 1e9:>7.4g} B params{moe}, {m.layers} layers, {m.dtype}, KV {kv:,.0f} kB per token   {m.source}")
  return "\n".join(lines) + "\n"

def disaggregation_pays(cluster: Cluster, model: Model, prefill: str, decode: str, prompt_len: int, prefill_queue_s: float = 0.0,
                        local_queue_s: float = 0.0) -> bool:
  """True when a prompt of prompt_len tokens gets its first token sooner prefilled on node `prefill` (after its queue) with
  the KV streamed layer by layer to `decode`, than prefilled on `decode` itself (after its own queue). The decode that
  follows is the same either way."""
  p, d = cluster.node(prefill), cluster.node(decode)
  if cannot_hold(p, model, prompt_len): return False
  if cannot_hold(d, model, prompt_len): return True
  t_p = prefill_time(p, model, prompt_len)
  remote = prefill_queue_s + t_p + kv_transfer_exposed(model, prompt_len, t_p, cluster.link(prefill, decode))
  return remote < local_queue_s + prefill_time(d, model, prompt_len)

def cached_disaggregation_pays(cluster: Cluster, model: Model, prefill: str, decode: str, prompt_len: int, cached: int,
                               prefill_queue_s: float = 0.0, local_queue_s: float = 0.0) -> bool:
  """disaggregation_pays for a prompt whose first `cached` tokens the decode node holds in its prefix cache. There it
  prefills only the suffix; the prefill node gets the prefix by pulling its KV over the link (counted whole, not hidden
  under the suffix's compute: an upper bound) or by computing it again, whichever is cheaper, then computes the suffix
  and streams the suffix's KV. A suffix's prefill is priced as a prompt of its length (its attention over the prefix is
  left out, on both sides)."""
  p, d = cluster.node(prefill), cluster.node(decode)
  if cannot_hold(p, model, prompt_len): return False
  if cannot_hold(d, model, prompt_len): return True
  link, suffix = cluster.link(prefill, decode), prompt_len - cached
  t_suffix = prefill_time(p, model, suffix)
  pull = link.latency + cached * model.kv_bytes_per_token / link.bandwidth
  t_p = min(pull + t_suffix, prefill_time(p, model, prompt_len))
  remote = prefill_queue_s + t_p + kv_transfer_exposed(model, suffix, t_suffix, link)
  return remote < local_queue_s + prefill_time(d, model, suffix)
