"""The decode node's rows that decode speculatively (docs/speculative.md): those whose request asked for it, or whose node
default is on (DecodeNode.speculative, `tinyhet node --speculative`), run one tinyhet.engine.speculative.SpeculativeStep
of their own before the plain step of the rest (tinyhet.engine.batch_step.run_batch), each drafting by its mode: ngram,
or draft (the node's draft model, `tinyhet node --draft-model`; on a node without one such a request fails with a 400
that says so). A row with a grammar, logprobs, returned logits or stop strings decodes plainly. The accepted tokens are
cut at the row's stop ids and max_tokens before the rollback, then each one is streamed as a plain step's token would be.
"""
from __future__ import annotations
from tinyhet.engine.scheduler import SequenceStatus
from tinyhet.engine.speculative import SpeculativeStep, check_speculative

def speculative_k(node, seq) -> tuple[int, str]:
  """How many tokens to draft for seq a step (0: it decodes plainly), and how (ngram or draft)."""
  s = seq.extra["sampler"]
  if s.constraint is not None or s.logprobs is not None or seq.extra.get("want_logits") or seq.extra.get("stop_strings"): return 0, "off"
  spec = check_speculative(s.speculative if s.speculative is not None else node.speculative)
  return (0, "off") if spec["mode"] == "off" else (spec["k"], spec["mode"])

def run_speculative(node, batch: list) -> list:
  """Step batch's speculative rows (the caller holds them in node.in_step); the rows left for the plain step."""
  ks = {s.seq_id: speculative_k(node, s) for s in batch if not s.extra.get("cancelled")}
  rows = [s for s in batch if ks.get(s.seq_id, (0,))[0]]
  if not rows: return batch
  # capture False: a verify step runs only at a batch bucket the node's warm-up captured (none is built on a request's path)
  if node.spec is None: node.spec = SpeculativeStep(node.engine, capture=False, draft=node.draft)
  if node.draft is None and (bad := [s for s in rows if ks[s.seq_id][1] == "draft"]):
    fail(node, bad, ValueError(f'speculative mode "draft" needs a draft model and node {node.node.name} has none (tinyhet node --draft-model)'))
    batch, rows = [s for s in batch if s not in bad], [s for s in rows if s not in bad]
    if not rows: return batch
  eos = node.scheduler.eos
  try:
    out = node.spec.step([s.seq_id for s in rows], [list(s.token_ids) for s in rows], [s.extra["sampler"] for s in rows],
                         [ks[s.seq_id][0] for s in rows], [s.max_new_tokens - s.num_generated for s in rows],
                         [s.extra["stop_ids"] | ({eos} if eos is not None else set()) for s in rows], node.cond,
                         [ks[s.seq_id][1] for s in rows])
  except Exception as e:                 # a failed step fails its sequences, not the node
    fail(node, rows, RuntimeError(f"decode step failed on {node.node.name}: {type(e).__name__}: {e}"))
    return [s for s in batch if s not in rows]
  with node.cond:
    finished = []
    for s, draws in zip(rows, out):
      if s.extra.get("cancelled"):
        finished.append(s)
        continue
      for d in draws:
        if isinstance(d, ValueError):        # non-finite logits: that sequence fails, with the reason
          s.extra["queue"].put(ValueError(f"sequence {s.seq_id} stopped: {d}"))
          finished.append(s)
          break
        done = node.scheduler.postprocess([s], [d.token])
        s.extra["queue"].put(d.token)
        if done or d.token in s.extra["stop_ids"]:
          finished.append(s)
          break
    for s in finished:
      node.spec.forget(s.seq_id)
      if s.status is SequenceStatus.RUNNING: node.scheduler.finish(s)
      s.extra["queue"].put(None)
    node.cond.notify_all()
  return [s for s in batch if s not in rows]

def fail(node, rows: list, error: Exception) -> None:
  """These sequences end with this error (the others go on): they leave the scheduler, caching nothing past the slot the
  step was writing. A ValueError is the request's fault (the router answers 400 with it), a RuntimeError the node's (the
  router starts the request over elsewhere)."""
  with node.cond:
    node.scheduler.steps_failed(rows, False)
    for s in rows:
      s.extra["queue"].put(error)
      if node.spec is not None: node.spec.forget(s.seq_id)
      if s.status is SequenceStatus.RUNNING: node.scheduler.finish(s)
      s.extra["queue"].put(None)
    node.cond.notify_all()
