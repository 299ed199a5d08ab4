"""`tinyhet bench gpu` (bench/gpu_check.sh sets a bare machine up for it): the one GPU check of issue 14, in under 5 minutes.

On a machine with an NVIDIA GPU (GPU_CHECK_DEVICE, default CUDA): the HET device checks on CUDA (and on NV where it
opens); `tinyhet run` on the embedded SmolLM2 with HET on the GPU and the decode node on the CPU (shm), with the layers
leaving GPU memory through the asynchronous staging buffers and, for comparison, copied on the prefill thread
(TINYHET_STAGING_BUFFERS=0), each with TTFT with and without transfer; the same run with HET on the CPU, whose greedy
tokens the GPU's must equal; the Llama-3.1 70B shapes (--layers, random weights) prefilled on the GPU and on the CPU, tokens
compared; if time is left, `tinyhet bench staging` with the model on the device. Prints a table and one JSON object at
the end. GPU_CHECK_DEVICE=CPU runs the same steps with HET on the CPU (the logic end to end, on a machine without a GPU).
Each step runs in its own process with a timeout; a step that cannot start before the time budget (GPU_CHECK_BUDGET_S,
default 285 s) ends is reported as skipped, not run; on a slow machine GPU_CHECK_TIMEOUT_SCALE multiplies each step's
timeout.
"""
from __future__ import annotations
import datetime, json, os, shutil, subprocess, sys, time

PROMPT = "What is the capital of France? Answer in one short sentence."

def say(msg: str): print(f"gpu check: {msg}", file=sys.stderr, flush=True)

class Steps:
  def __init__(self, budget_s: float, scale: float):
    self.t0, self.budget_s, self.scale, self.results = time.perf_counter(), budget_s, scale, {}

  def left(self) -> float: return self.budget_s - (time.perf_counter() - self.t0)

  def run(self, name: str, cmd: list[str], env: dict, timeout: float) -> dict | None:
    """Run cmd; its last stdout line is its JSON. Records {ok, seconds, result | error} under name."""
    if (t := min(timeout * self.scale, self.left())) < 10:
      self.results[name] = {"ok": False, "skipped": f"not started: {self.left():.0f} s of the budget left"}
      say(f"{name}: skipped (budget spent)")
      return None
    say(f"{name}: {' '.join(cmd[1:] if cmd[0] == sys.executable else cmd)}")
    st = time.perf_counter()
    try: p = subprocess.run(cmd, capture_output=True, text=True, timeout=t, env={**os.environ, **env})
    except subprocess.TimeoutExpired:
      self.results[name] = {"ok": False, "seconds": round(t, 1), "error": f"timed out after {t:.0f} s"}
      say(f"{name}: timed out after {t:.0f} s")
      return None
    rec: dict = {"seconds": round(time.perf_counter() - st, 1)}
    lines = p.stdout.strip().splitlines()
    try: rec["result"] = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError: rec["result"] = None
    rec["ok"] = p.returncode == 0 and rec["result"] is not None
    if not rec["ok"]: rec["error"] = (p.stderr.strip().splitlines() or [f"exit status {p.returncode}"])[-1][:300]
    self.results[name] = rec
    say(f"{name}: {'ok' if rec['ok'] else 'FAILED: ' + rec['error']} ({rec['seconds']} s)")
    return rec["result"] if rec["ok"] else None

def opens(backend: str) -> str | None:
  """None when tinygrad opens the backend here, else why not (one line)."""
  code = (f"from tinygrad import Device\ntry: Device[{backend!r}]\n"
          "except Exception as e: print(type(e).__name__, str(e).strip().splitlines()[0][:200] if str(e).strip() else '')")
  p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
  return (p.stdout.strip() or p.stderr.strip()[-200:] or None) if (p.stdout.strip() or p.returncode) else None

def gpu_name() -> str:
  if shutil.which("nvidia-smi") is None: return "none (no nvidia-smi)"
  p = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"], capture_output=True, text=True)
  return p.stdout.strip().splitlines()[0] if p.returncode == 0 and p.stdout.strip() else "unknown"

def main(argv=None) -> int:
  device = os.environ.get("GPU_CHECK_DEVICE", "CUDA").upper()
  layers = os.environ.get("GPU_CHECK_LAYERS", "2")
  steps = Steps(float(os.environ.get("GPU_CHECK_BUDGET_S", "285")), float(os.environ.get("GPU_CHECK_TIMEOUT_SCALE", "1")))
  tinyhet = [sys.executable, "-m", "tinyhet"]
  root = os.environ.get("GPU_CHECK_ROOT") or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))    # the repo
  example = os.path.join(root, "examples", "llama3_70b.py")
  report: dict = {"device": device, "gpu": gpu_name(), "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
  if (why := opens(device)) is not None:
    report |= {"ok": False, "error": f"tinygrad cannot open {device} here: {why}"}
    print(json.dumps(report))
    return 1
  # 1. the HET device checks
  steps.run(f"het {device}", [*tinyhet, "bench", "het", "--json"], {"HET_BACKEND": device}, 90)
  if device == "CUDA":
    if (why := opens("NV")) is None: steps.run("het NV", [*tinyhet, "bench", "het", "--json"], {"HET_BACKEND": "NV"}, 60)
    else: steps.results["het NV"] = {"ok": False, "skipped": f"NV does not open here: {why}"}
  # 2. SmolLM2: HET on the device, decode node on the CPU (shm); staged, then the synchronous copy; then HET on the CPU
  run = [*tinyhet, "run", PROMPT, "--max-tokens", "12", "--json", "--quiet", "--overhead", "--transport", "shm"]
  staged = steps.run("run staged", run, {"HET_BACKEND": device}, 120)
  sync = steps.run("run sync copy", run, {"HET_BACKEND": device, "TINYHET_STAGING_BUFFERS": "0"}, 90)
  cpu = steps.run("run CPU", [*tinyhet, "run", PROMPT, "--max-tokens", "12", "--json", "--quiet", "--transport", "shm", "--keep-alive", "0"],
                  {"HET_BACKEND": "CPU"}, 90)
  # 3. the 70B shapes, first `layers` layers, random weights: prefill on the device, then on the CPU
  big = [sys.executable, example, "--random-weights", "--layers", layers, "--prompt-tokens", "32", "--decode-tokens", "4", "--json"]
  big_dev = steps.run(f"70B x{layers} layers", big, {"HET_BACKEND": device}, 120)
  big_cpu = steps.run(f"70B x{layers} layers CPU", big, {"HET_BACKEND": "CPU"}, 120)
  # 4. last, if time is left: the staging benchmark with the model on the device itself (layers from its memory, staged or not)
  bench = steps.run("bench staging", [*tinyhet, "bench", "staging", "--device", device, "--rounds", "2", "--buffers", "1,2", "--json"], {}, 90)

  if staged:
    report |= {"ttft_s": staged["ttft_s"], "ttft_no_transfer_s": staged["ttft_no_transfer_s"], "overhead_s": staged["overhead_s"],
               "prefill_s": staged["prefill_s"], "kv_bytes": staged["kv_bytes"], "transfer_gbps": staged["transfer_gbps"],
               "tokens": staged["generated_ids"], "text": staged["text"]}
  if bench:
    report["bench_staging"] = {"no_transfer_s": bench["no_transfer_s"], "pinned_buffers": bench.get("pinned_buffers", 0)} | \
                              {r["path"]: {k: r[k] for k in ("prefill_s", "handoff_ms_per_layer", "staging_waits")} for r in bench["rows"]}
  if sync: report |= {"ttft_sync_copy_s": sync["ttft_s"], "prefill_sync_copy_s": sync["prefill_s"], "overhead_sync_copy_s": sync["overhead_s"]}
  if cpu: report |= {"tokens_cpu": cpu["generated_ids"], "tokens_equal": bool(staged) and staged["generated_ids"] == cpu["generated_ids"]}
  if big_dev:
    report["70b"] = {"layers": int(layers), "prefill_s": big_dev["prefill_s"], "ttft_s": big_dev.get("ttft_s"), "tokens": big_dev["tokens"]}
    if big_cpu:
      report["70b"] |= {"prefill_cpu_s": big_cpu["prefill_s"], "tokens_cpu": big_cpu["tokens"],
                        "tokens_equal": big_dev["tokens"] == big_cpu["tokens"]}
  het_fail = [f for k, r in steps.results.items() if k.startswith("het") and r.get("result") for f in r["result"]["failures"]]
  report |= {"het_failures": het_fail, "steps": {k: {x: v for x, v in r.items() if x != "result"} for k, r in steps.results.items()},
             "elapsed_s": round(time.perf_counter() - steps.t0, 1)}
  needed = [f"het {device}", "run staged", "run sync copy", "run CPU", f"70B x{layers} layers", f"70B x{layers} layers CPU"]
  report["ok"] = all(steps.results[k]["ok"] for k in needed) and not het_fail and report.get("tokens_equal") is True and \
                 report.get("70b", {}).get("tokens_equal") is True
  try: print(table(report), file=sys.stderr)
  except Exception as e: say(f"the table could not be printed ({type(e).__name__}: {e}); the JSON below has every figure")
  print(json.dumps(report))
  return 0 if report["ok"] else 1

def table(r: dict) -> str:
  lines = ["-" * 72, f"GPU check on {r['device']} ({r['gpu']}), {r['date']}, {r['elapsed_s']} s"]
  for k, s in r["steps"].items():
    state = "ok" if s["ok"] else s.get("skipped") or "FAILED: " + s.get("error", "")
    lines.append(f"  {k:<24} {state}" + (f"  ({s['seconds']} s)" if "seconds" in s else ""))
  if "ttft_s" in r:
    lines.append(f"SmolLM2, HET on {r['device']} -> decode on CPU (shm): TTFT {r['ttft_s']:.3f} s, no transfer {r['ttft_no_transfer_s']:.3f} s, "
                 f"overhead {r['overhead_s']:+.3f} s; KV {r['kv_bytes'] / 2**20:.2f} MiB")
  if "ttft_sync_copy_s" in r:
    lines.append(f"  with the copy on the prefill thread instead: TTFT {r['ttft_sync_copy_s']:.3f} s, overhead {r['overhead_sync_copy_s']:+.3f} s")
  if "tokens_equal" in r: lines.append(f"  greedy tokens equal the CPU path's: {r['tokens_equal']}  {r.get('tokens')}")
  if "70b" in r:
    b = r["70b"]
    lines.append(f"70B shapes, {b['layers']} layers: prefill {b['prefill_s']:.3f} s on {r['device']}" +
                 (f", {b['prefill_cpu_s']:.3f} s on CPU; tokens equal: {b['tokens_equal']}" if "prefill_cpu_s" in b else ""))
  if "bench_staging" in r:
    b = r["bench_staging"]
    lines.append(f"bench staging on {r['device']} (random model, {b['pinned_buffers']} staging buffers page-locked): "
                 f"prefill no transfer {b['no_transfer_s']:.3f} s; " +
                 "; ".join(f"{k} {v['prefill_s']:.3f} s, {v['handoff_ms_per_layer']:.2f} ms/layer, {v['staging_waits']} waits"
                           for k, v in b.items() if isinstance(v, dict)))
  lines.append("PASS" if r["ok"] else "NOT PASSED")
  return "\n".join(lines)

if __name__ == "__main__": sys.exit(main())
