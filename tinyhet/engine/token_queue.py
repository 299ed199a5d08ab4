"""How a sequence's tokens leave the batching loop: the loop puts each into the sequence's queue (an id, (id, logprob, top)
with logprobs, ("prompt", entries), an Exception for a failed step, None at the end); a stream reads them from there."""
from __future__ import annotations
import queue

TICK = 0.5                # seconds: how often a waiting stream lets the control channel look for a cancel or a departed client

def queued_tokens(seq):
  """A sequence's tokens as the batching loop queues them, until it is done; None every TICK while none comes (a stream
  then lets the control channel look for a cancel or a departed client). A failed step's error is raised."""
  while True:
    try: tok = seq.extra["queue"].get(timeout=TICK)
    except queue.Empty:
      yield None
      continue
    if isinstance(tok, Exception): raise tok
    if tok is None: return
    yield tok

def token_item(tok) -> dict:
  """A queued token as the generate stream sends it: an id, or (id, logprob, top alternatives) when logprobs were asked for;
  ("prompt", entries): the prompt's own logprobs (tinyhet.engine.prompt_logprobs), before the first token."""
  if isinstance(tok, tuple) and tok[0] == "prompt": return {"prompt_logprobs": tok[1]}
  if isinstance(tok, tuple): return {"token": tok[0], "logprob": tok[1], "top_logprobs": tok[2]}
  return {"token": tok}

