"""tinyhet bench decode: the decode node's engine against llama.cpp and PyTorch, on the same GGUF, the same thread count, in
one run: batch-1 decode tokens/s, aggregate decode tokens/s at batches 4, 16 and 64, prefill tokens/s at 100 and 1,000
tokens, and the share of the machine's read bandwidth a decode step uses.

  tinyhet    prefill on HET (CPU), decode on MESH: the paged KV cache and one TinyJit capture per batch bucket, as the decode
             node runs them; the GGUF's quantized blocks read by the kernels; float16 KV
  llama.cpp  llama-cpp-python (pip install -e '.[bench]' compiles it; `make bench-setup` builds it as the README says) on the
             same GGUF: one context with a sequence per batch row, each with KV cells of its own (kv_unified off; row 0
             prefilled, the other rows' cells copies of its cells by llama_memory_seq_cp), float16 KV, flash attention on;
             `llama.cpp-noflash` the same with it off
  torch      Meta's reference forward in PyTorch bfloat16 (weights dequantized, then cast), scaled_dot_product_attention
             with grouped-query heads, a preallocated KV cache written in place; `torch-f32` the same in float32;
             `torch-compile` bfloat16 with the forward under torch.compile (not in the default list: inductor's compile
             takes minutes on a small machine)
The table's last column is tinyhet over the best other engine of that row.

Decode rows run every sequence at a context of --context tokens (the KV is present, its values do not matter to the speed).
read share = bytes one decode step reads (the weights it streams, plus every row's KV) / step time / the machine's read
bandwidth (bench/membw.py, a streaming read by the same number of threads, measured in this run). The engines run
each in a process of its own, one after another; each figure is the best of --rounds rounds (another process can
stall one round on a shared machine).
"""
from __future__ import annotations
import argparse, json, math, os, subprocess, sys, time
import numpy as np
from tinyhet.bench.prompts import filler_ids
from tinyhet.bench.formats import FORMATS, format_path
from tinyhet.bench.torch_llama import TorchLlama

def rss_bytes() -> int:
  """This process's resident memory: anonymous pages plus file pages (llama.cpp maps the GGUF: its weights are file pages)."""
  with open("/proc/self/status") as f: kb = {l.split(":")[0]: int(l.split()[1]) for l in f if l.startswith(("RssAnon", "RssFile"))}
  return 1024 * (kb.get("RssAnon", 0) + kb.get("RssFile", 0))

def best_rate(fn, work: int, rounds: int) -> float:
  best = math.inf
  for _ in range(rounds):
    t0 = time.perf_counter()
    fn()
    best = min(best, time.perf_counter() - t0)
  return work / best

class TinyhetEngine:
  name = "tinyhet"
  def __init__(self, path, threads: int, max_batch: int, max_context: int):
    import tinyhet  # noqa: F401  (HET and MESH)
    from tinyhet.device.cpu_threads import configured_threads
    from tinyhet.engine.decode_engine import DecodeEngine
    from tinyhet.kv.paged_cache import PagedKVCache
    from tinyhet.model.weights import load_model
    if configured_threads() != threads: raise SystemExit(f"tinyhet runs {configured_threads()} threads: set TINYHET_CPU_THREADS={threads}")
    self.het, self.tok = load_model(path, device="HET", max_context=max_context, quiet=True, packed=True)
    self.mesh, _ = load_model(path, device="MESH", max_context=max_context, quiet=True, packed=True)
    cfg = self.mesh.cfg
    blocks = (max_batch + 1) * -(-max_context // 16) + 2
    self.cache = PagedKVCache(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, blocks, 16, "float16", device="MESH", max_seq_len=max_context)
    self.engine = DecodeEngine(self.mesh, self.cache)     # the decode node's step: bucketed, padded, one capture per bucket
    w = self.mesh.w
    self.weight_bytes = w.nbytes() - (0 if w.output is w.tok_embeddings else w.tok_embeddings.nbytes())   # rows of the embedding only
    # the decode node's weights as held (the arena is mapped ahead, so its RSS does not show them; this process also holds
    # HET's copy for prefill): the bytes of every matrix and norm, stored form
    self.weights_resident = w.nbytes()
    self.kv_token_bytes = cfg.kv_bytes_per_token()

  def prefill(self, prompt: list[int]) -> int:
    from tinygrad import Tensor, dtypes
    return int(self.het.prefill(Tensor([prompt], dtype=dtypes.int32, device="HET")).numpy()[0].argmax())

  def decode(self, batch: int, context: int, steps: int) -> tuple[float, int]:
    """(seconds for `steps` decode steps of `batch` sequences at `context` tokens, bytes one step reads)."""
    bm, ids = self.cache.block_manager, list(range(batch))
    for i in ids: bm.allocate(i, context)
    tokens = [1] * batch
    def one():
      nonlocal tokens
      for i in ids: bm.append_slot(i)
      tokens = [int(t) for t in self.engine.step(ids, tokens).argmax(-1)]
    try:
      for _ in range(3): one()          # TinyJit: run, capture, replay
      t0 = time.perf_counter()
      for _ in range(steps): one()
      return time.perf_counter() - t0, self.weight_bytes + batch * (context + 3 + steps) * self.kv_token_bytes
    finally:
      for i in ids: bm.deallocate(i)

class LlamaCppEngine:
  name = "llama.cpp"
  def __init__(self, path, threads: int, max_batch: int, max_context: int, flash: bool = True):
    import llama_cpp as L
    self.L = L
    self._quiet = L.llama_log_callback(lambda level, text, user: None)    # llama.cpp logs every graph node: keep stderr for the figures
    L.llama_log_set(self._quiet, None)
    L.llama_backend_init()
    self.rss_before = rss_bytes()
    self.model = L.llama_load_model_from_file(str(path).encode(), L.llama_model_default_params())
    if not self.model: raise RuntimeError(f"llama.cpp could not load {path}")
    cp = L.llama_context_default_params()
    # every sequence its own cells (a stream per sequence), as a server running unrelated requests has them
    cp.n_ctx, cp.n_seq_max, cp.kv_unified = max_context * max_batch, max_batch, False
    cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
    if not flash: self.name = "llama.cpp-noflash"
    cp.n_batch = cp.n_ubatch = max(512, max_batch)
    cp.n_threads = cp.n_threads_batch = threads
    self.ctx = L.llama_init_from_model(self.model, cp)
    if not self.ctx: raise RuntimeError("llama.cpp could not create a context")
    self.mem, self.n_vocab = L.llama_get_memory(self.ctx), L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
    self.batch = L.llama_batch_init(max(512, max_batch), 0, max_batch)
    self.weight_bytes = os.path.getsize(path)
    self.kv_token_bytes = None      # set by the caller from the model's config (float16 K and V)

  def _run(self, items: list[tuple[int, int, int, bool]]) -> list[int]:
    """Decode (token, position, sequence, wants logits) items in chunks of n_batch; the argmax of each wanted row."""
    L, b, out = self.L, self.batch, []
    for s in range(0, len(items), 512):
      chunk = items[s:s + 512]
      b.n_tokens = len(chunk)
      for i, (tok, pos, seq, want) in enumerate(chunk):
        b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, want
        b.seq_id[i][0] = seq
      if (rc := L.llama_decode(self.ctx, b)) != 0: raise RuntimeError(f"llama_decode returned {rc}")
      out += [int(np.ctypeslib.as_array(L.llama_get_logits_ith(self.ctx, i), (self.n_vocab,)).argmax()) for i, c in enumerate(chunk) if c[3]]
    return out

  def prefill(self, prompt: list[int]) -> int:
    self.L.llama_memory_clear(self.mem, True)
    return self._run([(t, p, 0, p == len(prompt) - 1) for p, t in enumerate(prompt)])[0]

  def decode(self, batch: int, context: int, steps: int) -> tuple[float, int]:
    self.L.llama_memory_clear(self.mem, True)
    self._run([(1, p, 0, p == context - 1) for p in range(context)])
    for s in range(1, batch): self.L.llama_memory_seq_cp(self.mem, 0, s, -1, -1)   # each row's own cells, a copy of row 0's
    tokens, pos = [1] * batch, context
    def one():
      nonlocal tokens, pos
      tokens = self._run([(tokens[s], pos, s, True) for s in range(batch)])
      pos += 1
    for _ in range(3): one()
    t0 = time.perf_counter()
    for _ in range(steps): one()
    return time.perf_counter() - t0, self.weight_bytes + batch * (context + 3 + steps) * self.kv_token_bytes

class TorchEngine:
  def __init__(self, mesh_model, threads: int, max_batch: int, max_context: int, variant: str = "torch"):
    import torch
    torch.set_grad_enabled(False)
    torch.set_num_threads(threads)
    self.name, self.torch, self.cfg = variant, torch, mesh_model.cfg
    dtype = torch.float32 if variant == "torch-f32" else torch.bfloat16
    self.tm = TorchLlama(mesh_model.cfg, mesh_model.w, max_context, batch=max_batch, dtype=dtype)
    if variant == "torch-compile": self.tm.compile()
    size = 4 if dtype == torch.float32 else 2
    self.weight_bytes = size * (self.cfg.n_params() - (0 if self.cfg.tie_embeddings else self.cfg.vocab_size * self.cfg.dim))
    self.kv_token_bytes = 2 * self.cfg.n_layers * self.cfg.n_kv_heads * self.cfg.head_dim * size

  def prefill(self, prompt: list[int]) -> int: return int(self.tm.forward(self.torch.tensor([prompt]), 0)[0].argmax())

  def decode(self, batch: int, context: int, steps: int) -> tuple[float, int]:
    tokens, pos = self.torch.ones(batch, 1, dtype=self.torch.long), context
    def one():
      nonlocal tokens, pos
      tokens = self.tm.step(tokens, pos).argmax(-1, keepdim=True)
      pos += 1
    for _ in range(3): one()
    t0 = time.perf_counter()
    for _ in range(steps): one()
    return time.perf_counter() - t0, self.weight_bytes + batch * (context + 3 + steps) * self.kv_token_bytes

def llama_cpp_build() -> str:
  try:
    import llama_cpp
    return f"llama-cpp-python {llama_cpp.__version__}: {llama_cpp.llama_print_system_info().decode().strip()}"
  except ImportError: return ""

def make_engine(name: str, path, threads: int, max_batch: int, max_context: int):
  """One engine and the tokenizer, in this process."""
  from tinyhet.model.tokenizer import Tokenizer
  from tinyhet.model.weights import gguf_config, read_gguf
  g = read_gguf(path)
  tok, kv_token_bytes = Tokenizer.from_gguf_metadata(g.metadata), gguf_config(g).kv_bytes_per_token()
  if name in ("tinyhet", "tinyhet-int8"):   # tinyhet-int8: the int8-activation mode (tinyhet.model.layers.int8_activations)
    os.environ["TINYHET_INT8_ACTIVATIONS"] = "1" if name == "tinyhet-int8" else "0"
    e = TinyhetEngine(path, threads, max_batch, max_context)
    e.name = name
    return e, tok
  if name in ("llama.cpp", "llama.cpp-noflash"):
    e = LlamaCppEngine(path, threads, max_batch, max_context, flash=name == "llama.cpp")
    e.kv_token_bytes = kv_token_bytes
    return e, tok
  if name in ("torch", "torch-f32", "torch-compile"):
    import tinyhet  # noqa: F401  (MESH)
    from tinyhet.model.weights import load_model
    model, _ = load_model(path, device="MESH", max_context=max_context, quiet=True, packed=True)
    return TorchEngine(model, threads, max_batch, max_context, name), tok
  raise SystemExit(f"tinyhet bench decode: unknown engine {name!r} (tinyhet, llama.cpp, llama.cpp-noflash, torch, torch-f32, torch-compile)")

def measure(e, tok, prompts: list[int], batches: list[int], context: int, steps: int, rounds: int, log) -> list[dict]:
  rows = measure_rates(e, tok, prompts, batches, context, steps, rounds, log)
  # llama.cpp maps the file (its weights are the file's pages): its growth in resident memory over the rows is reported,
  # weights, KV cache and compute buffers together (an upper bound); tinyhet's weights as held
  resident = getattr(e, "weights_resident", None) or (rss_bytes() - e.rss_before if hasattr(e, "rss_before") else None)
  rows.append({"engine": e.name, "batch": None, "prompt_tokens": None, "prefill_tok_s": None, "decode_tok_s": None, "step_bytes": None,
               "weights_resident": resident})
  return rows

def measure_rates(e, tok, prompts: list[int], batches: list[int], context: int, steps: int, rounds: int, log) -> list[dict]:
  rows = []
  for n in prompts:
    prompt = filler_ids(tok, n)
    e.prefill(prompt)                              # compiles, warms caches
    rows.append({"engine": e.name, "batch": 1, "prompt_tokens": n, "prefill_tok_s": best_rate(lambda: e.prefill(prompt), n, rounds),
                 "decode_tok_s": None, "step_bytes": None})
    log(f"  prefill {n:>5} tokens  {e.name:<10} {rows[-1]['prefill_tok_s']:8.1f} tok/s")
  for b in batches:
    best, nbytes = math.inf, 0
    for _ in range(rounds):
      dt, nbytes = e.decode(b, context, steps)
      best = min(best, dt)
    rows.append({"engine": e.name, "batch": b, "prompt_tokens": context, "prefill_tok_s": None, "decode_tok_s": b * steps / best,
                 "step_bytes": nbytes})
    log(f"  decode batch {b:>3}  {e.name:<10} {rows[-1]['decode_tok_s']:8.1f} tok/s")
  return rows

def main(argv: list[str] | None = None) -> int:
  from tinyhet.device.cpu_threads import configured_threads
  ap = argparse.ArgumentParser(prog="tinyhet bench decode", description=__doc__.split("\n\n")[0])
  ap.add_argument("--model", help="GGUF file (default: the embedded SmolLM2-135M-Instruct, Q4_1)")
  ap.add_argument("--formats", nargs="?", const="Q4_1," + ",".join(FORMATS),
                  help="a sweep over SmolLM2 in these formats (default: Q4_1 and every one `make bench-setup` made): one table row each")
  ap.add_argument("--threads", type=int, default=None, help="threads for every engine (default: tinyhet's, TINYHET_CPU_THREADS or every CPU)")
  ap.add_argument("--batches", default="1,4,16,64")
  ap.add_argument("--prompts", default="100,1000", help="prefill lengths (empty: no prefill rows)")
  ap.add_argument("--context", type=int, default=100, help="tokens in each sequence's KV during the decode rows")
  ap.add_argument("--steps", type=int, default=16, help="decode steps per round")
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--engines", default="tinyhet,llama.cpp,llama.cpp-noflash,torch,torch-f32",
                  help="of tinyhet, tinyhet-int8 (int8 activations), llama.cpp, llama.cpp-noflash, torch, torch-f32, torch-compile")
  ap.add_argument("--one-engine", action="store_true", help=argparse.SUPPRESS)   # a child process measuring one engine
  ap.add_argument("--quick", action="store_true", help="batches 1,4; prompt 100; 8 steps; 2 rounds")
  ap.add_argument("--json", action="store_true")
  args = ap.parse_args(argv)
  if args.quick: args.batches, args.prompts, args.steps, args.rounds = "1,4", "100", 8, 2
  threads = args.threads or configured_threads()
  os.environ["TINYHET_CPU_THREADS"] = str(threads)
  configured_threads.cache_clear()
  batches, prompts = [int(b) for b in args.batches.split(",")], [int(p) for p in args.prompts.split(",") if p]
  from tinyhet.model.weights import embedded_model_path
  path = embedded_model_path() if args.model is None else args.model
  max_context = max(max(prompts, default=0), args.context + 3 + args.steps * args.rounds) + 16
  log = (lambda m: None) if args.json and not args.one_engine else (lambda m: print(m, file=sys.stderr, flush=True))
  if args.one_engine:
    e, tok = make_engine(args.engines, path, threads, max(batches), max_context)
    print(json.dumps({"rows": measure(e, tok, prompts, batches, args.context, args.steps, args.rounds, log), "model": gguf_name(path)}))
    return 0
  # each engine in a process of its own: two thread pools in one process (llama.cpp's and PyTorch's OpenMP, tinyhet's) can
  # leave one spinning while another works, which here slowed llama.cpp's batch-1 decode 100-fold
  from tinyhet.bench.membw import read_gbps
  gbps = read_gbps(threads=threads)
  log(f"read bandwidth {gbps:.1f} GB/s ({threads} threads)")
  if args.formats:
    if args.engines == ap.get_default("engines"): args.engines = "tinyhet,tinyhet-int8,llama.cpp,llama.cpp-noflash"
    runs = {}
    for fmt in args.formats.split(","):
      p = embedded_model_path() if fmt == "Q4_1" else format_path(fmt)
      if not p.exists(): raise SystemExit(f"tinyhet bench decode: no {fmt} file at {p}: run `make bench-setup`")
      log(f"{fmt}: {p}")
      runs[fmt] = dict(run_model(args, str(p), threads, gbps, log), file_bytes=p.stat().st_size)
      log(json.dumps({fmt: runs[fmt]}))     # each format's rows as they come (a sweep takes minutes per format)
    out = {"threads": threads, "read_gbps": gbps, "context": args.context, "llama_cpp": llama_cpp_build(), "formats": runs}
    columns, cells = format_cells(out)
    out["table"] = {"columns": columns, "rows": cells}      # what docs/benchmarks.md renders (bench/results.py)
    print(json.dumps(out) if args.json else format_table(out))
    return 0
  out = run_model(args, args.model, threads, gbps, log)
  columns, cells = model_cells(out)
  out["table"] = {"columns": columns, "rows": cells}      # what docs/benchmarks.md renders (bench/results.py)
  if args.json: print(json.dumps(out))
  else: print(table(out))
  return 0

def run_model(args, model_path, threads: int, gbps: float, log) -> dict:
  """Every engine of --engines on one GGUF, each in a process of its own: their rows, with the read share filled in."""
  rows, skipped, model = [], {}, ""
  for name in args.engines.split(","):
    log(f"{name} ({threads} threads) ...")
    # every engine the same rows: the int8 mode changes every product of block-quantized weights (decode, batches, prefill)
    cmd = [sys.executable, "-m", "tinyhet.bench.decode", "--one-engine", "--engines", name, "--threads", str(threads), "--batches", args.batches,
           "--prompts", args.prompts, "--context", str(args.context), "--steps", str(args.steps), "--rounds", str(args.rounds)]
    r = subprocess.run(cmd + (["--model", str(model_path)] if model_path else []), capture_output=True, text=True)
    if r.returncode != 0:
      last = (r.stderr.strip().splitlines() or ["no output"])[-1]
      if "No module named" in last: skipped[name] = f"not installed ({last.split()[-1]}): make bench-setup"
      else: raise SystemExit(f"tinyhet bench decode: the {name} engine failed: {last}")
      continue
    if not args.json: print(r.stderr.strip(), file=sys.stderr)
    child = json.loads(r.stdout.strip().splitlines()[-1])
    model = child["model"]
    for row in child["rows"]:
      step_bytes = row.pop("step_bytes")
      row["read_share"] = step_bytes * row["decode_tok_s"] / row["batch"] / (gbps * 1e9) if step_bytes else None
      rows.append(row)
  return {"threads": threads, "read_gbps": gbps, "model": model, "context": args.context, "llama_cpp": llama_cpp_build(),
          "skipped": skipped, "rows": rows}

def pick(rows, e, key, **match):
  """Engine e's figure `key` in the row matching `match`, or None."""
  return next((r[key] for r in rows if r["engine"] == e and r.get(key) is not None and all(r[k] == v for k, v in match.items())), None)

def best_llama(rows, key: str, **match):
  """llama.cpp's better figure of flash attention on and off for one cell: (tok/s, which), or (None, None)."""
  got = [(v, mode) for e, mode in (("llama.cpp", "flash"), ("llama.cpp-noflash", "no flash")) if (v := pick(rows, e, key, **match))]
  return max(got) if got else (None, None)

def format_cells(out: dict) -> tuple[list[str], list[list[str]]]:
  """The sweep as one row per format: each cell tinyhet's float rate / llama.cpp's better of flash attention on and off
  (ratio), the int8 mode's rate and ratio, then the batch-1 read share and resident weights against the file."""
  runs = out["formats"].values()
  batches = sorted({r["batch"] for run in runs for r in run["rows"] if r["decode_tok_s"]})
  prompts = sorted({r["prompt_tokens"] for run in runs for r in run["rows"] if r["prefill_tok_s"]})
  keys = [(f"decode b{b}", "decode_tok_s", {"batch": b}) for b in batches] + \
         [(f"prefill {n}", "prefill_tok_s", {"prompt_tokens": n}) for n in prompts]
  columns = ["format"] + [k[0] + (" tok/s: float / llama.cpp (its mode); int8" if i == 0 else "") for i, k in enumerate(keys)] + \
            ["b1 read share", "resident / file", "skipped"]
  rows = []
  for fmt, run in out["formats"].items():
    rs, cells = run["rows"], [fmt]
    for _, key, match in keys:
      t, i8 = pick(rs, "tinyhet", key, **match), pick(rs, "tinyhet-int8", key, **match)
      l, mode = best_llama(rs, key, **match)
      cell = f"{t:.1f} / {l:.1f} ({t / l:.2f}x, {mode})" if t and l else f"{t or 0:.1f}"
      cells.append(cell + (f"; int8 {i8:.1f}" + (f" ({i8 / l:.2f}x)" if l else "") if i8 else ""))
    share, res = pick(rs, "tinyhet", "read_share", batch=1), pick(rs, "tinyhet", "weights_resident")
    cells += [f"{share:.0%}" if share else "-", f"{res / run['file_bytes']:.2f}x ({run['file_bytes'] / 1e6:.0f} MB)" if res else "-",
              ", ".join(run["skipped"]) or "-"]
    rows.append(cells)
  return columns, rows

NAMES = {"tinyhet": "tinyhet", "tinyhet-int8": "tinyhet int8", "llama.cpp": "llama.cpp (flash)", "llama.cpp-noflash": "llama.cpp (no flash)",
         "torch-f32": "PyTorch float32", "torch": "PyTorch bfloat16", "torch-compile": "PyTorch compiled"}

def model_cells(out: dict) -> tuple[list[str], list[list[str]]]:
  """One model's run as one row per figure (prefill per length, decode per batch with its read share), one column per
  engine, then each tinyhet mode over the best baseline of its row, named."""
  rows = out["rows"]
  engines = list(dict.fromkeys(r["engine"] for r in rows))
  ours, others = [e for e in engines if e.startswith("tinyhet")], [e for e in engines if not e.startswith("tinyhet")]
  prompts, batches = sorted({r["prompt_tokens"] for r in rows if r["prefill_tok_s"]}), sorted({r["batch"] for r in rows if r["decode_tok_s"]})
  keys = [(f"prefill {n} tokens, tok/s", "prefill_tok_s", {"prompt_tokens": n}) for n in prompts]
  keys += [(f"decode batch {b}, tok/s (read share)", "decode_tok_s", {"batch": b}) for b in batches]
  cells = []
  for label, key, match in keys:
    vals = {e: pick(rows, e, key, **match) for e in engines}
    share = {e: pick(rows, e, "read_share", **match) for e in engines} if key == "decode_tok_s" else {}
    line = [label] + [f"{v:.1f}" + (f" ({share[e]:.0%})" if share.get(e) else "") if v else "-" for e, v in vals.items()]
    best = max(((vals[e], e) for e in others if vals[e]), default=None)
    line += [f"{vals[e] / best[0]:.2f}x ({NAMES.get(best[1], best[1]).replace('(', '').replace(')', '')})" if best and vals[e] else "-" for e in ours]
    cells.append(line)
  return ["row"] + [NAMES.get(e, e) for e in engines] + [f"{NAMES.get(e, e)} / best baseline" for e in ours], cells

def format_table(out: dict) -> str:
  """format_cells as text, one line per format."""
  columns, rows = format_cells(out)
  lines = [f"{out['threads']} threads, read bandwidth {out['read_gbps']:.1f} GB/s; decode at a context of {out['context']} tokens; "
           "each cell tinyhet / llama.cpp (the better of flash attention on and off) tok/s (ratio)"]
  lines += ["; ".join(f"{c}: {v}" for c, v in zip(columns, r) if v != "-") for r in rows]
  if out["llama_cpp"]: lines.append(f"llama.cpp: {out['llama_cpp']}")
  return "\n".join(lines)

def gguf_name(path) -> str:
  from tinyhet.model.weights import gguf_config, read_gguf
  return gguf_config(read_gguf(path)).name

def table(out: dict) -> str:
  rows, engines = out["rows"], list(dict.fromkeys(r["engine"] for r in out["rows"]))
  lines = [f"{out['model']}, {out['threads']} threads, read bandwidth {out['read_gbps']:.1f} GB/s; decode at a context of {out['context']} tokens"]
  others = [e for e in engines if not e.startswith("tinyhet")]   # the baselines: tinyhet-int8 is tinyhet's own other mode
  lines.append(f"{'':22}" + "".join(f"{e:>18}" for e in engines) + (f"{'tinyhet/best':>14}" if "tinyhet" in engines and others else ""))
  def line(label, pick, fmt, ratio: bool = True):
    vals = {e: pick(e) for e in engines}
    best = max((vals[e] for e in others if vals[e]), default=None) if ratio else None
    ratio = f"{vals['tinyhet'] / best:>13.2f}x" if best and vals.get("tinyhet") else ""
    lines.append(f"{label:22}" + "".join(f"{fmt(vals[e]) if vals[e] is not None else '-':>18}" for e in engines) + ratio)
  for n in sorted({r["prompt_tokens"] for r in rows if r["prefill_tok_s"]}):
    rate = lambda e: next((r["prefill_tok_s"] for r in rows if r["engine"] == e and r["prefill_tok_s"] and r["prompt_tokens"] == n), None)
    line(f"prefill {n} tok/s", rate, lambda v: f"{v:.1f}")
  for b in sorted({r["batch"] for r in rows if r["decode_tok_s"]}):
    pick = lambda e, k: next((r[k] for r in rows if r["engine"] == e and r["decode_tok_s"] and r["batch"] == b), None)
    line(f"decode batch {b} tok/s", lambda e: pick(e, "decode_tok_s"), lambda v: f"{v:.1f}")
    line("  read share", lambda e: pick(e, "read_share"), lambda v: f"{v:.0%}", ratio=False)
  res = {r["engine"]: r["weights_resident"] for r in rows if r.get("weights_resident")}
  if res: lines.append("resident weights MB  " + ", ".join(f"{e} {v / 1e6:.0f}" for e, v in res.items()))
  if out["llama_cpp"]: lines.append(f"llama.cpp: {out['llama_cpp']}")
  lines += [f"{k}: skipped, {v}" for k, v in out["skipped"].items()]
  return "\n".join(lines)

if __name__ == "__main__": sys.exit(main())
