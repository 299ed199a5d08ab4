"""Continuous batching over a paged KV pool, in nano-vllm's manner: admission and preemption. Plain Python, no device.

A step is either a prefill batch (waiting sequences admitted while their blocks fit) or a decode batch (every running
sequence gets one token slot). A full pool never crashes and never truncates: admission waits for blocks (first come, first
served), and a decode step that needs a block preempts the newest running sequence: its blocks are freed and it goes back to
the front of the waiting queue, to be recomputed (prompt and generated tokens prefilled again) when blocks free up.
Admission is by need: a request holds its prompt's blocks (less a prefix-cache hit) and grows a block at a time. A prompt
that could not fit even in an empty pool is rejected when it is added, with one error naming its size and the pool's; a
max_new_tokens past what the whole pool holds is cut to that (the request ends with 'length' there).

With the block manager's prefix cache on, admission shares the cached blocks a sequence's tokens start with (the engine then
computes only the rest: cached_length), and a finished or preempted sequence's full blocks stay cached, evicted (least
recently used) before any running sequence is preempted. Only KV the node vouches for is cached: a sequence whose engine set
cache_limit (a failed step or prefill, a prompt written by a peer it does not trust) caches at most that many tokens.

Parallel samples (n > 1): a sequence may carry forks, sequences of the same prompt that its first prefill serves too. They
are admitted with it (room in the batch for all of them, and a block each for the copy of a partial last block) and forked
at once (BlockManager.fork: the prompt's full blocks shared by reference count); the engine copies the partial block's KV
(fork_copy) after the prefill and samples every fork's first token from the same logits. A preempted fork is recomputed on
its own, like any sequence.

Sequences prefilled elsewhere (disaggregated) arrive through reserve_incoming (blocks held before the prefill node starts
writing), then commit_incoming when the transfer lands, or abort_incoming when it fails.

Token accounting: after a step, a running sequence has KV for num_tokens - 1 tokens; its last token (just sampled) is the
input of its next decode step, which stores its KV in the slot that schedule() appended.
"""
from __future__ import annotations
from collections import deque
from dataclasses import dataclass, field
from enum import Enum, auto
from tinyhet.kv.block_manager import BlockManager

class SequenceStatus(Enum):
  WAITING = auto(); INCOMING = auto(); RUNNING = auto(); FINISHED = auto()  # noqa: E702

class RequestTooLarge(ValueError):
  """A request longer than the whole KV pool: no amount of waiting or preemption makes it fit."""

@dataclass(eq=False)
class Sequence:
  seq_id: int
  token_ids: list[int]            # prompt, then generated tokens
  max_new_tokens: int
  num_prompt_tokens: int = -1     # defaults to len(token_ids) at creation
  status: SequenceStatus = SequenceStatus.WAITING
  num_preemptions: int = 0
  prefilled: int | None = None    # while its prompt is prefilled over several steps (schedule_step): the tokens whose KV is stored
  extra: dict = field(default_factory=dict)   # the engine's per-sequence state (sampling parameters, a reply channel)
  cache_salt: str = ""            # its tenant's salt: it shares cached blocks only with sequences of the same salt
  writer: str | None = None       # the peer that wrote its prompt's KV (a prefill node); None: computed on this node
  cache_limit: int | None = None  # tokens at most whose KV may enter the prefix cache as it leaves; None: all it stores
  forks: list = field(default_factory=list)   # sequences of the same prompt forked from this one at its first prefill (n > 1)
  fork_of: Sequence | None = None             # a fork not yet prefilled: its KV comes from this sequence's prefill
  fork_copy: tuple | None = None              # (src, dst) block the engine copies for it after that prefill, or None

  def __post_init__(self):
    if self.num_prompt_tokens < 0: self.num_prompt_tokens = len(self.token_ids)
    if self.num_prompt_tokens < 1: raise ValueError(f"sequence {self.seq_id}: empty prompt")
  @property
  def num_tokens(self) -> int: return len(self.token_ids)
  @property
  def num_generated(self) -> int: return len(self.token_ids) - self.num_prompt_tokens
  @property
  def max_tokens(self) -> int: return self.num_prompt_tokens + self.max_new_tokens

class Scheduler:
  def __init__(self, block_manager: BlockManager, max_num_seqs: int = 64, max_num_batched_tokens: int = 8192, eos: int | None = None,
               capacity: int | None = None):
    # zero would admit nothing, ever: every request would wait for good (a node started with --max-seqs 0 did)
    if max_num_seqs < 1 or max_num_batched_tokens < 1:
      raise ValueError(f"max_num_seqs and max_num_batched_tokens must be at least 1, got {max_num_seqs} and {max_num_batched_tokens}")
    self.bm, self.max_num_seqs, self.max_num_batched_tokens, self.eos = block_manager, max_num_seqs, max_num_batched_tokens, eos
    self.capacity = block_manager.num_blocks if capacity is None else capacity   # blocks sequences can have (the engine may keep some)
    self.waiting: deque[Sequence] = deque()
    self.running: deque[Sequence] = deque()
    self.incoming: dict[int, Sequence] = {}
    self.num_preemptions = 0

  def is_finished(self) -> bool: return not self.waiting and not self.running and not self.incoming

  def check_fits(self, seq: Sequence) -> None:
    """Raise RequestTooLarge if seq's prompt needs more blocks than the whole pool; cut its max_new_tokens to what the whole
    pool holds past the prompt (the last token sampled needs no slot)."""
    if 1 + len(seq.forks) > self.max_num_seqs:
      raise RequestTooLarge(f"request {seq.seq_id}: {1 + len(seq.forks)} samples, but this node runs at most {self.max_num_seqs} sequences at once")
    need = self.bm.blocks_needed(seq.num_prompt_tokens) + self._copies(seq)
    if need > self.capacity:
      raise RequestTooLarge(f"request {seq.seq_id}: its prompt of {seq.num_prompt_tokens} tokens needs {need} KV blocks of "
                            f"{self.bm.block_size} tokens, but the pool has {self.capacity} blocks ({self.capacity * self.bm.block_size} tokens): "
                            "shorten the prompt or give the decode node a bigger KV pool")
    seq.max_new_tokens = min(seq.max_new_tokens, self.capacity * self.bm.block_size - seq.num_prompt_tokens + 1)

  def add(self, seq: Sequence) -> None:
    """Queue a request for prefill on this node."""
    self.check_fits(seq)
    seq.status = SequenceStatus.WAITING
    self.waiting.append(seq)

  def schedule(self) -> tuple[list[Sequence], bool]:
    """The next batch and whether it is a prefill. Prefill: admit waiting sequences in order while their blocks fit
    (num_tokens of KV each). Otherwise decode: one new token slot per running sequence, preempting the newest running
    sequences when a slot needs a block and none is free. An empty list means nothing can run until blocks free up."""
    scheduled: list[Sequence] = []
    batched = 0
    while self.waiting and (not scheduled or batched + self.waiting[0].num_tokens <= self.max_num_batched_tokens) and (seq := self._admit()):
      scheduled.append(seq)
      batched += seq.num_tokens
      scheduled += self._fork(seq)
    if scheduled: return scheduled, True

    while self.running:
      seq = self.running.popleft()
      while not self.bm.may_append(seq.seq_id):
        if self.running: self.preempt(self.running.pop())
        else:
          self.preempt(seq)
          break
      else:
        self.bm.append_slot(seq.seq_id)
        scheduled.append(seq)
    self.running.extendleft(reversed(scheduled))
    return scheduled, False

  def _copies(self, seq: Sequence) -> int:
    """Blocks seq's forks take at admission: a copy of the partial last block each (none when the prompt fills its blocks)."""
    return len(seq.forks) if seq.num_tokens % self.bm.block_size else 0

  def _fork(self, seq: Sequence) -> list[Sequence]:
    """seq's forks, running from now on with its prompt's blocks (they follow it in the prefill batch: the engine fills them)."""
    forks, seq.forks = [f for f in seq.forks if f.status is SequenceStatus.WAITING], []   # a fork its client dropped stays out
    for f in forks:
      f.max_new_tokens = min(f.max_new_tokens, seq.max_new_tokens)
      f.fork_copy, f.fork_of = self.bm.fork(seq.seq_id, f.seq_id), seq
      f.token_ids, f.status = list(seq.token_ids), SequenceStatus.RUNNING
      self.running.append(f)
    return forks

  def _admit(self) -> Sequence | None:
    """The first waiting sequence, running now with its blocks held; None when it does not fit (first come, first served:
    later requests wait too) or max_num_seqs sequences run or arrive (an incoming sequence will run here too; a sequence
    with forks needs a place for each, and a block each for its copy of the partial last block)."""
    if not self.waiting or len(self.running) + len(self.incoming) + 1 + len(self.waiting[0].forks) > self.max_num_seqs: return None
    seq = self.waiting[0]
    if self.bm.fresh_needed(seq.num_tokens, seq.token_ids, seq.cache_salt) + self._copies(seq) > self.bm.num_free: return None
    self.bm.allocate(seq.seq_id, seq.num_tokens, seq.token_ids, seq.cache_salt)
    self.waiting.popleft()
    seq.status = SequenceStatus.RUNNING
    self.running.append(seq)
    return seq

  def schedule_step(self, budget: int) -> tuple[list[Sequence], list[tuple[Sequence, int, int]]]:
    """A stall-free step (Sarathi-Serve's; vLLM's chunked prefill under max_num_batched_tokens): one new token slot for every
    decoding sequence, as schedule() gives them (preempting the newest when a slot needs a block), and prompt chunks of at most
    `budget` tokens in all: the prompts under way first, then waiting sequences admitted in order while their blocks fit.
    While nothing decodes, up to max_num_batched_tokens, but no chunk past the first that ends its prompt: that prompt
    decodes from the next step on, and a chunk after it in this step would hold back its second token (a stall of a whole
    prompt's prefill, the one these steps are there to prevent).
    Returns (decode batch, [(sequence, first token, end)]): the chunk's tokens are token_ids[first:end]; a prompt is done when
    its end is num_tokens (seq.prefilled holds the progress between steps; an admitted prompt starts after its cached prefix).
    A long prompt is spread over steps, so the decoding sequences get a token every step whatever arrives."""
    if budget < 1: raise ValueError(f"a step's prefill budget must be at least 1 token, got {budget}")
    decode = self.decode_slots()
    idle = not decode
    if idle: budget = max(budget, self.max_num_batched_tokens)     # nothing decodes to keep pace with: a prompt whole
    chunks: list[tuple[Sequence, int, int]] = []
    def take(seq: Sequence) -> bool:          # seq's next chunk; False once the step is full
      nonlocal budget
      n = min(seq.num_tokens - seq.prefilled, budget)
      chunks.append((seq, seq.prefilled, seq.prefilled + n))
      budget -= n
      return budget > 0 and not (idle and seq.prefilled + n == seq.num_tokens)
    for seq in [s for s in self.running if s.prefilled is not None]:
      if budget <= 0 or not take(seq): return decode, chunks
    while budget > 0 and (seq := self._admit()):
      self._fork(seq)                         # its forks run from now on, waiting (fork_of) for its prompt's last chunk
      seq.prefilled = self.bm.cached_length(seq.seq_id)
      if not take(seq): break
    return decode, chunks

  def decode_slots(self) -> list[Sequence]:
    """A new token slot for every decoding sequence (its prompt's KV in place), as schedule() gives them: a slot that needs a
    block preempts the newest running sequence. The sequences to decode this step; schedule_step's first half."""
    decode: list[Sequence] = []
    for seq in [s for s in self.running if s.prefilled is None and s.fork_of is None]:   # a fork decodes once its prompt's KV is in
      if seq.status is not SequenceStatus.RUNNING: continue            # preempted for an earlier sequence's slot
      while not self.bm.may_append(seq.seq_id):
        victim = self.running.pop()                                       # the newest, maybe seq itself
        self.preempt(victim)
        if victim is seq: break
      else:
        self.bm.append_slot(seq.seq_id)
        decode.append(seq)
    return decode

  def preempt(self, seq: Sequence) -> None:
    """Free seq's blocks (its full ones stay cached: its recompute may find them) and queue it first for recompute. Its
    forks still waiting for its prompt's KV go too: each is recomputed on its own."""
    self._unfork(seq)
    self.bm.deallocate(seq.seq_id, self.cacheable(seq))
    seq.status, seq.prefilled, seq.fork_of, seq.fork_copy = SequenceStatus.WAITING, None, None, None
    seq.cache_limit = None        # its recompute here computes every token past its (vouched) hit: a failure sets it again
    seq.num_preemptions += 1
    self.num_preemptions += 1
    self.waiting.appendleft(seq)

  def postprocess(self, seqs: list[Sequence], token_ids: list[int]) -> list[Sequence]:
    """Append each sequence's sampled token; finish (and free) those that hit eos or max_new_tokens. Returns the finished."""
    finished = []
    for seq, tok in zip(seqs, token_ids, strict=True):
      seq.token_ids.append(tok)
      if (self.eos is not None and tok == self.eos) or seq.num_generated >= seq.max_new_tokens:
        self.finish(seq)
        finished.append(seq)
    return finished

  def _unfork(self, seq: Sequence) -> None:
    """seq's forks still waiting for its prompt's KV, queued to be recomputed on their own: seq stopped part-way through a
    prompt spread over steps (schedule_step). A prompt prefilled whole (schedule) took its forks along in the same batch."""
    if seq.prefilled is None: return
    for f in [f for f in self.running if f.fork_of is seq]:
      self.running.remove(f)
      self.preempt(f)

  def finish(self, seq: Sequence) -> None:
    """Stop a running sequence (done, cancelled by its client, or failed) and free its blocks; its full ones stay cached, up
    to its cache_limit. Forks still waiting for its prompt's KV are recomputed on their own."""
    self._unfork(seq)
    self.running.remove(seq)
    self.bm.deallocate(seq.seq_id, self.cacheable(seq))
    seq.status = SequenceStatus.FINISHED

  def steps_failed(self, seqs: list[Sequence], in_prefill: bool) -> None:
    """A step over seqs failed: each caches nothing past its hit (a failed prefill: shared blocks, never written) or past
    the slot the step was writing (a failed decode step) as it leaves."""
    for seq in seqs:
      known = self.bm.cached_length(seq.seq_id) if in_prefill else self.bm.length(seq.seq_id) - 1
      seq.cache_limit = known if seq.cache_limit is None else min(seq.cache_limit, known)

  @staticmethod
  def cacheable(seq: Sequence) -> list[int]:
    """The tokens whose KV may stay cached as seq leaves: all it stores, or its first cache_limit."""
    return seq.token_ids if seq.cache_limit is None else seq.token_ids[:seq.cache_limit]

  # ***** sequences prefilled on another node *****

  def reserve_incoming(self, seq: Sequence, use_cache: bool = False) -> bool:
    """Hold blocks for seq's prompt KV before a prefill node writes it; False (nothing held) when they do not fit now or
    max_num_seqs sequences are already running or arriving. use_cache: share its cached prefix's blocks (the writer then
    writes from bm.cached_length on)."""
    self.check_fits(seq)
    ids = seq.token_ids if use_cache else None
    if self.bm.fresh_needed(seq.num_tokens, ids, seq.cache_salt) + self._copies(seq) > self.bm.num_free: return False
    if len(self.running) + len(self.incoming) + 1 + len(seq.forks) > self.max_num_seqs: return False
    self.bm.reserve(seq.seq_id, seq.num_tokens, ids, seq.cache_salt)
    seq.status = SequenceStatus.INCOMING
    self.incoming[seq.seq_id] = seq
    forks, seq.forks = seq.forks, []        # n > 1: its samples, reserved with it (their copies of its partial block made on commit)
    for f in forks:
      f.fork_copy = self.bm.fork(seq.seq_id, f.seq_id)
      f.max_new_tokens, f.status = min(f.max_new_tokens, seq.max_new_tokens), SequenceStatus.INCOMING
      self.incoming[f.seq_id] = f
    return True

  def commit_incoming(self, seq: Sequence, first_token: int) -> bool:
    """The prompt's KV landed and the prefill node sampled first_token: seq starts decoding here. Returns True when
    first_token already finished it (eos, or max_new_tokens == 1) and its blocks were freed."""
    self.bm.commit(self.incoming.pop(seq.seq_id).seq_id)
    seq.status = SequenceStatus.RUNNING
    self.running.append(seq)
    return bool(self.postprocess([seq], [first_token]))

  def abort_incoming(self, seq: Sequence) -> None:
    """The transfer failed: give its blocks back. The caller decides whether to prefill seq again (add) or drop it."""
    self.bm.release_reservation(self.incoming.pop(seq.seq_id).seq_id)
    seq.status = SequenceStatus.WAITING
