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
  5. only committed sequences are appended to and deallocated; only reserved ones are committed or released; a reserved
     sequence's fork is reserved too (its blocks' KV has not landed either)
  6. (prefix cache) a block has a hash only if its block_size tokens are stored in full; hash -> block is one to one; a free
     block with a hash sits in the LRU queue of cached blocks, every other free block in the plain free queue

Prefix cache (prefix_cache=True, vLLM's automatic prefix caching): a full block is named by block_hashes: a hash of the
previous block's hash, its tokens, the model's fingerprint (tinyhet.model.fingerprint: what determines the KV) and the
sequence's salt (its tenant's: allocate(salt=...)); sequences of different salts never share a block. cache_blocks gives
a sequence's full blocks their hashes (the caller says their KV is stored: only KV the node vouches for, see
tinyhet.engine.scheduler's cache_limit); deallocate with the token ids does it as the sequence leaves, and its hashed blocks stay in the pool,
free but cached, least recently used first out. A new sequence's allocate(token_ids=...) shares the longest chain of cached
full blocks its prompt starts with (refcount + 1), at most up to its last token (that one is computed for its logits, so
the last, partial block is always the sequence's own), and takes fresh blocks for the rest: plain free blocks first, then
cached ones are evicted, oldest first. A block with a refcount is never evicted, and a shared block is full, so never
written (invariant 4).
"""
from __future__ import annotations
import hashlib, sys
from collections import OrderedDict, deque

def block_hashes(token_ids, block_size: int, model_id: str = "", n_blocks: int | None = None, salt: str = "") -> list[int]:
  """The chained hashes of the full blocks of token_ids (the first n_blocks of them): 64-bit integers, the same in every
  process (the router computes them too), hash_i = H(hash_{i-1}, tokens of block i, model_id, salt)."""
  n = len(token_ids) // block_size if n_blocks is None else min(n_blocks, len(token_ids) // block_size)
  out, prev, mid = [], b"\0" * 8, model_id.encode() + (b"|" + salt.encode() if salt else b"")
  for i in range(n):
    h = hashlib.blake2b(prev, digest_size=8, person=b"tinyhet-kv")
    h.update(b",".join(str(t).encode() for t in token_ids[i * block_size:(i + 1) * block_size]))
    h.update(b"|" + mid)
    prev = h.digest()
    out.append(int.from_bytes(prev, "little"))
  return out

HASH_LATER = "hash later"   # a restore's fill that returns it: the block is the sequence's, hashed by adopt once its bytes are in
_FAILED = object()

class PoolFull(RuntimeError):
  """Not enough free blocks. The scheduler avoids it by asking can_allocate / may_append first."""

class BlockManager:
  def __init__(self, num_blocks: int, block_size: int, prefix_cache: bool = False, model_id: str = ""):
    if num_blocks < 1 or block_size < 1: raise ValueError(f"BlockManager needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
    self.num_blocks, self.block_size, self.prefix_cache, self.model_id = num_blocks, block_size, prefix_cache, model_id
    self.free_ids: deque[int] = deque(range(num_blocks))
    self.cached_free: OrderedDict[int, None] = OrderedDict()   # free blocks that keep their hash, least recently used first
    self.block_hash: dict[int, int] = {}     # block -> the hash of the tokens it stores in full
    self.hash_block: dict[int, int] = {}     # hash -> block
    self.hit_tokens: dict[int, int] = {}     # seq_id -> tokens its allocation found cached
    self.salts: dict[int, str] = {}          # seq_id -> its salt, where it has one (its blocks are hashed with it)
    self.queried_tokens = self.matched_tokens = self.evictions = 0   # prompt tokens looked up / found (vLLM counts tokens)
    self.peak_used = 0                       # the most blocks used at once since take_peak last read it
    self.ref_counts: list[int] = [0] * num_blocks
    self.tables: dict[int, list[int]] = {}
    self.lengths: dict[int, int] = {}
    self.reserved: set[int] = set()
    # a lower tier (tinyhet.kv.disk_tier): evicted(block, hash) as a cached block is evicted, before it is reused;
    # restore(hash) -> a function writing that hash's KV into a given block, or None: allocate's hit goes on through it.
    # Neither may cost the pool a block: a hook that raises is logged (the first time) and counted, the block stays accounted
    self.evicted = self.restore = None
    self.tier_errors = 0
    self.log = lambda msg: print(f"tinyhet node: {msg}", file=sys.stderr, flush=True)

  # ***** figures *****

  @property
  def num_free(self) -> int: return len(self.free_ids) + len(self.cached_free)   # cached free blocks are evicted on demand
  @property
  def num_used(self) -> int: return self.num_blocks - self.num_free
  @property
  def num_cached(self) -> int: return len(self.block_hash)
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

  def match(self, token_ids, n_tokens: int | None = None, salt: str = "") -> list[int]:
    """The cached blocks a new sequence of these tokens (and this salt) would share: the longest chain of its full blocks
    found cached, at most up to its last token (n_tokens - 1 tokens: the last one is computed, for its logits)."""
    n = len(token_ids) if n_tokens is None else n_tokens
    if not isinstance(salt, str) or len(salt.encode()) > 256:
      raise ValueError(f"the cache salt must be a string of at most 256 bytes, got {str(salt)[:40]!r}")
    if not self.prefix_cache or n < 1: return []
    hit = []
    for h in block_hashes(token_ids, self.block_size, self.model_id, (n - 1) // self.block_size, salt):
      if (b := self.hash_block.get(h)) is None: break
      hit.append(b)
    return hit

  def fresh_needed(self, n_tokens: int, token_ids=None, salt: str = "") -> int:
    """Free blocks an allocation of n_tokens tokens (with these token ids) would take: its blocks less the hit, plus the hit's
    blocks that are free (cached, refcount 0) now."""
    hit = self.match(token_ids, n_tokens, salt) if token_ids is not None else []
    return self.blocks_needed(n_tokens) - len(hit) + sum(1 for b in hit if self.ref_counts[b] == 0)

  def can_allocate(self, n_tokens: int, token_ids=None, salt: str = "") -> bool:
    return self.fresh_needed(n_tokens, token_ids, salt) <= self.num_free

  def allocate(self, seq_id: int, n_tokens: int, token_ids=None, salt: str = "") -> list[int]:
    """Blocks for a new sequence of n_tokens tokens (a prompt, or a preempted sequence being recomputed). With token_ids and
    the prefix cache on, its first cached_length(seq_id) tokens are shared cached blocks (their KV is there already): blocks
    hashed with the same salt only. Its own blocks are hashed with that salt when they are cached (cache_blocks)."""
    self._new(seq_id, n_tokens)
    if not isinstance(salt, str): raise ValueError(f"sequence {seq_id}: the salt must be a string, got {salt!r}")
    hit = self.match(token_ids, n_tokens, salt) if token_ids is not None else []
    if self.fresh_needed(n_tokens, token_ids, salt) > self.num_free:
      raise PoolFull(f"KV pool full: sequence {seq_id} ({n_tokens} tokens, {len(hit)} blocks cached) needs "
                     f"{self.fresh_needed(n_tokens, token_ids, salt)} blocks, {self.num_free} of {self.num_blocks} are free; "
                     "wait for sequences to finish or preempt one (the scheduler does both)")
    for b in hit:                             # taken before _take may evict: a hit block is never its own eviction's victim
      if self.ref_counts[b] == 0: del self.cached_free[b]
      self.ref_counts[b] += 1
      self.hash_block[h] = self.hash_block.pop(h := self.block_hash[b])   # newest last: what a heartbeat's summary shows
    if self.restore is not None and token_ids is not None and self.prefix_cache: hit += self._restored(token_ids, n_tokens, len(hit), salt)
    self.tables[seq_id] = hit + self._take(self.blocks_needed(n_tokens) - len(hit), f"sequence {seq_id} ({n_tokens} tokens)")
    self.lengths[seq_id] = n_tokens
    if token_ids is not None and self.prefix_cache:
      self.queried_tokens += n_tokens
      self.matched_tokens += len(hit) * self.block_size
    self.hit_tokens[seq_id] = len(hit) * self.block_size
    if salt: self.salts[seq_id] = salt
    return self.tables[seq_id]

  def _restored(self, token_ids, n_tokens: int, start: int, salt: str) -> list[int]:
    """The blocks past a RAM hit of `start` blocks that the lower tier gives back (restore): each in a fresh block, written
    and hashed there, so it counts as cached; a block of the chain still in RAM is shared as a hit is."""
    out = []
    for h in block_hashes(token_ids, self.block_size, self.model_id, (n_tokens - 1) // self.block_size, salt)[start:]:
      if (b := self.hash_block.get(h)) is not None:    # a later block of the chain outlived an earlier one in RAM
        if self.ref_counts[b] == 0: del self.cached_free[b]
        self.ref_counts[b] += 1
      elif (fill := self._hook(self.restore, "restore", h)) is None or fill is _FAILED: break
      else:
        b = self._take(1, f"a block restored for {n_tokens} tokens")[0]   # its fresh block: one the allocation counted anyway
        if (got := self._hook(fill, "restore", b)) is _FAILED:   # a failed copy: the block back, unhashed; the rest is computed
          self.ref_counts[b] = 0
          self.free_ids.appendleft(b)
          break
        if got != HASH_LATER: self.block_hash[b], self.hash_block[h] = h, b
      out.append(b)
    return out

  def adopt(self, seq_id: int, pairs) -> int:
    """Hash a sequence's restored blocks whose fill said HASH_LATER, now that their bytes are in: pairs of (block, hash).
    A block the sequence no longer holds, or a hash another block took meanwhile, is skipped. Returns the blocks hashed."""
    table, n = set(self.tables.get(seq_id, ())), 0
    for b, h in pairs:
      if b in table and b not in self.block_hash and h not in self.hash_block:
        self.block_hash[b], self.hash_block[h] = h, b
        n += 1
    return n

  def cached_length(self, seq_id: int) -> int:
    """Tokens at the start of the sequence that were cached when it was allocated (their KV need not be computed)."""
    return self.hit_tokens[self._known(seq_id)]

  def cache_blocks(self, seq_id: int, token_ids) -> int:
    """Give the sequence's full blocks up to min(length, len(token_ids)) tokens their hashes: the caller says these tokens'
    KV is stored. A block whose hash another block holds already stays unhashed. Returns how many blocks are hashed now."""
    if not self.prefix_cache: return 0
    table, n = self.tables[self._known(seq_id)], min(self.lengths[seq_id], len(token_ids))
    hashes = block_hashes(token_ids, self.block_size, self.model_id, n // self.block_size, self.salts.get(seq_id, ""))
    for b, h in zip(table, hashes):
      if self.block_hash.get(b) == h or h in self.hash_block: continue
      if b in self.block_hash: raise AssertionError(f"block {b} holds other tokens than sequence {seq_id}'s: its hash differs")
      self.block_hash[b], self.hash_block[h] = h, b
    return len(hashes)

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

  def truncate(self, seq_id: int, n_tokens: int) -> list[int]:
    """Shorten a committed sequence to n_tokens slots (speculative decoding's rejected drafts, tinyhet.engine.speculative):
    the blocks past them go back to the front of the free queue in the order they were taken, so the pool is as if they had
    never been taken. Only blocks with no hash and no other holder may be dropped. Returns the blocks freed."""
    self._committed(seq_id, "truncate")
    if not 0 <= n_tokens <= self.lengths[seq_id]: raise ValueError(f"sequence {seq_id}: cannot truncate {self.lengths[seq_id]} tokens to {n_tokens}")
    table, keep = self.tables[seq_id], self.blocks_needed(n_tokens)
    dropped = table[keep:]
    if any(self.ref_counts[b] != 1 or b in self.block_hash for b in dropped):
      raise ValueError(f"sequence {seq_id}: a block past {n_tokens} tokens is shared or cached")
    for b in reversed(dropped):
      self.ref_counts[b] = 0
      self.free_ids.appendleft(b)
    del table[keep:]
    self.lengths[seq_id] = n_tokens
    return dropped

  def deallocate(self, seq_id: int, token_ids=None) -> None:
    """Free a finished or preempted sequence: its blocks go back to the pool once no other sequence shares them. With
    token_ids (the tokens whose KV it stores, at least), its full blocks stay cached (cache_blocks) until the pool needs them."""
    self._committed(seq_id, "deallocate")
    if token_ids is not None: self.cache_blocks(seq_id, token_ids)
    self._drop(seq_id)

  def fork(self, parent: int, child: int) -> tuple[int, int] | None:
    """child starts as a copy of parent: full blocks are shared (refcount + 1), a partial last block is copied into a new
    block. Returns (src, dst) for that copy, which the caller must perform on every layer's pool, or None."""
    self._known(parent)
    self._new(child, self.lengths[parent])
    table, n = self.tables[parent], self.lengths[parent]
    partial = n % self.block_size != 0
    copy = self._take(1, f"the partial last block of sequence {parent}") if partial else []
    shared = table[:-1] if partial else table
    for b in shared: self.ref_counts[b] += 1
    self.tables[child], self.lengths[child], self.hit_tokens[child] = shared + copy, n, 0
    if parent in self.salts: self.salts[child] = self.salts[parent]
    if parent in self.reserved: self.reserved.add(child)
    return (table[-1], copy[0]) if partial else None

  # ***** incoming transfers *****

  def reserve(self, seq_id: int, n_tokens: int, token_ids=None, salt: str = "") -> list[int]:
    """Hold blocks for n_tokens tokens that a prefill node will write (a transfer): with token_ids, the cached prefix's blocks
    are shared and only the rest (from cached_length on) are written. The blocks stay held until commit (the transfer
    landed) or release_reservation (it failed)."""
    blocks = self.allocate(seq_id, n_tokens, token_ids, salt)
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
    free = set(self.free_ids) | set(self.cached_free)
    assert len(free) == len(self.free_ids) + len(self.cached_free), "a block is in the free queues twice"
    assert all(b in self.block_hash for b in self.cached_free), "a block in the cached free queue has no hash"
    assert not any(b in self.block_hash for b in self.free_ids), "a block in the plain free queue keeps a hash"
    assert all(self.hash_block.get(h) == b for b, h in self.block_hash.items()) and len(self.hash_block) == len(self.block_hash), \
      "block and hash maps disagree"
    counts = [0] * self.num_blocks
    for sid, table in self.tables.items():
      assert len(set(table)) == len(table), f"sequence {sid} holds a block twice: {table}"
      assert len(table) == self.blocks_needed(self.lengths[sid]), f"sequence {sid}: {len(table)} blocks for {self.lengths[sid]} tokens"
      for b in table: counts[b] += 1
      if self.lengths[sid] % self.block_size: assert self.ref_counts[table[-1]] == 1, f"sequence {sid}: partial last block {table[-1]} is shared"
    assert counts == self.ref_counts, "reference counts differ from the block tables"
    for b in range(self.num_blocks): assert (b in free) == (counts[b] == 0), f"block {b}: refcount {counts[b]}, free={b in free}"
    assert self.reserved <= set(self.tables), "a reservation without blocks"
    assert self.hit_tokens.keys() == self.tables.keys(), "hit lengths differ from the sequences"
    assert self.salts.keys() <= self.tables.keys(), "a salt without a sequence"

  # ***** helpers *****

  def _take(self, n: int, what: str) -> list[int]:
    if n > self.num_free:
      raise PoolFull(f"KV pool full: {what} needs {n} blocks, {self.num_free} of {self.num_blocks} are free; "
                     "wait for sequences to finish or preempt one (the scheduler does both)")
    ids = []
    for _ in range(n):
      if self.free_ids: b = self.free_ids.popleft()
      else:                                 # evict the least recently used cached block
        b, _ = self.cached_free.popitem(last=False)
        del self.hash_block[h := self.block_hash.pop(b)]
        self.evictions += 1
        # its bytes are still there (nothing wrote the block since); a hook that raises costs the spill, never the block
        if self.evicted is not None: self._hook(self.evicted, "spill", b, h)
      ids.append(b)
    for b in ids: self.ref_counts[b] = 1
    self.peak_used = max(self.peak_used, self.num_used)
    return ids

  def _hook(self, fn, what: str, *args):
    """fn(*args) for a lower tier; where it raises, _FAILED: the spill or the restore is dropped, logged the first time,
    counted in tier_errors. The pool's bookkeeping never depends on a tier's success."""
    try: return fn(*args)
    except Exception as e:
      self.tier_errors += 1
      if self.tier_errors == 1: self.log(f"the KV tier's {what} failed ({type(e).__name__}: {e}); dropped, the pool goes on (counted in tier_errors)")
      return _FAILED

  def take_peak(self) -> int:
    """The most blocks used at once since the last call; the count starts again from now."""
    peak, self.peak_used = max(self.peak_used, self.num_used), self.num_used
    return peak

  def _drop(self, seq_id: int) -> None:
    # the tail first: a chain's last blocks are evicted before its first. Plain blocks go to the front of the free queue, in
    # table order: the next sequence takes the blocks just written, whose pages a shm writer's mapping and the caches still
    # hold (a block unused for long costs each process that touches its pages a fault per page: ~1 us per 4 KiB)
    for b in reversed(self.tables.pop(seq_id)):
      self.ref_counts[b] -= 1
      if self.ref_counts[b] == 0:
        if b in self.block_hash: self.cached_free[b] = None
        else: self.free_ids.appendleft(b)
    del self.lengths[seq_id]
    del self.hit_tokens[seq_id]
    self.salts.pop(seq_id, None)

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
