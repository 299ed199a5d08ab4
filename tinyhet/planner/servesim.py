"""Serving under load, simulated: a small discrete-event simulation of requests flowing through prefill and decode units.

Why a simulation and not formulas: the figures an operator asks for (p90 TTFT and TPOT, goodput under both SLOs) are
tails of distributions that depend on batching, on queues in front of two stages in series, and on a colocated unit
alternating prefill and decode; closed forms exist for one stage at a time (DistServe's M/D/1 prefill queue) but not
for their interplay. DistServe and Vidur answer the same question the same way. This one is kept small and exact about
what it models:

  - requests: `prompt_len` prompt tokens, `output_len` output tokens; Poisson arrivals at `rate` (open loop, seeded: the
    same seed gives the same run) or `concurrency` clients each sending its next request when the last one ends (closed).
  - a prompt goes to the least-loaded unit that prefills (_State.pending_s: the work queued ahead of a prefill unit; for
    colocated replicas, the requests in flight for their speed);
  - a prefill unit takes waiting prompts first come first served, as many as fit a token budget, in one pass
    (roofline: FLOPs add up, weights are read once); the first token is out when the pass ends.
  - the KV cache then goes to the decode unit with the least load for its speed: streamed layer by layer, only what the
    link has not sent by the end of prefill shows; a unit's NIC sends one request's KV at a time. The first token leaves
    the prefill unit, so the transfer delays the second token (TPOT), as Splitwise and DistServe count it.
  - a decode unit runs continuous batching: each step every admitted sequence gains a token and costs
    max(weights + every sequence's KV / bandwidth, FLOPs / compute) (roofline.decode_step_time); it admits what its
    memory holds (roofline.max_batch), the rest wait.
  - a colocated ("both") unit does both, as vLLM does without chunking: waiting prompts go first (a prefill pass stalls
    every running decode) while fewer than COLOCATED_SEQS sequences run, then decode steps; so each phase slows the
    other (and past what it sustains, decodes starve while prompts keep coming). It decodes what it prefilled unless a
    decode-only unit is as lightly loaded.
  - runs of decode steps between events are taken in one jump (the step time is fixed while the batch is), so a run
    costs a few events per request, not one per token.
Measured: requests issued from 20% to 90% of the run (the start fills the pipeline, the end drains it); throughput over
the span of their first tokens. Every function
here is arithmetic over roofline costs, no device is touched.
"""
from __future__ import annotations
import functools, heapq, math, random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from tinyhet.planner.catalog import Link, Model
from tinyhet.planner.roofline import Node, decode_context, decode_step_time, kv_transfer_exposed, max_batch, prefill_batch_time

PREFILL_TOKEN_BUDGET = 8192  # tokens one prefill pass takes at most (at least one whole prompt), as vLLM's max_num_batched_tokens
COLOCATED_SEQS = 256         # sequences a colocated unit runs at most (vLLM's max_num_seqs): past it, prompts wait and decode runs
ROLES = ("prefill", "decode", "both")

@dataclass(frozen=True)
class Unit:
  """One replica of a node in one role."""
  name: str
  node: Node
  role: str  # "prefill" | "decode" | "both"

@dataclass(frozen=True)
class SLO:
  """Latency targets a request must meet (None: no target) and the share of requests that must meet them."""
  ttft_s: float | None = None
  tpot_s: float | None = None
  attainment: float = 0.9

  def met(self, ttft: float, tpot: float) -> bool:
    return (self.ttft_s is None or ttft <= self.ttft_s) and (self.tpot_s is None or tpot <= self.tpot_s)

@dataclass(frozen=True)
class Outcome:
  """What one run measured. TPOT: (finish - first token) / (output_len - 1), per request."""
  ttft_p50_s: float
  ttft_p90_s: float
  tpot_p50_s: float
  tpot_p90_s: float
  throughput_tok_s: float   # output tokens/s over the measured window
  request_rps: float        # requests/s finishing over the measured window
  attainment: float         # share of measured requests meeting the SLO
  goodput_rps: float        # requests/s meeting the SLO
  prefill_busy: float = 0.0  # share of time units that prefill spent prefilling
  decode_batch: float = 0.0  # sequences a decoding unit ran per step, averaged over time
  e2e_mean_s: float = 0.0    # arrival to last token, mean over measured requests

def _pct(xs: list[float], q: float) -> float:
  s = sorted(xs)
  return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]

@dataclass
class _State:
  unit: Unit
  limit: int                  # sequences its memory holds
  prefill_s: float            # one prompt alone
  step: Callable[[float], float]
  queue: deque = field(default_factory=deque)    # requests waiting for prefill
  waiting: deque = field(default_factory=deque)  # requests waiting for a decode slot
  active: dict = field(default_factory=dict)     # request -> output tokens still to make
  busy_until: float = 0.0
  prefill_s_total: float = 0.0
  batch_s: float = 0.0        # sequences x seconds of decode runs
  nic_free: float = 0.0
  work: tuple = ()            # what runs until busy_until: ("prefill", requests) or ("decode", steps, start, step seconds)
  version: int = 0            # of the pending "free" event; a cut run pushes a new one and the old is ignored

  def pending_s(self, now: float, output_len: int) -> float:
    """How loaded a unit is for a new prompt, in seconds, for least-loaded routing. A prefill-only unit: the prompts
    ahead of it and the pass under way (FCFS passes). A colocated unit: its requests in flight (queued, waiting, running)
    times the seconds one takes there (a prefill pass plus its tokens at the present batch's step), i.e. least
    outstanding requests weighted by how long one takes there alone, as a load balancer in front of vLLM replicas does
    (the weight is fixed per unit: one that fell with the batch would make the busier unit look lighter). Its decode run is cut at the
    next step for a prompt, so the run's planned end is no measure: routing by it (or by prefill queues alone) piles
    prompts, and the stalls they bring, onto a few replicas while others idle."""
    if self.unit.role != "both":
      return (len(self.queue) + 1) * self.prefill_s + max(0.0, self.busy_until - now)
    passing = len(self.work[1]) if self.work and self.work[0] == "prefill" else 0  # in the pass under way
    return (len(self.queue) + passing + len(self.waiting) + len(self.active) + 1) * (self.prefill_s + (output_len - 1) * self.step(1))

  def decode_load(self) -> float:
    """How loaded a decoding unit is for one more sequence: its sequences once that one joins, times the step they
    would then take (so a unit twice as fast takes about twice as many). Not the step shared per sequence, which falls
    with the batch and would make the busier unit look lighter and pile sequences onto it."""
    n = len(self.active) + len(self.waiting) + 1
    return n * self.step(n)

def simulate(units: list[Unit], model: Model, prompt_len: int, output_len: int, link: Callable[[str, str], Link],
             rate: float | None = None, concurrency: int | None = None, requests: int = 400, slo: SLO = SLO(), seed: int = 0,
             round_robin: bool = False, overlap: bool = True) -> Outcome:
  """Run `requests` requests through `units` (at least one that prefills and one that decodes, each holding the model
  with one request) at `rate` requests/s or `concurrency` clients; `link(node_a, node_b)` is the link between two nodes.
  `round_robin`: each request goes to the next colocated unit in turn (naive load balancing) instead of the least loaded;
  `overlap=False`: the KV cache is sent after prefill instead of layer by layer."""
  if (rate is None) == (concurrency is None): raise ValueError("give exactly one of rate and concurrency")
  if rate is not None and not rate > 0: raise ValueError(f"rate must be > 0 requests/s (got {rate})")
  if concurrency is not None and concurrency < 1: raise ValueError(f"concurrency must be at least 1 (got {concurrency})")
  if requests < 10: raise ValueError(f"simulate at least 10 requests (got {requests})")
  if (bad := [f"{u.name}: {u.role!r}" for u in units if u.role not in ROLES]): raise ValueError(f"roles are {', '.join(ROLES)}; got {', '.join(bad)}")
  context = decode_context(prompt_len, output_len)
  states = [_State(u, min(max_batch(u.node, model, prompt_len + output_len), COLOCATED_SEQS if u.role == "both" else 1 << 30),
                   prefill_batch_time(u.node, model, 1, prompt_len),
                   functools.cache((lambda n: lambda b: decode_step_time(n, model, b, context))(u.node))) for u in units]  # batch -> step s
  passes: dict[tuple[int, int], float] = {}  # (id of node, prompts) -> seconds of one prefill pass
  def pass_s(node: Node, prompts: int) -> float:
    if (id(node), prompts) not in passes: passes[id(node), prompts] = prefill_batch_time(node, model, prompts, prompt_len)
    return passes[id(node), prompts]
  prefillers = [s for s in states if s.unit.role in ("prefill", "both")]
  decoders = [s for s in states if s.unit.role in ("decode", "both")]
  decode_only = [s for s in states if s.unit.role == "decode"]
  if not prefillers or not decoders: raise ValueError("a configuration needs a unit that prefills and one that decodes")
  if (full := [s.unit.name for s in decoders if s.limit < 1]):
    raise ValueError(f"{', '.join(full)} cannot hold {model.name} with a {prompt_len + output_len}-token sequence")
  kv_bytes = prompt_len * model.kv_bytes_per_token
  arrive, first, finish = {}, {}, {}
  # (time of the first event, seconds between events, events, output tokens each): throughput counts tokens as they come
  # (each step of a decode run at its own end, not the run's tokens where the run ends), not as requests end
  made: list[tuple[float, float, int, int]] = []
  events, seq, issued, rr = [], 0, 0, 0
  rng = random.Random(seed)

  def push(t: float, kind: str, what):
    nonlocal seq
    heapq.heappush(events, (t, seq, kind, what))
    seq += 1

  def issue(t: float):
    nonlocal issued
    if issued < requests:
      push(t, "arrive", issued)
      issued += 1

  if rate is not None:
    t = 0.0
    for _ in range(requests):
      push(t, "arrive", issued)
      issued += 1
      t += rng.expovariate(rate)
  else:
    for _ in range(min(concurrency, requests)): issue(0.0)

  def done(r: int, t: float):
    finish[r] = t
    if concurrency is not None: issue(t)

  def start(s: _State, now: float):
    """Give an idle unit its next work: waiting prompts first (if their decode will fit, for a colocated unit), then decode steps."""
    if s.busy_until > now: return
    room = s.limit - len(s.active) - len(s.waiting) if s.unit.role == "both" else len(s.queue)
    if s.queue and room > 0:
      take = max(1, min(room, len(s.queue), PREFILL_TOKEN_BUDGET // prompt_len))
      batch = [s.queue.popleft() for _ in range(take)]
      s.work, s.busy_until = ("prefill", batch), now + pass_s(s.unit.node, take)
      s.prefill_s_total += s.busy_until - now
    elif s.active:
      step = s.step(len(s.active))
      steps = min(s.active.values())  # run until a sequence ends; new work cuts the run short (cut)
      s.work, s.busy_until = ("decode", steps, now, step), now + steps * step
      s.batch_s += len(s.active) * steps * step
    else:
      return
    s.version += 1
    push(s.busy_until, "free", (s, s.version))

  def cut(s: _State, now: float):
    """New work for a unit in a run of decode steps: end the run at the next step boundary, where the work can join."""
    if not s.work or s.work[0] != "decode" or s.busy_until <= now: return
    _, steps, begun, step = s.work
    done_steps = max(1, math.ceil((now - begun) / step - 1e-9))
    if done_steps >= steps: return
    end = begun + done_steps * step
    s.batch_s -= len(s.active) * (s.busy_until - end)
    s.work, s.busy_until = ("decode", done_steps, begun, step), end
    s.version += 1
    push(end, "free", (s, s.version))

  def admit(s: _State, now: float):
    """Sequences join a unit's batch only between steps: while it runs, they wait for its next "free" event."""
    if s.busy_until > now: return
    while s.waiting and len(s.active) < s.limit:
      s.active[s.waiting.popleft()] = output_len - 1
    start(s, now)

  now = 0.0
  while events:
    now, _, kind, what = heapq.heappop(events)
    if kind == "arrive":
      arrive[what] = now
      if round_robin:
        s = prefillers[rr % len(prefillers)]
        rr += 1
      else:
        s = min(prefillers, key=lambda p: p.pending_s(now, output_len))
      s.queue.append(what)
      cut(s, now)
      start(s, now)
    elif kind == "kv":  # a request's KV cache is in a decode unit's memory: it joins at the next step boundary
      r, s = what
      s.waiting.append(r)
      if len(s.active) < s.limit: cut(s, now)
      admit(s, now)
    else:  # a unit finished its work
      s, version = what
      if version != s.version: continue  # a run that was cut short
      work, s.work = s.work, ()
      kind_, payload = work[:2]
      if kind_ == "prefill":
        made.append((now, 0.0, 1, len(payload)))
        for r in payload:
          first[r] = now
          if output_len == 1: done(r, now)
          else:
            # a colocated unit keeps it unless a decode-only unit is as lightly loaded (colocated replicas do not trade requests)
            d = min([*decode_only, s] if s.unit.role == "both" else decoders, key=lambda d: d.decode_load())
            if d is s:
              s.waiting.append(r)
              continue
            l = link(s.unit.node.name, d.unit.node.name)
            sent = max(now + kv_transfer_exposed(model, prompt_len, s.prefill_s, l, overlap), s.nic_free + kv_bytes / l.bandwidth + l.latency)
            s.nic_free = sent
            push(sent, "kv", (r, d))
        admit(s, now) if s.unit.role == "both" else start(s, now)
      else:
        _, steps, begun, step = work
        made.append((begun + step, step, steps, len(s.active)))
        for r in list(s.active):
          s.active[r] -= payload
          if s.active[r] <= 0:
            del s.active[r]
            done(r, now)
        admit(s, now)
  if len(finish) != requests: raise RuntimeError(f"simulation ended with {requests - len(finish)} requests unfinished")  # a bug, not an input
  return _measure(arrive, first, finish, made, requests, output_len, rate, slo, states, now)

def _measure(arrive, first, finish, made, requests, output_len, rate, slo, states, end) -> Outcome:
  """Latencies of the requests issued from 20% to 90% of the run; throughput: output tokens made between their first
  tokens (the load is steady then; counting tokens rather than finished requests keeps bursts of completions out of it)."""
  lo, hi = int(0.2 * requests), max(int(0.9 * requests), int(0.2 * requests) + 1)
  measured = [r for r in range(lo, min(hi, requests)) if r in finish]
  ttft = [first[r] - arrive[r] for r in measured]
  tpot = [(finish[r] - first[r]) / (output_len - 1) if output_len > 1 else 0.0 for r in measured]
  # the window: from the first token of the first measured request to that of the last. Under a load it keeps up with
  # this is the arrival window shifted by a TTFT; overloaded, the arrival window would close while the work it admitted
  # is barely started (a colocated unit is still filling its batch with prompts), measuring the ramp, not the saturated
  # rate, whereas the queue still holds the requests after the last measured one when its first token is out
  a, b = first[lo], first[min(hi, requests - 1)]
  if b <= a: a, b = 0.0, end  # a closed loop's clients all sent at once: the whole run
  rps = sum(n * _events_in(t0, dt, k, a, b) for t0, dt, k, n in made) / (b - a) / output_len
  met = sum(1 for x, y in zip(ttft, tpot) if slo.met(x, y)) / max(1, len(ttft))
  offered = rps if rate is None else min(rate, rps)
  pre = [s.prefill_s_total / end for s in states if s.unit.role != "decode"] if end > 0 else [0.0]
  dec = [s.batch_s / end for s in states if s.unit.role != "prefill"] if end > 0 else [0.0]
  return Outcome(_pct(ttft, 0.5), _pct(ttft, 0.9), _pct(tpot, 0.5), _pct(tpot, 0.9), rps * output_len, rps, met, offered * met,
                 sum(pre) / len(pre), sum(dec) / len(dec), sum(finish[r] - arrive[r] for r in measured) / max(1, len(measured)))

def _events_in(t0: float, dt: float, k: int, a: float, b: float) -> int:
  """How many of the k events at t0, t0 + dt, ..., t0 + (k - 1) dt fall in (a, b]."""
  if dt <= 0: return k if a < t0 <= b else 0
  lo = 0 if t0 > a else math.floor((a - t0) / dt) + 1
  hi = -1 if t0 > b else min(k - 1, math.floor((b - t0) / dt))
  return max(0, hi - lo + 1)

def unit_rates(node: Node, role: str, model: Model, prompt_len: int, output_len: int) -> tuple[float, float]:
  """(requests/s it prefills, requests/s it decodes) at most, for one unit in `role`: prompts batched to the token
  budget, decode at the full batch its memory (or, colocated, COLOCATED_SEQS) allows; a colocated unit alone in both."""
  k = max(1, PREFILL_TOKEN_BUDGET // prompt_len)
  p_s = prefill_batch_time(node, model, k, prompt_len) / k
  b = max(1, min(max_batch(node, model, prompt_len + output_len), COLOCATED_SEQS if role == "both" else 1 << 30))
  d = b / (max(output_len - 1, 1) * decode_step_time(node, model, b, decode_context(prompt_len, output_len)))
  if role == "prefill": return 1 / p_s, 0.0
  if role == "decode": return 0.0, d
  both = 1 / (p_s + 1 / d)
  return both, both

def capacity(units: list[Unit], model: Model, prompt_len: int, output_len: int) -> float:
  """A quick upper estimate of the requests/s `units` sustain (for screening configurations and bounding searches)."""
  rates = [unit_rates(u.node, u.role, model, prompt_len, output_len) for u in units]
  return min(sum(p for p, _ in rates), sum(d for _, d in rates))

def alone_throughput(node: Node, model: Model, prompt_len: int, output_len: int, rate: float | None = None, concurrency: int | None = None) -> float:
  """Output tokens/s of one replica of `node` serving alone (prefill and decode colocated) at a rate or a concurrency."""
  def no_link(a: str, b: str) -> Link: raise AssertionError("a unit alone sends no KV")
  requests = min(2000, max(200, 4 * (concurrency or 0)))
  return simulate([Unit(node.name, node, "both")], model, prompt_len, output_len, no_link, rate, concurrency, requests).throughput_tok_s

def max_goodput(units: list[Unit], model: Model, prompt_len: int, output_len: int, link, slo: SLO, requests: int = 400, seed: int = 0,
                round_robin: bool = False, iterations: int = 7, overlap: bool = True) -> tuple[float, Outcome | None]:
  """DistServe's goodput: the highest Poisson rate at which at least `slo.attainment` of requests meet the SLO, found by a
  scan up to the capacity estimate and bisection; with the run at that rate (None when even a trickle misses the SLO)."""
  cap = capacity(units, model, prompt_len, output_len)
  run = lambda r: simulate(units, model, prompt_len, output_len, link, rate=r, requests=requests, slo=slo, seed=seed, round_robin=round_robin,
                           overlap=overlap)
  # attainment need not fall monotonically with the rate (a colocated unit may take a prompt at one rate and not at the
  # next), so a coarse scan finds the highest rate that meets it before bisection refines it
  grid = [cap * f for f in (0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.2)]
  outs = [run(r) for r in grid]
  ok = [i for i, o in enumerate(outs) if o.attainment >= slo.attainment]
  if not ok: return 0.0, None
  i = ok[-1]
  lo, best = grid[i], outs[i]
  hi = grid[i + 1] if i + 1 < len(grid) else grid[i] * 2
  for _ in range(iterations):
    mid = (lo + hi) / 2
    out = run(mid)
    if out.attainment >= slo.attainment: lo, best = mid, out
    else: hi = mid
  return lo, best
