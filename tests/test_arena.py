import numpy as np, pytest
from hypothesis import given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule, invariant, Bundle, consumes
from tinyhet.runtime.spans import SpanAllocator, OutOfMemory
from tinyhet.runtime.arena import Arena

class SpanMachine(RuleBasedStateMachine):
  """Random alloc/free sequences keep the span invariants; freeing everything coalesces back to one span."""
  spans = Bundle("spans")
  def __init__(self):
    super().__init__()
    self.a = SpanAllocator(1 << 16, "test")
    self.live: dict[int, tuple[int, int]] = {}

  @rule(target=spans, nbytes=st.integers(1, 9000), align=st.sampled_from([1, 8, 64, 256, 4096]))
  def alloc(self, nbytes, align):
    try: off = self.a.alloc(nbytes, align)
    except OutOfMemory as e:
      assert "test" in str(e) and str(nbytes) in str(e)
      return None
    assert off % align == 0 and off + nbytes <= self.a.size
    self.live[off] = (nbytes, align)
    return off

  @rule(off=consumes(spans))
  def free(self, off):
    if off is None: return
    self.a.free(off)
    del self.live[off]

  @invariant()
  def spans_tile_the_arena(self):
    pieces = sorted([(o, n) for o, (n, _) in self.live.items()] + self.a.free_spans())
    pos = 0
    for o, n in pieces:
      assert o == pos and n > 0
      pos += n
    assert pos == self.a.size and self.a.in_use == sum(n for n, _ in self.live.values())
    free = self.a.free_spans()
    assert all(s1 + n1 < s2 for (s1, n1), (s2, _) in zip(free, free[1:])), "free neighbours must coalesce"

  def teardown(self):
    for off in list(self.live): self.a.free(off)
    assert self.a.free_spans() == [(0, self.a.size)] and self.a.in_use == 0

TestSpanMachine = SpanMachine.TestCase
TestSpanMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)

def test_span_errors():
  a = SpanAllocator(1024, "kv")
  with pytest.raises(ValueError, match="positive"): a.alloc(0)
  with pytest.raises(ValueError, match="power of two"): a.alloc(8, 3)
  with pytest.raises(ValueError, match="not an allocated span"): a.free(5)
  a.alloc(1000)
  with pytest.raises(OutOfMemory, match=r"kv.*cannot allocate 100 bytes.*24 of 1024 bytes free"): a.alloc(100)

def test_arena_regions_are_shared_memory():
  arena = Arena(4 << 20, "t", hugepages=True)
  assert arena.pages and arena.figures() == {"reserved": arena.size, "in_use": 0, "largest_free": arena.size}
  r1, r2 = arena.alloc(1000), arena.alloc(5000, align=4096)
  assert r2.addr % 4096 == 0 and arena.contains(r1.addr, 1000) and not arena.contains(arena.base + arena.size, 1)
  r1.numpy()[:] = 7
  assert bytes(arena.view(r1.offset, 3)) == b"\x07\x07\x07"
  # another mapping of the same memfd sees the bytes: this is what the shm transport relies on
  import mmap
  with mmap.mmap(arena.fd, arena.size) as m: assert m[r1.offset:r1.offset + 2] == b"\x07\x07"
  with pytest.raises(IndexError, match="outside region"): r1.view(999, 2)
  with pytest.raises(RuntimeError, match="still allocated"): arena.close()
  r1.free(); r2.free()
  assert arena.in_use == 0
  arena.close()

def test_arena_region_numpy_shape():
  arena = Arena(1 << 20, "np", hugepages=False)
  assert arena.pages.startswith("normal")
  r = arena.alloc(4 * 6)
  x = r.numpy(np.float32, (2, 3))
  x[:] = np.arange(6).reshape(2, 3)
  assert np.frombuffer(r.view(), np.float32).tolist() == [0, 1, 2, 3, 4, 5]
  r.free(); arena.close()

@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 1 << 16), min_size=1, max_size=20))
def test_arena_alloc_free_returns_to_start(sizes):
  arena = Arena(2 << 20, "prop", hugepages=False)
  regions = []
  for n in sizes:
    try: regions.append(arena.alloc(n))
    except OutOfMemory: pass
  spans = sorted((r.offset, r.offset + r.nbytes) for r in regions)
  assert all(e1 <= s2 for (_, e1), (s2, _) in zip(spans, spans[1:]))
  for r in regions: r.free()
  assert arena.figures()["in_use"] == 0 and arena.figures()["largest_free"] == arena.size
  arena.close()
