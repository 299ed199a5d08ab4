"""`tinyhet plan`: the planner (tinyhet.planner) from the command line: predictions per configuration, or with a load
(--rate, --concurrency, --max-throughput) the simulated serving figures, and the plan."""
from __future__ import annotations
import json, sys
from tinyhet.cli.common import ArgumentParser
from tinyhet.planner.catalog import PlanError
from tinyhet.planner.cluster_file import load_cluster
from tinyhet.planner.plan import catalog_text, predict, table
from tinyhet.planner.servesim import SLO
from tinyhet.planner.serving import plan_serving, table as serving_table

def main(argv: list[str] | None = None) -> int:
  ap = ArgumentParser(prog="tinyhet plan", description="Predict TTFT, time per output token and throughput of each way to run a model "
                               "on a cluster, and choose where prefill and decode run. With --rate, --concurrency or --max-throughput: "
                               "simulate each configuration under that load and report goodput, TTFT and TPOT p50/p90.")
  ap.add_argument("--cluster", help="cluster file (TOML); examples in examples/clusters/")
  ap.add_argument("--model", help="model name (see --list) or one defined in the cluster file")
  ap.add_argument("--prompt-len", type=int, default=8192, help="prompt tokens (default 8192)")
  ap.add_argument("--output-len", type=int, default=256, help="generated tokens (default 256)")
  ap.add_argument("--rate", type=float, default=None, help="serving mode: Poisson requests/s to plan for")
  ap.add_argument("--concurrency", type=int, default=None, help="serving mode: clients, each sending its next request when the last ends")
  ap.add_argument("--max-throughput", action="store_true", help="serving mode: the most requests/s each configuration serves within the SLOs")
  ap.add_argument("--ttft-slo", type=float, default=None, help="serving mode: p90 time to first token target, seconds")
  ap.add_argument("--tpot-slo", type=float, default=None, help="serving mode: p90 time per output token target, seconds")
  ap.add_argument("--seed", type=int, default=0, help="serving mode: seed of the simulated arrivals (default 0)")
  ap.add_argument("--dtype", default=None, help="weight dtype to plan for instead of the model's (fp4, fp8, fp16, bf16, fp32)")
  ap.add_argument("--no-overlap", action="store_true", help="predict the KV cache sent after prefill instead of streamed layer by layer")
  ap.add_argument("--json", action="store_true", help="print one JSON object: configurations and plan")
  ap.add_argument("--list", action="store_true", help="list the catalog's devices and models")
  args = ap.parse_args(argv)
  if args.list:
    print(catalog_text(), end="")
    return 0
  if not args.cluster or not args.model: ap.error("--cluster and --model are required (or --list)")
  loads = sum(x is not None and x is not False for x in (args.rate, args.concurrency, args.max_throughput or None))
  if loads > 1: ap.error("give one of --rate, --concurrency and --max-throughput")
  serving = loads == 1 or args.ttft_slo is not None or args.tpot_slo is not None
  try:
    cluster = load_cluster(args.cluster)
    for line in cluster.warnings: print(f"tinyhet plan: {line}", file=sys.stderr)  # a calibration row the fit cannot explain
    model = cluster.model(args.model, args.dtype)
    if serving:
      pred = plan_serving(cluster, model, args.prompt_len, args.output_len, args.rate, args.concurrency, SLO(args.ttft_slo, args.tpot_slo), args.seed,
                          overlap=not args.no_overlap)
    else:
      pred = predict(cluster, model, args.prompt_len, args.output_len, None, overlap=not args.no_overlap)
  except PlanError as e:
    print(f"tinyhet plan: {e}", file=sys.stderr)
    return 2
  text = serving_table(pred) if serving else table(pred)
  print(json.dumps(pred.to_json(), indent=2) if args.json else text, end="\n" if args.json else "")
  return 0

if __name__ == "__main__": sys.exit(main())
