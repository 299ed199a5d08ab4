"""bench decode's table: an engine that measured only some rows gets a dash in the others, and the ratio column compares
tinyhet with the best baseline that has the row (tinyhet-int8, tinyhet's own other mode, is not a baseline)."""
from tinyhet.bench.decode import table

def row(engine, batch=None, prompt=None, rate=None, share=None):
  return {"engine": engine, "batch": batch, "prompt_tokens": prompt, "decode_tok_s": rate if batch else None,
          "prefill_tok_s": rate if prompt else None, "read_share": share}

def test_an_engine_without_a_row_gets_a_dash():
  rows = [row("tinyhet", prompt=512, rate=60.0), row("tinyhet", batch=1, rate=10.0, share=0.1), row("tinyhet", batch=16, rate=80.0, share=0.05),
          row("tinyhet-int8", prompt=16, rate=50.0), row("tinyhet-int8", batch=1, rate=12.0, share=0.08),
          row("llama.cpp", prompt=512, rate=80.0), row("llama.cpp", batch=1, rate=8.0, share=0.07), row("llama.cpp", batch=16, rate=40.0, share=0.02)]
  out = table({"rows": rows, "model": "m", "threads": 2, "read_gbps": 10.0, "context": 100, "llama_cpp": "", "skipped": {}})
  lines = {ln.split("  ")[0].strip(): ln for ln in out.splitlines()}
  assert lines["prefill 16 tok/s"].split()[3:5] == ["-", "50.0"] and lines["prefill 16 tok/s"].split()[-1] == "-"
  assert lines["prefill 512 tok/s"].rstrip().endswith("0.75x")          # 60 / 80
  assert lines["decode batch 1 tok/s"].rstrip().endswith("1.25x")       # 10 / 8: not 10 / 12, tinyhet-int8's
  assert "-" in lines["decode batch 16 tok/s"].split() and lines["decode batch 16 tok/s"].rstrip().endswith("2.00x")

def test_the_formats_sweep_holds_llama_cpp_to_its_better_mode():
  """bench decode --formats: each cell is against llama.cpp's better of flash attention on and off, naming which."""
  from tinyhet.bench.decode import format_cells
  rows = [row("tinyhet", 1, None, 10.0), row("llama.cpp", 1, None, 8.0), row("llama.cpp-noflash", 1, None, 12.5),
          row("tinyhet", None, 512, 900.0), row("llama.cpp", None, 512, 600.0), row("llama.cpp-noflash", None, 512, 450.0),
          row("tinyhet-int8", 1, None, 15.0)]
  columns, cells = format_cells({"formats": {"Q8_0": {"rows": rows, "skipped": {}, "file_bytes": 1e8}}})
  got = dict(zip(columns, cells[0]))
  assert got["format"] == "Q8_0" and "(0.80x, no flash)" in got[columns[1]] and "int8 15.0 (1.20x)" in got[columns[1]]
  assert "(1.50x, flash)" in got["prefill 512"]

def test_one_models_table_puts_each_tinyhet_mode_over_the_best_baseline_of_its_row():
  """bench decode's saved table (docs/benchmarks.md): one column per engine, a dash where an engine has no row, and each
  tinyhet mode over the best baseline that has the row, naming it; the other tinyhet mode is never the baseline."""
  from tinyhet.bench.decode import model_cells
  rows = [row("tinyhet", 1, None, 10.0, 0.25), row("tinyhet-int8", 1, None, 30.0, 0.5), row("llama.cpp", 1, None, 8.0),
          row("torch-f32", 1, None, 12.5), row("tinyhet", None, 512, 900.0), row("llama.cpp-noflash", None, 512, 450.0)]
  columns, cells = model_cells({"rows": rows})
  got = {c[0]: dict(zip(columns, c)) for c in cells}
  assert columns[-2:] == ["tinyhet / best baseline", "tinyhet int8 / best baseline"]
  b1 = got["decode batch 1, tok/s (read share)"]
  assert b1["tinyhet"] == "10.0 (25%)" and b1["tinyhet / best baseline"] == "0.80x (PyTorch float32)"
  assert b1["tinyhet int8 / best baseline"] == "2.40x (PyTorch float32)" and b1["llama.cpp (no flash)"] == "-"
  p = got["prefill 512 tokens, tok/s"]
  assert p["tinyhet / best baseline"] == "2.00x (llama.cpp no flash)" and p["tinyhet int8"] == "-" and p["tinyhet int8 / best baseline"] == "-"
