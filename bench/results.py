"""Benchmark results as data: `tinyhet bench NAME --save [ARGS]` runs NAME with --json and writes docs/results/NAME.json
(or --save=FILE) with the figures and their provenance: the commit, the date, the machine (CPU model, cores, flags,
memory), the command and the load average around the run. `make tables` (`python -m tinyhet.bench.results`) renders
every table of docs/benchmarks.md from those files, between `<!-- results: NAME -->` and `<!-- /results -->`;
tests/test_docs.py fails when a table does not match its file.

A result is published only when the machine was quiet: the load average over the minute before the run below 1 (no
other work sharing the cores; the benchmark's own processes come after). A run that was not quiet is saved with
`"quiet": false`, and the test refuses such a file under docs/results/."""
import contextlib, io, json, os, pathlib, platform, re, shlex, subprocess, sys, threading, time

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
DOC = ROOT / "docs" / "benchmarks.md"
FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_int8", "amx_bf16")
QUIET_LOAD = 1.0
PROVENANCE = ("name", "command", "date", "commit", "machine", "load_before", "load_max", "quiet")

def machine() -> dict:
  """The CPU model, cores this process may use, the SIMD flags the kernels choose from, and memory."""
  info = pathlib.Path("/proc/cpuinfo").read_text() if pathlib.Path("/proc/cpuinfo").exists() else ""
  model = re.search(r"^model name\s*:\s*(.+)$", info, re.M)
  found = re.search(r"^flags\s*:\s*(.+)$", info, re.M)
  flags = set(found.group(1).split()) if found else set()
  mem = re.search(r"^MemTotal:\s*(\d+) kB", pathlib.Path("/proc/meminfo").read_text(), re.M) if pathlib.Path("/proc/meminfo").exists() else None
  return {"cpu": model.group(1).strip() if model else platform.processor() or "unknown", "cores": len(os.sched_getaffinity(0)),
          "flags": [f for f in FLAGS if f in flags], "memory_gib": round(int(mem.group(1)) / 2**20, 1) if mem else None}

NOT_CODE = ("docs/", "README.md")   # paths whose changes are figures and prose, not code

def commit(root=None) -> str:
  """The checkout's commit, with `+dirty` when tracked code differs from it (the figure is then of uncommitted code). The
  docs and the published figures (docs/, README.md) are not code: a run taken while earlier runs' files and their prose
  wait to be committed is still of the commit's code."""
  try:
    git = ["git", "-C", str(root or ROOT)]
    head = subprocess.run([*git, "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    changed = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True).stdout.splitlines()
    dirty = [ln for ln in changed if not ln[3:].startswith(NOT_CODE)]
    return head + ("+dirty" if dirty else "")
  except (OSError, subprocess.CalledProcessError): return "unknown"

class LoadWatch:
  """The 1-minute load average before the run and its maximum during it (sampled every 2 s on a daemon thread)."""
  def __init__(self):
    self.before, self.max, self._stop = os.getloadavg()[0], 0.0, threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True); self._thread.start()
  def _run(self):
    while not self._stop.is_set():
      self.max = max(self.max, os.getloadavg()[0]); self._stop.wait(2.0)
  def stop(self):
    self._stop.set(); self._thread.join(); self.max = max(self.max, os.getloadavg()[0])

def table_of(data) -> tuple[list[str], list[list]]:
  """A result's table: its `table` ({columns, rows}) when the benchmark made one, else its `rows` (a list of objects)
  flattened, else (an object of figures) one row a figure."""
  if isinstance(data, dict) and isinstance(data.get("table"), dict): return list(data["table"]["columns"]), [list(r) for r in data["table"]["rows"]]
  rows = data.get("rows") if isinstance(data, dict) else data
  if isinstance(data, dict) and rows is None:      # no rows: every figure a row of its own, nested keys joined with dots, a list of rows a line each
    flat = {}
    def walk(prefix, v):
      if isinstance(v, dict):
        for k, x in v.items(): walk(f"{prefix}.{k}" if prefix else str(k), x)
      elif isinstance(v, list) and all(isinstance(x, dict) for x in v):    # a list of rows: each row's figures on one line
        for i, x in enumerate(v): flat[f"{prefix}[{i}]"] = ", ".join(f"{k} {cell(y)}" for k, y in x.items() if not isinstance(y, (dict, list)))
      else: flat[prefix] = ", ".join(cell(x) for x in v) if isinstance(v, list) else v
    walk("", data)
    return ["figure", "value"], [[k, v] for k, v in flat.items()]
  if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
    raise ValueError("a result needs a 'table', a list of 'rows' objects, or an object of figures")
  columns = list(dict.fromkeys(k for r in rows for k, v in r.items() if not isinstance(v, (dict, list))))
  return columns, [[r.get(c) for c in columns] for r in rows]

def run_and_save(name: str, module, argv: list[str], out: str | None) -> int:
  """Runs a benchmark's main with --json, prints what it printed, and saves its last JSON line with the provenance."""
  args = argv if "--json" in argv else [*argv, "--json"]
  watch, buf = LoadWatch(), io.StringIO()
  date = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
  with contextlib.redirect_stdout(buf): rc = module.main(args) or 0
  watch.stop()
  text = buf.getvalue(); sys.stdout.write(text)
  lines = [ln for ln in text.splitlines() if ln.strip().startswith("{")]
  if rc or not lines:
    print(f"tinyhet bench {name} --save: nothing saved ({'exit ' + str(rc) if rc else 'no JSON printed'})", file=sys.stderr)
    return rc or 1
  data = json.loads(lines[-1])
  path = pathlib.Path(out) if out else RESULTS / f"{name}.json"     # a result is named by its file: one benchmark may give several
  result = {"name": path.stem, "command": shlex.join(["tinyhet", "bench", name, *argv]), "date": date, "commit": commit(), "machine": machine(),
            "load_before": round(watch.before, 2), "load_max": round(watch.max, 2), "quiet": watch.before < QUIET_LOAD, "data": data}
  path.parent.mkdir(parents=True, exist_ok=True); path.write_text(json.dumps(result, indent=1) + "\n")
  busy = f" (load average {watch.before:.1f} before the run: other work shared the cores, not publishable)"
  print(f"saved {path}" + ("" if result["quiet"] else busy), file=sys.stderr)
  return 0

def cell(v) -> str:
  if v is None: return "-"
  if isinstance(v, bool): return "yes" if v else "no"
  if isinstance(v, float): return f"{v:.3g}" if abs(v) < 100 else f"{v:.1f}"
  return str(v).replace("|", "\\|")

def render(result: dict) -> str:
  """A result as a markdown table and one provenance line under it."""
  columns, rows = table_of(result["data"])
  m = result["machine"]
  out = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)] + ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
  load = (f"load average {result['load_before']} before, {result['load_max']} at most during the run" if result.get("load_before") is not None
          else f"load average {result.get('load_note', 'not recorded')}")
  note = result.get("note", "")
  out.append(f"\n`{result['command']}` at commit {result['commit']}, {result['date']}, {m['cpu']} ({m['cores']} cores; "
             f"{', '.join(m['flags']) or 'no AVX flags'}; {m['memory_gib']} GiB); {load}." + (f" {note[:1].upper()}{note[1:]}." if note else "")
             + (f" Source: {result['source']}." if result.get("source") else ""))
  return "\n".join(out)

MARK = re.compile(r"(<!-- results: ([\w.-]+) -->\n)(.*?)(<!-- /results -->)", re.S)

def render_doc(text: str) -> str:
  """The document with every marked table rendered again from its file."""
  def sub(m):
    path = RESULTS / f"{m.group(2)}.json"
    if not path.exists(): raise FileNotFoundError(f"{DOC.name} names a result {m.group(2)!r} with no {path}")
    return m.group(1) + render(json.loads(path.read_text())) + "\n" + m.group(4)
  return MARK.sub(sub, text)

def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if argv and argv[0] in ("-h", "--help"): print(__doc__); return 0
  new = render_doc(DOC.read_text())
  if "--check" in argv:
    if new != DOC.read_text(): print(f"{DOC} does not match docs/results/: run make tables", file=sys.stderr); return 1
    return 0
  DOC.write_text(new); print(f"rendered {len(MARK.findall(new))} tables into {DOC}")
  return 0

if __name__ == "__main__": sys.exit(main())
