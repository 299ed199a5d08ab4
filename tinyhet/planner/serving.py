"""The planner under load: which replicas prefill, which decode, which do both, in what ratio, for a traffic and SLOs.

  plan = plan_serving(cluster, "llama-3-8b", prompt_len=1024, output_len=128, rate=4, slo=SLO(ttft_s=1, tpot_s=0.05))
  pd_split(cluster, "llama-3-8b", 1024, 128, rate=4, slo=SLO(1, 0.05))  # the router's question: {"prefill": [...], ...}

Configurations: each node group alone (all its replicas colocated), naive round-robin over every group (colocated), and
every assignment of node groups to prefill / decode / both / unused, in both directions, with each group's replicas split
between prefill and decode (or prefill and both, or decode and both) in the ratios P:D worth trying (every ratio for up
to 8 replicas, a spread of them above; coarser when there are many groups). An analytic capacity estimate screens the
assignments; the most promising are
simulated (tinyhet/planner/servesim.py) with the alone and round-robin ones, and the plan is the one with the highest goodput
(requests/s meeting both SLOs), then the highest throughput, then the lowest p90 latency.
"""
from __future__ import annotations
import itertools, math
from dataclasses import dataclass
from tinyhet.planner.calibration import reasons as calibration_reasons
from tinyhet.planner.catalog import Model, PlanError
from tinyhet.planner.cluster_file import Cluster
from tinyhet.planner.roofline import Node, cannot_hold, max_batch
from tinyhet.planner.servesim import COLOCATED_SEQS, SLO, Outcome, Unit, capacity, max_goodput, simulate, unit_rates

SIMULATED = 14          # assignments simulated after screening, besides each group alone and round-robin
MAX_ASSIGNMENTS = 20_000

def _num(x: float | None) -> float | None: return None if x is None or not math.isfinite(x) else float(f"{x:.6g}")

@dataclass(frozen=True)
class ServingConfig:
  """One way to serve, simulated at the load: the unit names in each role, and what the run measured (None: not run)."""
  name: str
  kind: str                          # "alone" | "balanced" | "disaggregated" | "mixed" (some units do both)
  prefill: tuple[str, ...]           # units that only prefill
  decode: tuple[str, ...]            # units that only decode
  both: tuple[str, ...]              # units that do both (colocated)
  groups: tuple[tuple[str, int, int, int], ...]  # (node, prefill replicas, decode replicas, both replicas)
  outcome: Outcome | None
  goodput_rps: float | None          # at the rate / concurrency given, or the most the SLO allows (max-throughput)
  output_len: int = 1

  @property
  def ratio(self) -> str: return f"{len(self.prefill) + len(self.both)}:{len(self.decode) + len(self.both)}"

  def to_json(self) -> dict:
    o = self.outcome
    get = (lambda k: _num(getattr(o, k))) if o else (lambda k: None)
    return {"name": self.name, "prefill": list(self.prefill + self.both), "decode": list(self.decode + self.both), "both": list(self.both),
            "ratio": self.ratio, "ttft_s": get("ttft_p50_s"), "tpot_s": get("tpot_p50_s"), "throughput_tok_s": get("throughput_tok_s"),
            "goodput_rps": _num(self.goodput_rps), "ttft_p90_s": get("ttft_p90_s"), "tpot_p90_s": get("tpot_p90_s"),
            "attainment": get("attainment")}

@dataclass(frozen=True)
class ServingPlan:
  """Every simulated configuration for one workload and load, the chosen one and why."""
  model: Model
  prompt_len: int
  output_len: int
  load: str
  slo: SLO
  configurations: tuple[ServingConfig, ...]
  chosen: ServingConfig
  reasons: tuple[str, ...]

  def to_json(self) -> dict:
    return {"configurations": [c.to_json() for c in self.configurations], "plan": {"name": self.chosen.name, "reasons": list(self.reasons)}}

def _ratios(r: int, detail: int = 2) -> list[int]:
  """Replica counts worth giving one role out of r: every one up to 8, then a spread (detail 2); a quarter, a half and
  three quarters (detail 1); none (detail 0, whole groups only)."""
  fractions = {2: (1 / 8, 1 / 6, 1 / 4, 1 / 3, 1 / 2, 2 / 3, 3 / 4, 5 / 6, 7 / 8), 1: (1 / 4, 1 / 2, 3 / 4), 0: ()}[detail]
  if detail == 2 and r <= 8: return list(range(1, r))
  return sorted({max(1, min(r - 1, round(r * f))) for f in fractions if r > 1})

def splits(node: Node, holds_prompt: bool, holds_request: bool, detail: int = 2) -> list[tuple[int, int, int]]:
  """(prefill, decode, both) replica counts one node group may take: unused, one role for all, or two roles split
  (prefill/decode, prefill/both, and at full detail decode/both)."""
  r, out = node.replicas, [(0, 0, 0)]
  if holds_prompt: out.append((r, 0, 0))
  if holds_request: out += [(0, r, 0), (0, 0, r)]
  if holds_prompt and holds_request:
    for k in _ratios(r, detail): out += [(k, r - k, 0), (k, 0, r - k)] + ([(0, k, r - k)] if detail == 2 else [])
  return out

def _units(cluster: Cluster, groups) -> list[Unit]:
  units = []
  for name, p, d, b in groups:
    names = cluster.node(name).unit_names()
    roles = ["prefill"] * p + ["decode"] * d + ["both"] * b
    units += [Unit(u, cluster.node(name), role) for u, role in zip(names, roles)]
  return units

def _label(name: str, k: int, node: Node) -> str: return name if k == node.replicas == 1 else f"{name}×{k}"

def _name(cluster: Cluster, groups, kind: str) -> str:
  if kind == "alone": return f"{groups[0][0]} alone"
  if kind == "balanced": return "balanced (round-robin)"
  part = lambda i, role: " + ".join(_label(g[0], g[i], cluster.node(g[0])) for g in groups if g[i])
  return ", ".join(f"{part(i, role)} {role}" for i, role in ((1, "prefill"), (2, "decode"), (3, "both")) if part(i, role))

def assignments(cluster: Cluster, model: Model, prompt_len: int, output_len: int) -> list[tuple[tuple[str, int, int, int], ...]]:
  """Every assignment of node groups to roles (see splits) with something that prefills and something that decodes;
  with many groups, each group's replicas are split in fewer ratios so that at most MAX_ASSIGNMENTS are tried."""
  holds = [(n, not cannot_hold(n, model, prompt_len), not cannot_hold(n, model, prompt_len + output_len)) for n in cluster.nodes]
  for detail in (2, 1, 0):  # as fine a split of each group as keeps the product of choices tractable
    options = [[(n.name, *s) for s in splits(n, p, d, detail)] for n, p, d in holds]
    if math.prod(len(o) for o in options) <= MAX_ASSIGNMENTS: break
  else:
    raise PlanError(f"{cluster.source}: too many node groups to try every assignment; describe identical servers as one node with replicas = N")
  return [tuple(g for g in a if any(g[1:])) for a in itertools.product(*options)
          if any(g[1] or g[3] for g in a) and any(g[2] or g[3] for g in a)]

def _kind(groups) -> str:
  if len(groups) == 1 and groups[0][3] and not groups[0][1] and not groups[0][2]: return "alone"
  return "mixed" if any(g[3] for g in groups) else "disaggregated"

def evaluate(cluster: Cluster, model: Model, prompt_len: int, output_len: int, groups, slo: SLO, rate: float | None = None,
             concurrency: int | None = None, kind: str | None = None, requests: int | None = None, seed: int = 0,
             overlap: bool = True) -> ServingConfig:
  """Simulate one assignment (`requests` requests; default: as many as plan_serving runs) at the load: `rate` requests/s,
  `concurrency` clients, or (neither) the highest rate the SLO allows (DistServe's goodput; without SLOs, the most the
  configuration sustains)."""
  kind = kind or _kind(groups)
  units = _units(cluster, groups)
  requests = requests or _requests(cluster, model, prompt_len, output_len, concurrency)
  link = cluster.link
  rr = kind == "balanced"
  if rate is None and concurrency is None:
    if slo.ttft_s is None and slo.tpot_s is None:  # no SLO: the most it sustains, measured overloaded
      out = simulate(units, model, prompt_len, output_len, link, rate=2 * capacity(units, model, prompt_len, output_len), requests=requests,
                     slo=slo, seed=seed, round_robin=rr, overlap=overlap)
      goodput = out.request_rps
    else:
      goodput, out = max_goodput(units, model, prompt_len, output_len, link, slo, requests, seed, rr, overlap=overlap)
  else:
    out = simulate(units, model, prompt_len, output_len, link, rate=rate, concurrency=concurrency, requests=requests, slo=slo, seed=seed,
                   round_robin=rr, overlap=overlap)
    goodput = out.goodput_rps
  P = tuple(u.name for u in units if u.role == "prefill")
  D = tuple(u.name for u in units if u.role == "decode")
  B = tuple(u.name for u in units if u.role == "both")
  return ServingConfig(_name(cluster, groups, kind), kind, P, D, B, tuple(groups), out, goodput, output_len)

def _requests(cluster: Cluster, model: Model, prompt_len: int, output_len: int, concurrency: int | None) -> int:
  """Enough requests that every unit sees a steady state (twice what the decode memory of all of them holds, so an
  overloaded one fills up), and the closed loop's clients each send a few."""
  units = sum(n.replicas for n in cluster.nodes)
  slots = sum(n.replicas * min(max_batch(n, model, prompt_len + output_len), COLOCATED_SEQS) for n in cluster.nodes)
  return min(4000, max(400, 20 * units, 2 * slots, 4 * (concurrency or 0)))

def plan_serving(cluster: Cluster, model: str | Model, prompt_len: int, output_len: int, rate: float | None = None, concurrency: int | None = None,
                 slo: SLO | None = None, seed: int = 0, overlap: bool = True) -> ServingPlan:
  """Simulate the configurations worth trying under this load and choose one (module docstring)."""
  model = cluster.model(model) if isinstance(model, str) else model
  slo = slo or SLO()
  if prompt_len < 1 or output_len < 1: raise PlanError(f"prompt_len and output_len must be at least 1 (got {prompt_len}, {output_len})")
  if rate is not None and concurrency is not None: raise PlanError("give --rate or --concurrency, not both")
  if rate is not None and not (0 < rate < 1e9): raise PlanError(f"rate must be > 0 requests/s (got {rate})")
  if concurrency is not None and not 1 <= concurrency <= 1_000_000: raise PlanError(f"concurrency must be from 1 to 1,000,000 (got {concurrency})")
  for what, v in (("ttft", slo.ttft_s), ("tpot", slo.tpot_s)):
    if v is not None and not 0 < v < 1e6: raise PlanError(f"the {what} SLO must be > 0 seconds (got {v})")
  every = assignments(cluster, model, prompt_len, output_len)
  if not every:
    raise PlanError(f"no node of {cluster.source} can run {model.name} with {prompt_len + output_len} tokens: "
                    + "; ".join(w for n in cluster.nodes if (w := cannot_hold(n, model, prompt_len + output_len))))
  naive = [a for a in every if _kind(a) == "alone"]
  groups_all = tuple((n.name, 0, 0, n.replicas) for n in cluster.nodes if not cannot_hold(n, model, prompt_len + output_len))
  rates = {(n.name, role): unit_rates(n, role, model, prompt_len, output_len) for n in cluster.nodes for role in ("prefill", "decode", "both")}
  def cap(a) -> float:  # servesim.capacity, summed per group: thousands of assignments are screened
    per = [(rates[g[0], role], k) for g in a for role, k in zip(("prefill", "decode", "both"), g[1:]) if k]
    return min(sum(r[0] * k for r, k in per), sum(r[1] * k for r, k in per))
  # ties broken by what the groups are (device, count, roles), not by their names: renaming nodes never changes the plan
  what = lambda a: sorted((cluster.node(g[0]).device.name, cluster.node(g[0]).count, cluster.node(g[0]).replicas, *g[1:]) for g in a)
  rest = sorted((a for a in every if a not in naive), key=lambda a: (-cap(a), what(a)))[:SIMULATED]
  requests = _requests(cluster, model, prompt_len, output_len, concurrency)
  run = lambda a, kind=None: evaluate(cluster, model, prompt_len, output_len, a, slo, rate, concurrency, kind, requests, seed, overlap)
  configs = [run(a) for a in naive] + ([run(groups_all, "balanced")] if len(groups_all) > 1 else []) + [run(a) for a in rest]
  chosen = max(configs, key=_rank)
  return ServingPlan(model, prompt_len, output_len, _load(rate, concurrency), slo, tuple(configs), chosen,
                     tuple(explain(cluster, model, configs, chosen, rate, concurrency, slo)))

def _bucket(x: float) -> int: return round(math.log(max(x, 1e-12)) / math.log(1.01))  # values within ~1% share a bucket

def _rank(c: ServingConfig):
  """Goodput first, then throughput, then lower p90 end-to-end time (each within ~1% counts as equal), then fewer units,
  then fewer colocated ones (a plain split is simpler to route)."""
  o = c.outcome
  if o is None: return (-(1 << 30), 0, 0, 0, 0)
  e2e = o.ttft_p90_s + (c.output_len - 1) * o.tpot_p90_s
  return (_bucket(c.goodput_rps or 0.0), _bucket(o.throughput_tok_s), -_bucket(e2e), -(len(c.prefill) + len(c.decode) + len(c.both)), -len(c.both))

def _load(rate: float | None, concurrency: int | None) -> str:
  if rate is not None: return f"{rate:g} requests/s (Poisson)"
  if concurrency is not None: return f"{concurrency} concurrent clients"
  return "the most the SLOs allow"

def _g(x: float) -> str: return f"{x:.3g}" if abs(x) < 1000 else f"{x:,.0f}"
def _ms(x: float) -> str: return f"{x:.3g} s" if x >= 0.1 else f"{x * 1e3:.3g} ms"

def explain(cluster: Cluster, model: Model, configs: list[ServingConfig], chosen: ServingConfig, rate, concurrency, slo: SLO) -> list[str]:
  """The plan's reasons, most important first."""
  o, reasons = chosen.outcome, []
  target = ", ".join(f"{k} p90 <= {_ms(v)}" for k, v in (("TTFT", slo.ttft_s), ("TPOT", slo.tpot_s)) if v is not None) or "no SLO"
  reasons.append(f"{chosen.name} (prefill:decode {chosen.ratio}): goodput {_g(chosen.goodput_rps or 0)} requests/s ({target}), "
                 f"{_g(o.throughput_tok_s)} output tokens/s, TTFT p50/p90 {_ms(o.ttft_p50_s)}/{_ms(o.ttft_p90_s)}, "
                 f"TPOT p50/p90 {_ms(o.tpot_p50_s)}/{_ms(o.tpot_p90_s)} at {_load(rate, concurrency)}")
  for kind, what in (("alone", "the best single node"), ("balanced", "round-robin over every node")):
    others = [c for c in configs if c.kind == kind and c is not chosen and c.outcome]
    if others:
      c = max(others, key=_rank)
      times = (chosen.goodput_rps or 0) / c.goodput_rps if c.goodput_rps else math.inf
      reasons.append(f"against {what} ({c.name}): {_g(c.goodput_rps or 0)} requests/s of goodput" + (f", {times:.2f}x less" if times >= 1.005 else "")
                     + f"; TTFT p90 {_ms(c.outcome.ttft_p90_s)}, TPOT p90 {_ms(c.outcome.tpot_p90_s)}")
  stage = "prefill" if o.prefill_busy > 0.8 else "decode"
  reasons.append(f"prefilling units busy {o.prefill_busy:.0%} of the time; decoding units hold {o.decode_batch:.3g} sequences on average; "
                 + ("queues form at prefill (TTFT grows first)" if stage == "prefill" else "decode batches set TPOT and throughput"))
  if rate is not None:
    short = [c.name for c in configs if c.outcome and c.outcome.attainment < slo.attainment]
    if len(short) == len(configs):
      reasons.append(f"no configuration meets the SLO for {slo.attainment:.0%} of requests at {rate:g} requests/s; "
                     "this one serves the most within it")
    elif short: reasons.append(f"at {rate:g} requests/s fewer than {slo.attainment:.0%} of requests meet the SLO with: {'; '.join(short)}")
  if chosen.both and (chosen.prefill or chosen.decode):
    reasons.append(f"{len(chosen.both)} of its units both prefill and decode: each of their prefill passes stalls their running decode steps")
  elif chosen.both:
    reasons.append("colocated: every prefill pass stalls the running decode steps (prefill goes first), which shows in TPOT")
  reasons += calibration_reasons(cluster)
  return reasons

def table(plan: ServingPlan) -> str:
  """The simulated configurations as an aligned table, then the plan and its reasons."""
  m = plan.model
  lines = [f"{m.name} ({m.dtype}), {plan.prompt_len}-token prompts, {plan.output_len} output tokens, load: {plan.load}", ""]
  fmt = lambda x, scale=1.0: "-" if x is None else _g(x * scale)
  rows = [("configuration", "P:D", "goodput rps", "tokens/s", "TTFT p50 s", "p90 s", "TPOT p50 ms", "p90 ms")]
  for c in plan.configurations:
    o = c.outcome
    rows.append((c.name, c.ratio, fmt(c.goodput_rps), fmt(o and o.throughput_tok_s), fmt(o and o.ttft_p50_s), fmt(o and o.ttft_p90_s),
                 fmt(o and o.tpot_p50_s, 1e3), fmt(o and o.tpot_p90_s, 1e3)))
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  for i, r in enumerate(rows):
    lines.append("  ".join([r[0].ljust(widths[0])] + [v.rjust(w) for v, w in zip(r[1:], widths[1:])]).rstrip())
    if i == 0: lines.append("  ".join("-" * w for w in widths))
  lines += ["", f"plan: {plan.chosen.name}"] + [f"  - {r}" for r in plan.reasons]
  return "\n".join(lines) + "\n"

def pd_split(cluster: Cluster, model: str | Model, prompt_len: int, output_len: int, rate: float | None = None, concurrency: int | None = None,
             slo: SLO | tuple[float | None, float | None] | None = None) -> dict:
  """For the router: which replicas should prefill, which decode, which do both, for this traffic and SLO (a SLO or a
  (ttft_s, tpot_s) pair, p90). Returns {"prefill": [unit names], "decode": [...], "both": [...], "ratio": "P:D", "name",
  "goodput_rps", "throughput_tok_s"}; "prefill" and "decode" exclude the "both" units, "ratio" counts them on each side."""
  slo = slo if isinstance(slo, SLO) else SLO(*slo) if slo else SLO()
  c = plan_serving(cluster, model, prompt_len, output_len, rate, concurrency, slo).chosen
  return {"prefill": list(c.prefill), "decode": list(c.decode), "both": list(c.both), "ratio": c.ratio, "name": c.name,
          "goodput_rps": c.goodput_rps, "throughput_tok_s": c.outcome.throughput_tok_s}
