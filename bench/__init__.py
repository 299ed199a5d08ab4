"""Benchmarks (`tinyhet bench NAME`, or `python -m tinyhet.bench NAME`): each prints a baseline measured in the same run
next to the project's figure, with --json one JSON object, and with --save that object and its provenance into
docs/results/NAME.json (bench/results.py). Installed as tinyhet.bench."""
import importlib, sys

BENCHMARKS = {
  "transfer": ("tinyhet.bench.transfer", "KV transports (shm, tcp, verbs) against memcpy and a raw socket"),
  "kv": ("tinyhet.bench.kv", "paged KV: memory utilization and paged attention against contiguous/dense"),
  "decode": ("tinyhet.bench.decode", "the decode node's engine against llama.cpp and PyTorch: decode at batches 1-64, prefill, read-bandwidth share"),
  "int8": ("tinyhet.bench.int8", "the int8-activation mode against the float path: logit error and greedy agreement on a few prompts"),
  "qmm": ("tinyhet.bench.qmm", "the matmul kernels per weight type against tinygrad's path on dequantized weights, one core"),
  "het": ("tinyhet.bench.het_check", "the HET device on its backend (HET_BACKEND=CUDA on a GPU): checks and matmul speed"),
  "serve": ("tinyhet.bench.serve", "the service: 1 prefill + 1 decode node against one --role both node, requests/s, TTFT, TPOT"),
  "staging": ("tinyhet.bench.staging", "layers leaving unregistered device memory: asynchronous staging buffers against the synchronous copy"),
  "gpu": ("tinyhet.bench.gpu_check", "the GPU check (bench/gpu_check.sh): HET checks, SmolLM2 and 70B shapes prefilled on the GPU"),
  "samples": ("tinyhet.bench.samples", "n = 4 parallel samples of one prompt against 4 separate requests: prefills, peak KV blocks, time"),
  "prefix": ("tinyhet.bench.prefix", "the decode node as a KV store: a multi-turn chat through the router, prefix cache on against off"),
  "profile": ("tinyhet.bench.profile", "where a prefill and a decode step spend their time, kernel by kernel (matmuls per shape, attention, rest)"),
  "latency": ("tinyhet.bench.latency", "what a request waits for: first requests after warm-up, a fresh process, decode under prefill load"),
  "logprobs": ("tinyhet.bench.logprobs", "a prompt's own logprobs (echo): its prefill against a plain one; loglikelihood load vs llama-cpp-python"),
  "bignode": ("tinyhet.bench.bignode", "the CPU node model fitted at 1 thread, checked at 1 and 2, and its 2 x 96-core prediction"),
  "kvquant": ("tinyhet.bench.kvquant", "the KV dtypes (q8_0, fp8, bfloat16) against float16 KV: greedy tokens, perplexity, capacity, speed"),
  "spec": ("tinyhet.bench.spec", "speculative decoding (ngram) vs plain decode, copy-heavy and chat prompts: tok/s, accept length, same tokens"),
  "e2e": ("tinyhet.bench.e2e", "end to end: disaggregated against --no-disagg, decode against the memory-bandwidth bound"),
}

def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if not argv or argv[0] not in BENCHMARKS:
    listing = "".join(f"  {n:<9}{h}\n" for n, (_, h) in BENCHMARKS.items())
    print("usage: tinyhet bench NAME [--json] [--save[=FILE]] [ARGS]\n\nbenchmarks:\n" + listing, end="",
          file=sys.stdout if not argv or argv[0] in ("-h", "--help") else sys.stderr)
    return 0 if not argv or argv[0] in ("-h", "--help") else 2
  module = importlib.import_module(BENCHMARKS[argv[0]][0])
  save = [a for a in argv[1:] if a == "--save" or a.startswith("--save=")]
  if save:   # the figures as data, with their provenance (bench/results.py)
    from tinyhet.bench import results
    return results.run_and_save(argv[0], module, [a for a in argv[1:] if a not in save], save[-1].partition("=")[2] or None)
  return module.main(argv[1:]) or 0
