"""Draft-model drafting for speculative decoding (mode "draft", docs/speculative.md): a smaller model of the same
tokenizer on the same node, with a paged KV pool of its own, decodes each sequence's next tokens greedily; the target
verifies them in one step (engine/speculative.py), as it does n-gram drafts.

  draft = DraftModel(model, num_blocks, block_size)    # its own DecodeEngine over its own pool
  pending = draft.sync(seq_ids, token_lists)           # tokens each sequence still has to feed the draft (after its rollback)
  drafts = draft.run(seq_ids, token_lists, takes)      # takes[i] greedy tokens after token_lists[i] (0: none, it only catches up)
  seconds = draft.cost(depth, rows)                    # what drafting `depth` tokens for sequences of `rows` first-step rows costs
  draft.forget(seq_id)

The draft's pool holds, for each sequence, the K, V of the tokens it has been fed: the sequence's own, then the drafts
it made. sync compares those with the sequence's tokens now (only past the part already known to agree) and truncates
the pool to the agreeing prefix, so the rejected drafts' slots go back (BlockManager.truncate) and what is left to feed
is the accepted tokens' tail and the target's own token: one to k + 1 tokens a step. A sequence the draft has not seen
(a new request, a prompt) is fed over steps, at most `catch_up` rows of such tokens a step for all of them (the step's
stall is bounded, as a prefill budget bounds a prefill's), and drafts only once it is within MAX_PENDING tokens.

A draft round is one decode step of the draft's DecodeEngine: the first feeds every drafting sequence's pending tokens
(rows with counts, as the verify step's) and the catch-up rows, and draws each drafting sequence's first token from its
last row's logits; each later round feeds the one token drawn, one row a sequence still drafting. Drafts are greedy (a
point mass), so the verify step's rule (keep a draft while it equals the target's draw) is the standard rejection rule
and the output is the target's own, at any temperature.

Where the node warms up (engine/warm_up.py), the draft runs only at batch buckets its warm-up captured (`ready`): a
bucket not captured yet costs infinity to the policy, and the catch-up rows are cut to the largest ready bucket. The pool
is the node's to size; a sequence that finds no free block drafts nothing (the draft's least recently used sequences
other than the step's are evicted first: a sequence that ended without forget() holds its blocks only until then).
"""
from __future__ import annotations
from collections import OrderedDict
import time
import numpy as np
from tinyhet.engine.decode_engine import BATCH_BUCKETS, DecodeEngine, PAD_SEQ, batch_bucket
from tinyhet.engine.spec_policy import DRAFT_N  # noqa: F401  (the policy's key for this model's drafts)
from tinyhet.engine.step_costs import StepCosts
from tinyhet.kv.paged_cache import PagedKVCache

MAX_PENDING = 16     # a sequence with more tokens than this still to feed catches up before it drafts
CATCH_UP = 128       # the most rows of catching-up tokens a step feeds the draft, all sequences together

class DraftModel:
  def __init__(self, model, num_blocks: int, block_size: int = 16, name: str = "", catch_up: int = CATCH_UP):
    cfg = model.cfg
    self.model, self.name, self.catch_up = model, name, catch_up
    self.cache = PagedKVCache(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, num_blocks + 1, block_size, device=model.device,   # +1: PAD_SEQ's
                              max_seq_len=cfg.max_context)
    self.engine = DecodeEngine(model, self.cache)
    self.bm = self.cache.block_manager
    self.fed: OrderedDict[int, list[int]] = OrderedDict()   # seq_id -> the tokens whose K, V its pool holds, least recently used first
    self.agreed: dict[int, int] = {}          # seq_id -> how many of fed[seq_id] were the sequence's own tokens (not drafts)
    self.ready: set[int] | None = None        # the batch buckets it may run at (None: any, captured on first use)
    self.costs = StepCosts(self.engine)
    self.steps = self.fed_tokens = 0          # draft steps run and tokens fed (its figures)

  def warm(self, B: int) -> None:
    """Capture the draft's decode step at bucket B (the node's warm-up calls this for each bucket it may need)."""
    self.engine.warm_up((B,))
    if self.ready is None: self.ready = set()
    self.ready.add(B)

  def bucket(self, rows: int) -> int | None:
    """The bucket a draft step of rows runs at: batch_bucket's, or the smallest ready one holding it (None: none does)."""
    if self.ready is None: return batch_bucket(rows)
    return min((b for b in self.ready if b >= rows), default=None)

  def most_rows(self) -> int:
    return max(self.ready, default=0) if self.ready is not None else BATCH_BUCKETS[-1]


  def catch_up_rows(self) -> int:
    """Rows a step's catch-up feeds run at, at most: the catch-up budget within the most rows captured (0: none)."""
    return min(self.catch_up, self.most_rows())
  def price(self, rows: int) -> float:
    """Seconds of a draft step of rows (its bucket's, measured; infinity where no ready bucket holds them)."""
    return float("inf") if (B := self.bucket(rows)) is None else self.costs(B)

  def cost(self, depth: int, first_rows: int, rows: int) -> float:
    """Seconds to draft depth tokens: a first step of first_rows rows, then depth - 1 steps of rows rows (0 for depth 0)."""
    return 0.0 if depth <= 0 else self.price(first_rows) + (depth - 1) * self.price(rows)

  def forget(self, seq_id: int) -> None:
    """seq_id is done: its blocks in the draft's pool go back."""
    if self.fed.pop(seq_id, None) is not None: self.bm.deallocate(seq_id)
    self.agreed.pop(seq_id, None)

  def sync(self, seq_ids: list[int], token_lists: list[list[int]]) -> list[int]:
    """Roll each sequence's draft pool back to the tokens it shares with token_lists[i] (never past the last one, which
    the draft must be fed to draw after it); the count of tokens each still has to feed."""
    pending = []
    for sid, tokens in zip(seq_ids, token_lists):
      fed, base = self.fed.get(sid), self.agreed.get(sid, 0)
      if fed is not None and (len(tokens) < base or base and fed[base - 1] != tokens[base - 1]): self.forget(sid); fed = None
      if fed is None:
        self.bm.allocate(sid, 0)
        fed = self.fed[sid] = []
        base = 0
      n = base
      while n < len(fed) and n < len(tokens) - 1 and fed[n] == tokens[n]: n += 1
      n = min(n, len(tokens) - 1)
      if n < len(fed):
        self.bm.truncate(sid, n)
        del fed[n:]
      self.agreed[sid] = n
      self.fed.move_to_end(sid)
      pending.append(len(tokens) - n)
    return pending

  def room(self, seq_id: int, n: int, keep: set[int]) -> bool:
    """Whether n more slots fit seq_id's table, evicting the least recently used sequences not in keep if need be."""
    need = lambda: self.bm.blocks_needed(self.bm.length(seq_id) + n) - len(self.bm.block_table(seq_id))
    while need() > self.bm.num_free:
      old = next((s for s in self.fed if s not in keep), None)
      if old is None: return False
      self.forget(old)
    return True

  def run(self, seq_ids: list[int], token_lists: list[list[int]], takes: list[int], catch_up: list[bool] | None = None) -> list[list[int]]:
    """Each sequence's greedy draft of takes[i] tokens (after sync: the pool holds its tokens but its pending tail);
    sequences taking none are fed part of their tail (catch-up rows) within the step's budget, where catch_up[i] (default
    all)."""
    keep, drafts, takes = set(seq_ids), [[] for _ in seq_ids], list(takes)
    feed, budget = [0] * len(seq_ids), self.catch_up_rows()
    for i, (sid, tokens, t) in enumerate(zip(seq_ids, token_lists, takes)):     # drafting rows first, whole
      pend = len(tokens) - len(self.fed[sid])
      if t > 0 and pend <= budget and self.room(sid, pend + t - 1, keep): feed[i], budget = pend, budget - pend
      else: takes[i] = 0
    for i, (sid, tokens) in enumerate(zip(seq_ids, token_lists)):               # then catch-up rows, as the budget allows
      if takes[i] or budget <= 0 or catch_up is not None and not catch_up[i]: continue
      n = min(len(tokens) - len(self.fed[sid]), budget)
      if n > 0 and self.room(sid, n, keep): feed[i], budget = n, budget - n
    rows = [(i, tokens[len(self.fed[sid]):len(self.fed[sid]) + feed[i]]) for i, (sid, tokens) in enumerate(zip(seq_ids, token_lists)) if feed[i]]
    if not rows: return drafts
    logits = self.step([seq_ids[i] for i, _ in rows], [r for _, r in rows])
    end = 0
    for i, r in rows:
      end += len(r)
      if takes[i]: drafts[i].append(int(np.argmax(logits[end - 1])))
    while (live := [i for i, t in enumerate(takes) if len(drafts[i]) < t]):
      logits = self.step([seq_ids[i] for i in live], [[drafts[i][-1]] for i in live])
      for j, i in enumerate(live): drafts[i].append(int(np.argmax(logits[j])))
    return drafts

  def step(self, seq_ids: list[int], feeds: list[list[int]]) -> np.ndarray:
    """One draft decode step: feeds[i] appended to seq_ids[i]'s pool (a row each); the logits of every row."""
    counts = [len(f) for f in feeds]
    for sid, f in zip(seq_ids, feeds):
      for _ in f: self.bm.append_slot(sid)
      self.fed[sid] += f
    B = self.bucket(sum(counts))
    t0 = time.perf_counter()
    logits = self.engine.step(seq_ids, [t for f in feeds for t in f], bucket=B, counts=counts)
    self.costs.record(B, time.perf_counter() - t0)
    self.steps, self.fed_tokens = self.steps + 1, self.fed_tokens + sum(counts)
    return logits

  def check(self) -> None:
    """Every sequence's pool length is what it was fed (tests)."""
    for sid, fed in self.fed.items(): assert self.bm.length(sid) == len(fed), (sid, self.bm.length(sid), len(fed))
    assert set(self.bm.tables) == set(self.fed) | {PAD_SEQ}
    self.bm.check()

def same_tokenizer(a, b) -> str | None:
  """Why tokenizers a and b are not the same (a draft must share its target's ids), or None when they are."""
  if type(a) is not type(b): return f"tokenizers of different kinds ({type(a).__name__}, {type(b).__name__})"
  if getattr(a, "vocab_size", None) != getattr(b, "vocab_size", None):
    return f"vocabularies of {getattr(a, 'vocab_size', '?')} and {getattr(b, 'vocab_size', '?')} tokens"
  ta, tb = getattr(a, "tok", None), getattr(b, "tok", None)
  if ta is not None and tb is not None and ta.get_vocab(with_added_tokens=True) != tb.get_vocab(with_added_tokens=True):
    return "the same number of tokens but other token ids"
  return None
