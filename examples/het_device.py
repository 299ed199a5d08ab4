"""Device["HET"] and Device["MESH"] in a plain tinygrad script.

Builds a tensor on HET (the prefill accelerator), computes, moves it to MESH (this node's decode memory), computes there,
sends it to the MESH memory of a second local process over the transport, reads it back, and checks every step
against numpy.   Run: python examples/het_device.py
"""
import os, subprocess, sys
import numpy as np
import tinyhet
from tinygrad import Tensor, Device

def start_peer() -> tuple[subprocess.Popen, str]:
  """A second node in another process: it only serves its MESH memory."""
  code = "import sys, tinyhet; print(tinyhet.serve(), flush=True); sys.stdin.read()"
  proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                          env={**os.environ, "TINYHET_NODE": "peer0"})
  return proc, proc.stdout.readline().strip()

def main():
  os.environ.setdefault("TINYHET_TOKEN", os.urandom(16).hex())     # both processes prove this shared token
  rng = np.random.default_rng(0)
  a, b = rng.standard_normal((64, 32)).astype(np.float32), rng.standard_normal((32, 16)).astype(np.float32)

  x = Tensor(a, device="HET") @ Tensor(b, device="HET")                 # prefill-side compute
  want = a @ b
  assert np.allclose(x.numpy(), want, rtol=1e-4, atol=1e-4)
  print(f"HET ({Device['HET'].__class__.__name__}): matmul ok")

  m = x.to("MESH")                                                      # one copy into registered memory
  y = (m * 2).relu().sum(axis=0)
  want_y = np.maximum(want * 2, 0).sum(axis=0)
  assert np.allclose(y.numpy(), want_y, rtol=1e-4, atol=1e-3)
  print("MESH: relu/sum ok")

  proc, address = start_peer()
  try:
    tinyhet.connect("peer0", address)
    r = m.to("MESH:peer0").realize()                                     # a transport write into the peer's memory
    back = r.to("MESH")                                                  # a transport read
    assert np.array_equal(back.numpy(), m.numpy())
    assert np.allclose((back + 1).numpy(), want + 1, rtol=1e-4, atol=1e-4)
    print(f"MESH:peer0 over {tinyhet.local_node().peer('peer0').transport}: round trip byte-exact")
  finally:
    proc.stdin.close()
    proc.wait(30)
  print("all results match numpy")

if __name__ == "__main__": main()
