"""tinyhet/'s layout holds: every import inside tinyhet/ (at any depth: a function's lazy import counts too) follows the
order of the subpackages, and no module imports itself back through others (no cycles). The order, one line each:

  config                 imports nothing of tinyhet
  device                 config
  model                  config, device
  kv                     config, device, model
  engine                 config, device, model, kv
  planner                config                          (beside the engine: arithmetic only)
  service                config, device, model, kv, engine, planner
  cli                    anything
runtime/ and kernels/ (tinyhet.runtime, tinyhet.kernels) are below all of them and import nothing above (test_runtime_layer)."""
import ast, pathlib
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "tinyhet"
LOW = {"runtime", "kernels"}
ALLOWED = {
  "config": set(), "device": {"config"}, "model": {"config", "device"}, "kv": {"config", "device", "model"},
  "engine": {"config", "device", "model", "kv"}, "planner": {"config"},
  "service": {"config", "device", "model", "kv", "engine", "planner"},
  "cli": {"config", "device", "model", "kv", "engine", "planner", "service", "bench", "__init__"},
  "__init__": {"config", "device"}, "__main__": {"cli"},
}

def module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

def imported(path: pathlib.Path, source: str | None = None) -> set[str]:
  """Every tinyhet module this file imports, at any depth, as dotted names (relative imports resolved)."""
  me, out = module_name(path), set()
  package = me if path.name == "__init__.py" else me.rpartition(".")[0]
  for node in ast.walk(ast.parse(path.read_text() if source is None else source)):
    if isinstance(node, ast.Import): names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level: base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
      names = [base] + [f"{base}.{a.name}" for a in node.names]
    else: continue
    out |= {n for n in names if n == "tinyhet" or n.startswith("tinyhet.")}
  return out

def modules() -> dict[str, pathlib.Path]:
  return {module_name(p): p for p in ROOT.rglob("*.py")}

def resolve(name: str, known: dict) -> str | None:
  """The module a dotted import names (`from tinyhet.kv import sender` names tinyhet.kv.sender), or None outside tinyhet/."""
  while name and name not in known: name = name.rpartition(".")[0]
  return name or None

def concern(module: str) -> str:
  parts = module.split(".")
  return "__init__" if len(parts) == 1 else parts[1]

def graph() -> dict[str, set[str]]:
  known = modules()
  edges = {}
  for m, p in known.items():
    deps = {r for n in imported(p) if concern(n) not in LOW and (r := resolve(n, known)) and r != m}
    edges[m] = {d for d in deps if not (d in ("tinyhet", f"tinyhet.{concern(m)}") and known[d].name == "__init__.py" and d != "tinyhet")}
  return edges

def test_every_import_follows_the_order():
  wrong = []
  for m, deps in graph().items():
    for d in deps:
      if concern(d) != concern(m) and concern(d) not in ALLOWED[concern(m)]: wrong.append(f"{m} imports {d}")
  assert not wrong, "imports against the order in this file's docstring:\n" + "\n".join(sorted(wrong))

def test_no_import_cycles():
  edges, cycles, state = graph(), [], {}
  def visit(m, path):
    state[m] = "open"
    for d in sorted(edges.get(m, ())):
      if state.get(d) == "open": cycles.append(" -> ".join([*path[path.index(d):], d]) if d in path else f"{m} -> {d}")
      elif d not in state: visit(d, [*path, d])
    state[m] = "done"
  for m in sorted(edges):
    if m not in state: visit(m, [m])
  assert not cycles, "import cycles:\n" + "\n".join(cycles)

def test_modules_stay_small():
  big = {m: n for m, p in modules().items() if (n := len(p.read_text().splitlines())) > 420}
  assert not big, f"modules over ~400 lines: {big}"

@pytest.mark.parametrize("source,expected", [
  ("from tinyhet.kv import sender", {"tinyhet.kv", "tinyhet.kv.sender"}),
  ("def f():\n  import tinyhet.device.memory as m", {"tinyhet.device.memory"}),
  ("from .. import config", {"tinyhet", "tinyhet.config"}),
  ("from . import plan", {"tinyhet.planner", "tinyhet.planner.plan"}),
  ("import numpy, os", set()),
])
def test_the_walker_sees_every_kind_of_import(source, expected):
  # the checks above are only as good as this walker: a lazy import, a relative one and a `from package import module` count
  assert imported(ROOT / "planner" / "probe.py", source) == expected

def test_a_cycle_and_a_wrong_import_are_found(monkeypatch):
  real = graph()
  fake = {**real, "tinyhet.device.backend": real["tinyhet.device.backend"] | {"tinyhet.engine.decode_node"}}
  monkeypatch.setattr(__import__(__name__), "graph", lambda: fake)
  with pytest.raises(AssertionError, match="device.backend imports tinyhet.engine.decode_node"): test_every_import_follows_the_order()
  with pytest.raises(AssertionError, match="import cycles"): test_no_import_cycles()

def test_the_layout_doc_names_every_module():
  # docs/layout.md is the map a newcomer reads: every folder and module of tinyhet/ is on it
  section = (ROOT.parent / "docs" / "layout.md").read_text()
  missing = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py") if p.name != "__init__.py" and p.name not in section]
  missing += [f"{d.name}/" for d in ROOT.iterdir() if d.is_dir() and (d / "__init__.py").exists() and f"{d.name}/" not in section]
  assert not missing, f"docs/layout.md does not name: {missing}"
