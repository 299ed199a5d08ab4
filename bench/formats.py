"""SmolLM2-135M-Instruct in the formats people download, made with llama.cpp's own quantizer (`make bench-setup` runs this):
the embedded Q4_1 GGUF is first converted to F32 (llama_model_quantize with requantizing allowed: each tensor dequantized
to float32), and that F32 file is quantized to F16, BF16, Q8_0, Q6_K, Q5_K_M and Q4_K_M, as `llama-quantize` does (the same
function of libllama, called through llama-cpp-python, which `make bench-setup` compiles). No Hugging Face checkpoint is
needed (this machine reaches no model hub): the weights are the embedded model's, so every format's tokens are comparable.

  python -m tinyhet.bench.formats [--out DIR]     # prints each file's path; an existing file is kept

Note what llama-quantize does with SmolLM2's width (576 = 2.25 x 256): a K-quant needs whole 256-weight super-blocks in a row,
so matrices with 576 columns fall back (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0) and only those with 1536 columns (the FFN's
down projections) are K-quants. A Llama-3 file (4096 or 8192 wide) is K-quants throughout.
"""
from __future__ import annotations
import argparse, os, pathlib, sys

FORMATS = ("F16", "BF16", "Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M")
DEFAULT_DIR = pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache")) / "tinyhet" / "formats"

def format_path(fmt: str, out: pathlib.Path = DEFAULT_DIR) -> pathlib.Path: return out / f"SmolLM2-135M-Instruct-{fmt}.gguf"

def quantize(L, src: pathlib.Path, dst: pathlib.Path, ftype: int) -> None:
  p = L.llama_model_quantize_default_params()
  p.ftype, p.allow_requantize, p.nthread = ftype, True, os.cpu_count() or 1
  tmp = dst.with_suffix(".part")
  if (rc := L.llama_model_quantize(str(src).encode(), str(tmp).encode(), p)) != 0: raise SystemExit(f"llama_model_quantize {src} -> {dst}: {rc}")
  tmp.rename(dst)

def make_formats(out: pathlib.Path = DEFAULT_DIR, formats=FORMATS, log=print) -> dict[str, pathlib.Path]:
  try: import llama_cpp as L
  except ImportError as e: raise SystemExit(f"llama-cpp-python is not installed ({e}): run `make bench-setup`") from e
  from tinyhet.model.weights import embedded_model_path
  quiet = L.llama_log_callback(lambda level, text, user: None)
  L.llama_log_set(quiet, None)
  L.llama_backend_init()
  out.mkdir(parents=True, exist_ok=True)
  f32 = format_path("F32", out)
  if not f32.exists():
    log(f"{f32}: F32 from the embedded Q4_1 model")
    quantize(L, embedded_model_path(), f32, L.LLAMA_FTYPE_ALL_F32)
  paths = {}
  for fmt in formats:
    paths[fmt] = dst = format_path(fmt, out)
    if dst.exists(): continue
    log(f"{dst}: {fmt} from F32")
    quantize(L, f32, dst, getattr(L, f"LLAMA_FTYPE_MOSTLY_{fmt}"))
  return paths

def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(prog="python -m tinyhet.bench.formats", description=__doc__.split("\n\n")[0])
  ap.add_argument("--out", type=pathlib.Path, default=DEFAULT_DIR)
  ap.add_argument("--formats", default=",".join(FORMATS))
  args = ap.parse_args(argv)
  for fmt, p in make_formats(args.out, args.formats.split(","), log=lambda m: print(m, file=sys.stderr)).items(): print(fmt, p)
  return 0

if __name__ == "__main__": sys.exit(main())
