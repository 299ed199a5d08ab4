"""`tinyhet run [PROMPT]`: generate text with prefill on HET and decode on a MESH decode node, the KV cache streamed
layer by layer between them while prefill runs. With no --decode-node, a decode node is started on this machine (another
process; auto picks the shm transport for it). Prints the text as it is generated, then the figures that matter.
The model and the decode node stay loaded in a resident process for the next runs (--keep-alive; see tinyhet.resident).
"""
from __future__ import annotations
import argparse, json, os, secrets, signal, subprocess, sys, threading, time

from tinyhet.cli import ArgumentParser, exit_now, host_port, int_in
from tinyhet.resident import KEEP_ALIVE_DEFAULT, parse_keep_alive

DEFAULT_PROMPT = "What is the capital of France? Answer in one short sentence."

def parse_args(argv):
  ap = ArgumentParser(prog="tinyhet run", description=__doc__.splitlines()[0])
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
  ap.add_argument("--raw", action="store_true", help="no chat template: complete the prompt as plain text")
  ap.add_argument("--json", action="store_true", help="print one JSON object instead of the text and the table")
  ap.add_argument("--quiet", action="store_true", help="no progress on stderr")
  ap.add_argument("--keep-alive", default=os.environ.get("TINYHET_KEEP_ALIVE", KEEP_ALIVE_DEFAULT), metavar="DURATION",
                  help="keep the model loaded in a resident tinyhet this long after the run, for the next runs (default "
                  f"{KEEP_ALIVE_DEFAULT}, or TINYHET_KEEP_ALIVE; 0: load in this process and keep nothing; see tinyhet.resident)")
  ap.add_argument("--stop", action="store_true", help="stop every resident tinyhet of this user, and exit")
  ap.add_argument("--resident-serve", action="store_true", help=argparse.SUPPRESS)   # the resident process itself
  args = ap.parse_args(argv)
  try: parse_keep_alive(args.keep_alive)
  except ValueError as e: ap.error(str(e))
  from tinyhet.config import ConfigError, parse_bytes
  try: parse_bytes(args.kv_memory, "--kv-memory")
  except ConfigError as e: ap.error(str(e))
  from tinyhet.sampling import check_sampling
  try: check_sampling(args.temperature, args.top_p)
  except ValueError as e: ap.error(str(e).replace("temperature", "--temperature").replace("top_p", "--top-p"))
  return args

class RunError(RuntimeError):
  """A run that cannot go on, said in the user's words (the CLI prints it as one line)."""

class Terminated(Exception):
  """SIGTERM: unwind like Ctrl-C, so that the decode node this run started is stopped with it."""

def _on_sigterm(*_):
  signal.signal(signal.SIGTERM, signal.SIG_IGN)     # once: the cleanup that follows is not interrupted again
  raise Terminated()

def say(args, msg: str):
  if not args.quiet: print(msg, file=sys.stderr, flush=True)

class LocalDecodeNode:
  """`tinyhet node --role decode` as a child process, sharing a fresh token with this process."""
  def __init__(self, args):
    cmd = [sys.executable, "-m", "tinyhet", "node", "--role", "decode", "--listen", "127.0.0.1:0", "--kv-memory", args.kv_memory,
           "--stdin-stop"] + (["--model", args.model] if args.model else []) + (["--quiet"] if args.quiet else []) + \
          (["--float-weights"] if args.float_weights else [])
    # its own process group: a Ctrl-C at the terminal reaches this process only, which then stops the node (once, cleanly);
    # the node dies with this process anyway (its stdin closes, and PR_SET_PDEATHSIG: tinyhet.node.die_with_parent, which
    # fires when the thread that started it ends: start it from the thread that outlives it, the main one)
    self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, process_group=0,
                                 env={**os.environ, "TINYHET_NODE": "decode-local", "TINYHET_PARENT_PID": str(os.getpid())})
    self.ready, self.info, self.errors = threading.Event(), None, []
    threading.Thread(target=self._stdout, daemon=True, name="tinyhet-decode-stdout").start()
    self.stderr_reader = threading.Thread(target=self._stderr, args=(args.quiet,), daemon=True, name="tinyhet-decode-stderr")
    self.stderr_reader.start()

  def _stdout(self):
    line = self.proc.stdout.readline()
    if line: self.info = json.loads(line)
    self.ready.set()

  def _stderr(self, quiet: bool):
    debug, traceback = bool(os.environ.get("TINYHET_DEBUG")), False
    for line in self.proc.stderr:
      self.errors.append(line)
      traceback = traceback or line.startswith("Traceback (most recent call last)")
      # the node's own error (its "tinyhet node: ..." line, or a traceback) becomes this run's one error line (address()),
      # so it is not echoed here: one error, said once
      if debug or not (quiet or traceback or line.startswith("tinyhet node:")):
        print(f"[decode node] {line}", end="", file=sys.stderr, flush=True)

  def address(self, timeout: float = 600) -> str:
    if not self.ready.wait(timeout) or self.info is None:
      self.stderr_reader.join(5)
      last = next((x.strip() for x in reversed(self.errors) if x.strip()), "")
      why = last.removeprefix("tinyhet node: ") if last else f"it exited with status {self.proc.poll()}"
      raise RunError(f"the decode node started for this run failed: {why}" +
                     (" (TINYHET_DEBUG=1 shows its traceback)" if any(x.startswith("Traceback") for x in self.errors) else ""))
    return self.info["address"]

  def close(self):
    if self.proc.poll() is None:
      try: self.proc.stdin.close()          # the node stops when its stdin closes
      except OSError: pass
      for stop in (lambda: None, self.proc.terminate, self.proc.kill):
        stop()
        try:
          self.proc.wait(10)
          break
        except subprocess.TimeoutExpired: pass

def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  args = parse_args(argv)
  from tinyhet import resident
  if args.stop:
    resident.stop_all(lambda m: say(args, m))
    return 0
  if args.resident_serve: return resident.serve(args)
  signal.signal(signal.SIGTERM, _on_sigterm)
  if parse_keep_alive(args.keep_alive) > 0 and not (args.decode_node or args.no_disagg or args.overhead):
    from tinyhet.weights import model_nbytes
    model_nbytes(args.model, packed=not args.float_weights)   # a bad --model fails here, not in a process started for it
    try: report(args, resident.client_run(args, argv, lambda m: say(args, m)))   # the model stays loaded for the next run
    except KeyboardInterrupt: return 130
    except Terminated: exit_now(143)    # our socket closes: the resident process stops the run at its next token, and stays
    return 0
  sys.setswitchinterval(1e-3)      # transport threads get the GIL sooner from the busy prefill thread
  # a fresh shared token for the decode node started here (a remote one needs TINYHET_TOKEN set on both nodes)
  if not args.decode_node and not args.no_disagg: os.environ.setdefault("TINYHET_TOKEN", secrets.token_hex(16))
  child = None
  try:
    from tinyhet.weights import model_nbytes
    model_nbytes(args.model, packed=not args.float_weights)   # a bad --model fails here, once, before a node is started for it
    child = LocalDecodeNode(args) if not (args.decode_node or args.no_disagg) else None
    return generate(args, child)
  except KeyboardInterrupt: return 130
  except Terminated: pass
  finally:
    if child is not None: child.close()
  exit_now(143)

class Session:
  """What a run loads once: the model on HET, its tokenizer, and the decode node's client (or the one-device engine's
  model). `tinyhet run` makes one per process; a resident tinyhet (tinyhet.resident) keeps one for every later run."""
  def __init__(self, args, child):
    import tinyhet  # noqa: F401  (HET and MESH)
    from tinyhet.memory import local_node
    from tinyhet.devices import resolve_backend
    from tinyhet.weights import load_model, model_name
    self.node = local_node()
    self.backend = resolve_backend(self.node.config.het_backend)
    say(args, f"loading {model_name(args.model)} onto HET ({self.backend})")
    self.model, self.tok = load_model(args.model, device="HET", quiet=args.quiet, packed=not args.float_weights)
    self.client = None
    if not args.no_disagg:
      from tinyhet.prefill import DecodeClient
      self.client = DecodeClient(self.node, args.decode_node or child.address(), self.model, model_name(args.model), args.transport)
      say(args, f"decode node at {self.client.ctl.peer}")

  def close(self):
    if self.client is not None: self.client.close()

  def answer(self, args, on_text, progress_out=None) -> dict:
    """One prompt: the text goes to on_text as it is generated; returns the run's figures (the table's and --json's)."""
    model, tok = self.model, self.tok
    prompt_ids = tok.encode_prompt(args.prompt, raw=args.raw)
    if len(prompt_ids) + args.max_tokens > model.cfg.max_context:
      raise RunError(f"the prompt ({len(prompt_ids)} tokens) and --max-tokens {args.max_tokens} exceed the model's context of "
                     f"{model.cfg.max_context} tokens: lower --max-tokens or shorten the prompt")
    stream = tok.stream_decoder()
    def on_token(t: int): on_text(stream.push(t))
    sampling = dict(temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    from tinyhet.prefill import prefill_progress
    progress = None if args.quiet else prefill_progress(len(prompt_ids), model.cfg.n_layers, out=progress_out)   # a long prefill says where it is
    backend = self.backend
    if args.no_disagg:
      from tinyhet.local_engine import LocalEngine
      engine = LocalEngine(model, len(prompt_ids) + args.max_tokens)
      t0 = time.perf_counter()
      ids, st = engine.generate(prompt_ids, args.max_tokens, stop_ids=tok.stop_ids, on_token=on_token, progress=progress, **sampling)
      result = {"ttft_s": st["ttft_s"], "kv_bytes": 0, "transfer_gbps": 0.0, "decode_tok_s": st["decode_tok_s"], "transport": "none",
                "prefill_device": f"HET ({backend})", "decode_device": f"HET ({backend})", "total_s": time.perf_counter() - t0}
    else:
      from tinyhet.prefill import ttft_no_transfer
      client = self.client
      say(args, f"prefilling {len(prompt_ids)} tokens on HET, streaming KV layer by layer to the decode node")
      if args.overhead:
        say(args, "compiling the prefill without transfer (--overhead)")
        ttft_no_transfer(model, prompt_ids, client.kv_dtype)
      t0 = time.perf_counter()
      ids, st = client.generate(prompt_ids, args.max_tokens, stop_ids=tok.stop_ids, on_token=on_token, progress=progress, **sampling)
      result = {"ttft_s": st.ttft_s, "prefill_s": st.prefill_s, "kv_bytes": st.kv_bytes, "transfer_s": st.transfer_s,
                "transfer_gbps": st.transfer_gbps, "kv_tail_s": st.kv_tail_s, "landed_clock": st.landed_clock,
                "decode_tok_s": st.decode_tok_s, "transport": st.transport, "preemptions": st.preemptions, "prefill_device": f"HET ({backend})",
                "decode_device": f"MESH on {client.ctl.peer}", "total_s": time.perf_counter() - t0,
                "timeline": [vars(t) for t in st.timeline]}
      if args.overhead:
        result["ttft_no_transfer_s"] = ttft_no_transfer(model, prompt_ids, client.kv_dtype)
        result["overhead_s"] = result["ttft_s"] - result["ttft_no_transfer_s"]
    on_text(stream.flush())
    return {"prompt_ids": prompt_ids, "generated_ids": ids, "text": tok.decode(ids), **result}

def generate(args, child) -> int:
  session = Session(args, child)
  try: out = session.answer(args, (lambda piece: None) if args.json else (lambda piece: print(piece, end="", flush=True)))
  finally: session.close()
  report(args, out)
  return 0

def report(args, out: dict):
  if args.json: print(json.dumps(out))
  else:
    print()
    print(table(out))

def table(r: dict) -> str:
  rows = [("prompt tokens", f"{len(r['prompt_ids'])}"), ("generated tokens", f"{len(r['generated_ids'])}"),
          ("TTFT", f"{r['ttft_s']:.3f} s (prefill on {r['prefill_device']}" + (", until every layer landed)" if r["transport"] != "none" else ")"))]
  if r["transport"] != "none":
    rows += [("KV moved", f"{r['kv_bytes'] / 2**20:.2f} MiB over {r['transport']}, {r['transfer_gbps']:.3f} GB/s over the "
                          f"{1e3 * r['transfer_s']:.1f} ms it was moving; last layer landed {1e3 * r['kv_tail_s']:.1f} ms after the first token")]
    if "overhead_s" in r:
      rows.append(("overhead", f"{r['overhead_s']:+.3f} s of TTFT ({100 * r['overhead_s'] / r['ttft_no_transfer_s']:+.1f}%) over the same "
                               f"prefill with no transfer ({r['ttft_no_transfer_s']:.3f} s)"))
  rows.append(("decode", f"{r['decode_tok_s']:.1f} tokens/s on {r['decode_device']}"))
  width = max(len(k) for k, _ in rows)
  return "\n".join(["-" * 60] + [f"{k:<{width}}  {v}" for k, v in rows])

if __name__ == "__main__": sys.exit(main())
