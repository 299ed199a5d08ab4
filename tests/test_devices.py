import gc, os, pathlib, subprocess, sys
import numpy as np, pytest
from hypothesis import given, settings, strategies as st
import tinyhet
from tinygrad import Tensor, dtypes
from tinyhet.device.backend import region_of
from tinyhet.device.memory import local_node

ROOT = pathlib.Path(__file__).parent.parent
NP = {dtypes.float32: np.float32, dtypes.float16: np.float16, dtypes.int32: np.int32}

def arrays(draw, dtype, shape):
  rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
  if dtype == dtypes.int32: return rng.integers(-1000, 1000, shape).astype(np.int32)
  return (rng.standard_normal(shape) * 3).astype(NP[dtype])

@settings(max_examples=10, deadline=None)
@given(st.data(), st.sampled_from(["HET", "MESH"]), st.sampled_from([dtypes.float32, dtypes.float16, dtypes.int32]),
       st.sampled_from([(1,), (7,), (3, 5), (16, 9), (2, 3, 4)]))
def test_ops_equal_numpy(data, device, dtype, shape):
  a, b = arrays(data.draw, dtype, shape), arrays(data.draw, dtype, shape)
  ta, tb = Tensor(a, device=device), Tensor(b, device=device)
  tol = dict(rtol=1e-2, atol=1e-2) if dtype == dtypes.float16 else dict(rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose((ta + tb * 2).numpy(), a + b * 2, **tol)
  np.testing.assert_allclose(ta.max(axis=-1).numpy(), a.max(axis=-1), **tol)
  np.testing.assert_allclose(ta.cast(dtypes.float32).sum(axis=0).numpy(), a.astype(np.float32).sum(axis=0), rtol=1e-4, atol=1e-2)
  assert (ta + tb).device == device

@settings(max_examples=10, deadline=None)
@given(st.binary(min_size=1, max_size=5000))
def test_het_mesh_het_round_trip_is_byte_exact(data):
  raw = np.frombuffer(data, np.uint8)
  h = Tensor(raw, device="HET")
  m = h.to("MESH")
  back = m.to("HET")
  assert back.numpy().tobytes() == data and m.numpy().tobytes() == data

def test_every_buffer_lies_in_a_registered_arena():
  node = local_node()
  ts = [(Tensor(np.arange(100, dtype=np.float32), device=d) * 2).realize() for d in ("HET", "MESH")]
  ts.append(ts[0].reshape(10, 10)[3:5].contiguous().realize())
  for t in ts:
    region, offset = region_of(t.uop.buffer)
    arena = node.arenas[t.device]
    assert region.arena is arena and arena.contains(region.addr + offset, t.nbytes())
    assert bytes(region.view(offset, t.nbytes())) == t.numpy().tobytes()     # the tensor's bytes are the arena's bytes

def test_arena_bytes_return_to_start():
  node = local_node()
  Tensor([1.0], device="HET").realize(); Tensor([1.0], device="MESH").realize()   # device set-up buffers
  gc.collect()
  before = {k: a.in_use for k, a in node.arenas.items()}
  xs = [Tensor(np.ones((64, 64), np.float32), device="HET") @ Tensor(np.ones((64, 64), np.float32), device="HET")]
  xs.append(xs[0].to("MESH").sum(axis=0).realize())
  assert node.arenas["HET"].in_use > before["HET"] and node.arenas["MESH"].in_use > before["MESH"]
  del xs
  gc.collect()
  assert {k: a.in_use for k, a in node.arenas.items() if k in before} == before

def test_register_gives_a_descriptor_of_the_tensor_bytes():
  node = local_node()
  lazy = Tensor(np.arange(24, dtype=np.float32), device="HET").reshape(4, 6).T * 3       # lazy, and a non-contiguous view
  for src in (lazy, lazy.to("MESH"), Tensor(np.arange(5, dtype=np.int32), device="CPU")):
    t, desc = tinyhet.register(src)
    assert desc.length == t.nbytes() and desc.node == node.name
    assert node.endpoint.lookup(desc.region_id, desc.offset, desc.length).tobytes() == t.numpy().tobytes()
  t2, d2 = tinyhet.register(t)                   # registering again exposes the same bytes, of the same allocation
  assert d2.addr + d2.offset == desc.addr + desc.offset and t2.uop.buffer is t.uop.buffer
  del t, t2
  gc.collect()
  with pytest.raises(Exception, match="not exposed"): node.endpoint.lookup(d2.region_id, d2.offset, d2.length)   # freed: withdrawn

def test_errors_name_the_problem():
  with pytest.raises(Exception, match="unknown peer 'nobody'.*tinyhet.connect"): Tensor([1.0], device="MESH:nobody").realize()
  with pytest.raises(ValueError, match="not in registered memory"): tinyhet.register(Tensor([1.0], device="PYTHON"))

def run(args, **env):
  return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600, cwd=ROOT,
                        env={k: v for k, v in {**os.environ, **env}.items() if v is not None})

def test_example_het_device_script():
  out = run(["examples/het_device.py"])
  assert out.returncode == 0, out.stderr
  assert "MESH:peer0 over shm: round trip byte-exact" in out.stdout and "all results match numpy" in out.stdout

def test_remote_memory_errors_and_cleanup():
  code = """
import os, subprocess, sys, numpy as np, tinyhet
from tinygrad import Tensor
peer = subprocess.Popen([sys.executable, "-c", "import sys, tinyhet; print(tinyhet.serve(), flush=True); sys.stdin.read()"],
                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, "TINYHET_NODE": "p1"})
tinyhet.connect("p1", peer.stdout.readline().strip())
r = Tensor(np.arange(8, dtype=np.float32), device="MESH").to("MESH:p1").realize()
try: (r * 2).realize(); print("no error")
except RuntimeError as e: print("kernel:", e)
try: tinyhet.register(r)
except ValueError as e: print("register:", e)
ctl = tinyhet.local_node().control("p1")
print("peer MESH in use:", ctl.call("mem.alloc", nbytes=4096)["desc"] != "")
del r
import gc; gc.collect()
peer.stdin.close(); peer.wait(30)
"""
  out = run(["-c", code], TINYHET_TOKEN="t0k")
  assert out.returncode == 0, out.stderr
  assert "kernel: MESH:p1 is memory on node 'p1': kernels cannot run there" in out.stdout
  assert "register: MESH:p1 is another node's memory" in out.stdout

@pytest.mark.parametrize("backend", ["CPU", "PYTHON", "CUDA", "NV"])
def test_het_on_each_backend(backend):
  """The same checks (ops vs numpy, buffers inside the arena, HET->MESH->HET, bytes returning) on each HET backend.
  PYTHON is tinygrad's emulator: a non-CPU backend whose allocator HET wraps like a GPU's."""
  if backend in ("CUDA", "NV"):
    code = (f"from tinygrad import Device\ntry: Device[{backend!r}]\n"
            "except Exception as e: print(type(e).__name__, str(e).strip().splitlines()[0][:200])")
    probe = run(["-c", code])
    if probe.stdout.strip(): pytest.skip(f"no {backend} GPU here ({probe.stdout.strip()})")
  # the emulator's memory is a bytearray, zero-filled as it is made: a small arena instead of the 8 GiB default
  small = {"TINYHET_ARENA_BYTES": "64M"} if backend == "PYTHON" else {}
  out = run(["-m", "tinyhet.bench", "het", "--json", "--quick"], HET_BACKEND=backend, **small)
  assert out.returncode == 0, out.stdout + out.stderr
  import json
  report = json.loads(out.stdout)
  assert report["backend"] == backend and report["failures"] == []
