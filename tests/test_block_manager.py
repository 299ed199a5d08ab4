import pytest
from hypothesis import given, settings, strategies as st
from tinyhet.kv.block_manager import BlockManager, PoolFull

class Model:
  """A BlockManager plus what its blocks should hold: every stored token gets a unique label, written into a fake pool at its
  (block, offset); fork performs the returned copy. Each sequence must read back exactly its own labels through its table."""
  def __init__(self, num_blocks: int, block_size: int):
    self.bm = BlockManager(num_blocks, block_size)
    self.pool: dict[tuple[int, int], int] = {}
    self.tokens: dict[int, list[int]] = {}     # committed and reserved sequences -> labels in token order
    self.next_label, self.next_seq = 0, 0

  def _store(self, sid: int, n: int) -> None:
    for p in range(len(self.tokens[sid]), len(self.tokens[sid]) + n):
      self.pool[self.bm.slot(sid, p)] = self.next_label
      self.tokens[sid].append(self.next_label)
      self.next_label += 1

  def allocate(self, n: int, reserve: bool) -> None:
    sid, self.next_seq = self.next_seq, self.next_seq + 1
    if not self.bm.can_allocate(n):
      with pytest.raises(PoolFull): (self.bm.reserve if reserve else self.bm.allocate)(sid, n)
      return
    (self.bm.reserve if reserve else self.bm.allocate)(sid, n)
    self.tokens[sid] = []
    self._store(sid, n)   # a transfer (reserve) fills the slots too

  def append(self, sid: int) -> None:
    if not self.bm.may_append(sid):
      with pytest.raises(PoolFull): self.bm.append_slot(sid)
      return
    before = self.bm.num_free
    block, off = self.bm.append_slot(sid)
    assert self.bm.num_free == before - (off == 0)
    self.pool[(block, off)] = self.next_label
    self.tokens[sid].append(self.next_label)
    self.next_label += 1

  def fork(self, parent: int) -> None:
    child, self.next_seq = self.next_seq, self.next_seq + 1
    partial = self.bm.length(parent) % self.bm.block_size != 0
    if partial and self.bm.num_free == 0:
      with pytest.raises(PoolFull): self.bm.fork(parent, child)
      return
    copy = self.bm.fork(parent, child)
    assert (copy is not None) == partial
    if copy is not None:
      for off in range(self.bm.block_size):
        if (copy[0], off) in self.pool: self.pool[(copy[1], off)] = self.pool[(copy[0], off)]
    self.tokens[child] = list(self.tokens[parent])

  def free(self, sid: int) -> None:
    (self.bm.release_reservation if self.bm.is_reserved(sid) else self.bm.deallocate)(sid)
    del self.tokens[sid]

  def verify(self) -> None:
    self.bm.check()
    for sid, labels in self.tokens.items():
      assert self.bm.length(sid) == len(labels)
      assert [self.pool[self.bm.slot(sid, p)] for p in range(len(labels))] == labels, f"sequence {sid} reads another's tokens"
    used = {b for sid in self.tokens for b in self.bm.block_table(sid)}
    assert len(used) == self.bm.num_used and self.bm.num_free + self.bm.num_used == self.bm.num_blocks
    assert self.bm.largest_fit() == self.bm.num_free * self.bm.block_size
    assert 0.0 <= self.bm.utilization() <= 1.0

OPS = st.lists(st.tuples(st.sampled_from(["alloc", "reserve", "append", "append", "append", "fork", "fork", "free", "commit", "release"]),
                         st.integers(0, 10**6), st.integers(0, 40)), min_size=10, max_size=150)

@settings(max_examples=300, deadline=None)
@given(num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 2, 4, 16]), ops=OPS)
def test_random_operations_keep_invariants(num_blocks, block_size, ops):
  m = Model(num_blocks, block_size)
  for op, pick, n in ops:
    seqs = sorted(m.tokens)
    committed = [s for s in seqs if not m.bm.is_reserved(s)]
    reserved = [s for s in seqs if m.bm.is_reserved(s)]
    if op == "alloc": m.allocate(n, reserve=False)
    elif op == "reserve": m.allocate(n, reserve=True)
    elif op == "append" and committed: m.append(committed[pick % len(committed)])
    elif op == "fork" and committed: m.fork(committed[pick % len(committed)])
    elif op == "free" and seqs: m.free(seqs[pick % len(seqs)])
    elif op == "commit" and reserved: m.bm.commit(reserved[pick % len(reserved)])
    elif op == "release" and reserved: m.free(reserved[pick % len(reserved)])
    m.verify()
  for sid in list(m.tokens): m.free(sid)
  m.verify()
  assert m.bm.num_free == num_blocks and m.bm.num_used == 0 and sorted(m.bm.free_ids) == list(range(num_blocks))

def test_fork_shares_full_blocks_and_copies_the_partial_one():
  bm = BlockManager(8, 4)
  bm.allocate(0, 10)                          # blocks [a, b, c]: c holds 2 tokens
  a, b, c = bm.block_table(0)
  src, dst = bm.fork(0, 1)
  assert (src, dst) == (c, bm.block_table(1)[-1]) and bm.block_table(1)[:2] == [a, b]
  assert bm.ref_counts[a] == bm.ref_counts[b] == 2 and bm.ref_counts[c] == bm.ref_counts[dst] == 1
  assert bm.append_slot(1) == (dst, 2)        # the child's partial block is its own
  bm.allocate(2, 8)
  assert bm.fork(2, 3) is None                # block-aligned: everything shared, nothing copied
  assert bm.utilization() == pytest.approx((10 + 3 + 8) / (6 * 4))   # distinct slots: a, b, c, dst (2 copied + 1), the 2 aligned blocks
  for s in range(4): bm.deallocate(s)
  assert bm.num_free == 8

def test_reservation_lifecycle_and_errors():
  bm = BlockManager(4, 16)
  assert bm.reserve(7, 40) == [0, 1, 2] and bm.is_reserved(7)
  assert bm.utilization() == 0.0              # held for a transfer, nothing stored yet
  with pytest.raises(ValueError, match="not been committed"): bm.append_slot(7)
  with pytest.raises(ValueError, match="not been committed"): bm.deallocate(7)
  bm.release_reservation(7)
  assert bm.num_free == 4 and 7 not in bm
  bm.reserve(8, 16)
  bm.commit(8)
  with pytest.raises(ValueError, match="no reservation"): bm.commit(8)
  assert bm.append_slot(8) == (bm.block_table(8)[1], 0)
  with pytest.raises(ValueError, match="already has blocks"): bm.allocate(8, 1)
  with pytest.raises(KeyError, match="no blocks"): bm.deallocate(99)
  with pytest.raises(PoolFull, match="needs 3 blocks, 2 of 4 are free"): bm.allocate(9, 48)
  assert bm.largest_fit() == 32 and bm.can_allocate(32) and not bm.can_allocate(33)

@settings(max_examples=50, deadline=None)
@given(sizes=st.lists(st.integers(1, 60), min_size=1, max_size=8), data=st.data())
def test_a_freed_sequences_blocks_are_the_next_taken_in_its_tables_order(sizes, data):
  """Plain blocks freed go to the front of the free queue in table order: the next sequence of that length takes the same
  blocks, in the same order (a shm writer's mapping of their pages is warm, and one run of blocks stays one span)."""
  bm = BlockManager(64, 4)
  live = [i for i, n in enumerate(sizes) if bm.can_allocate(n) and bm.allocate(i, n)]
  if not live: return
  sid = data.draw(st.sampled_from(live))
  table, n = list(bm.block_table(sid)), bm.length(sid)
  bm.deallocate(sid)
  assert bm.allocate(100, n) == table
  bm.check()
