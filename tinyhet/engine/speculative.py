"""Speculative decoding on the decode node's paged KV: each sequence's newest token and up to k drafted tokens
(engine/ngram_draft.py: NgramIndex, one a sequence) go through the model in one step (the weights read once for k + 1 tokens a row), the longest
prefix of drafts that the model itself would have produced is kept, and the rejected drafts' KV slots are given back.

  spec = SpeculativeStep(engine)                       # over a DecodeEngine's model and paged cache
  draws = spec.step(seq_ids, token_lists, samplers, k)  # per sequence the Draws of 1..k+1 new tokens

Each draft is cut to what pays (engine/spec_policy.py: the node's acceptance estimate for a draft matched on that many
tokens against the measured time of a step of that many rows, engine/step_costs.py); a step where no sequence drafts is
plain decode's own step. k is each sequence's most (a request's, DEFAULT_K = MAX_K = 8 when it does not say): the policy
picks each draft's length up to it.
SpeculativeStep(engine, adaptive=False) verifies every n-gram draft whole, up to k.

Before a step each sequence holds len(tokens) slots (the newest token's included, as for a plain decode step); after it
len(tokens) + len(draws) - 1, and the blocks taken for rejected drafts are back in the free queue where they were
(BlockManager.truncate, last taken first): lengths, table sizes and free blocks are as a plain decode of the same tokens
leaves them, no hash covering a rejected token. Which block ids each sequence holds may differ from plain decode's: rows
cross block boundaries in another order, and a block one row rolls back stays free while a later row keeps its own.

Why the output is plain decode's: row j of the step holds the model's logits after the tokens before it, so its draw is the
token plain decode draws at that position (up to the bits of the logits, which the verify's attention and, past one
decode tile, its matrix kernels sum in another order: docs/speculative.md); a draft is kept only while it equals that draw. Sampling draws from (seed,
position) (tinyhet.model.sampling), so the same holds at any temperature: for a draft that is one token (a point mass),
drawing the model's token with the position's draw and keeping the draft while they agree is the standard rejection rule
(kept with probability p(x); on a rejection the token drawn is from p restricted to tokens != x, renormalized), and the
tokens are plain sampling's, token for token.

The verify step is plain decode's own: a sequence's newest token and its draft are rows of one DecodeEngine.step (its
counts), padded to a batch bucket and replayed from that bucket's TinyJit capture, so a step of B sequences with drafts of
d tokens costs a plain decode step of B * (d + 1) rows (the weights read once, each row's attention over its own context),
with no tinygrad scheduling on the way.
"""
from __future__ import annotations
import contextlib
import time
from tinyhet.engine.ngram_draft import NgramIndex
from tinyhet.engine.draft_model import MAX_PENDING
from tinyhet.engine.spec_policy import DRAFT_N, SpecPolicy
from tinyhet.engine.step_costs import StepCosts
from tinyhet.kernels.quant_matmul import DECODE_MAX_M
from tinyhet.model.sampling import DEFAULT_K, MAX_K, MODES, check_speculative, sample_batch  # noqa: F401  (the request's field: checked there)

MAX_INDEXES = 4096      # sequences whose n-gram table is kept (the oldest goes first: one never forgotten)


def within_one_tile(take: list[int], tile: int = DECODE_MAX_M) -> list[int]:
  """Each sequence's draft cap (`take`, the most it may draft) cut, the longest first, so that a step whose plain rows fit
  one decode tile (`tile` rows: the matrix kernels' decode kernel, up to DECODE_MAX_M rows of x) verifies within it too,
  and the policy prices the step that runs. Past it the kernels switch (kernels/quant_matmul.py), and a row's bits, so a
  near-tie's greedy token, would differ from plain decode's. A step of more sequences than a tile runs past it plain or
  not, where every row gets the same bits at any count: nothing is cut. (Attention sums each row as the plain step of its
  sequences does at any row count: the verify passes that step's part count, DecodeEngine.step.)"""
  if len(take) > tile: return list(take)
  take = list(take)
  while len(take) + sum(take) > tile: take[take.index(max(take))] -= 1
  return take


class SpeculativeStep:
  """Draft, verify in one multi-token step through the paged cache, keep the agreeing prefix, roll the rest back."""
  def __init__(self, engine, adaptive: bool = True, policy: SpecPolicy | None = None, capture: bool = True, draft=None):
    self.engine, self.cache, self.bm = engine, engine.cache, engine.cache.block_manager
    self.drafted = self.accepted = self.steps = 0      # /metrics' counters: accept length = accepted / steps + 1
    self.verifies = self.plain_steps = 0               # engine steps run with drafts, and without (a plain decode step)
    # adaptive: each sequence's draft cut by spec_policy (its acceptance estimate against the measured step costs);
    # else every n-gram draft is verified whole, up to k
    self.policy = (policy or SpecPolicy()) if adaptive else None
    self.costs = StepCosts(engine, capture=capture)     # capture False: only buckets captured already are planned (a node's)
    self.index: dict[int, NgramIndex] = {}             # seq_id -> its n-gram table (ngram_draft.NgramIndex)
    self.draft = draft                                 # a DraftModel (engine/draft_model.py) for the sequences of mode "draft", or None

  def forget(self, seq_id: int):
    """seq_id is done: its n-gram table and any probe it was given go."""
    self.index.pop(seq_id, None)
    if self.policy is not None: self.policy.forget(seq_id)
    if self.draft is not None: self.draft.forget(seq_id)

  def drafts(self, seq_ids: list[int], token_lists: list[list[int]], ks: list[int], limits: list[int],
             modes: list[str] | None = None) -> tuple[list[list[int]], list[int]]:
    """Each sequence's draft and the tail length it matched on (DRAFT_N for a draft model's): up to ks[i] tokens and its
    limit (tokens it may still take, less the one every step gives), cut by the policy where adaptive. modes[i]: "ngram"
    (the default) or "draft" (the draft model's, drafted after the plan, as long as the plan gives it). Needs no lock
    (the policy may time a step: StepCosts.measure)."""
    modes = modes or ["ngram"] * len(seq_ids)
    if "draft" in modes and self.draft is None: raise ValueError('speculative mode "draft" needs a draft model (tinyhet node --draft-model)')
    caps = within_one_tile([min(k, max(0, limit - 1), self.cache.max_seq_len - len(t)) for t, k, limit in zip(token_lists, ks, limits)])
    modeled = [i for i, m in enumerate(modes) if m == "draft"]
    pending = dict(zip(modeled, self.draft.sync([seq_ids[i] for i in modeled], [token_lists[i] for i in modeled]))) if modeled else {}
    behind = [i for i in modeled if pending[i] > MAX_PENDING]
    gain = self.catch_up_gain(len(seq_ids), max(ks)) if behind else 0.0   # the same for every sequence of the step: once
    catch_up = {i: self.catch_up_pays(pending[i], limits[i], gain) for i in behind}
    out, ns = [], []
    for i, (sid, tokens, cap) in enumerate(zip(seq_ids, token_lists, caps)):
      if i in pending:               # drafted below; it may draft once the draft model has caught up with it
        out.append([0] * (cap if pending[i] <= MAX_PENDING else 0))
        ns.append(DRAFT_N)
        continue
      if (ix := self.index.get(sid)) is None:
        if len(self.index) >= MAX_INDEXES: self.index.pop(next(iter(self.index)))
        ix = self.index[sid] = NgramIndex()
      d, n = ix.draft(tokens, cap)
      out.append(d)
      ns.append(n)
    take = [len(d) for d in out]
    if self.policy is not None:
      draft_cost = None
      if modeled:
        ready = [i for i in modeled if out[i]]
        first = sum(pending[i] for i in ready)
        draft_cost = lambda depth: self.draft.cost(depth, first, len(ready))    # noqa: E731
      take = self.policy.plan(seq_ids, take, ns, self.costs, draft_cost)
    if modeled:
      made = self.draft.run([seq_ids[i] for i in modeled], [token_lists[i] for i in modeled], [take[i] for i in modeled],
                            [catch_up.get(i, True) for i in modeled])
      for i, d in zip(modeled, made): out[i] = d
    return [d[:n] for d, n in zip(out, take)], ns

  def catch_up_gain(self, B: int, k: int) -> float | None:
    """Seconds a draft saves per token at this step's batch and depth (SpecPolicy.draft_gain, by the node's estimate and
    measured step costs); None without a policy (catching up always pays), 0 where the draft model has no captured rows."""
    if self.policy is None: return None
    return self.policy.draft_gain(B, k, self.costs, self.draft.price) if self.draft.catch_up_rows() else 0.0

  def catch_up_pays(self, pending: int, limit: int, gain: float | None) -> bool:
    """Whether feeding a sequence's pending tokens to the draft model (its prompt, say) pays for itself over the limit
    tokens it may still take: the draft's catch-up rows' time against `gain` (catch_up_gain) per token."""
    if gain is None: return True
    rows = self.draft.catch_up_rows()
    return bool(rows) and limit * gain > pending * self.draft.price(rows) / rows

  def fit(self, token_lists: list[list[int]], out: list[list[int]]) -> list[list[int]]:
    """The drafts cut so their slots fit the plain free blocks (no cached block evicted, nothing preempted); under the lock."""
    free = len(self.bm.free_ids)
    def blocks(n: int) -> int:         # new blocks the drafts cut to n tokens take
      return sum(self.bm.blocks_needed(len(t) + min(len(d), n)) - self.bm.blocks_needed(len(t)) for t, d in zip(token_lists, out))
    n = max(len(d) for d in out)
    while n > 0 and blocks(n) > free: n -= 1
    return [d[:n] for d in out]

  def step(self, seq_ids: list[int], token_lists: list[list[int]], samplers: list, k: int | list[int], limits: list[int] | None = None,
           stops: list[set] | None = None, lock=None, modes: list[str] | None = None) -> list[list]:
    """Per sequence the Draws of its new tokens (1 + its accepted drafts). k: the most tokens a sequence drafts (one for all,
    or one each). limits: tokens each may still take. modes: each one's drafter, "ngram" (default) or "draft". stops: each
    sequence's stop ids, after which nothing more is kept (cut before the rollback). lock: held while the block manager
    and the step's block tables are touched (the decode node's, whose other threads change them).
    The verify step is a decode step (DecodeEngine.step with counts) whose rows are each sequence's newest token and its
    draft: the jitted, bucketed step of plain decode, replayed from its capture, each row of a sequence attending to the
    slots before its own (the rows before it store theirs in the same step). A sequence takes slots for its own draft
    only: rows of a shorter draft are not padded."""
    ks = list(k) if isinstance(k, (list, tuple)) else [k] * len(seq_ids)
    limits = limits or [kk + 1 for kk in ks]
    self.costs.lock = lock
    drafts, ns = self.drafts(seq_ids, token_lists, ks, limits, modes)
    with lock if lock is not None else contextlib.nullcontext():
      drafts = self.fit(token_lists, drafts)
      for sid, d in zip(seq_ids, drafts):
        for _ in d: self.bm.append_slot(sid)
    counts = [1 + len(d) for d in drafts]
    self.steps += len(seq_ids)
    if sum(counts) == len(seq_ids):            # nothing drafted: a plain decode step (its own capture, no counts)
      t0 = time.perf_counter()
      logits = self.engine.step(seq_ids, [t[-1] for t in token_lists], lock)
      self.costs.record(len(seq_ids), time.perf_counter() - t0)
      self.plain_steps += 1
      return [[d] for d in sample_batch(logits, samplers, [len(t) for t in token_lists], token_lists)]
    rows = [tok for tokens, d in zip(token_lists, drafts) for tok in (tokens[-1], *d)]
    t0 = time.perf_counter()
    logits = self.engine.step(seq_ids, rows, lock, counts=counts)      # (sum(counts), vocab)
    self.costs.record(len(rows), time.perf_counter() - t0)
    self.verifies += 1
    # the model's draw at every row, in one call (a draw depends only on its row, position and the tokens before it); a
    # penalizing sampler reads each row's own history, the drafts before it
    history = [tokens + d[:j] if samplers[i].penalizes or samplers[i].constraint is not None else tokens
               for i, (tokens, d) in enumerate(zip(token_lists, drafts)) for j in range(len(d) + 1)]
    draws = sample_batch(logits, [s for s, c in zip(samplers, counts) for _ in range(c)],
                         [len(tokens) + j for tokens, c in zip(token_lists, counts) for j in range(c)], history)
    out, first = [], 0
    for i, (tokens, d) in enumerate(zip(token_lists, drafts)):
      kept = []
      for j in range(len(d) + 1):            # kept while the draft agrees with the model's draw
        kept.append(draw := draws[first + j])
        if isinstance(draw, Exception) or j == len(d) or draw.token != d[j] or (stops and draw.token in stops[i]): break
      samplers[i].position = len(tokens) + len(kept) - isinstance(kept[-1], Exception)   # as plain sampling leaves it
      first += counts[i]
      self.drafted += len(d)
      self.accepted += len(kept) - 1
      if self.policy is not None and d: self.policy.update(seq_ids[i], ns[i], min(len(d), len(kept)), len(kept) - 1)
      out.append(kept)
    with lock if lock is not None else contextlib.nullcontext():
      for sid, tokens, kept in reversed(list(zip(seq_ids, token_lists, out))):   # undone last taken first: the free queue's order
        self.bm.truncate(sid, len(tokens) + len(kept) - 1)
    return out
