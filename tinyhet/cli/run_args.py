"""`tinyhet run`'s options: parsed and checked here for the run itself and again, from the same command line, by the resident
process that serves it (tinyhet.cli.resident_server)."""
from __future__ import annotations
import argparse, os
from tinyhet.cli.common import ArgumentParser, host_port, int_in
from tinyhet.cli.resident import KEEP_ALIVE_DEFAULT, parse_keep_alive

DEFAULT_PROMPT = "What is the capital of France? Answer in one short sentence."

def parse_args(argv):
  ap = ArgumentParser(prog="tinyhet run", description="generate text with prefill on HET and decode on a MESH decode node, the KV cache "
                      "streamed layer by layer")
  ap.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT, help=f"the prompt (default: {DEFAULT_PROMPT!r})")
  ap.add_argument("--model", default=None, help="GGUF file or Hugging Face directory (default: the embedded SmolLM2-135M-Instruct)")
  ap.add_argument("--max-tokens", type=int_in(1, 1 << 24), default=64, help="tokens to generate at most (default 64)")
  ap.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
  ap.add_argument("--top-p", type=float, default=1.0)
  ap.add_argument("--seed", type=int_in(0, 2**64 - 1), default=0)
  ap.add_argument("--transport", choices=["auto", "verbs", "tcp", "shm"], default=None, help="default: the configured one (auto)")
  ap.add_argument("--decode-node", metavar="HOST:PORT", type=host_port(), default=None, help="use a running decode node (tinyhet node --role decode)")
  ap.add_argument("--no-disagg", action="store_true", help="one device (HET) does prefill and decode (the same paged engine, no "
                  "transfer), for comparison")
  ap.add_argument("--overhead", action="store_true", help="also time the same padded prefill on HET with no transfer (after one "
                  "untimed run that compiles it) and report the TTFT overhead of disaggregation")
  ap.add_argument("--kv-memory", default="512M", help="KV pool of the decode node started here (default 512M)")
  ap.add_argument("--float-weights", action="store_true", help="dequantize a GGUF's weights to float32 on both nodes (default: "
                  "keep the quantized blocks, dequantized inside the matmul kernels)")
  ap.add_argument("--int8-activations", action="store_true", help="round activations to int8 per block for integer dot products "
                  "against quantized weights, to bfloat16 against BF16 weights (faster, not the float32 reference's numbers; sets "
                  "TINYHET_INT8_ACTIVATIONS=1)")
  ap.add_argument("--raw", action="store_true", help="no chat template: complete the prompt as plain text")
  ap.add_argument("--json", action="store_true", help="print one JSON object instead of the text and the table")
  ap.add_argument("--quiet", action="store_true", help="no progress on stderr")
  ap.add_argument("--keep-alive", default=os.environ.get("TINYHET_KEEP_ALIVE", KEEP_ALIVE_DEFAULT), metavar="DURATION",
                  help="keep the model loaded in a resident tinyhet this long after the run, for the next runs (default "
                  f"{KEEP_ALIVE_DEFAULT}, or TINYHET_KEEP_ALIVE; 0: load in this process and keep nothing; see tinyhet.cli.resident)")
  ap.add_argument("--stop", action="store_true", help="stop every resident tinyhet of this user, and exit")
  ap.add_argument("--resident-serve", action="store_true", help=argparse.SUPPRESS)   # the resident process itself
  args = ap.parse_args(argv)
  if args.int8_activations: os.environ["TINYHET_INT8_ACTIVATIONS"] = "1"   # read by tinyhet.model.layers; inherited by the nodes started here
  try: parse_keep_alive(args.keep_alive)
  except ValueError as e: ap.error(str(e))
  from tinyhet.config import ConfigError, parse_bytes
  try: parse_bytes(args.kv_memory, "--kv-memory")
  except ConfigError as e: ap.error(str(e))
  from tinyhet.model.sampling import check_sampling
  try: check_sampling(args.temperature, args.top_p)
  except ValueError as e: ap.error(str(e).replace("temperature", "--temperature").replace("top_p", "--top-p"))
  return args
