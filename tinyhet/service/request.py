"""What the router holds for one request (Request: its prompt, sampling, the tokens sent so far, its connections) and the
errors a request ends in, each mapped to an HTTP status by tinyhet.service.http_api."""
from __future__ import annotations
import threading
from dataclasses import dataclass, field

class Overloaded(RuntimeError):
  """No KV room within the queue's bound or timeout: try again later (HTTP 503 with Retry-After)."""
class BadRequest(ValueError):
  """The request itself cannot be served (too long for any pool or context): HTTP 400."""
class Unavailable(RuntimeError):
  """The request could not complete: no node to serve it, or it lost too many nodes."""
class Cancelled(Exception):
  """The client went away."""
@dataclass(eq=False)
class Request:
  prompt_ids: list[int]
  max_tokens: int
  emit: object                                # emit(token id, logprobs), called from the request's thread
  temperature: float = 0.0
  top_p: float = 1.0
  seed: int | None = None
  stop_ids: list[int] = field(default_factory=list)
  options: dict = field(default_factory=dict)     # the nodes' further sampling options (tinyhet.model.sampling.OPTIONS)
  stop: list[str] = field(default_factory=list)   # stop strings: the decode node ends the sequence at one (the HTTP side cuts the text)
  prompt_logprobs: list | None = None             # the prompt's own logprobs, from the node that prefilled it (options["prompt_logprobs"])
  cache_salt: str = ""                            # its tenant's salt (tinyhet.service.tenancy): it shares cached KV with that tenant only
  generated: list[int] = field(default_factory=list)
  cancelled: threading.Event = field(default_factory=threading.Event)
  clients: set = field(default_factory=set)
  attempts: int = 0
  cached_tokens: int = 0                      # prompt tokens the decode node found in its prefix cache (the last attempt's)
  ended: bool = False                         # the output completed its grammar (options["grammar"]): a stop without a stop id

  def push(self, token: int, logprobs: dict | None = None):
    """A token for the client; logprobs: {"logprob", "top_logprobs": [(id, logprob)]} when the request asked for them."""
    self.generated.append(token)
    self.emit(token, logprobs)

  def cancel(self):
    """From any thread: stop the request and close its connections (the nodes free what it held)."""
    self.cancelled.set()
    for c in list(self.clients): c.close()

def cached_prompt_tokens(reported, prompt_tokens: int) -> int:
  """usage.prompt_tokens_details.cached_tokens from a node's figure: a count in 0..prompt_tokens whatever the node said."""
  return min(max(reported, 0), prompt_tokens) if isinstance(reported, int) and not isinstance(reported, bool) else 0
