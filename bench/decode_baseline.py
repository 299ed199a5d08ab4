"""python -m tinyhet.bench.decode_baseline: the model on one CPU against a straightforward PyTorch float32 forward of
the same weights, measured in the same run: load time, prefill of a ~100-token prompt, decode tokens/s at batch 1
(tinygrad: the TinyJit decode step over a DenseKVCache, with float32 weights or the GGUF's blocks read directly; torch:
Meta's reference forward with a preallocated KV cache). Needs torch for the baseline (`pip install torch`, a CPU wheel).

The engines take turns, round after round, and each figure is the best round: on a shared machine another process can
stall one round (a 2-thread OpenMP region waits for its descheduled thread), and best-of-rounds compares the engines at
their undisturbed speed.
"""
from __future__ import annotations
import argparse, dataclasses, json, math, sys, time
import numpy as np

FILLER = ("The history of astronomy is long. Early observers tracked the motions of the Sun, the Moon and the planets, "
          "built calendars from them, and argued about the shape of the heavens. ")

def prompt_ids(tok, n_tokens: int) -> list[int]:
  """A chat prompt of about n_tokens tokens: filler text in one user turn, cut to length before the template is applied."""
  filler = tok.encode(FILLER * (1 + n_tokens // 20), add_special=False)
  head = tok.encode_prompt("Summarize: ")
  body = tok.decode(filler[:max(1, n_tokens - len(head))])
  return tok.encode_prompt("Summarize: " + body)

class TorchLlama:
  """Meta's reference Llama forward in PyTorch, float32, with a preallocated KV cache (llama/model.py, without the parallel
  layers). Weights are the tinyhet LlamaWeights' (Meta layout: interleaved RoPE pairs)."""

  def __init__(self, cfg, weights, max_context: int):
    import torch
    self.torch, self.cfg = torch, cfg
    from tinyhet.packed import PackedWeight
    t = lambda x: torch.from_numpy(np.ascontiguousarray((x.dequantize() if isinstance(x, PackedWeight) else x.float()).numpy()))
    self.emb, self.norm, self.out = t(weights.tok_embeddings), t(weights.norm), None
    self.out = self.emb if weights.output is weights.tok_embeddings else t(weights.output)
    from tinyhet.model import LayerWeights, rope_frequencies
    self.layers = [{f.name: t(getattr(lw, f.name)) for f in dataclasses.fields(LayerWeights)} for lw in weights.layers]
    freqs = torch.from_numpy(rope_frequencies(cfg)).float()
    self.freqs_cis = torch.polar(torch.ones(max_context, len(freqs)), torch.outer(torch.arange(max_context).float(), freqs))
    shape = (1, max_context, cfg.n_kv_heads, cfg.head_dim)
    self.cache_k = [torch.zeros(shape) for _ in self.layers]
    self.cache_v = [torch.zeros(shape) for _ in self.layers]

  def rms(self, x, w): return x * self.torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg.norm_eps) * w

  def rope(self, x, fc):
    xc = self.torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return self.torch.view_as_real(xc * fc.view(1, x.shape[1], 1, -1)).flatten(3)

  def forward(self, tokens, start_pos: int):
    torch, cfg = self.torch, self.cfg
    F = torch.nn.functional
    B, T = tokens.shape
    x = self.emb[tokens]
    fc = self.freqs_cis[start_pos:start_pos + T]
    mask = torch.full((T, T), float("-inf")).triu(1) if T > 1 else None
    G = cfg.n_heads // cfg.n_kv_heads
    for l, w in enumerate(self.layers):
      h = self.rms(x, w["attn_norm"])
      q = self.rope(F.linear(h, w["wq"]).view(B, T, cfg.n_heads, cfg.head_dim), fc)
      k = self.rope(F.linear(h, w["wk"]).view(B, T, cfg.n_kv_heads, cfg.head_dim), fc)
      self.cache_k[l][:B, start_pos:start_pos + T] = k
      self.cache_v[l][:B, start_pos:start_pos + T] = F.linear(h, w["wv"]).view(B, T, cfg.n_kv_heads, cfg.head_dim)
      keys = self.cache_k[l][:B, :start_pos + T].repeat_interleave(G, dim=2).transpose(1, 2)
      values = self.cache_v[l][:B, :start_pos + T].repeat_interleave(G, dim=2).transpose(1, 2)
      scores = q.transpose(1, 2) @ keys.transpose(2, 3) / math.sqrt(cfg.head_dim)
      if mask is not None: scores = scores + torch.cat([torch.zeros(T, start_pos), mask], dim=1)
      att = (scores.softmax(-1) @ values).transpose(1, 2).reshape(B, T, -1)
      x = x + F.linear(att, w["wo"])
      h = self.rms(x, w["ffn_norm"])
      x = x + F.linear(F.silu(F.linear(h, w["w_gate"])) * F.linear(h, w["w_up"]), w["w_down"])
    return F.linear(self.rms(x[:, -1], self.norm), self.out)

class TinygradEngine:
  """The tinyhet model: prefill = one forward over a fresh DenseKVCache, decode = the jitted step."""
  def __init__(self, model, kv_dtype: str, max_context: int):
    self.model, self.kv_dtype, self.max_context = model, kv_dtype, max_context

  def prefill(self, prompt: list[int]) -> int:
    from tinygrad import Tensor, dtypes
    from tinyhet.model import DenseKVCache
    from tinyhet.cpu_threads import kernel_threads
    self.cache = DenseKVCache(self.model.cfg, 1, self.max_context, getattr(dtypes, self.kv_dtype), self.model.device)
    T = len(prompt)
    with kernel_threads(self.model.device):
      logits = self.model.forward(Tensor([prompt], dtype=dtypes.int32), Tensor([list(range(T))], dtype=dtypes.int32), self.cache).numpy()
    self.step, self.pos = self.model.make_decode_step(self.cache), T
    return int(logits[0].argmax())

  def decode(self, token: int) -> int:
    from tinygrad import Tensor, dtypes
    logits = self.step(Tensor([[token]], dtype=dtypes.int32), Tensor([[self.pos]], dtype=dtypes.int32)).numpy()
    self.pos += 1
    return int(logits[0].argmax())

class TorchEngine:
  def __init__(self, model, max_context: int):
    import torch
    torch.set_grad_enabled(False)
    self.torch, self.model, self.max_context = torch, model, max_context

  def prefill(self, prompt: list[int]) -> int:
    self.tm = getattr(self, "tm", None) or TorchLlama(self.model.cfg, self.model.w, self.max_context)
    self.pos = len(prompt)
    return int(self.tm.forward(self.torch.tensor([prompt]), 0)[0].argmax())

  def decode(self, token: int) -> int:
    out = int(self.tm.forward(self.torch.tensor([[token]]), self.pos)[0].argmax())
    self.pos += 1
    return out

def measure(engines: dict, prompt: list[int], n_decode: int, rounds: int) -> dict:
  """Per engine: first prefill (compiles), best prefill over `rounds`, best decode tokens/s over `rounds` of n_decode steps
  (after 3 warm-up steps), and the greedy tokens of the last round's prefill + decode."""
  res = {name: {"prefill_s": math.inf, "decode_tok_s": 0.0} for name in engines}
  for name, e in engines.items():
    t0 = time.perf_counter()
    e.prefill(prompt)
    res[name]["prefill_first_s"] = time.perf_counter() - t0
  for _ in range(rounds):
    for name, e in engines.items():
      t0 = time.perf_counter()
      tokens = [e.prefill(prompt)]
      res[name]["prefill_s"] = min(res[name]["prefill_s"], time.perf_counter() - t0)
  tokens = {name: [e.prefill(prompt)] for name, e in engines.items()}
  for name, e in engines.items():
    for _ in range(3): tokens[name].append(e.decode(tokens[name][-1]))   # the JIT captures in the first two calls
  for _ in range(rounds):
    for name, e in engines.items():
      t0 = time.perf_counter()
      for _ in range(n_decode): tokens[name].append(e.decode(tokens[name][-1]))
      res[name]["decode_tok_s"] = max(res[name]["decode_tok_s"], n_decode / (time.perf_counter() - t0))
  for name in engines: res[name]["tokens"] = tokens[name]
  return res

def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(prog="python -m tinyhet.bench.decode_baseline", description=__doc__.split("\n\n")[0])
  ap.add_argument("--model", help="GGUF file or Hugging Face directory (default: the embedded SmolLM2-135M-Instruct)")
  ap.add_argument("--device", default="CPU", help="tinygrad device for the weights and the compute (default CPU)")
  ap.add_argument("--prompt-tokens", type=int, default=100)
  ap.add_argument("--decode-tokens", type=int, default=32, help="decode steps per round")
  ap.add_argument("--rounds", type=int, default=3, help="rounds per engine; each figure is the best round")
  ap.add_argument("--weights", choices=["float32", "packed", "both"], default="both",
                  help="tinygrad reads float32 weights (dequantized on load), the GGUF blocks (packed), or both")
  ap.add_argument("--kv-dtype", choices=["float16", "float32", "both"], default="both",
                  help="KV cache dtype of tinygrad's decode (torch's reference keeps float32 K, V)")
  ap.add_argument("--no-torch", action="store_true", help="skip the PyTorch baseline")
  ap.add_argument("--json", action="store_true", help="print one JSON object")
  args = ap.parse_args(argv)
  from tinyhet.weights import load_model
  kinds = ["float32", "packed"] if args.weights == "both" else [args.weights]
  kv_dtypes = ["float16", "float32"] if args.kv_dtype == "both" else [args.kv_dtype]
  out, engines, loads = {"decode_tokens": args.decode_tokens, "rounds": args.rounds}, {}, {}
  for kind in kinds:
    t0 = time.perf_counter()
    model, tok = load_model(args.model, device=args.device, max_context=args.prompt_tokens + 64 + args.decode_tokens * (args.rounds + 1),
                            quiet=args.json, packed=kind == "packed")
    loads[kind] = {"load_s": time.perf_counter() - t0, "weight_bytes": model.w.nbytes()}
    prompt = prompt_ids(tok, args.prompt_tokens)
    ctx = len(prompt) + 4 + args.decode_tokens * args.rounds
    for kv in kv_dtypes: engines[f"tinygrad {kind} weights, {kv} KV"] = TinygradEngine(model, kv, ctx)
    out |= {"model": model.cfg.name, "prompt_tokens": len(prompt)}
  if not args.no_torch:
    try: import torch  # noqa: F401
    except ImportError: print("torch is not installed: pip install torch (a CPU wheel) for the baseline", file=sys.stderr)
    else:
      engines["torch float32"] = TorchEngine(model, ctx)
      loads["torch"] = {"weight_bytes": 4 * model.cfg.n_params(), "threads": torch.get_num_threads()}
  res = measure(engines, prompt, args.decode_tokens, args.rounds)
  for name, r in res.items():
    r |= loads["torch" if name.startswith("torch") else name.split()[1]]
    if "torch float32" in res: r["decode_vs_torch"] = r["decode_tok_s"] / res["torch float32"]["decode_tok_s"]
    if "torch float32" in res: r["greedy_tokens_as_torch"] = sum(a == b for a, b in zip(r["tokens"], res["torch float32"]["tokens"]))
  out["engines"] = res
  if args.json:
    print(json.dumps(out))
    return 0
  print(f"{out['model']}: prompt {out['prompt_tokens']} tokens, decode at batch 1, {args.rounds} rounds of {args.decode_tokens} tokens "
        f"(best round shown), device {args.device}")
  print(f"{'':34}{'weights':>9}{'load':>8}{'prefill 1st':>12}{'prefill':>9}{'decode':>12}{'vs torch':>9}{'same tokens':>12}")
  for name, r in res.items():
    load = f"{r['load_s']:>7.2f}s" if "load_s" in r else f"{'-':>8}"     # torch takes the loaded weights: no load of its own
    print(f"{name:38}{r['weight_bytes'] / 1e6:>6.0f} MB{load}{r['prefill_first_s']:>11.3f}s{r['prefill_s']:>8.3f}s"
          f"{r['decode_tok_s']:>7.1f} tok/s{r.get('decode_vs_torch', math.nan):>8.2f}x"
          f"{r.get('greedy_tokens_as_torch', 0):>7}/{len(r['tokens'])}")
  return 0

if __name__ == "__main__": sys.exit(main())
