"""Constrained decoding: a grammar (llguidance's: Lark, with JSON schemas and regexes inside) limits each token a sequence
may draw. The router turns a request's response_format, guided_* fields or forced tool call into one grammar text
(tinyhet.service.structured) and sends it with the sampling options (`grammar`); each node that samples for the request
(the prefill node's first token, the decode node's others) builds a Constraint over its tokenizer's vocabulary:

  c = grammars(tokenizer, n_vocab).constraint(text, output_from)   # a copy of the grammar compiled once per text (LRU)
  allowed = c.allowed(tokens)      # (n_vocab,) bool: the tokens that may follow the sequence's output so far
  c.done(tokens)                   # the grammar is complete and admits nothing more: the sequence ends ("stop")

A Constraint follows the sequence's own token list (tokens[output_from:] is the output), consuming what it has not seen
yet, so it needs no notice of each draw: a draw repeated (the prefill node draws twice), a recompute after preemption and
a request restarted on another node (its output so far becomes prompt after output_from) all see the same state.
prefetch() computes a batch's masks on a thread of its own while the decode step runs (llguidance drops the GIL);
sequences without a grammar are not looked at. llguidance over xgrammar: no dependencies (xgrammar's import needs torch),
and a mask costs microseconds on a 49k vocabulary.
"""
from __future__ import annotations
import collections, os, threading
from concurrent.futures import Future, ThreadPoolExecutor
import numpy as np

CACHED_GRAMMARS = 64        # compiled grammars kept per tokenizer (a copy of one is cheap; compiling a schema costs milliseconds)
MAX_GRAMMAR_CHARS = 1 << 20

class GrammarError(ValueError):
  """A grammar that does not compile, or output that left its grammar."""

def check_grammar(text: str) -> str:
  """The grammar text if llguidance compiles it (without a vocabulary), else GrammarError with its message."""
  from llguidance import LLMatcher
  if not isinstance(text, str) or not 0 < len(text) <= MAX_GRAMMAR_CHARS:
    raise GrammarError(f"a grammar is a non-empty string of at most {MAX_GRAMMAR_CHARS} characters")
  if err := LLMatcher.validate_grammar(text): raise GrammarError(" ".join(line.strip() for line in err.strip().splitlines())[:300])
  return text

def vocabulary(tokenizer, n_vocab: int):
  """llguidance's view of the model's vocabulary: the Hugging Face tokenizer's JSON with the ids that end a reply as EOS; a
  byte tokenizer (the tests' random: models) as 256 byte tokens, the model's other ids unused, and one id past the model's
  vocabulary as the EOS no logit can pick (so a grammar ends there by admitting nothing more: Constraint.done)."""
  from llguidance import LLTokenizer, TokenizerWrapper
  if hasattr(tokenizer, "tok"):         # tinyhet.model.tokenizer.Tokenizer
    stops = list(tokenizer.stop_ids) or ([tokenizer.eos_id] if tokenizer.eos_id is not None else [])
    if not stops: raise GrammarError("the model's tokenizer names no end-of-reply token: a grammar cannot end")
    return LLTokenizer(tokenizer.tok.to_str(), n_vocab=max(n_vocab, tokenizer.vocab_size), eos_token=stops), max(n_vocab, tokenizer.vocab_size)
  class Bytes:
    eos_token_id, bos_token_id = n_vocab, None
    tokens = [bytes([i]) for i in range(256)] + [f"<|unused_{i}|>".encode() for i in range(256, n_vocab)] + [b"<|end|>"]
    special_token_ids = list(range(256, n_vocab + 1))
    def __call__(self, s): return list(s if isinstance(s, bytes) else s.encode())
  return LLTokenizer(TokenizerWrapper(Bytes())), n_vocab + 1

class Grammars:
  """One tokenizer's compiled grammars, the most recently used CACHED_GRAMMARS of them."""
  def __init__(self, tokenizer, n_vocab: int):
    self.tokenizer, self.n_vocab, self.lock = tokenizer, n_vocab, threading.Lock()
    self.vocab = None
    self.compiled: collections.OrderedDict = collections.OrderedDict()
    self.compiles = 0                       # grammars compiled so far (a cached one is copied, not compiled)

  def constraint(self, text: str, output_from: int | None = None) -> Constraint:
    from llguidance import LLMatcher
    with self.lock:
      if self.vocab is None: self.vocab = vocabulary(self.tokenizer, self.n_vocab)
      if (m := self.compiled.get(text)) is None:
        m = LLMatcher(self.vocab[0], check_grammar(text), log_level=0)
        if m.is_error(): raise GrammarError(f"the grammar does not compile: {m.get_error()[:300]}")
        m.compute_bitmask()                 # the first mask builds the lexer's states (~10 ms on a 49k vocabulary): here, once per grammar
        self.compiled[text], self.compiles = m, self.compiles + 1
        while len(self.compiled) > CACHED_GRAMMARS: self.compiled.popitem(last=False)
      self.compiled.move_to_end(text)
      return Constraint(m.deep_copy(), self.n_vocab, self.vocab[1], output_from)

_grammars: dict[int, Grammars] = {}
_grammars_lock = threading.Lock()

def grammars(tokenizer, n_vocab: int) -> Grammars:
  """The Grammars of this tokenizer (one per tokenizer object and vocabulary size: a `both` node's two roles share it)."""
  with _grammars_lock:
    g = _grammars.get(key := id(tokenizer))
    if g is None or g.tokenizer is not tokenizer or g.n_vocab != n_vocab: g = _grammars[key] = Grammars(tokenizer, n_vocab)
    return g

def constrain(sampler, tokenizer, n_vocab: int) -> None:
  """Give the sampler its Constraint when its options carry a grammar; GrammarError (a ValueError) when it does not compile."""
  if sampler.grammar is None: return
  if tokenizer is None: raise GrammarError("this node has no tokenizer to build a grammar's token masks: leave the grammar out")
  sampler.constraint = grammars(tokenizer, n_vocab).constraint(sampler.grammar, sampler.output_from)

class Constraint:
  """A grammar's state over one sequence's output. n_vocab: the model's logits' width; width: llguidance's (>= n_vocab)."""
  def __init__(self, matcher, n_vocab: int, width: int, output_from: int | None):
    self.matcher, self.n_vocab, self.width, self.start = matcher, n_vocab, width, output_from
    self.consumed, self.mask_at, self.mask = 0, -1, None

  def sync(self, tokens) -> None:
    """Consume the output tokens not seen yet (tokens: the whole sequence; the output starts at output_from, or where the
    first call found the sequence's end)."""
    if self.start is None: self.start = len(tokens)
    new = list(tokens[self.start + self.consumed:])
    if not new: return
    if not self.matcher.consume_tokens(new):
      raise GrammarError(f"the output left its grammar: {self.matcher.get_error()[:200]}")
    self.consumed += len(new)

  def allowed(self, tokens) -> np.ndarray:
    """(n_vocab,) bool: the tokens the grammar admits after the sequence's output so far (computed once per state)."""
    self.sync(tokens)
    if self.mask_at != self.consumed: self.set_mask(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8))
    return self.mask

  def set_mask(self, bits: np.ndarray) -> None:
    """The mask of the current state from llguidance's bitmask (one bit a token, little-endian words)."""
    self.mask = np.unpackbits(bits.view(np.uint8), bitorder="little")[:self.n_vocab].astype(bool)
    self.mask_at = self.consumed
    if self.matcher.is_error(): raise GrammarError(f"the grammar failed: {self.matcher.get_error()[:200]}")

  def done(self, tokens) -> bool:
    """The output so far completes the grammar and nothing more may follow (an end-of-reply token, if drawn, ends it too)."""
    self.sync(tokens)
    return self.matcher.is_stopped()

_executor: ThreadPoolExecutor | None = None
_masker = None              # llguidance's LLExecutor: a batch's masks in parallel, in Rust threads
MASK_THREADS = max(1, min(8, (os.cpu_count() or 1) // 4))    # a few: the decode step's kernels run on the same cores meanwhile

def fill_masks(rows) -> None:
  """The masks of rows [(Constraint, tokens)] for their current states, several at once through llguidance's executor; a
  row whose output left its grammar is skipped here (sample_batch raises it for that row)."""
  global _masker
  todo = []
  for c, t in rows:
    try: c.sync(t)
    except GrammarError: continue
    if c.mask_at != c.consumed: todo.append(c)
  if len(todo) < 2 or len({c.width for c in todo}) > 1:
    for c in todo: c.allowed(())
    return
  from llguidance import LLExecutor
  if _masker is None: _masker = LLExecutor(MASK_THREADS)
  words = (todo[0].width + 31) // 32
  bits = np.zeros((len(todo), words), dtype=np.int32)
  _masker.unsafe_compute_mask_ptr([(c.matcher, k) for k, c in enumerate(todo)], bits.ctypes.data, words * 4, len(todo))
  for k, c in enumerate(todo):
    try: c.set_mask(bits[k])
    except GrammarError: pass

def prefetch(samplers, tokens) -> Future | None:
  """Start computing the masks of a batch's constrained rows (samplers[i].constraint over tokens[i]) on the grammar thread,
  so they are ready when the step's logits are; None when no row has a grammar. Errors surface again when sample_batch
  asks the row's Constraint."""
  global _executor
  rows = [(s.constraint, t) for s, t in zip(samplers, tokens) if s.constraint is not None]
  if not rows: return None
  if _executor is None: _executor = ThreadPoolExecutor(1, thread_name_prefix="tinyhet-grammar")
  return _executor.submit(fill_masks, rows)
