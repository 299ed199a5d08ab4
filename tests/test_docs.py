"""The documentation holds together: README.md stays a front page (≤ 250 lines), every relative link in it and in docs/
resolves (the file, and the heading an anchor names), docs/benchmarks.md's tables are exactly what docs/results/ renders
(`make tables`), every published result carries its provenance and was taken on a quiet machine, no text dates a figure
by the occasion it was taken on, and nothing points outside the repository."""
import json, re, subprocess, sys, types, pathlib
import pytest
from tinyhet.bench import results

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", *DOCS]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")

def slug(heading: str) -> str:
  """GitHub's anchor for a heading: lower case, punctuation dropped but for hyphens and underscores, spaces to hyphens."""
  text = re.sub(r"`|\*", "", heading.strip().lower())
  return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")

def anchors(path: pathlib.Path) -> set[str]:
  text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
  return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}

def links(path: pathlib.Path):
  text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
  return [m.group(1) for m in LINK.finditer(text)]

def test_the_readme_is_a_front_page():
  n = len((ROOT / "README.md").read_text().splitlines())
  assert n <= 250, f"README.md has {n} lines: move detail into docs/"

@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page):
  broken = []
  for target in links(page):
    if re.match(r"[a-z]+:", target): continue              # http(s), mailto: not checked here
    file, _, anchor = target.partition("#")
    dest = (page.parent / file).resolve() if file else page
    if not dest.exists(): broken.append(f"{target}: no {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
    elif anchor and dest.suffix == ".md" and anchor not in anchors(dest): broken.append(f"{target}: no heading #{anchor} in {dest.name}")
  assert not broken, f"{page.name}: " + "; ".join(broken)

def test_the_link_checker_finds_a_broken_link_and_a_missing_anchor(tmp_path):
  (tmp_path / "a.md").write_text("# Title\n## Two words\n[ok](#two-words) [bad](#nope) [gone](missing.md) `[code](x.md)`\n")
  assert links(tmp_path / "a.md") == ["#two-words", "#nope", "missing.md", "x.md"]
  assert anchors(tmp_path / "a.md") == {"title", "two-words"}
  assert slug("HET on a GPU: layers leaving `device` memory") == "het-on-a-gpu-layers-leaving-device-memory"

def test_benchmark_tables_match_their_data():
  doc = results.DOC.read_text()
  assert results.render_doc(doc) == doc, "docs/benchmarks.md does not match docs/results/: run `make tables`"

def test_every_table_in_benchmarks_is_rendered_from_a_result():
  outside = results.MARK.sub("", results.DOC.read_text())
  stray = [ln for ln in outside.splitlines() if ln.startswith("|")]
  assert not stray, f"tables in docs/benchmarks.md that no result file renders: {stray[:3]}"
  named = {m.group(2) for m in results.MARK.finditer(results.DOC.read_text())}
  unused = {p.stem for p in results.RESULTS.glob("*.json")} - named
  assert not unused, f"results nothing renders: {sorted(unused)}"

@pytest.mark.parametrize("path", sorted(results.RESULTS.glob("*.json")), ids=lambda p: p.stem)
def test_a_published_result_says_where_it_comes_from(path):
  r = json.loads(path.read_text())
  missing = [k for k in results.PROVENANCE if k not in r]
  assert not missing, f"{path.name} lacks {missing}"
  assert r["name"] == path.stem and r["command"].startswith("tinyhet bench ") and re.fullmatch(r"[0-9a-f]{7,40}(\+dirty)?", r["commit"])
  assert re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d", r["date"]) and r["machine"]["cpu"] and r["machine"]["cores"] >= 1
  assert r["quiet"] is True, f"{path.name} was measured while other work shared the cores: not publishable"
  assert r["load_before"] is not None or r.get("load_note"), f"{path.name} says nothing of the load"
  results.table_of(r["data"])

def test_save_writes_the_figures_with_their_provenance(tmp_path, capsys):
  bench = types.SimpleNamespace(main=lambda argv: print(json.dumps({"rows": [{"rows_done": len(argv), "rate": 12.5}]})))
  out = tmp_path / "probe.json"
  assert results.run_and_save("probe", bench, ["--rounds", "1"], str(out)) == 0
  r = json.loads(out.read_text())
  assert r["name"] == "probe" and r["command"] == "tinyhet bench probe --rounds 1"
  assert r["data"]["rows"] == [{"rows_done": 3, "rate": 12.5}]                  # --json was added
  # the command as a shell takes it: an empty argument (--prompts '') stays one
  assert results.run_and_save("probe", bench, ["--prompts", "", "--rounds", "1"], str(out)) == 0
  assert json.loads(out.read_text())["command"] == "tinyhet bench probe --prompts '' --rounds 1"
  assert r["machine"]["cores"] >= 1 and isinstance(r["quiet"], bool) and r["load_max"] >= 0
  table = results.render(r)
  assert table.splitlines()[0] == "| rows_done | rate |" and "| 3 | 12.5 |" in table and "tinyhet bench probe --rounds 1" in table
  assert results.run_and_save("probe", types.SimpleNamespace(main=lambda argv: 3), [], str(tmp_path / "x.json")) == 3
  assert not (tmp_path / "x.json").exists()

def test_a_commit_is_dirty_for_changed_code_not_for_changed_figures_or_docs(tmp_path):
  git = lambda *a: subprocess.run(["git", "-C", str(tmp_path), *a], check=True, capture_output=True)
  git("init", "-q"); git("config", "user.email", "t@t"); git("config", "user.name", "t")
  (tmp_path / "docs" / "results").mkdir(parents=True)
  for f in ("docs/results/x.json", "docs/benchmarks.md", "docs/kv.md", "README.md", "code.py"): (tmp_path / f).write_text("0\n")
  git("add", "-A"); git("commit", "-qm", "one")
  clean = results.commit(tmp_path)
  assert re.fullmatch(r"[0-9a-f]{12}", clean)
  for f in ("docs/results/x.json", "docs/benchmarks.md", "docs/kv.md", "README.md"): (tmp_path / f).write_text("1\n")
  assert results.commit(tmp_path) == clean                  # earlier runs' figures and prose waiting to be committed
  (tmp_path / "code.py").write_text("1\n")
  assert results.commit(tmp_path) == clean + "+dirty"

def test_make_tables_check_fails_on_a_stale_table(tmp_path, monkeypatch):
  doc = tmp_path / "benchmarks.md"
  (tmp_path / "r").mkdir()
  result = {"name": "t", "command": "tinyhet bench t", "date": "2026-01-01T00:00Z", "commit": "abc1234", "quiet": True, "load_before": 0.1,
            "load_max": 2.0, "machine": {"cpu": "x", "cores": 2, "flags": [], "memory_gib": 1}, "data": {"rows": [{"a": 1}]}}
  (tmp_path / "r" / "t.json").write_text(json.dumps(result))
  doc.write_text("x\n<!-- results: t -->\n| a |\n| --- |\n| 2 |\n<!-- /results -->\n")
  monkeypatch.setattr(results, "DOC", doc); monkeypatch.setattr(results, "RESULTS", tmp_path / "r")
  assert results.main(["--check"]) == 1
  assert results.main([]) == 0 and "| 1 |" in doc.read_text() and results.main(["--check"]) == 0

OCCASION = re.compile(r"\b(first|second|third|fourth|fifth|sixth|seventh|this|that|previous|last|earlier|same) session\b|\bhelpers?'s?\b|"
                      r"\bshared VM\b|\bquiet run\b", re.I)

@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_figure_is_dated_by_an_occasion(page):
  bad = [f"{i}: {ln.strip()[:100]}" for i, ln in enumerate(page.read_text().splitlines(), 1) if OCCASION.search(ln)]
  assert not bad, f"{page.name} dates figures by an occasion instead of commit, machine and command:\n" + "\n".join(bad)

def test_nothing_points_outside_the_repository():
  tracked = subprocess.run(["git", "-C", str(ROOT), "ls-files"], capture_output=True, text=True).stdout.split()
  if not tracked: pytest.skip("not a git checkout")
  bad = []
  for name in tracked:
    path = ROOT / name
    if name.startswith("tests/test_docs.py") or path.suffix in (".gguf", ".safetensors", ".bin") or not path.is_file(): continue
    try: text = path.read_text()
    except UnicodeDecodeError: continue
    bad += [f"{name}:{i}" for i, ln in enumerate(text.splitlines(), 1) if "../shared" in ln or re.search(r"(?<!docs/)\bDESIGN\.md", ln)]
  assert not bad, f"references to files outside the repository (../shared, DESIGN.md): {bad}"

def test_mkdocs_nav_lists_every_page():
  nav = (ROOT / "mkdocs.yml").read_text()
  missing = [p.name for p in DOCS if f": {p.name}" not in nav]
  assert not missing, f"mkdocs.yml's nav does not list {missing}"

if __name__ == "__main__": sys.exit(pytest.main([__file__, "-q"]))
