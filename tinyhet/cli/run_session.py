"""What a `tinyhet run` loads once: its decode node (a child process, LocalDecodeNode) and the Session (the model on HET, its
tokenizer, the decode node's client) that answers prompts. A plain run makes one and ends; the resident process
(tinyhet.cli.resident_server) keeps one for every later run."""
from __future__ import annotations
import json, os, subprocess, sys, threading, time
from tinyhet.cli.common import RunError

def say(args, msg: str):
  if not args.quiet: print(msg, file=sys.stderr, flush=True)

class LocalDecodeNode:
  """`tinyhet node --role decode` as a child process, sharing a fresh token with this process."""
  def __init__(self, args):
    cmd = [sys.executable, "-m", "tinyhet", "node", "--role", "decode", "--listen", "127.0.0.1:0", "--kv-memory", args.kv_memory,
           "--stdin-stop"] + (["--model", args.model] if args.model else []) + (["--quiet"] if args.quiet else []) + \
          (["--float-weights"] if args.float_weights else []) + (["--no-prefix-cache"] if getattr(args, "no_prefix_cache", False) else [])
    # no warm-up unless asked for (TINYHET_WARM_UP): this node decodes one run's tokens, and a background warm-up would take
    # the cores from the run's own prefill. Its own process group: a Ctrl-C at the terminal reaches this process only, which
    # then stops the node (once, cleanly); the node dies with this process anyway (its stdin closes, and PR_SET_PDEATHSIG:
    # tinyhet.cli.node.die_with_parent, which fires when the thread that started it ends: start it from the thread that
    # outlives it, the main one)
    # its one writer is this process: bound to this process's key, and trusted (its KV may be cached: tinyhet.runtime.identity)
    from tinyhet.device.memory import local_node
    me = local_node()
    # args.kv_dtype, where given, is the node's (its Config kv_dtype; bench e2e starts one node per dtype), else this process's
    kv_dtype = {"TINYHET_KV_DTYPE": args.kv_dtype} if getattr(args, "kv_dtype", None) else {}
    keys = ",".join(x for x in (os.environ.get("TINYHET_PEER_KEYS", ""), f"{me.name}={me.endpoint.identity.public}") if x)
    self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, process_group=0,
                                 env={"TINYHET_WARM_UP": "off", **os.environ, "TINYHET_NODE": "decode-local", "TINYHET_PARENT_PID": str(os.getpid()),
                                      "TINYHET_PEER_KEYS": keys, "TINYHET_TRUSTED_WRITERS": me.name, **kv_dtype})
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

class Session:
  """What a run loads once: the model on HET, its tokenizer, and the decode node's client (or the one-device engine's
  model). `tinyhet run` makes one per process; a resident tinyhet (tinyhet.cli.resident) keeps one for every later run."""
  def __init__(self, args, child):
    import tinyhet  # noqa: F401  (HET and MESH)
    from tinyhet.device.memory import local_node
    from tinyhet.device.backend import resolve_backend
    from tinyhet.model.weights import load_model, model_name
    self.node = local_node()
    self.backend = resolve_backend(self.node.config.het_backend)
    say(args, f"loading {model_name(args.model)} onto HET ({self.backend})")
    self.model, self.tok = load_model(args.model, device="HET", quiet=args.quiet, packed=not args.float_weights)
    self.client = None
    if not args.no_disagg:
      from tinyhet.engine.client import DecodeClient
      from tinyhet.model.fingerprint import fingerprint
      self.client = DecodeClient(self.node, args.decode_node or child.address(), self.model, model_name(args.model), args.transport,
                                 fingerprint=fingerprint(args.model, self.model.cfg, not args.float_weights))
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
    from tinyhet.engine.prefill import prefill_progress
    progress = None if args.quiet else prefill_progress(len(prompt_ids), model.cfg.n_layers, out=progress_out)   # a long prefill says where it is
    backend = self.backend
    if args.no_disagg:
      from tinyhet.engine.local_engine import LocalEngine
      engine = LocalEngine(model, len(prompt_ids) + args.max_tokens)
      t0 = time.perf_counter()
      ids, st = engine.generate(prompt_ids, args.max_tokens, stop_ids=tok.stop_ids, on_token=on_token, progress=progress, **sampling)
      result = {"ttft_s": st["ttft_s"], "kv_bytes": 0, "transfer_gbps": 0.0, "decode_tok_s": st["decode_tok_s"], "transport": "none",
                "prefill_device": f"HET ({backend})", "decode_device": f"HET ({backend})", "total_s": time.perf_counter() - t0}
    else:
      from tinyhet.engine.prefill import ttft_no_transfer
      client = self.client
      say(args, f"prefilling {len(prompt_ids)} tokens on HET, streaming KV layer by layer to the decode node")
      if args.overhead:
        say(args, "compiling the prefill without transfer (--overhead)")
        ttft_no_transfer(model, prompt_ids, client.kv_dtype)
      t0 = time.perf_counter()
      ids, st = client.generate(prompt_ids, args.max_tokens, stop_ids=tok.stop_ids, on_token=on_token, progress=progress, **sampling)
      result = {"ttft_s": st.ttft_s, "prefill_s": st.prefill_s, "kv_bytes": st.kv_bytes, "transfer_s": st.transfer_s,
                "transfer_gbps": st.transfer_gbps, "kv_tail_s": st.kv_tail_s, "landed_clock": st.landed_clock,
                "decode_tok_s": st.decode_tok_s, "transport": st.transport, "preemptions": st.preemptions,
                "cached_tokens": st.cached_tokens, "prefill_device": f"HET ({backend})",
                "decode_device": f"MESH on {client.ctl.peer}", "total_s": time.perf_counter() - t0,
                "timeline": [vars(t) for t in st.timeline]}
      if args.overhead:
        result["ttft_no_transfer_s"] = ttft_no_transfer(model, prompt_ids, client.kv_dtype)
        result["overhead_s"] = result["ttft_s"] - result["ttft_no_transfer_s"]
    on_text(stream.flush())
    return {"prompt_ids": prompt_ids, "generated_ids": ids, "text": tok.decode(ids), **result}
