"""A prompt's own logprobs (completions' `echo` with `logprobs`, as lm-evaluation-harness's loglikelihood tasks ask), from the
prefill that computes its KV anyway: the prefill hands each chunk's last-layer rows (1, C, dim) to on_hidden (Llama.prefill,
chunked_prefill, prefill_suffix_logits), and PromptLogprobs puts them through the output head in a capture of its own per
chunk length: the chunk's logits (C, vocab) into a buffer, then per row the log-sum-exp, the next token's logit and the most
likely token. Memory: one chunk's logits (C x vocab float32), whatever the prompt's length; no (T, T) matrix, no forward
of its own. Token i's entry is its log-probability after tokens 0..i-1 (the first token has none), with the top
alternatives: as sampling's log-softmax (float32 logits; the log-sum-exp in float32 on the device), the most likely first
and the lowest id on ties."""
from __future__ import annotations
import numpy as np
from tinygrad import Tensor, dtypes
from tinyhet.model.layer_jit import Replay, allocated
from tinyhet.model.llama import Llama

class RowHead:
  """The captured output head over C rows: x (1, C, dim), next ids (C,) -> logits (C, vocab) and per row
  (next token's logprob, log-sum-exp, most likely token's logprob, its id) in `rows` (C, 4) float32."""
  def __init__(self, model: Llama, C: int):
    dev, V = model.device, model.cfg.vocab_size
    self.C, self.next = C, allocated(Tensor.empty(C, dtype=dtypes.int32, device=dev))
    self.logits = allocated(Tensor.empty(C, V, device=dev))
    self.rows = allocated(Tensor.empty(C, 4, device=dev))
    def head(x: Tensor, nxt: Tensor, logits_out: Tensor, rows_out: Tensor):
      lg = logits_out.assign(model._logits(x, all_rows=True).reshape(C, V)).realize()   # (C, V)
      m = lg.max(1, keepdim=True)                                                        # (C, 1)
      lse = (lg - m).exp().sum(1, keepdim=True).log() + m
      tok = lg.gather(1, nxt.reshape(C, 1))                                              # (C, 1): the next token's logit
      best = lg.argmax(1, keepdim=True).float()                                          # exact below 2**24 ids
      rows_out.assign((tok - lse).cat(lse, m - lse, best, dim=1)).realize()
    self.replay = Replay(head, capture_first=True)

  def __call__(self, x: Tensor, next_ids: np.ndarray) -> np.ndarray:
    from tinyhet.model.chunked_prefill import _write
    ids = np.zeros(self.C, np.int32)
    ids[:len(next_ids)] = next_ids
    _write(self.next, ids)
    self.replay(x, self.next, self.logits, self.rows)
    return self.rows.numpy()

KEEP_BYTES = 256 << 20   # the heads kept per model, the most recently used, hold at most this much of logits (C x vocab float32 each)

def row_head(model: Llama, C: int) -> RowHead:
  """The model's head over C rows (made on first use; a prompt of each bucket length has its own), most recently used last."""
  heads = model.__dict__.setdefault("_row_heads", {})
  h = heads.pop(C, None) or RowHead(model, C)
  heads[C] = h
  while len(heads) > 1 and sum(c for c in heads) * model.cfg.vocab_size * 4 > KEEP_BYTES: heads.pop(next(iter(heads)))
  return h

class PromptLogprobs:
  """on_hidden for a prefill of prompt_ids (or of a part of it): (x (1, C, dim) realized, p0, n) with the last layer's rows
  of positions p0..p0+n-1 in x's first n rows. .entries once every row 0..T-2 has been seen: [None, {"logprob",
  "top_logprobs": [(id, logprob)]}, ...] for each prompt token."""
  def __init__(self, model: Llama, prompt_ids: list[int], n_top: int):
    if not 0 <= n_top <= 20: raise ValueError(f"prompt logprobs take 0..20 alternatives, got {n_top}")
    self.model, self.ids, self.n_top = model, np.asarray(prompt_ids, np.int32), n_top
    self.got: list[dict | None] = [None] * len(prompt_ids)     # got[i]: token i's entry, from row i - 1
    self.seen = 0

  def __call__(self, x: Tensor, p0: int, n: int) -> None:
    n = min(n, len(self.ids) - 1 - p0)                          # the prompt's last row predicts no prompt token
    if n <= 0: return
    head = row_head(self.model, x.shape[1])
    rows = head(x, self.ids[p0 + 1:p0 + 1 + n])[:n]            # (n, 4)
    tops = self._tops(head, rows) if self.n_top > 1 else None
    for i in range(n):
      lp, _, best_lp, best = rows[i]
      top = tops[i] if tops is not None else [(int(best), float(best_lp))] if self.n_top == 1 else []
      self.got[p0 + 1 + i] = {"logprob": float(lp), "top_logprobs": top}
    self.seen += n

  def _tops(self, head: RowHead, rows: np.ndarray) -> list[list[tuple[int, float]]]:
    # the n_top most likely of each row on the host, from the chunk's logits (one argpartition over the rows)
    n, k = len(rows), self.n_top
    lg = head.logits.numpy()[:n]
    idx = np.argpartition(-lg, k - 1, axis=1)[:, :k]
    vals = np.take_along_axis(lg, idx, 1) - rows[:, 1:2]
    out = []
    for r in range(n):
      order = np.lexsort((idx[r], -vals[r]))
      out.append([(int(idx[r, j]), float(vals[r, j])) for j in order])
    return out

  @property
  def entries(self) -> list[dict | None]:
    if self.seen != len(self.ids) - 1: raise RuntimeError(f"prompt logprobs: {self.seen} of {len(self.ids) - 1} rows seen")
    return self.got

def prompt_logprobs(model: Llama, prompt_ids: list[int], n_top: int, kv_dtype=dtypes.float16) -> list[dict | None]:
  """One prompt's logprobs ([None, {"logprob", "top_logprobs": [(id, logprob)]}, ...]) by a prefill of its own, its KV
  dropped: for a prompt that is only scored (a prefill that runs anyway takes a PromptLogprobs as its on_hidden)."""
  from tinyhet.engine.prefill import prefill_logits
  scorer = PromptLogprobs(model, prompt_ids, n_top)
  prefill_logits(model, prompt_ids, kv_dtype, on_hidden=scorer)
  return scorer.entries
