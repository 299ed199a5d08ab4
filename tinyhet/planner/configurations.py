"""The ways to run a model on a cluster, each predicted at a request rate: one node alone, naive round-robin over all
nodes, and disaggregated prefill/decode for one assignment of nodes to roles.

Queueing is kept simple and said here once: a prefill-only node is an M/D/1 queue; a decode node batches as many
sequences as are in flight (Little's law: batch = rate x output_len x TPOT) up to what its memory holds; a node serving
both spends rate x prefill time of every second prefilling, and its decode steps run in the rest. Requests are spread
over prefill (decode) nodes in proportion to what each sustains; prompts are prefilled one at a time.
"""
from __future__ import annotations
import itertools, math
from collections.abc import Callable
from dataclasses import dataclass
from tinyhet.planner.catalog import Model, PlanError
from tinyhet.planner.cluster_file import Cluster
from tinyhet.planner.roofline import Node, cannot_hold, decode_context, decode_step_time, kv_transfer_exposed, max_batch, prefill_time

MAX_ASSIGNMENTS = 50_000  # disaggregated assignments tried; more nodes than this allows should be grouped with replicas

def _num(x: float | None) -> float | None: return None if x is None or not math.isfinite(x) else float(f"{x:.6g}")

@dataclass(frozen=True)
class Configuration:
  """One way to run the model on the cluster, predicted. None times: it cannot run (notes say why) or not at this rate."""
  name: str
  kind: str                      # "alone" | "balanced" | "disaggregated"
  prefill: tuple[str, ...]       # node names (name.i for replicas)
  decode: tuple[str, ...]
  ttft_s: float | None
  tpot_s: float | None
  throughput_tok_s: float | None # the most output tokens/s it sustains
  notes: tuple[str, ...] = ()
  groups: tuple[tuple[str, int, int], ...] = ()  # (node, replicas prefilling, replicas decoding)
  output_len: int = 1

  @property
  def e2e_s(self) -> float | None:
    """End to end: TTFT + output_len x TPOT."""
    return None if self.ttft_s is None or self.tpot_s is None else self.ttft_s + self.output_len * self.tpot_s

  def to_json(self) -> dict:
    return {"name": self.name, "prefill": list(self.prefill), "decode": list(self.decode), "ttft_s": _num(self.ttft_s), "tpot_s": _num(self.tpot_s),
            "throughput_tok_s": _num(self.throughput_tok_s)}

# --- one node in one role, at a rate of requests/s per replica ---------------------------------------------------------

def md1_wait(rho: float, service_s: float) -> float:
  """Mean wait in an M/D/1 queue (Poisson arrivals, fixed service time) at utilization rho < 1."""
  return rho * service_s / (2 * (1 - rho))

def solve_batch(step: Callable[[float], float], rate: float, output_len: int, share: float, limit: int) -> float | None:
  """The batch a decode node settles at: b = rate x output_len x TPOT(b), TPOT(b) = step(b) / share (share: the part of
  the time it decodes). The smallest such b up to `limit` (what memory holds); None when even `limit` cannot keep up.
  One bisection finds it: step(b)/b never grows with b (every sequence of the batch shares the weight reads), so once
  b keeps up, every larger b does too."""
  need = lambda b: rate * output_len * step(b) / share - b
  if rate <= 0: return 0.0
  if need(limit) > 0: return None
  lo, hi = 0.0, float(limit)
  for _ in range(60):
    mid = (lo + hi) / 2
    lo, hi = (mid, hi) if need(mid) > 0 else (lo, mid)
  return hi

@dataclass(frozen=True)
class Work:
  """What the configurations need to know of one node for this workload (computed once)."""
  node: Node
  prefill_s: float        # one prompt
  holds_prompt: str | None  # why it cannot prefill (None: it can)
  holds_request: str | None  # why it cannot decode the whole request
  batch_limit: int        # sequences of prompt + output tokens its memory holds
  step: Callable[[float], float]  # batch -> decode step seconds

def work(node: Node, model: Model, prompt_len: int, output_len: int) -> Work:
  context = decode_context(prompt_len, output_len)
  return Work(node, prefill_time(node, model, prompt_len), cannot_hold(node, model, prompt_len), cannot_hold(node, model, prompt_len + output_len),
               max_batch(node, model, prompt_len + output_len), lambda b: decode_step_time(node, model, b, context))

def _alone(w: Work, rate: float, output_len: int) -> tuple[float, float, float]:
  """(TTFT, TPOT, capacity requests/s) of one replica serving whole requests; inf times when it cannot keep up."""
  capacity = 1 / (w.prefill_s + output_len * w.step(w.batch_limit) / w.batch_limit)
  rho = rate * w.prefill_s
  batch = solve_batch(w.step, rate, output_len, 1 - rho, w.batch_limit) if rho < 1 else None
  if batch is None: return math.inf, math.inf, capacity
  return w.prefill_s + md1_wait(rho, w.prefill_s), w.step(batch) / (1 - rho), capacity

def _prefill(w: Work, rate: float) -> float:
  rho = rate * w.prefill_s
  return w.prefill_s + md1_wait(rho, w.prefill_s) if rho < 1 else math.inf

def _decode(w: Work, rate: float, output_len: int) -> float:
  batch = solve_batch(w.step, rate, output_len, 1.0, w.batch_limit)
  return math.inf if batch is None else w.step(batch)

def _decode_capacity(w: Work, output_len: int) -> float: return w.batch_limit / (output_len * w.step(w.batch_limit))

# --- configurations ----------------------------------------------------------------------------------------------------

def _units(w: Work, k: int) -> list[str]: return w.node.unit_names()[:k] if k else []
def _label(w: Work, k: int) -> str: return w.node.name if k == w.node.replicas == 1 else f"{w.node.name}×{k}"

def _finish(name, kind, prefill, decode, ttft, tpot, capacity, rate, output_len, notes=(), groups=()) -> Configuration:
  if rate > 0 and not rate < capacity:
    notes = (*notes, f"{name} cannot sustain {rate:g} requests/s (at most {capacity:.3g})")
    ttft = tpot = math.inf
  fin = lambda x: x if math.isfinite(x) else None
  return Configuration(name, kind, tuple(prefill), tuple(decode), fin(ttft), fin(tpot), fin(capacity * output_len), tuple(notes), tuple(groups),
                       output_len)

def alone(w: Work, rate: float, output_len: int) -> Configuration:
  name, units = f"{w.node.name} alone", w.node.unit_names()
  if w.holds_request: return Configuration(name, "alone", tuple(units), tuple(units), None, None, None, (w.holds_request,), output_len=output_len)
  ttft, tpot, capacity = _alone(w, rate / w.node.replicas, output_len)
  return _finish(name, "alone", units, units, ttft, tpot, capacity * w.node.replicas, rate, output_len,
                 groups=((w.node.name, w.node.replicas, w.node.replicas),))

def balanced(works: list[Work], rate: float, output_len: int) -> Configuration | None:
  """Round-robin over every replica of every node that holds the request, each serving whole requests."""
  usable = [w for w in works if not w.holds_request]
  if len(usable) < 2: return None
  total = sum(w.node.replicas for w in usable)
  parts = [(w.node.replicas / total, *_alone(w, rate / total, output_len)) for w in usable]
  units = [u for w in usable for u in w.node.unit_names()]
  return _finish("balanced (round-robin)", "balanced", units, units, sum(s * t for s, t, _, _ in parts), sum(s * t for s, _, t, _ in parts),
                 total * min(c for *_, c in parts), rate, output_len, groups=tuple((w.node.name, w.node.replicas, w.node.replicas) for w in usable))

def disaggregated(cluster: Cluster, model: Model, prompt_len: int, output_len: int, rate: float, works: dict[str, Work],
                  assignment: list[tuple[str, int, int]], overlap: bool = True) -> Configuration:
  """Prefill on the `p` replicas and decode on the `d` replicas of each (node, p, d) in `assignment`."""
  P = [(works[n], p) for n, p, _ in assignment if p]
  D = [(works[n], d) for n, _, d in assignment if d]
  cap_p = {w.node.name: k / w.prefill_s for w, k in P}
  cap_d = {w.node.name: k * _decode_capacity(w, output_len) for w, k in D}
  total_p, total_d = sum(cap_p.values()), sum(cap_d.values())
  share_p = {n: c / total_p for n, c in cap_p.items()}
  share_d = {n: c / total_d for n, c in cap_d.items()}
  kv = prompt_len * model.kv_bytes_per_token
  link = lambda a, b: cluster.link(a.node.name, b.node.name)
  # Each replica's NIC carries its share of the KV traffic (seconds of sending per request); the busiest one limits the rate.
  link_limits = [k / (share_p[w.node.name] * sum(share_d[v.node.name] * kv / link(w, v).bandwidth for v, _ in D)) for w, k in P]
  link_limits += [k / (share_d[w.node.name] * sum(share_p[v.node.name] * kv / link(v, w).bandwidth for v, _ in P)) for w, k in D]
  capacity = min(total_p, total_d, *link_limits)
  ttft = sum(share_p[w.node.name] * share_d[v.node.name] *
             (_prefill(w, rate * share_p[w.node.name] / kw) + kv_transfer_exposed(model, prompt_len, w.prefill_s, link(w, v), overlap))
             for w, kw in P for v, _ in D)
  tpot = sum(share_d[w.node.name] * _decode(w, rate * share_d[w.node.name] / k, output_len) for w, k in D)
  name = f"{' + '.join(_label(w, k) for w, k in P)} prefill, {' + '.join(_label(w, k) for w, k in D)} decode"
  return _finish(name, "disaggregated", [u for w, k in P for u in _units(w, k)], [u for w, k in D for u in w.node.unit_names()[-k:]],
                 ttft, tpot, capacity, rate, output_len, groups=assignment)

def assignments(cluster: Cluster, works: dict[str, Work]) -> list[list[tuple[str, int, int]]]:
  """Every way to give each node's replicas to prefill, decode, both (split) or neither, with some prefill and some decode."""
  options = []
  for n in cluster.nodes:
    w, r = works[n.name], n.replicas
    mine = [(n.name, 0, 0)]
    if not w.holds_prompt: mine.append((n.name, r, 0))
    if not w.holds_request: mine.append((n.name, 0, r))
    if not w.holds_prompt and not w.holds_request: mine += [(n.name, p, r - p) for p in range(1, r)]
    options.append(mine)
  if math.prod(len(o) for o in options) > MAX_ASSIGNMENTS:
    raise PlanError(f"{cluster.source}: too many nodes to try every assignment; describe identical servers as one node with replicas = N")
  return [list(a) for a in itertools.product(*options) if any(p for _, p, _ in a) and any(d for _, _, d in a)]

def best(configs: list[Configuration]) -> Configuration | None:
  """The lowest end-to-end time among those that sustain the rate (within 1%: the one that sustains more);
  when none does, the one that sustains the most."""
  running = [c for c in configs if c.e2e_s is not None]
  if running:
    fastest = min(c.e2e_s for c in running)
    return max((c for c in running if c.e2e_s <= fastest * 1.01), key=lambda c: (c.throughput_tok_s, -c.e2e_s))
  possible = [c for c in configs if c.throughput_tok_s]
  return max(possible, key=lambda c: c.throughput_tok_s) if possible else None

