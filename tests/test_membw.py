"""bench/membw.py: the read-bandwidth figure decode is measured against."""
import threading
import numpy as np, pytest
from tinyhet.bench.membw import read_gbps

def test_read_gbps_measures_and_refuses_bad_input():
  assert read_gbps(32 << 20, 1, repeats=1) > 0 and read_gbps(32 << 20, 2, repeats=1) > 0 and read_gbps(32 << 20, repeats=1) > 0
  with pytest.raises(ValueError, match="threads must be at least 1"): read_gbps(1 << 20, 0)
  with pytest.raises(ValueError, match="too small"): read_gbps(8, 2)

def test_numpy_reduction_releases_the_gil():
  """read_gbps's threads read in parallel only if numpy drops the GIL inside max(): while one thread is inside a single
  large max(), this thread keeps running Python."""
  a = np.ones(1 << 27, np.int64)                       # 1 GiB: one max() over it takes tens of ms or more
  inside, done, ticks = threading.Event(), threading.Event(), [0]
  def reduce():
    inside.set()
    a.max()
    done.set()
  t = threading.Thread(target=reduce)
  t.start()
  inside.wait()
  while not done.is_set(): ticks[0] += 1
  t.join()
  assert ticks[0] > 1000, f"this thread ran only {ticks[0]} loop steps while max() ran: the reduction held the GIL"
