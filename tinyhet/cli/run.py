"""`tinyhet run [PROMPT]`: generate text with prefill on HET and decode on a MESH decode node, the KV cache streamed
layer by layer between them while prefill runs. With no --decode-node, a decode node is started on this machine (another
process; auto picks the shm transport for it). Prints the text as it is generated, then the figures that matter.
The model and the decode node stay loaded in a resident process for the next runs (--keep-alive; see tinyhet.cli.resident).
"""
from __future__ import annotations
import json, os, secrets, signal, sys

from tinyhet.cli.common import exit_now
from tinyhet.cli.resident import parse_keep_alive
from tinyhet.cli.run_args import parse_args
from tinyhet.cli.run_session import LocalDecodeNode, Session, say

class Terminated(Exception):
  """SIGTERM: unwind like Ctrl-C, so that the decode node this run started is stopped with it."""

def _on_sigterm(*_):
  signal.signal(signal.SIGTERM, signal.SIG_IGN)     # once: the cleanup that follows is not interrupted again
  raise Terminated()

def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  args = parse_args(argv)
  from tinyhet.cli import resident
  if args.stop:
    resident.stop_all(lambda m: say(args, m))
    return 0
  if args.resident_serve:
    from tinyhet.cli.resident_server import serve
    return serve(args)
  signal.signal(signal.SIGTERM, _on_sigterm)
  if parse_keep_alive(args.keep_alive) > 0 and not (args.decode_node or args.no_disagg or args.overhead):
    from tinyhet.model.weights import model_nbytes
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
    from tinyhet.model.weights import model_nbytes
    model_nbytes(args.model, packed=not args.float_weights)   # a bad --model fails here, once, before a node is started for it
    child = LocalDecodeNode(args) if not (args.decode_node or args.no_disagg) else None
    return generate(args, child)
  except KeyboardInterrupt: return 130
  except Terminated: pass
  finally:
    if child is not None: child.close()
  exit_now(143)

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
