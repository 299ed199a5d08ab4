"""The decode node's disk tier (`tinyhet node --kv-disk DIR --kv-disk-size 200G`): cached blocks evicted from the RAM prefix
cache are written to a DiskStore (tinyhet.kv.disk_store) and read back into fresh blocks when a later prompt's chain goes on
there, so they count as cached (usage cached_tokens) and are never computed again.

  tier = DiskTier(cache, root, size_bytes)        # keyed by the pool's cache key (fingerprint, KV dtype) and block size
  tier.stage(prompt_ids, salt)                    # on a request's thread, before admission: the disk reads, into RAM
  (admission: BlockManager.allocate asks restore(hash) for each block past its RAM hit; a staged one is copied in)

The three moments of a block:
  eviction  BlockManager._take calls evicted(block, hash) before the block is reused: its bytes are copied out of the pool,
            every layer's (PagedKVCache.read_block_bytes: whatever the KV dtype) into one record, and queued for the writer
            thread; a full queue drops the spill (the copy is skipped too). The step never waits for a disk.
  stage     decode.reserve and decode.submit read the prompt's blocks past its RAM hit from disk on the request's thread,
            outside the node's lock, while the batching loop goes on: a bounded set of staged records (STAGED_BYTES).
  restore   at admission, under the lock: a staged record is copied into a fresh block (write_block_bytes per layer) that
            takes the hash; what was not staged (or was dropped as bad) ends the hit there, and the rest is computed.
Nothing here changes a token: a restored block holds the bytes that block held when it was evicted, checked by checksum.
"""
from __future__ import annotations
from collections import OrderedDict
import threading
from tinyhet.kv.block_manager import block_hashes
from tinyhet.kv.disk_store import DiskStore

STAGED_BYTES = 256 << 20    # records read ahead for admission at most; the oldest go first

class DiskTier:
  def __init__(self, cache, root, size_bytes: int, queue_blocks: int = 64, log=None):
    self.cache, self.bm = cache, cache.block_manager
    self.record_bytes = cache.n_layers * cache.block_nbytes
    # bm.model_id is model.fingerprint.cache_key(fingerprint, kv_dtype): another model's or KV dtype's blocks are another folder
    self.store = DiskStore(root, size_bytes, f"{self.bm.model_id}|block_size={self.bm.block_size}", queue_blocks, log)
    self.staged: OrderedDict[int, bytes] = OrderedDict()
    self.lock = threading.Lock()
    self.restored_tokens = 0
    self.bm.evicted, self.bm.restore = self.evicted, self.restore

  @property
  def found_blocks(self) -> int: return self.store.found_blocks

  def evicted(self, block: int, h: int) -> None:
    """A cached block is about to be reused: its bytes to the disk, if the writer has room for them."""
    if h in self.store or not self.store.has_room(): return
    # sync=False: the block is free and full, no queued kernel writes it; a synchronize here would assert tinygrad's
    # process-wide ALLOW_DEVICE_USAGE, off while another thread compiles a capture (the spill and the allocation failed)
    nb, data = self.cache.block_nbytes, bytearray(self.record_bytes)
    for layer in range(self.cache.n_layers): data[layer * nb:(layer + 1) * nb] = self.cache.read_block_bytes(layer, block, sync=False)
    self.store.put(h, data)

  def chain(self, prompt_ids, salt: str = "", start: int = 0) -> int:
    """How many blocks past the first `start` of the prompt's chain (its RAM hit) the disk holds, one after another."""
    n = 0
    for h in self._hashes(prompt_ids, salt)[start:]:
      if h not in self.store.index: break
      n += 1
    return n

  def stage(self, prompt_ids, salt: str = "") -> int:
    """Read the prompt's blocks that are on disk and not in RAM (the chain past its RAM hit) into memory, for its admission.
    Call it without the node's lock: it reads the disk. Returns the blocks staged."""
    n = 0
    for h in self._hashes(prompt_ids, salt):
      if h in self.bm.hash_block: continue              # in RAM (read without the lock: a stale answer costs a read or a miss)
      with self.lock:
        if h in self.staged:
          self.staged.move_to_end(h)
          n += 1
          continue
      if (data := self.store.get(h)) is None or len(data) != self.record_bytes: break
      with self.lock:
        self.staged[h] = data
        while len(self.staged) * self.record_bytes > STAGED_BYTES: self.staged.popitem(last=False)
      n += 1
    return n

  def restore(self, h: int):
    """For BlockManager.allocate: a function writing the staged record of hash h into a block, or None."""
    with self.lock: data = self.staged.pop(h, None)
    if data is None: return None
    def fill(block: int):
      nb, view = self.cache.block_nbytes, memoryview(data)
      for layer in range(self.cache.n_layers): self.cache.write_block_bytes(layer, block, view[layer * nb:(layer + 1) * nb], sync=False)
      self.restored_tokens += self.bm.block_size
    return fill

  def status(self) -> dict:
    """The tier's figures for heartbeats and decode.info (RAM hits: prefix_hit_tokens less disk_hit_tokens)."""
    return {**self.store.status(), "disk_hit_tokens": self.restored_tokens}

  def describe(self) -> str:
    return (f"KV disk tier {self.store.dir} ({self.store.disk_bytes() / 2**30:.2f} of {self.store.size_bytes / 2**30:.2f} GiB, "
            f"{self.store.mode}): {self.found_blocks} blocks found")

  def close(self) -> None: self.store.close()

  def _hashes(self, prompt_ids, salt: str) -> list[int]:
    bs = self.bm.block_size
    return block_hashes(prompt_ids, bs, self.bm.model_id, (len(prompt_ids) - 1) // bs, salt)
