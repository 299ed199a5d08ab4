"""One step of a decode node's batching loop (tinyhet.engine.decode_node.DecodeNode.run) for one batch: the decode step of
the decoding sequences, or a prompt's chunk (with its forks at its last one); then the batch's tokens sampled together,
without the lock, and handed to each sequence's queue. decode_only_step: the decoding sequences' step alone, which a
`both` node runs between the layers of a prefill job (tinyhet.service.node_roles.KeepPace), so that a job of a whole prompt
never holds back the tokens of the sequences decoding there.
"""
from __future__ import annotations
from tinyhet.engine.forked_samples import prefill_group
from tinyhet.engine.grammar import prefetch
from tinyhet.engine.scheduler import SequenceStatus
from tinyhet.engine.speculative_rows import run_speculative
from tinyhet.model.sampling import sample_batch

def run_batch(node, batch: list, piece: tuple[int, int] | None) -> None:
  """batch: the decoding sequences (piece None), or a prompt's sequence and its forks with its chunk (first, end). The
  caller holds the batch's sequences in node.in_step (their blocks are not freed while it runs)."""
  if piece is None and not (batch := run_speculative(node, batch)): return    # the rows that asked for it: tinyhet.engine.speculative_rows
  # a grammar's masks, made on the grammar thread while the step runs (none for rows without one, or a chunk short of its end)
  masks = None if piece and piece[1] < batch[0].num_tokens else prefetch([s.extra["sampler"] for s in batch], [s.token_ids for s in batch])
  try:
    if piece is None: logits = node.engine.step([s.seq_id for s in batch], [s.token_ids[-1] for s in batch], node.cond)
    elif (logits := prefill_group(node, batch, *piece)) is None:    # a chunk short of the prompt's end: nothing to sample yet
      with node.cond:
        if batch[0].extra.get("cancelled") and batch[0].status is SequenceStatus.RUNNING: node.scheduler.finish(batch[0])
        else: batch[0].prefilled = piece[1]
      return
  except Exception as e:                 # a failed step fails its sequences, not the node
    logits = None
    with node.cond: node.scheduler.steps_failed(batch, piece is not None)     # they cache nothing past what they stored
    for s in batch: s.extra["queue"].put(RuntimeError(f"decode step failed on {node.node.name}: {type(e).__name__}: {e}"))
  if masks is not None: masks.result()
  # the whole batch sampled at once, without the lock (reservations and notices go on meanwhile): the step's sequences
  # keep their blocks and tokens until this thread postprocesses them
  draws = None if logits is None else sample_batch(logits[:len(batch)], [s.extra["sampler"] for s in batch], [s.num_tokens for s in batch],
                                                   [s.token_ids for s in batch])     # num_tokens: the new token's position
  with node.cond:
    for s in batch: s.prefilled = None   # a prompt's last chunk: it decodes from the next step on
    live = [s for s in batch if not s.extra.get("cancelled")]
    if logits is None: finished = list(live)
    else:
      new, failed = {}, []
      for s in live:
        d = draws[batch.index(s)]
        if isinstance(d, ValueError):        # non-finite logits: that sequence fails, with the reason; the node goes on
          s.extra["queue"].put(ValueError(f"sequence {s.seq_id} stopped: {d}"))
          failed.append(s)
        else: new[s.seq_id] = d
        if s.extra.get("want_logits"): s.extra["last_logits"] = logits[batch.index(s)].copy()   # the logits behind the newest token
      ok = [s for s in live if s.seq_id in new]
      finished = node.scheduler.postprocess(ok, [new[s.seq_id].token for s in ok]) + failed
      for s in ok:
        d = new[s.seq_id]
        s.extra["queue"].put(d.token if d.logprob is None else (d.token, d.logprob, d.top))
        if (d.token in s.extra["stop_ids"] or node._hits_stop(s, d.token) or node.grammar_done(s)) and s not in finished: finished.append(s)
    for s in batch:
      if (s in finished or s.extra.get("cancelled")) and s.status is SequenceStatus.RUNNING: node.scheduler.finish(s)
    for s in finished: s.extra["queue"].put(None)
    node.cond.notify_all()

def decode_only_step(node) -> int:
  """One decode step of the sequences decoding on the node now, no prompt chunk with it (Scheduler.decode_slots); the number
  of sequences it stepped. Run on the model's thread, outside a step of the loop (a `both` node's prefill job)."""
  with node.cond:
    decode = node.scheduler.decode_slots()
    node.in_step = set(decode)
  try:
    if decode: run_batch(node, decode, None)
  finally:
    with node.cond: node.in_step = set()
  return len(decode)
