"""The rules a generation request must meet, one set for every part that checks one. A node checks what the router sends
with these before it takes the request (the sampler's settings and options: tinyhet.model.sampling, whose Sampler is the
check; stop strings: check_stop, in tinyhet.engine.decode_node), and the HTTP API (tinyhet.service.api_schema) runs the
same check_generation on what it will send before it answers, so a request the API accepted is never refused by a node
after its first token streamed. The API adds OpenAI's narrower ranges on top (temperature up to 2, at most 5 logprobs in
completions, seeds below 2**63); it never accepts what a node refuses.
"""
from __future__ import annotations
from tinyhet.model.sampling import Sampler

MAX_STOPS = 4              # stop strings per request (OpenAI's limit)
MAX_STOP_CHARS = 200       # characters per stop string: the decode node keeps this much of each sequence's text to match them

def check_stop(stop) -> list[str]:
  """A request's stop strings (None: none): ValueError unless a list of at most MAX_STOPS non-empty strings of at most
  MAX_STOP_CHARS characters."""
  if stop is None: return []
  if not isinstance(stop, list) or len(stop) > MAX_STOPS or not all(isinstance(x, str) and 0 < len(x) <= MAX_STOP_CHARS for x in stop):
    raise ValueError(f"stop must be a list of at most {MAX_STOPS} non-empty strings of at most {MAX_STOP_CHARS} characters, got {str(stop)[:80]!r}")
  return list(stop)

def check_generation(temperature, top_p, seed, options: dict | None, stop) -> None:
  """What every node checks of a request's sampling settings, options (tinyhet.model.sampling.OPTIONS) and stop strings
  before it takes it: ValueError whose message starts with the setting's name."""
  Sampler(temperature, top_p, seed, **(options or {}))
  check_stop(stop)
