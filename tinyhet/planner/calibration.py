"""Calibration: every measured row of a cluster file fitted together to each node's compute and bandwidth efficiency.

A node's efficiencies (shares of its spec sheet's FLOP/s and bytes/s, roofline.Node) are what the planner cannot read
off a spec sheet. One measured figure rarely pins both (a serving throughput depends on both), so the fit adds what a
row cannot decide, and keeps the answer physical:

  - bounds: every efficiency stays within BOUNDS (10-95% of the spec sheet): nothing runs above its peak, and a
    kernel at 1% of it is a broken kernel or a wrong figure, not a device;
  - priors: where no row decides an efficiency, it stays near PRIOR (the middle of what the published checks'
    single-device figures give: tests/test_planner_published.py), loosely (a factor of PRIOR_SPREAD is one sigma);
  - ties: two nodes' efficiencies for one resource are tied, the tighter the closer their spec sheets are in it
    (sigma TIE_BASE + TIE_SLOPE x |ln spec ratio|): a difference in what two devices measured is put on the resource in
    which their spec sheets differ, not on the one in which they are alike. (An MI300X and an MI308X have the same HBM3
    at 5.3 TB/s and 5.6x apart FP8: their bandwidth efficiencies are held together, their compute ones are free.)

The fit is least squares in log space (a row's error is ln(predicted / measured), MEASURED_SIGMA one sigma) by a
projected Levenberg-Marquardt over the log-efficiencies, within the bounds. Its residual is reported per row; a row
predicted more than SUSPECT off after the fit is named in one line with why (an efficiency at a bound: the figure
cannot be reached within it; otherwise: it disagrees with the node's other rows).
"""
from __future__ import annotations
import dataclasses, math
from dataclasses import dataclass
from tinyhet.planner.catalog import Model
from tinyhet.planner.loaded import colocated_throughput
from tinyhet.planner.roofline import Node, decode_context, decode_step_time, prefill_time

BOUNDS = (0.10, 0.95)
PRIOR = {"compute_eff": 0.5, "bandwidth_eff": 0.6}
PRIOR_SPREAD = 2.5
TIE_BASE, TIE_SLOPE = 0.05, 2.0
MEASURED_SIGMA = 0.02
SUSPECT = 0.15  # |predicted / measured - 1| past which a row is named
RESOURCES = ("compute_eff", "bandwidth_eff")
GRID = 13  # points per efficiency of the starting grid

@dataclass(frozen=True)
class Row:
  """One measured figure of a node serving a model alone. kind: prefill_s, decode_s (output_len tokens), total_s (prefill +
  decode), throughput_tok_s (loaded, at `concurrency` clients or `rate` requests/s), prefill_tflops, decode_gb_s."""
  key: str          # where it is in the file, e.g. calibration[0].prefill_s
  node: str
  kind: str
  value: float
  model: Model | None = None
  prompt_len: int = 1
  output_len: int = 1
  concurrency: int | None = None
  rate: float | None = None
  dtype: str = "fp16"  # of prefill_tflops
  what: str = ""       # the figure as the file gives it, for messages

  def predict(self, node: Node) -> float:
    m, p, o = self.model, self.prompt_len, self.output_len
    if self.kind == "prefill_tflops": return node.compute_eff * node.flops(self.dtype) / 1e12
    if self.kind == "decode_gb_s": return node.bandwidth_eff * node.bandwidth / 1e9
    if self.kind == "throughput_tok_s": return colocated_throughput(node, m, p, o, self.concurrency, self.rate)
    decode = o * decode_step_time(node, m, 1, decode_context(p, o)) if self.kind in ("decode_s", "total_s") else 0.0
    return decode + (prefill_time(node, m, p) if self.kind in ("prefill_s", "total_s") else 0.0)

@dataclass(frozen=True)
class Fit:
  """The calibrated nodes, each row's error after the fit (predicted / measured - 1), and a line per suspect row."""
  nodes: dict[str, Node]
  errors: dict[str, float]
  warnings: tuple[str, ...]

  def summary(self) -> str:
    if not self.errors: return ""
    rms = math.sqrt(sum(math.log1p(e) ** 2 for e in self.errors.values()) / len(self.errors))
    worst = max(self.errors, key=lambda k: abs(self.errors[k]))
    return (f"calibration: {len(self.errors)} measured figure{'s' if len(self.errors) > 1 else ''} fitted together, efficiencies within "
            f"{BOUNDS[0]:.0%}-{BOUNDS[1]:.0%} of the spec sheets; residual {_spread(rms)} rms, worst {worst} {_ratio(self.errors[worst])}")

def _spread(log_error: float) -> str: return f"{math.exp(log_error):.3g}x" if log_error > math.log(2) else f"{math.expm1(log_error):.1%}"

def _tie_sigma(a: Node, b: Node, resource: str) -> float:
  spec = (lambda n: max(n.device.flops.values())) if resource == "compute_eff" else (lambda n: n.device.bandwidth)
  return TIE_BASE + TIE_SLOPE * abs(math.log(spec(a) / spec(b)))

def _solve(a: list[list[float]], b: list[float]) -> list[float]:
  """a x = b by Gaussian elimination with partial pivoting (a is small, symmetric positive definite)."""
  n = len(b)
  m = [[*row, b[i]] for i, row in enumerate(a)]
  for c in range(n):
    p = max(range(c, n), key=lambda r: abs(m[r][c]))
    m[c], m[p] = m[p], m[c]
    for r in range(c + 1, n):
      f = m[r][c] / m[c][c]
      for k in range(c, n + 1): m[r][k] -= f * m[c][k]
  x = [0.0] * n
  for c in reversed(range(n)): x[c] = (m[c][n] - sum(m[c][k] * x[k] for k in range(c + 1, n))) / m[c][c]
  return x

def fit(nodes: dict[str, Node], rows: list[Row]) -> Fit:
  """Every node with a row gets the efficiencies that fit all rows together (module docstring); others are unchanged."""
  names = list(dict.fromkeys(r.node for r in rows))
  if not names: return Fit(dict(nodes), {}, ())
  lo, hi = math.log(BOUNDS[0]), math.log(BOUNDS[1])
  index = {(n, res): 2 * i + j for i, n in enumerate(names) for j, res in enumerate(RESOURCES)}
  at = lambda x, n: dataclasses.replace(nodes[n], **{res: math.exp(x[index[n, res]]) for res in RESOURCES})
  # the linear terms: (variable weights, target, sigma) with residual (sum w x - target) / sigma
  linear = [({index[n, res]: 1.0}, math.log(PRIOR[res]), math.log(PRIOR_SPREAD)) for n in names for res in RESOURCES]
  linear += [({index[a, res]: 1.0, index[b, res]: -1.0}, 0.0, _tie_sigma(nodes[a], nodes[b], res))
             for i, a in enumerate(names) for b in names[i + 1:] for res in RESOURCES]

  def residuals(x):
    out = [math.log(max(r.predict(at(x, r.node)), 1e-300) / r.value) / MEASURED_SIGMA for r in rows]
    return out + [(sum(w * x[i] for i, w in ws.items()) - t) / s for ws, t, s in linear]

  def jacobian(x, base):
    jac = [[0.0] * len(x) for _ in base]
    for i, r in enumerate(rows):
      for res in RESOURCES:
        j, h = index[r.node, res], 1e-6 if x[index[r.node, res]] + 1e-6 <= hi else -1e-6
        moved = list(x)
        moved[j] += h
        jac[i][j] = (math.log(max(r.predict(at(moved, r.node)), 1e-300) / r.value) / MEASURED_SIGMA - base[i]) / h
    for k, (ws, _, s) in enumerate(linear):
      for j, w in ws.items(): jac[len(rows) + k][j] = w / s
    return jac

  # start: each node alone at the best point of a grid over its bounds (rooflines have kinks: started at the prior, a
  # prefill that the prior makes bound by bandwidth would never tell its compute), then all rows and ties together
  grid = [lo + (hi - lo) * i / (GRID - 1) for i in range(GRID)]
  def alone(n, c, b):
    node = dataclasses.replace(nodes[n], compute_eff=math.exp(c), bandwidth_eff=math.exp(b))
    return (sum((math.log(max(r.predict(node), 1e-300) / r.value) / MEASURED_SIGMA) ** 2 for r in rows if r.node == n)
            + sum(((v - math.log(PRIOR[res])) / math.log(PRIOR_SPREAD)) ** 2 for v, res in zip((c, b), RESOURCES)))
  x = [v for n in names for v in min(((c, b) for c in grid for b in grid), key=lambda cb: alone(n, *cb))]
  cost = lambda rs: sum(v * v for v in rs)
  res, lam = residuals(x), 1e-3
  for _ in range(200):
    jac = jacobian(x, res)
    grad = [sum(jac[k][j] * res[k] for k in range(len(res))) for j in range(len(x))]
    # a variable at a bound that the cost would push past it is held there (projected step)
    free = [j for j in range(len(x)) if not ((x[j] <= lo + 1e-12 and grad[j] > 0) or (x[j] >= hi - 1e-12 and grad[j] < 0))]
    if not free: break
    jtj = [[sum(jac[k][a] * jac[k][b] for k in range(len(res))) for b in free] for a in free]
    improved = False
    while lam < 1e12:
      step = _solve([[v + (lam * jtj[i][i] + 1e-12 if i == j else 0.0) for j, v in enumerate(row)] for i, row in enumerate(jtj)],
                    [-grad[j] for j in free])
      trial = list(x)
      for j, d in zip(free, step): trial[j] = min(hi, max(lo, trial[j] + d))
      new = residuals(trial)
      if cost(new) < cost(res):
        improved = cost(res) - cost(new) > 1e-12 * max(1.0, cost(res))
        x, res, lam = trial, new, max(lam / 3, 1e-9)
        break
      lam *= 4
    if not improved: break
  fitted = dict(nodes) | {n: at(x, n) for n in names}
  errors = {r.key: r.predict(fitted[r.node]) / r.value - 1 for r in rows}
  return Fit(fitted, errors, tuple(_suspect(r, fitted[r.node], errors[r.key], rows, lo, hi) for r in rows if abs(errors[r.key]) > SUSPECT))

def _ratio(error: float) -> str: return f"{1 + error:.3g}x the figure" if abs(error) >= 1 else f"{error:+.1%}"

def _suspect(row: Row, node: Node, error: float, rows: list[Row], lo: float, hi: float) -> str:
  """One line: which row, by how much, and why it cannot be fitted."""
  bound = [res.split("_")[0] for res in RESOURCES if not lo + 1e-9 < math.log(getattr(node, res)) < hi - 1e-9]
  head = f"warning: suspect calibration row {row.key} ({row.what}): the fit predicts {row.predict(node):.4g} ({_ratio(error)})"
  if bound:
    rate = row.kind in ("throughput_tok_s", "prefill_tflops", "decode_gb_s")
    slower = (error > 0) == rate  # the node measured slower than the fit can make it
    units = {"throughput_tok_s": "output tokens/s of the whole server, at that concurrency?", "prefill_tflops": "TFLOP/s?", "decode_gb_s": "GB/s?"}
    return (f"{head}; {node.name} would need its {' and '.join(bound)} {'below' if slower else 'above'} {BOUNDS[0 if slower else 1]:.0%} "
            f"of its spec sheet (the bounds are {BOUNDS[0]:.0%}-{BOUNDS[1]:.0%}): check the figure and its units "
            f"({units.get(row.kind, 'seconds, for the whole prompt or all output_len tokens?')}), the node's device and count, and the model")
  others = [r.key for r in rows if r.node == row.node and r is not row]
  return f"{head}; it disagrees with {', '.join(others) or 'the ties to the other nodes'}: check which of them is right"

def reasons(cluster) -> list[str]:
  """The plan's lines about calibration: each calibrated node's efficiencies, the fit's residual, the suspect rows, and
  the nodes left at their spec sheets (a tinyhet.cluster_file.Cluster)."""
  out = [f"calibrated {n.name} ({n.calibration}): compute at {n.compute_eff:.0%}, bandwidth at {n.bandwidth_eff:.0%} of its spec sheet"
         for n in cluster.nodes if n.calibration]
  out += [cluster.calibration] if cluster.calibration else []
  out += list(cluster.warnings)
  if (raw := [n.name for n in cluster.nodes if not n.calibration]):
    out.append(f"spec-sheet peaks, uncalibrated (optimistic): {', '.join(raw)}; add [[calibration]] entries with measured figures")
  return out
