"""Which sequences draft, and how many tokens, in a speculative step (engine/speculative.py): drafting only where it pays.

  policy = SpecPolicy()
  lens = policy.plan(seq_ids, draft_lens, cost)    # tokens to verify a sequence (0: none), from each one's n-gram draft
  policy.update(seq_id, tried, accepted)           # after the verify step
  policy.forget(seq_id)                            # the sequence is done

Why a policy: a verify step of R rows costs the node's plain step of R rows, padded to its batch bucket, and that is not
free. On free chat a 1-gram almost always matches, so drafting whenever a match exists verifies ~4 tokens a step to keep
~0.07 of them (0.76x plain at batch 1); at batch 16 a k = 4 verify is a step of 80 rows (bucket 96) for ~3.4 tokens a row.

Each sequence carries an estimate p of the chance that its next drafted token is kept, given the one before it was: an
exponential moving average of accepted tokens over tried positions (accepted ones plus the first rejected one, if any),
the maximum-likelihood rate of a geometric run. A draft of j tokens is then worth sum_{m<=j} p^m expected extra tokens.
The step's cost is measured on the node (cost(rows), seconds of a step of that many rows, engine/step_costs.py). plan()
takes the drafted tokens in the order of their worth (a sequence's m-th token before its (m+1)-th, since p^m falls), and
for every row count R from the batch's own (no drafts) to all drafts picks the R whose expected tokens per second,
(B + sum of the worth taken) / cost(R), is highest; ties go to fewer rows. Since a step runs at its batch bucket, only each
bucket's largest R is priced, and the scan stops once all the worth left could not beat the best over the cheapest step's
time (so a policy that expects nothing asks no cost, and a bucket is measured only when the plan could use it).
No drafts chosen: the step is a plain decode step of B rows (its own capture, no counts).

A new sequence starts from the node's own figure: the same average over every sequence's verifies (`prior` until the
first), so a node that serves free chat does not spend a new chat sequence's first steps on drafts, nor a node of
rewrites hold back a new rewrite's.

A sequence whose estimate keeps it from drafting would never be measured again, so after `probe_every` steps without a
draft it drafts one token (a probe), which updates p. A rejected probe doubles that sequence's wait for the next one (up
to `max_probe_gap` steps), a kept one resets it: on free chat, where drafts are rarely kept, probes grow rare. A sequence
with no n-gram match drafts nothing (its draft is empty).
"""
from __future__ import annotations
from typing import Callable
from tinyhet.engine.decode_engine import batch_bucket

class SpecPolicy:
  """Per-sequence acceptance estimates and the rows-vs-time choice of each step's drafts."""
  def __init__(self, alpha: float = 0.3, prior: float = 0.3, probe_every: int = 16, max_probe_gap: int = 256, max_seqs: int = 4096):
    self.alpha, self.prior, self.probe_every, self.max_probe_gap, self.max_seqs = alpha, prior, probe_every, max_probe_gap, max_seqs
    self.gap: dict[int, int] = {}            # seq_id -> steps without a draft before its next probe (probe_every, doubled per miss)
    self.probing: set[int] = set()           # sequences whose draft this step is only a probe
    self.all_acc, self.all_tried = prior, 1.0    # the same EMAs over every sequence's verifies: a new sequence's start
    self.acc: dict[int, float] = {}          # seq_id -> EMA of accepted tokens a verify
    self.tried: dict[int, float] = {}        # seq_id -> EMA of positions tried a verify (accepted + the rejected one)
    self.idle: dict[int, int] = {}           # seq_id -> steps since its last draft

  def p(self, seq_id: int) -> float:
    """The estimated chance a drafted token is kept (after the ones before it were)."""
    t = self.tried.get(seq_id)
    return min((self.acc[seq_id] / t) if t else (self.all_acc / self.all_tried), 0.999)

  def update(self, seq_id: int, tried: int, accepted: int):
    """After a verify of `tried` positions of which the first `accepted` were kept (tried = accepted + 1 on a rejection)."""
    if tried <= 0: return
    if seq_id in self.probing:                   # a probe: a miss waits twice as long for the next one, a hit resets the wait
      self.probing.discard(seq_id)
      self.gap[seq_id] = self.probe_every if accepted else min(2 * self.gap.get(seq_id, self.probe_every), self.max_probe_gap)
    if seq_id not in self.tried:
      if len(self.tried) >= self.max_seqs:       # bounded: the oldest sequence's estimate goes (a finished one not forgotten)
        old = next(iter(self.tried))
        self.forget(old)
      self.acc[seq_id], self.tried[seq_id] = self.all_acc / self.all_tried, 1.0
    a, g = self.alpha, self.alpha / 4          # the node's figure moves slower: it averages many sequences
    self.all_acc = (1 - g) * self.all_acc + g * accepted
    self.all_tried = (1 - g) * self.all_tried + g * tried
    self.acc[seq_id] = (1 - a) * self.acc[seq_id] + a * accepted
    self.tried[seq_id] = (1 - a) * self.tried[seq_id] + a * tried

  def forget(self, seq_id: int):
    for d in (self.acc, self.tried, self.idle, self.gap): d.pop(seq_id, None)
    self.probing.discard(seq_id)

  def plan(self, seq_ids: list[int], draft_lens: list[int], cost: Callable[[int], float]) -> list[int]:
    """Tokens of each sequence's draft to verify (<= draft_lens[i]): the choice with the most expected tokens per second of
    step time, cost(R) being a step of R rows. Probes (one token) for sequences idle for probe_every steps are kept."""
    B = len(seq_ids)
    take = [0] * B
    for i, (sid, n) in enumerate(zip(seq_ids, draft_lens)):
      if n and self.idle.get(sid, 0) >= self.gap.get(sid, self.probe_every): take[i] = 1
    probes = list(take)
    if not any(draft_lens):                     # nothing to draft: a plain step, no cost asked for
      for sid in seq_ids: self.idle[sid] = self.idle.get(sid, 0) + 1
      return take
    worth = sorted(((self.p(sid) ** m, i) for i, (sid, n) in enumerate(zip(seq_ids, draft_lens)) for m in range(1 + probes[i], n + 1)),
                   key=lambda w: -w[0])
    gain = sum(self.p(sid) for sid, t in zip(seq_ids, probes) if t)
    R0, total = B + sum(probes), gain + sum(w for w, _ in worth)
    best_r, best = 0, (B + gain) / (base := cost(R0))
    for r, (w, _) in enumerate(worth, 1):
      gain += w
      # a step costs its bucket's time: within a bucket more rows only add worth, so only a bucket's last row count is
      # priced; and no larger step can beat best once all the worth left over the cheapest step's time does not
      if (B + total) / base <= best * (1 + 1e-9): break
      if r < len(worth) and batch_bucket(R0 + r + 1) == batch_bucket(R0 + r): continue
      if (rate := (B + gain) / cost(R0 + r)) > best * (1 + 1e-9): best_r, best = r, rate
    for _, i in worth[:best_r]: take[i] += 1
    self.probing = {sid for sid, t, pr in zip(seq_ids, take, probes) if pr and t == 1}
    for sid, t in zip(seq_ids, take): self.idle[sid] = 0 if t else self.idle.get(sid, 0) + 1
    return take
