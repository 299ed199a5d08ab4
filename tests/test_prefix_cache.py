"""The block manager's prefix cache over random request streams. A fake pool holds, at each (block, slot), what the KV of the
token there depends on: the tokens up to and including it, and the tenant salt of the sequence that wrote it. A hit must find
exactly that for every cached position (a block written under another salt is never a hit), a write must never land in a
block another sequence holds, and eviction must never change what a live sequence reads."""
import pytest
from hypothesis import given, settings, strategies as st
from tinyhet.kv.block_manager import BlockManager, PoolFull, block_hashes

class Model:
  def __init__(self, num_blocks: int, block_size: int):
    self.bm = BlockManager(num_blocks, block_size, prefix_cache=True, model_id="m")
    self.pool: dict[tuple[int, int], tuple[int, ...]] = {}
    self.tokens: dict[int, list[int]] = {}   # live sequences -> tokens whose KV they hold
    self.salts: dict[int, str] = {}          # live sequences -> their tenant salt
    self.next_seq = 0

  def _write(self, sid: int, p: int) -> None:
    block, off = self.bm.slot(sid, p)
    assert self.bm.ref_counts[block] == 1, f"sequence {sid} writes position {p} into block {block}, which another sequence holds"
    self.pool[(block, off)] = (self.salts[sid], *self.tokens[sid][:p + 1])

  def allocate(self, prompt: list[int], reserve: bool, salt: str = "") -> None:
    sid, self.next_seq = self.next_seq, self.next_seq + 1
    fits = self.bm.can_allocate(len(prompt), prompt, salt)
    queried, matched = self.bm.queried_tokens, self.bm.matched_tokens
    if not fits:
      with pytest.raises(PoolFull): (self.bm.reserve if reserve else self.bm.allocate)(sid, len(prompt), prompt, salt)
      self.bm.check()
      return
    (self.bm.reserve if reserve else self.bm.allocate)(sid, len(prompt), prompt, salt)
    self.tokens[sid], self.salts[sid] = list(prompt), salt
    hit = self.bm.cached_length(sid)
    assert hit % self.bm.block_size == 0 and 0 <= hit < len(prompt)
    assert (self.bm.queried_tokens - queried, self.bm.matched_tokens - matched) == (len(prompt), hit)
    for p in range(hit):    # a hit: the KV is there, equal to what computing the prompt would store
      assert self.pool[self.bm.slot(sid, p)] == (salt, *prompt[:p + 1]), f"sequence {sid} hit other tokens' (or another tenant's) KV at {p}"
    for p in range(hit, len(prompt)): self._write(sid, p)

  def append(self, sid: int, tok: int) -> None:
    if not self.bm.may_append(sid): return
    self.bm.append_slot(sid)
    self.tokens[sid].append(tok)
    self._write(sid, len(self.tokens[sid]) - 1)

  def free(self, sid: int, keep: bool) -> None:
    if self.bm.is_reserved(sid): self.bm.release_reservation(sid)
    else: self.bm.deallocate(sid, self.tokens[sid] if keep else None)
    del self.tokens[sid], self.salts[sid]

  def verify(self) -> None:
    self.bm.check()
    for sid, toks in self.tokens.items():
      assert self.bm.length(sid) == len(toks)
      for p in range(len(toks)):
        assert self.pool[self.bm.slot(sid, p)] == (self.salts[sid], *toks[:p + 1]), f"sequence {sid}'s KV changed at {p}"
    for b, h in self.bm.block_hash.items():   # a cached block holds the tokens its hash names, under its salt
      salt, *toks = self.pool[(b, self.bm.block_size - 1)]
      assert block_hashes(toks, self.bm.block_size, "m", salt=salt)[-1] == h

PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 9, 9, 9, 9], [7] * 10]
OPS = st.lists(st.tuples(st.sampled_from(["alloc", "alloc", "reserve", "append", "append", "free", "drop", "commit", "release"]),
                         st.integers(0, 10**6), st.integers(0, 12), st.lists(st.integers(0, 3), max_size=6)), min_size=10, max_size=120)

@settings(max_examples=300, deadline=None)
@given(num_blocks=st.integers(1, 20), block_size=st.sampled_from([1, 2, 4]), ops=OPS)
def test_random_request_streams_share_only_the_right_kv(num_blocks, block_size, ops):
  m = Model(num_blocks, block_size)
  for op, pick, n, tail in ops:
    seqs = sorted(m.tokens)
    committed = [s for s in seqs if not m.bm.is_reserved(s)]
    reserved = [s for s in seqs if m.bm.is_reserved(s)]
    prompt = PREFIXES[pick % len(PREFIXES)][:n] + tail or [pick % 4]
    if op in ("alloc", "reserve"): m.allocate(prompt, reserve=op == "reserve", salt=["", "", "tenant-a", "tenant-b"][pick // 7 % 4])
    elif op == "append" and committed: m.append(committed[pick % len(committed)], n % 4)
    elif op in ("free", "drop") and committed: m.free(committed[pick % len(committed)], keep=op == "free")
    elif op == "commit" and reserved: m.bm.commit(reserved[pick % len(reserved)])
    elif op == "release" and reserved: m.free(reserved[pick % len(reserved)], keep=False)
    m.verify()
  for sid in list(m.tokens): m.free(sid, keep=True)
  m.verify()
  assert m.bm.num_free == num_blocks and m.bm.num_used == 0

def test_a_finished_prompt_is_found_again_and_evicted_only_when_needed():
  bm = BlockManager(6, 4, prefix_cache=True)
  prompt = list(range(10))                        # two full blocks and a partial one
  bm.allocate(1, 10, prompt)
  assert bm.cached_length(1) == 0
  bm.deallocate(1, prompt)
  assert bm.num_cached == 2 and bm.num_free == 6  # cached blocks are free: evicted when the pool needs them
  bm.allocate(2, 13, [*prompt, 10, 11, 12])
  assert bm.cached_length(2) == 8 and bm.block_table(2)[:2] == [0, 1]
  bm.deallocate(2)
  bm.allocate(3, 8, prompt[:8])                    # the last token is computed: a whole-block prompt hits one block less
  assert bm.cached_length(3) == 4
  bm.deallocate(3)
  bm.allocate(4, 24, list(range(100, 124)))      # needs every block: the cached ones are evicted
  assert bm.num_cached == 0 and bm.evictions == 2
  bm.deallocate(4)
  bm.check()

def test_a_live_block_is_shared_not_evicted():
  bm = BlockManager(3, 2, prefix_cache=True)
  bm.allocate(1, 3, [5, 6, 7])
  bm.cache_blocks(1, [5, 6, 7])                   # its prompt is prefilled: the full block is found while it runs
  bm.allocate(2, 3, [5, 6, 8])
  assert bm.cached_length(2) == 2 and bm.ref_counts[bm.block_table(1)[0]] == 2
  assert not bm.can_allocate(4, [1, 2, 3, 4])     # one block free; nothing cached is free to evict
  with pytest.raises(PoolFull): bm.allocate(3, 4, [1, 2, 3, 4])
  bm.check()

def test_off_and_model_id():
  off = BlockManager(4, 2)
  off.allocate(1, 3, [1, 2, 3])
  off.deallocate(1, [1, 2, 3])
  off.allocate(2, 3, [1, 2, 3])
  assert off.cached_length(2) == 0 and off.num_cached == 0
  assert block_hashes([1, 2, 3, 4], 2, "a") != block_hashes([1, 2, 3, 4], 2, "b")
  assert block_hashes([1, 2, 3, 4], 2, "a")[0] == block_hashes([1, 2, 9, 9], 2, "a")[0]
  assert block_hashes([1, 2, 3, 4], 2)[1] != block_hashes([0, 2, 3, 4], 2)[1]   # chained: a block's hash names its whole prefix

def test_a_hit_gives_the_tokens_of_the_same_request_without_the_cache():
  """A random tiny model through the single-device engine: the second turn of a conversation (the first turn's prompt and
  reply, then more) hits the first's blocks and prefills only the rest (the paged forward over the cached prefix), and its
  greedy tokens are those of an engine without the cache (itself equal to the dense reference: test_e2e)."""
  import numpy as np
  from tinyhet.engine.local_engine import LocalEngine
  from tinyhet.model import llama as model
  cfg = model.small_config(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, hidden_dim=96, vocab_size=256, max_context=256)
  llama = model.Llama(cfg, model.random_weights(cfg, seed=3))
  cached, plain = LocalEngine(llama, 160, block_size=8, prefix_cache=True), LocalEngine(llama, 160, block_size=8)
  rng = np.random.default_rng(1)
  turn = [int(t) for t in rng.integers(0, 256, 37)]
  for i in range(3):
    got, st = cached.generate(turn, 6)
    want, st0 = plain.generate(turn, 6)
    assert got == want, f"turn {i}"
    assert st0["cached_tokens"] == 0 and st["cached_tokens"] == (0 if i == 0 else (len(turn) - 5) // 8 * 8)   # the last turn's stored KV
    turn = turn + got[:-1] + [int(t) for t in rng.integers(0, 256, 5)]
  assert cached.cache.block_manager.num_cached > 0 and cached.cache.block_manager.num_used == 1   # PAD_SEQ's block
