"""A prompt's own logprobs (completions' `echo` with `logprobs`, as lm-evaluation-harness's loglikelihood tasks ask): one
dense forward over the prompt with every position's logits, on the node that prefills it. Token i's entry is its
log-probability after tokens 0..i-1 (the first token has none), with the top alternatives; log-softmax as sampling's."""
from __future__ import annotations
from tinygrad import Tensor, dtypes
from tinyhet.model.llama import DenseKVCache, Llama
from tinyhet.model.sampling import log_softmax, top_alternatives

def prompt_logprobs(model: Llama, prompt_ids: list[int], n_top: int, kv_dtype=dtypes.float16) -> list[dict | None]:
  """[None, {"logprob", "top_logprobs": [(id, logprob)]}, ...] for each prompt token."""
  T = len(prompt_ids)
  cache = DenseKVCache(model.cfg, 1, T, kv_dtype, model.device)
  logits = model.forward(Tensor([prompt_ids], dtype=dtypes.int32, device=model.device),
                         Tensor.arange(T, dtype=dtypes.int32).reshape(1, T).to(model.device), cache, all_rows=True).numpy()[0]   # (T, vocab)
  lp = log_softmax(logits[:-1])                      # row i predicts token i + 1
  return [None] + [{"logprob": float(lp[i, t]), "top_logprobs": top_alternatives(lp[i], n_top)} for i, t in enumerate(prompt_ids[1:])]
