"""The generated programs of tinygrad's kernels persist across processes (tinyhet.device.program_cache), and the code
tinygrad generates in its worker processes splits kernels as the code generated here does (cpu_threads.more_parts)."""
import json, os, subprocess, sys

PREFILL = """
import json, tinyhet, tinygrad.codegen as codegen
from tinygrad import Device
Device["MESH"]                             # opened first: a device's own few programs (its signals, ops_cpu) are generated at its open
generated = [0]
do_to_program = codegen.do_to_program
def counted(*a, **k):                      # a program generated in this process (PARALLEL=0: every one is)
  generated[0] += 1
  return do_to_program(*a, **k)
codegen.do_to_program = counted
from tinyhet.model.llama import Llama, random_weights, small_config
from tinyhet.engine.prefill import prefill_logits
from tinyhet.device.program_cache import DiskPrograms
cfg = small_config(max_context=64)
prefill_logits(Llama(cfg, random_weights(cfg, device="MESH", seed=7), "MESH"), list(range(20)))
print(json.dumps({"generated": generated[0], "loaded": DiskPrograms.loaded}))
"""

def run(code: str, tmp_path, **env) -> dict:
  env = {**os.environ, "CACHEDB": str(tmp_path / "cache.db"), **env}
  p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
  assert p.returncode == 0, p.stderr[-3000:]
  return json.loads(p.stdout.strip().splitlines()[-1])

def test_a_second_process_generates_no_program_the_first_one_generated(tmp_path):
  # tinygrad alone keeps the compiled objects on disk but generates every kernel's code again in each process
  first, second = (run(PREFILL, tmp_path, PARALLEL="0") for _ in range(2))
  assert first["generated"] > 0 and second["generated"] == 0 and second["loaded"] > 0, (first, second)

def test_no_program_is_kept_with_tinygrads_cache_off(tmp_path):
  first, second = (run(PREFILL, tmp_path, PARALLEL="0", CACHELEVEL="0") for _ in range(2))
  assert second["generated"] == first["generated"] > 0 and second["loaded"] == 0, (first, second)

SPLIT = """
import json, tinyhet
from tinygrad import Tensor, Device
from tinyhet.device.cpu_threads import kernel_threads
import tinygrad.codegen as codegen
Device["MESH"]
a, b, c = (Tensor.rand(*s, device="MESH").realize() for s in ((96, 4096), (4096, 240), (96, 4096)))
with kernel_threads("MESH"): ((a @ b).relu().contiguous() + (c @ b).contiguous()).realize()   # two matmuls: generated in the pool
print(json.dumps(sorted(int(p.arg.global_size[0]) for p in codegen.to_program_cache.values() if p.arg.function_name.startswith("r_"))))
"""

def test_kernels_generated_in_tinygrads_worker_processes_split_as_in_this_one(tmp_path):
  # 24 threads: tinygrad's heuristic gives a (96 x 240) matmul 16 parts, more_parts 20; the pool's workers import tinygrad
  # alone, so without their initializer the two matmuls (lowered together, in the pool) got 16
  pooled = run(SPLIT, tmp_path, TINYHET_CPU_THREADS="24", PARALLEL="2", CACHELEVEL="0")
  here = run(SPLIT, tmp_path, TINYHET_CPU_THREADS="24", PARALLEL="0", CACHELEVEL="0")
  assert pooled == here == [20, 20], (pooled, here)
