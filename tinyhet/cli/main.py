"""`tinyhet` command line: each subcommand lives in its own module and parses its own arguments."""
import importlib, os, sys

# name -> (module with main(argv), one-line help). Modules are imported only when their command runs: tinygrad is slow to import.
COMMANDS = {
  "run": ("tinyhet.cli.run", "generate text: prefill on HET, stream KV layer by layer to a decode node (MESH), decode there"),
  "node": ("tinyhet.cli.node", "run a node process: --role decode (paged KV, batching), prefill (HET) or both"),
  "serve": ("tinyhet.cli.serve", "the router: an OpenAI-compatible HTTP API over prefill and decode nodes, with recovery"),
  "plan": ("tinyhet.cli.plan", "predict TTFT / time per token / throughput and choose where prefill and decode run"),
  "bench": ("tinyhet.bench", "benchmarks against a baseline from the same run: transfer, kv, e2e, serve, ..."),
  "info": ("tinyhet.cli.info", "show the configuration, devices and transports available on this machine"),
  "keygen": ("tinyhet.cli.keygen", "a new key pair for a node: the private key to a file, the public key printed (peer identity)"),
}

def usage() -> str:
  return "usage: tinyhet COMMAND [ARGS]\n\ncommands:\n" + "".join(f"  {n:<7}{h}\n" for n, (_, h) in COMMANDS.items()) + \
         "\n'tinyhet COMMAND --help' shows a command's options.\n"

def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if not argv or argv[0] in ("-h", "--help", "help"):
    print(usage(), end="")
    return 0
  if argv[0] not in COMMANDS:
    print(f"tinyhet: unknown command {argv[0]!r}\n\n{usage()}", end="", file=sys.stderr)
    return 2
  module = importlib.import_module(COMMANDS[argv[0]][0])
  try: return module.main(argv[1:]) or 0
  except Exception as e:
    # tinyhet's own errors say what is wrong and how to fix it: one line, not a traceback (TINYHET_DEBUG=1 shows it)
    if not type(e).__module__.startswith("tinyhet") or os.environ.get("TINYHET_DEBUG"): raise
    print(f"tinyhet {argv[0]}: {e}", file=sys.stderr)
    return 1

if __name__ == "__main__": sys.exit(main())
