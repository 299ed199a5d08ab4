"""`tinyhet node --role decode|prefill|both`: a node process (prefill and both: see tinyhet.service.node_roles). A decode node
loads the model onto MESH, allocates the paged KV pool in registered memory, listens, and prints one JSON line
{"address", "node", "kv_blocks", ...} on stdout once it is ready. Peers prove the shared token (TINYHET_TOKEN or the
config file). Stop it with Ctrl-C, SIGTERM, or by closing its stdin (--stdin-stop: a node owned by a parent process, which
also dies with that parent).
"""
from __future__ import annotations
import json, os, signal, sys, threading, time

from tinyhet.cli.common import ArgumentParser, exit_after_signal, exit_now, host_port, int_in

MAX_SEQS = 4096           # --max-seqs at most: far past any batch one node decodes at once
MAX_CONTEXT = 1 << 24     # --max-context: tokens

def parse_args(argv):
  ap = ArgumentParser(prog="tinyhet node", description=__doc__.splitlines()[0])
  ap.add_argument("--role", choices=["decode", "prefill", "both"], required=True)
  ap.add_argument("--listen", default="127.0.0.1:7470", type=host_port(listen=True), help="host:port to accept prefill nodes on (0: any port)")
  ap.add_argument("--model", default=None, help="GGUF file or Hugging Face directory (default: the embedded SmolLM2-135M-Instruct)")
  ap.add_argument("--kv-memory", default="1G", help="KV pool size (all layers, K and V), e.g. 512M, 64G")
  ap.add_argument("--max-seqs", type=int_in(1, MAX_SEQS), default=16, help=f"sequences decoded together at most (1 to {MAX_SEQS})")
  ap.add_argument("--max-context", type=int_in(2, MAX_CONTEXT), default=None, help="cap the model's context (tokens) to bound memory")
  ap.add_argument("--float-weights", action="store_true", help="dequantize a GGUF's weights to float32 (default: keep its quantized "
                  "blocks and dequantize inside the matmul kernels, reading ~5x fewer bytes per token)")
  ap.add_argument("--no-prefix-cache", action="store_true", help="forget a finished sequence's KV blocks at once (default: keep its "
                  "full blocks cached until the pool needs them, and share them with requests whose prompt starts the same)")
  ap.add_argument("--kv-disk", default=None, help="a folder for the KV disk tier: cached blocks evicted from RAM are written there "
                  "and read back on a hit, across restarts (TINYHET_KV_DISK; default: none)")
  ap.add_argument("--speculative", default=None, choices=("off", "ngram", "draft"),
                  help="speculative decoding for requests that do not set it (TINYHET_SPECULATIVE; default off; docs/speculative.md)")
  ap.add_argument("--draft-model", default=None, help="a smaller model of the same tokenizer (GGUF file or Hugging Face directory) "
                  "that drafts for requests of speculative mode draft, on this node (default: none)")
  ap.add_argument("--kv-disk-size", default=None, help="the disk tier's bound, e.g. 200G (TINYHET_KV_DISK_SIZE; default 64G)")
  ap.add_argument("--stdin-stop", action="store_true", help="exit when stdin closes (for a parent process that owns this node)")
  ap.add_argument("--quiet", action="store_true")
  args = ap.parse_args(argv)
  from tinyhet.config import ConfigError, parse_bytes
  try:
    parse_bytes(args.kv_memory, "--kv-memory")
    if args.kv_disk_size is not None: args.kv_disk_size = parse_bytes(args.kv_disk_size, "--kv-disk-size")
  except ConfigError as e: ap.error(str(e))
  return args

def die_with_parent():
  """A node started by another tinyhet process (tinyhet run) must not outlive it: the kernel sends SIGTERM when the parent
  dies (PR_SET_PDEATHSIG), and a parent that died before this call is noticed here."""
  import ctypes
  try: ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)     # PR_SET_PDEATHSIG = 1 (Linux)
  except (OSError, AttributeError): pass
  if (want := os.environ.get("TINYHET_PARENT_PID")) and os.getppid() != int(want): os._exit(1)

class Stopped(Exception):
  """SIGTERM: leave whatever the main thread is doing (loading, warming up, decoding) and shut down cleanly."""

def _on_sigterm(stop: threading.Event):
  def handler(*_):
    if stop.is_set(): return                # the shutdown is under way; a second signal does not interrupt its cleanup
    stop.set()
    raise Stopped()
  return handler

def main(argv=None) -> int:
  args = parse_args(argv)
  stop = threading.Event()
  signal.signal(signal.SIGTERM, _on_sigterm(stop))
  parent = os.getppid()
  def orphaned() -> bool:
    # the parent that owns this node (--stdin-stop) is gone: its death closed stdin (or sent SIGTERM) just before the
    # kernel gave this process to another parent, so give that a moment
    deadline = time.monotonic() + 0.5
    while args.stdin_stop and time.monotonic() < deadline:
      if os.getppid() != parent: return True
      time.sleep(0.01)
    return False
  # a main thread stuck in a kernel or a C call still ends within a few seconds of SIGTERM; at once where the parent is gone
  exit_after_signal(0, orphaned=orphaned)
  if args.stdin_stop:
    die_with_parent()
    # stdin closing stops the node like SIGTERM does, whatever the main thread is doing (loading the model, say)
    threading.Thread(target=lambda: (sys.stdin.read(), os.kill(os.getpid(), signal.SIGTERM)), daemon=True, name="tinyhet-stdin-stop").start()
  try: code = serve(args, stop)
  except (Stopped, KeyboardInterrupt): code = 0     # serve's own cleanup has run
  exit_now(code)           # a prefill node's SIGTERM returns from serve: the compile workers may be gone too (see exit_now)

def serve(args, stop: threading.Event) -> int:
  if args.role == "prefill":
    return main_prefill(args)
  from tinyhet.config import load_config, parse_bytes
  kv_bytes = parse_bytes(args.kv_memory, "--kv-memory")     # checked by parse_args, as --listen was
  host, _, port = args.listen.rpartition(":")
  cfg = load_config(kv_disk=args.kv_disk, kv_disk_size=args.kv_disk_size, speculative=args.speculative)
  if cfg.speculative == "draft" and not args.draft_model:
    print("tinyhet node: --speculative draft needs a draft model: give --draft-model (a smaller model of the same tokenizer)", file=sys.stderr)
    return 2
  node, model, tok, model_id = start(args.model, kv_bytes, args.max_context, args.quiet, packed=not args.float_weights, draft=args.draft_model)
  from tinyhet.engine.decode_node import DecodeNode
  from tinyhet.kv.paged_cache import kv_blocks_for
  try: blocks = kv_blocks_for(model.cfg, cfg.kv_block_size, cfg.kv_dtype, kv_bytes)
  except ValueError as e:                    # the smallest pool depends on the model: known only once it is loaded
    print(f"tinyhet node: --kv-memory {args.kv_memory}: {e}: give a bigger --kv-memory", file=sys.stderr)
    return 2
  if cfg.numa == "replicate":             # the weights once per NUMA node, each worker thread reading its own node's (one node: nothing)
    from tinyhet.device.numa_replicas import replicate_weights
    node.replicas = replicate_weights(model)
  from tinyhet.model.fingerprint import fingerprint
  decode = DecodeNode(model, node, blocks, cfg.kv_block_size, cfg.kv_dtype, args.max_seqs, model_id, tok.stop_ids,
                      prefix_cache=not args.no_prefix_cache, fingerprint=fingerprint(args.model, model.cfg, not args.float_weights))
  decode.tokenizer = tok                 # stop strings end sequences on the node
  from tinyhet.engine.speculative import DEFAULT_K
  decode.speculative = {"mode": cfg.speculative, "k": DEFAULT_K}     # the default of requests without a speculative field
  if args.draft_model:
    try: decode.draft = load_draft(args, model, tok, blocks, cfg.kv_block_size, kv_bytes)
    except ValueError as e:
      print(f"tinyhet node: --draft-model {args.draft_model}: {e}", file=sys.stderr)
      return 2
    if cfg.warm_up != "off": decode.draft.ready = set()       # it drafts at the buckets the warm-up has captured
  if cfg.kv_disk and not args.no_prefix_cache:
    from tinyhet.kv.disk_tier import DiskTier
    try: decode.disk = DiskTier(decode.cache, cfg.kv_disk, cfg.kv_disk_size)
    except (OSError, ValueError) as e:
      print(f"tinyhet node: --kv-disk {cfg.kv_disk}: {getattr(e, 'strerror', None) or e}: give a folder this process may write",
            file=sys.stderr)
      return 2
    if not args.quiet: print(f"tinyhet node: {decode.disk.describe()}", file=sys.stderr, flush=True)
  from tinyhet.service.node_roles import ServiceExtras
  extras = ServiceExtras(decode, args.role)     # heartbeats and decode.submit for the router; a prefill worker for --role both
  try:
    address = node.serve(host, int(port))
    say_guarantees(node, decode.trusted_writers, args.quiet or args.stdin_stop)   # a parent-owned node: its parent's config
    # capture the decode step before saying ready: a client's first request (and its TTFT) must not share the CPU with it
    decode.warm_up()
    if cfg.warm_up != "off":       # every other capture: before saying ready, or on the batching thread while it is idle
      from tinyhet.engine.warm_up import WarmUp
      decode.warm, decode.on_warm = WarmUp.for_decode_node(decode, prefill_jobs=args.role == "both"), warm_report(args.quiet)
      if cfg.warm_up == "before":
        while decode.warm.step(): pass
        decode.on_warm(decode.warm.status())
    print(json.dumps({"address": address, "node": node.name, "model": model_id, "fingerprint": decode.fingerprint, "kv_blocks": blocks,
                      "block_size": cfg.kv_block_size, "trusted_writers": sorted(decode.trusted_writers),
                      "transports": node.endpoint.transports, "role": args.role, "warm_up": cfg.warm_up,
                      **({"kv_disk": str(decode.disk.store.dir), "kv_disk_found_blocks": decode.disk.found_blocks} if decode.disk else {}),
                      **({"warm_up_status": decode.warm.status()} if cfg.warm_up == "before" else {})}), flush=True)
    decode.run(stop, warm_up=False)
  finally:
    stop.set()
    extras.close()
    decode.close()
    if decode.disk is not None: decode.disk.close()
    node.endpoint.close()
  return 0

def load_draft(args, model, tok, blocks: int, block_size: int, kv_bytes: int):
  """The node's DraftModel (engine/draft_model.py): args.draft_model on MESH, checked to share the model's tokenizer, its
  pool as many blocks as the node's (at most kv_bytes of them). ValueError in one line where it cannot be one."""
  from tinyhet.engine.draft_model import DraftModel, same_tokenizer
  from tinyhet.kv.paged_cache import kv_blocks_for
  from tinyhet.model import spec as service_model
  from tinyhet.model.weights import WeightsError
  try: draft, dtok, name = service_model.load(args.draft_model, "MESH", args.max_context or model.cfg.max_context, args.quiet, not args.float_weights)
  except (OSError, WeightsError, service_model.ModelSpecError) as e: raise ValueError(str(e)) from None
  if (why := same_tokenizer(tok, dtok)) is not None: raise ValueError(f"its tokenizer is not the model's: {why}")
  if draft.cfg.vocab_size != model.cfg.vocab_size:
    raise ValueError(f"its output has {draft.cfg.vocab_size} logits, not the model's {model.cfg.vocab_size}")
  d = DraftModel(draft, min(blocks, kv_blocks_for(draft.cfg, block_size, "float16", kv_bytes)), block_size, name)
  if not args.quiet: print(f"tinyhet node: draft model {name}: {draft.cfg.n_layers} layers, dim {draft.cfg.dim}, a pool of "
                           f"{d.bm.num_blocks - 1} blocks", file=sys.stderr, flush=True)
  return d

def warm_report(quiet: bool):
  """on_warm for a node: one line on stderr once every capture is built (tinyhet.engine.warm_up)."""
  def report(status: dict):
    if quiet: return
    cold = f", {status['cold']} requests came before their bucket was built" if status["cold"] else ""
    print(f"tinyhet node: warm-up took {status['seconds']:.1f} s: {status['captures']} captures for {status['of']} buckets{cold}",
          file=sys.stderr, flush=True)
  return report

def say_guarantees(node, trusted_writers, quiet: bool):
  """On stderr at start: what this node's transports prove and enforce (Endpoint.guarantees), its public key, and which
  trusted writers have no key bound to their name (a token holder can take such a name while its node is not connected)."""
  if quiet: return
  ep = node.endpoint
  lines = [f"public key {ep.identity.public} ({ep.identity.source})", *ep.guarantees()]
  if trusted_writers: lines.append(f"trusted prefill writers (their KV may be cached and shared): {', '.join(sorted(trusted_writers))}")
  if (unbound := sorted(set(trusted_writers) - set(node.config.peer_keys))):
    lines.append(f"warning: trusted writers without a public key in peer_keys or the cluster file: {', '.join(unbound)}")
  for line in lines: print(f"tinyhet node {node.name}: {line}", file=sys.stderr, flush=True)

def start(model_path, kv_bytes: int, max_context: int | None, quiet: bool, packed: bool = True, draft=None):
  """Size MESH's arena for the weights, the KV pool and activations (and a draft model's weights and pool, at most the
  KV pool's size), then load the model onto MESH."""
  import tinyhet  # noqa: F401  (HET and MESH)
  from tinyhet.config import load_config
  from tinyhet.device.memory import LocalNode
  import tinyhet.device.memory as memory
  from tinyhet.model import spec as service_model
  need = service_model.weights_nbytes(model_path, packed) + kv_bytes + (1 << 30)
  if draft: need += service_model.weights_nbytes(draft, packed) + kv_bytes
  cfg = load_config()
  memory._node = node = LocalNode(load_config(arena_bytes=max(cfg.arena_bytes, need)))
  model, tok, model_id = service_model.load(model_path, "MESH", max_context, quiet, packed)   # a file, or random: for tests
  return node, model, tok, model_id

def main_prefill(args) -> int:
  """`tinyhet node --role prefill`: the model on HET, prefill.run, heartbeats; prints {"address", ...} once ready."""
  host, _, port = args.listen.rpartition(":")
  if not host or not port.isdigit():
    print(f"tinyhet node: --listen {args.listen!r} is not host:port (e.g. 0.0.0.0:7471)", file=sys.stderr)
    return 2
  import tinyhet  # noqa: F401  (HET and MESH)
  from tinyhet.service import heartbeat
  from tinyhet.model import spec as service_model
  from tinyhet.device.memory import local_node
  from tinyhet.service.prefill_node import PrefillNode
  node = local_node()
  from tinyhet.model.fingerprint import fingerprint
  model, tok, model_id = service_model.load(args.model, "HET", args.max_context, args.quiet, packed=not args.float_weights)
  prefill = PrefillNode(model, node, model_id, fingerprint=fingerprint(args.model, model.cfg, not args.float_weights))
  prefill.tokenizer = tok                  # a request's grammar masks the first token, drawn here
  from tinyhet.kernels.kv_quant import kv_format
  from tinyhet.config import load_config
  from tinyhet.engine.warm_up import WarmUp
  cfg = load_config()
  warm = None if cfg.warm_up == "off" else WarmUp.for_prefill(model, kv_format(cfg.kv_dtype), cfg.kv_block_size)
  if warm is not None and cfg.warm_up == "before":
    while warm.step(): pass
  heartbeat.install(node.endpoint, "prefill", lambda: {**prefill.status(), "max_context": model.cfg.max_context,
                                                       **({"warm_up": warm.status()} if warm else {})})
  try: address = node.serve(host, int(port))
  except OSError as e:
    print(f"tinyhet node: cannot listen on {args.listen}: {e.strerror or e}: choose another --listen address or port", file=sys.stderr)
    return 2
  say_guarantees(node, (), args.quiet or args.stdin_stop)
  print(json.dumps({"address": address, "node": node.name, "model": model_id, "fingerprint": prefill.fingerprint, "role": "prefill",
                    "transports": node.endpoint.transports}), flush=True)
  stop = threading.Event()
  signal.signal(signal.SIGTERM, lambda *_: stop.set())
  if args.stdin_stop: threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
  report, reported = warm_report(args.quiet), [warm is None]
  def idle() -> bool:              # the warm-up's next capture while no job waits; its line once it is over
    if reported[0]: return False
    if not warm.step():
      reported[0] = True
      report(warm.status())
    return True
  try: prefill.run(stop, idle)
  except KeyboardInterrupt: pass
  prefill.close()
  node.endpoint.close()
  return 0

if __name__ == "__main__": sys.exit(main(sys.argv[1:]))
