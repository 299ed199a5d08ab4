"""Paged-KV block bookkeeping: which fixed-size blocks of the KV pool each sequence owns. Plain Python, no device.

The pool has num_blocks blocks of block_size token slots. A sequence has a block table (block ids in token order) and a
length (token slots in use: token p lives in block table[p // block_size], slot p % block_size). A sequence is committed
(allocate, fork, or commit after reserve) or reserved (reserve: blocks held for an incoming transfer that has not landed).

Invariants (check() asserts every one):
  1. every block is free (in the free queue, refcount 0) or used (refcount >= 1), never both; free + used == num_blocks
  2. a block's refcount equals the number of block tables that hold it; one table holds a block at most once
  3. a table holds exactly ceil(length / block_size) blocks
  4. a block is shared (refcount > 1) only if it is full in every table that holds it: fork shares full blocks and copies a
     partial last block, so appending never writes into a shared block
  5. only committed sequences are appended to, forked and deallocated; only reserved ones are committed or released
"""
from __future__ import annotations
from collections import deque

class PoolFull(RuntimeError):
  """Not enough free blocks. The scheduler avoids it by asking can_allocate / may_append first."""

class BlockManager:
  def __init__(self, num_blocks: int, block_size: int):
    if num_blocks < 1 or block_size < 1: raise ValueError(f"BlockManager needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
    self.num_blocks, self.block_size = num_blocks, block_size
    self.free_ids: deque[int] = deque(range(num_blocks))
    self.ref_counts: list[int] = [0] * num_blocks
    self.tables: dict[int, list[int]] = {}
    self.lengths: dict[int, int] = {}
    self.reserved: set[int] = set()

  # ***** figures *****

  @property
  def num_free(self) -> int: return len(self.free_ids)
  @property
  def num_used(self) -> int: return self.num_blocks - len(self.free_ids)
  def blocks_needed(self, n_tokens: int) -> int: return -(-n_tokens // self.block_size)
  def largest_fit(self) -> int:
    """The longest new sequence (in tokens) that the free blocks hold."""
    return self.num_free * self.block_size
  def tokens_stored(self) -> int:
    """Distinct token slots in use by committed sequences (a shared block counts once)."""
    fill: dict[int, int] = {}
    for sid, table in self.tables.items():
      if sid in self.reserved: continue
      for i, b in enumerate(table): fill[b] = max(fill.get(b, 0), min(self.block_size, self.lengths[sid] - i * self.block_size))
    return sum(fill.values())
  def utilization(self) -> float:
    """Tokens stored / token slots of the used blocks (1.0 for an empty pool). Reserved blocks count as slots, not tokens."""
    return self.tokens_stored() / (self.num_used * self.block_size) if self.num_used else 1.0

  # ***** queries *****

  def block_table(self, seq_id: int) -> list[int]: return self.tables[self._known(seq_id)]
  def length(self, seq_id: int) -> int: return self.lengths[self._known(seq_id)]
  def slot(self, seq_id: int, position: int) -> tuple[int, int]:
    """(block id, offset in block) of the token at position."""
    if not 0 <= position < self.length(seq_id): raise IndexError(f"sequence {seq_id} has {self.lengths[seq_id]} tokens, no position {position}")
    return self.tables[seq_id][position // self.block_size], position % self.block_size
  def __contains__(self, seq_id: int) -> bool: return seq_id in self.tables
  def is_reserved(self, seq_id: int) -> bool: return seq_id in self.reserved

  # ***** allocation *****

  def can_allocate(self, n_tokens: int) -> bool: return self.blocks_needed(n_tokens) <= self.num_free

  def allocate(self, seq_id: int, n_tokens: int) -> list[int]:
    """Blocks for a new sequence of n_tokens tokens (a prompt, or a preempted sequence being recomputed)."""
    self._new(seq_id, n_tokens)
    self.tables[seq_id] = self._take(self.blocks_needed(n_tokens), f"sequence {seq_id} ({n_tokens} tokens)")
    self.lengths[seq_id] = n_tokens
    return self.tables[seq_id]

  def may_append(self, seq_id: int) -> bool:
    """Whether one more token fits: always when the last block has room, else when a block is free."""
    self._committed(seq_id, "append to")
    return self.lengths[seq_id] % self.block_size != 0 or self.num_free > 0

  def append_slot(self, seq_id: int) -> tuple[int, int]:
    """Room for the next token (a new block when the last is full); returns its (block id, offset)."""
    self._committed(seq_id, "append to")
    n = self.lengths[seq_id]
    if n % self.block_size == 0: self.tables[seq_id] += self._take(1, f"token {n} of sequence {seq_id}")
    self.lengths[seq_id] = n + 1
    return self.tables[seq_id][-1], n % self.block_size

  def deallocate(self, seq_id: int) -> None:
    """Free a finished or preempted sequence: its blocks go back to the pool once no other sequence shares them."""
    self._committed(seq_id, "deallocate")
    self._drop(seq_id)

  def fork(self, parent: int, child: int) -> tuple[int, int] | None:
    """child starts as a copy of parent: full blocks are shared (refcount + 1), a partial last block is copied into a new
    block. Returns (src, dst) for that copy, which the caller must perform on every layer's pool, or None."""
    self._committed(parent, "fork")
    self._new(child, self.lengths[parent])
    table, n = self.tables[parent], self.lengths[parent]
    partial = n % self.block_size != 0
    copy = self._take(1, f"the partial last block of sequence {parent}") if partial else []
    shared = table[:-1] if partial else table
    for b in shared: self.ref_counts[b] += 1
    self.tables[child], self.lengths[child] = shared + copy, n
    return (table[-1], copy[0]) if partial else None

  # ***** incoming transfers *****

  def reserve(self, seq_id: int, n_tokens: int) -> list[int]:
    """Hold blocks for n_tokens tokens that a prefill node will write (a transfer). The blocks stay held until commit (the
    transfer landed) or release_reservation (it failed)."""
    blocks = self.allocate(seq_id, n_tokens)
    self.reserved.add(seq_id)
    return blocks

  def commit(self, seq_id: int) -> None:
    """The transfer landed: the reserved sequence holds its n_tokens and becomes an ordinary sequence."""
    self._reserved(seq_id, "commit")
    self.reserved.discard(seq_id)

  def release_reservation(self, seq_id: int) -> None:
    """The transfer failed: give the reserved blocks back."""
    self._reserved(seq_id, "release")
    self.reserved.discard(seq_id)
    self._drop(seq_id)

  # ***** invariants *****

  def check(self) -> None:
    """Assert the module's invariants; raises AssertionError naming the first one broken."""
    free = set(self.free_ids)
    assert len(free) == len(self.free_ids), "a block is in the free queue twice"
    counts = [0] * self.num_blocks
    for sid, table in self.tables.items():
      assert len(set(table)) == len(table), f"sequence {sid} holds a block twice: {table}"
      assert len(table) == self.blocks_needed(self.lengths[sid]), f"sequence {sid}: {len(table)} blocks for {self.lengths[sid]} tokens"
      for b in table: counts[b] += 1
      if self.lengths[sid] % self.block_size: assert self.ref_counts[table[-1]] == 1, f"sequence {sid}: partial last block {table[-1]} is shared"
    assert counts == self.ref_counts, "reference counts differ from the block tables"
    for b in range(self.num_blocks): assert (b in free) == (counts[b] == 0), f"block {b}: refcount {counts[b]}, free={b in free}"
    assert self.reserved <= set(self.tables), "a reservation without blocks"

  # ***** helpers *****

  def _take(self, n: int, what: str) -> list[int]:
    if n > len(self.free_ids):
      raise PoolFull(f"KV pool full: {what} needs {n} blocks, {len(self.free_ids)} of {self.num_blocks} are free; "
                     "wait for sequences to finish or preempt one (the scheduler does both)")
    ids = [self.free_ids.popleft() for _ in range(n)]
    for b in ids: self.ref_counts[b] = 1
    return ids

  def _drop(self, seq_id: int) -> None:
    for b in reversed(self.tables.pop(seq_id)):
      self.ref_counts[b] -= 1
      if self.ref_counts[b] == 0: self.free_ids.append(b)
    del self.lengths[seq_id]

  def _new(self, seq_id: int, n_tokens: int) -> None:
    if seq_id in self.tables: raise ValueError(f"sequence {seq_id} already has blocks")
    if n_tokens < 0: raise ValueError(f"sequence {seq_id}: negative length {n_tokens}")

  def _known(self, seq_id: int) -> int:
    if seq_id not in self.tables: raise KeyError(f"sequence {seq_id} has no blocks in this pool")
    return seq_id

  def _committed(self, seq_id: int, verb: str) -> None:
    if self._known(seq_id) in self.reserved: raise ValueError(f"cannot {verb} sequence {seq_id}: its transfer has not been committed")

  def _reserved(self, seq_id: int, verb: str) -> None:
    if self._known(seq_id) not in self.reserved: raise ValueError(f"cannot {verb} sequence {seq_id}: it holds no reservation")
