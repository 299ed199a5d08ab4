"""Which sequences draft, and how many tokens, in a speculative step (engine/speculative.py): drafting only where it pays.

  policy = SpecPolicy()
  lens = policy.plan(seq_ids, draft_lens, ns, cost)   # tokens to verify a sequence (0: none), from each one's n-gram draft
  policy.update(seq_id, n, tried, accepted)           # after the verify step, per sequence that drafted
  policy.forget(seq_id)                               # the sequence is done

Why a policy: a verify step of R rows costs the node's plain step of R rows, padded to its batch bucket, and that is not
free. On free chat a 1-gram almost always matches, so drafting whenever a match exists verifies ~4 tokens a step to keep
~0.07 of them (0.76x plain at batch 1); at batch 16 a k = 4 verify is a step of 80 rows (bucket 96) for ~3.4 tokens a row.

The estimate is by how long a tail the draft matched on (ns[i], one of ngram_draft.SIZES): a draft matched on 16 tokens is
kept far more often than one matched on the last token only, whatever the sequence (measured on tinyhet bench spec's
greedy outputs: the next token ~98% of the time against 15-29%), so the node keeps, for each n, p(n), the chance that a
drafted token is kept given the one before it was: accepted tokens over tried positions (accepted ones plus the first
rejected one, if any, the maximum-likelihood rate of a geometric run), both decayed sums over the node's verifies of
n-matched drafts (each verify scales the old sums by 1 - decay, then adds its own; `prior` over one position to start), so
the figure follows what the node serves now, and a first verify moves it at once. It is the node's, not a sequence's: a
new sequence starts from what the node has seen, and a sequence's own few verifies are too noisy to price 8 rows on. A
draft of j tokens is then worth sum_{m<=j} p^m expected extra tokens.

The step's cost is measured on the node (cost(rows), seconds of a step of that many rows, engine/step_costs.py; infinite
at a bucket the node has not captured, which is then never planned). plan()
takes the drafted tokens in the order of their worth (a sequence's m-th token before its (m+1)-th, since p^m falls), and
for every row count R from the batch's own (no drafts) to all drafts picks the R whose expected tokens per second,
(B + sum of the worth taken) / cost(R), is highest; ties go to fewer rows. Since a step runs at its batch bucket, only each
bucket's largest R is priced, and the scan stops once all the worth left could not beat the best over the cheapest step's
time (so a policy that expects nothing asks no cost, and a bucket is measured only when the plan could use it). Drafts
are taken only where their rate beats the step without them by `margin` (5%): the price leaves out what a verify costs
besides its step (sampling each row, the rows' logits copied out, the estimate's error), and a batch of fixed-length rows
ends with its slowest row, so tokens gained by the others are worth less than they count (tinyhet bench spec's free chat
at batch 16: an earlier policy, drafting at break-even, decoded at 0.95x plain decode).
No drafts chosen: the step is a plain decode step of B rows (its own capture, no counts). Each sequence's draft length
is its own: up to what its draft holds (k, at most speculative.MAX_K), as far as its p(n) pays for the rows.

An n whose estimate keeps it from being drafted would never be measured again, so after `probe_every` steps in which some
sequence had an n-matched draft and none was taken, one of them drafts one token (a probe), which updates p(n). A rejected
probe doubles that n's wait for the next one (up to `max_probe_gap` steps), a kept one resets it: on free chat, where
short matches are rarely kept, probes grow rare, and there is at most one a step for each n, whatever the batch. A probe
rides a padding row of the plain step's bucket where there is one (it costs nothing); where the batch fills its bucket
(batch 1, 16: a probe's row runs the step at the next bucket, +16-19% at 1 and 16 rows measured on SmolLM2) it waits
`max_probe_gap` steps (tinyhet bench spec's free chat, where such probes came every 16-128 steps for each of 7 match
lengths: 0.97x plain decode at batches 1 and 16). A
sequence with no n-gram match drafts nothing (its draft is empty).
"""
from __future__ import annotations
from typing import Callable
from tinyhet.engine.decode_engine import BATCH_BUCKETS, batch_bucket

DRAFT_N = 0          # the key a draft model's acceptance is kept under (an n-gram draft's is its match length, >= 1)
BUCKETS = frozenset(BATCH_BUCKETS)
def is_bucket(rows: int) -> bool:
  """Whether a step of rows fills its batch bucket (one more row runs at the next): batch_bucket(rows) == rows."""
  return rows in BUCKETS or rows > BATCH_BUCKETS[-1] and rows % 64 == 0

class SpecPolicy:
  """The node's acceptance estimate for each match length, and the rows-vs-time choice of each step's drafts."""
  def __init__(self, prior: float = 0.3, decay: float = 0.02, probe_every: int = 16, max_probe_gap: int = 256, margin: float = 0.05,
               draft_prior: float = 0.6):
    self.prior, self.decay, self.probe_every, self.max_probe_gap, self.margin = prior, decay, probe_every, max_probe_gap, margin
    self.draft_prior = draft_prior           # a draft model's starting estimate: it was chosen to agree with its target
    self.acc: dict[int, float] = {}          # n -> decayed sum of accepted tokens over verifies of n-matched drafts
    self.tried: dict[int, float] = {}        # n -> decayed sum of positions tried (accepted + the rejected one)
    self.idle: dict[int, int] = {}           # n -> steps with an n-matched draft but none taken
    self.gap: dict[int, int] = {}            # n -> idle steps before its next probe (probe_every, doubled per miss)
    self.probing: dict[int, int] = {}        # seq_id -> the n its one-token draft this step probes

  def p(self, n: int) -> float:
    """The estimated chance a drafted token is kept (after the ones before it were), its draft matched on n tokens."""
    return min(self.acc.get(n, self.prior_of(n)) / self.tried.get(n, 1.0), 0.999)

  def prior_of(self, n: int) -> float: return self.draft_prior if n == DRAFT_N else self.prior

  def update(self, seq_id: int, n: int, tried: int, accepted: int):
    """After a verify of `tried` positions of seq_id's n-matched draft, of which the first `accepted` were kept (tried =
    accepted + 1 on a rejection)."""
    if tried <= 0: return
    if self.probing.get(seq_id) == n:         # a probe: a miss waits twice as long for the next one, a hit resets the wait
      del self.probing[seq_id]
      self.gap[n] = self.probe_every if accepted else min(2 * self.gap.get(n, self.probe_every), self.max_probe_gap)
    keep = 1 - self.decay
    self.acc[n] = keep * self.acc.get(n, self.prior_of(n)) + accepted
    self.tried[n] = keep * self.tried.get(n, 1.0) + tried

  def forget(self, seq_id: int):
    """seq_id is done: a probe it was given is dropped."""
    self.probing.pop(seq_id, None)

  def draft_gain(self, B: int, k: int, cost: Callable[[int], float], draft_step: Callable[[int], float]) -> float:
    """Seconds a draft model would save per token of a sequence in a batch of B, by the estimate p(DRAFT_N): a plain step
    of B rows against the best draft depth d <= k (B * (d + 1) rows verified after d draft steps of B rows, for
    1 + p + ... + p^d tokens a sequence); 0 where no depth beats the plain step."""
    p, plain = self.p(DRAFT_N), cost(B)
    best = min((cost(B * (d + 1)) + d * draft_step(B)) / sum(p ** m for m in range(d + 1)) for d in range(1, k + 1))
    return max(0.0, plain - best)

  def plan(self, seq_ids: list[int], draft_lens: list[int], ns: list[int], cost: Callable[[int], float],
           draft_cost: Callable[[int], float] | None = None) -> list[int]:
    """Tokens of each sequence's draft to verify (<= draft_lens[i], ns[i] the tail length it matched on): the choice with
    the most expected tokens per second of step time, cost(R) being a step of R rows. The probes (one token, at most one
    for each n) due are kept. A sequence with ns[i] == DRAFT_N drafts with a draft model after the plan (draft_lens[i]
    the most it may draft): draft_cost(depth), the seconds its drafting of depth tokens takes, is added to the step's,
    depth the most tokens any such sequence is given."""
    B = len(seq_ids)
    take = [0] * B
    self.probing = {}
    if not any(draft_lens): return take          # nothing to draft: a plain step, no cost asked for
    free = batch_bucket(B) - B                    # padding rows of the plain step: a probe there costs nothing
    for i, (sid, d, n) in enumerate(zip(seq_ids, draft_lens, ns)):
      if not d or n in self.probing.values() or (idle := self.idle.get(n, 0)) < self.gap.get(n, self.probe_every): continue
      if free > 0: free -= 1
      elif idle < self.max_probe_gap: continue     # a probe that would run the step at a larger bucket waits the longest gap
      take[i], self.probing[sid] = 1, n
    probes = list(take)
    ps = [self.p(n) for n in ns]
    worth = sorted(((ps[i] ** m, i) for i, d in enumerate(draft_lens) for m in range(1 + probes[i], d + 1)), key=lambda w: -w[0])
    gain = sum(ps[i] for i, t in enumerate(probes) if t)
    R0, total = B + sum(probes), gain + sum(w for w, _ in worth)
    modeled, dc = [n == DRAFT_N for n in ns], draft_cost or (lambda depth: 0.0)
    cur, depth = list(probes), max((t for t, m in zip(probes, modeled) if m), default=0)
    if (base := cost(R0) + dc(depth)) == float("inf"):   # even the probes' step is at a bucket the node cannot run now: no drafts
      self.probing = {}
      return [0] * B
    best_r, best = 0, (B + gain) / base * (1 + self.margin)    # drafts must beat the plain step by margin
    for r, (w, i) in enumerate(worth, 1):
      gain += w
      cur[i] += 1
      if modeled[i]: depth = max(depth, cur[i])
      # a step costs its bucket's time: within a bucket more rows only add worth, so only a bucket's last row count is
      # priced (with a draft model's cost, every count: a deeper draft costs more); and no larger step can beat best
      # once all the worth left over the cheapest step's time does not
      if (B + total) / base <= best * (1 + 1e-9): break
      if draft_cost is None and r < len(worth) and not is_bucket(R0 + r): continue
      if (rate := (B + gain) / (cost(R0 + r) + dc(depth))) > best * (1 + 1e-9): best_r, best = r, rate
    for _, i in worth[:best_r]: take[i] += 1
    self.probing = {sid: n for sid, n in self.probing.items() if take[seq_ids.index(sid)] == 1}
    offered, taken = {n for n, d in zip(ns, draft_lens) if d}, {n for n, t in zip(ns, take) if t}
    for n in offered: self.idle[n] = 0 if n in taken else self.idle.get(n, 0) + 1
    return take
