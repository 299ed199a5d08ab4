"""n > 1: the samples of a prompt prefilled once. On the decode node's own prefill (prefill_group), the forks take the
prompt's KV and logits at its last chunk. On the disaggregated path, the samples of a prompt that a prefill node prefilled:

  decode.reserve  with n: the prompt's blocks for the first sample, and n - 1 forks of it reserved with it (the prompt's full
                  blocks shared by reference count, a block each for its copy of the partial last one); the prefill node
                  writes the first sample's blocks only.
  decode.generate with first_tokens (one per sample, sampled by the prefill node from the prompt's logits, sample i with
                  seed + i): once every layer has landed the partial block is copied to each fork, every sample joins the
                  batch with its own first token and seed, and the stream's items carry their sample's index
                  ({"done", "index"} as each ends, then {"done": True}). However it ends, every sample leaves the node.
"""
from __future__ import annotations
import queue, time
import numpy as np
from tinyhet.engine.checks import is_int
from tinyhet.engine.grammar import constrain
from tinyhet.engine.scheduler import Sequence, SequenceStatus
from tinyhet.engine.token_queue import TICK, token_item
from tinyhet.model.sampling import Sampler

def with_forks(scheduler, s: Sequence) -> list[Sequence]:
  """s and its forks still waiting for its prompt's KV (Scheduler._fork), in the order they were forked."""
  return [s, *(f for f in scheduler.running if f.fork_of is s)]

def prefill_group(node, group: list[Sequence], first: int | None = None, end: int | None = None):
  """A decode node's prefill of group[0] (or a chunk of it); at its prompt's end its forks (n > 1, prefilled on this node)
  take its KV (their partial last block copied now) and its logits. Logits (len(group), vocab), or None until the last chunk."""
  if (logits := node._prefill(group[0], first, end)) is None: return None
  for f in group[1:]:
    if f.fork_copy is not None: node.cache.copy_block(*f.fork_copy)
    f.fork_of, f.fork_copy = None, None
    f.extra.setdefault("cached_tokens", group[0].extra.get("cached_tokens", 0))
  return np.repeat(logits, len(group), axis=0)

class Tagged:
  """The queue of one of n samples: what the batching loop puts in it goes to the samples' shared queue as (index, item)."""
  def __init__(self, shared: queue.SimpleQueue, index: int): self.shared, self.index = shared, index
  def put(self, item) -> None: self.shared.put((self.index, item))

def generate_samples(node, conn, head: Sequence, first_tokens, sampling: dict, stop_ids, stop, timeout: float):
  seqs = [head] + head.extra["samples"]
  V = node.model.cfg.vocab_size
  if not isinstance(first_tokens, list) or len(first_tokens) != len(seqs) or not all(is_int(t) and 0 <= t < V for t in first_tokens):
    raise ValueError(f"first_tokens must be a list of {len(seqs)} token ids (one per reserved sample)")
  if stop_ids is not None and (not isinstance(stop_ids, list) or not all(is_int(t) for t in stop_ids)):
    raise ValueError(f"stop_ids must be a list of token ids, got {stop_ids!r}")
  first = Sampler(sampling["temperature"], sampling["top_p"], sampling["seed"], **(sampling["options"] or {}))
  samplers = [first] + [Sampler(sampling["temperature"], sampling["top_p"], (first.seed + i) % 2**64, **(sampling["options"] or {}))
                        for i in range(1, len(seqs))]
  for sampler in samplers: constrain(sampler, node.tokenizer, V)      # a grammar's token masks (tinyhet.engine.grammar)
  shared = queue.SimpleQueue()
  for i, (s, sampler) in enumerate(zip(seqs, samplers)):
    s.extra.update(queue=Tagged(shared, i), sampler=sampler, first_token=first_tokens[i], want_logits=False,
                   stop_ids=set(stop_ids if stop_ids is not None else node.stop_ids))
    node.set_stop_strings(s, stop)
  return _stream(node, conn, seqs, shared, timeout)

def sample_items(seqs: list[Sequence], shared: queue.SimpleQueue, left: set[int]):
  """The items of the samples in `left` as the batching loop queues them, each with its index, {"done", "index"} as each
  ends; None every TICK while none comes (the control channel then looks for a cancel or a departed client)."""
  while left:
    try: i, tok = shared.get(timeout=TICK)
    except queue.Empty:
      yield None
      continue
    if isinstance(tok, Exception): raise tok
    if tok is None:
      left.discard(i)
      yield {"done": True, "index": i, "preemptions": seqs[i].num_preemptions, "ended": bool(seqs[i].extra.get("grammar_done"))}
    else: yield {**token_item(tok), "index": i}

def _stream(node, conn, seqs: list[Sequence], shared: queue.SimpleQueue, timeout: float):
  head = seqs[0]
  try:
    deadline = time.monotonic() + timeout
    while not head.extra["layers"].wait(min(TICK, max(0.0, deadline - time.monotonic()))):
      if time.monotonic() >= deadline:
        raise TimeoutError(f"sequence {head.seq_id}: KV of {len(node.landed.get(head.seq_id, ()))} of {node.model.cfg.n_layers} layers "
                           f"arrived within {timeout} s")
      yield None
    yield from node.wait_restore(head, deadline, timeout)      # a disk hit read back and checked (tinyhet.kv.disk_restore)
    left = set()
    with node.cond:
      node.commit_restore(head)
      del node.landed[head.seq_id]
      for i, s in enumerate(seqs):
        if s.status is not SequenceStatus.INCOMING: continue          # a sample its client let go of already
        if s.fork_copy is not None: node.cache.copy_block(*s.fork_copy)
        s.fork_copy = None
        tok = s.extra["first_token"]
        done = node.scheduler.commit_incoming(s, tok) or tok in s.extra["stop_ids"] or node._hits_stop(s, tok) or node.grammar_done(s)
        if done and s.status is SequenceStatus.RUNNING: node.scheduler.finish(s)
        if not done: left.add(i)
      node.cond.notify_all()
    for i in set(range(len(seqs))) - left: yield {"done": True, "index": i, "preemptions": 0, "ended": bool(seqs[i].extra.get("grammar_done"))}
    yield from sample_items(seqs, shared, left)
    yield {"done": True, "preemptions": sum(s.num_preemptions for s in seqs)}
  finally:
    for s in seqs: node._detach(conn.state.get("seqs", {}), s)
