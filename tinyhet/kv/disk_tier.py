"""The decode node's disk tier (`tinyhet node --kv-disk DIR --kv-disk-size 200G`): cached blocks evicted from the RAM prefix
cache are written to a DiskStore (tinyhet.kv.disk_store) and read back into fresh blocks when a later prompt's chain goes on
there, so they count as cached (usage cached_tokens) and are never computed again.

  tier = DiskTier(cache, root, size_bytes)        # keyed by the pool's cache key (fingerprint, KV dtype) and block size
  tier.stage(prompt_ids, salt)                    # decode.submit, before admission: the disk reads, into RAM
  (admission: BlockManager.allocate asks restore(hash) for each block past its RAM hit; a staged one is copied in)
  with tier.planned() as plan: <reserve>          # decode.reserve: the disk chain's blocks taken, unfilled, into plan
  job = tier.start(plan)                          # then filled layer by layer on the reader thread (tinyhet.kv.disk_restore)

The three moments of a block:
  eviction  BlockManager._take calls evicted(block, hash) before the block is reused: its bytes are copied out of the pool,
            every layer's (PagedKVCache.read_block_bytes: whatever the KV dtype) into one record, and queued for the writer
            thread (QUEUE_BYTES of records at most: a whole prompt's eviction at once fits); a full queue drops the spill
            (the copy is skipped too; counted in disk_dropped_spills). The step never waits for a disk.
  restore   two ways, by who prefills the suffix:
            decode.submit (this node prefills it): stage reads the prompt's blocks past its RAM hit on the request's thread,
            outside the node's lock, while the batching loop goes on (a bounded set of staged records, STAGED_BYTES); at
            admission, under the lock, a staged record is copied into a fresh block that takes the hash; what was not staged
            (or was dropped as bad) ends the hit there, and the rest is computed. The read overlaps other requests' steps,
            not this request's own prefill (the batching loop's prefill does not wait layer by layer).
            decode.reserve (a prefill node prefills it): every block of the chain the index holds is taken, unfilled and
            unhashed (HASH_LATER), and counted in the reply's cached_tokens; the reply goes out at once and the reader thread
            fills the blocks layer by layer (tinyhet.kv.disk_restore) while the prefill node pulls each layer as it is in
            and prefills the suffix: the read overlaps the pull and the suffix's compute. The blocks take their hashes when
            the sequence is committed (decode.generate), after every checksum passed.
Nothing here changes a token: a restored block holds the bytes that block held when it was evicted, checked by checksum
before a token is decoded from them.
"""
from __future__ import annotations
from collections import OrderedDict
from contextlib import contextmanager
import queue, threading
from tinyhet.kv.block_manager import HASH_LATER, block_hashes
from tinyhet.kv.disk_restore import RestoreJob
from tinyhet.kv.disk_store import DiskStore

STAGED_BYTES = 256 << 20    # records read ahead for admission at most; the oldest go first
# spills queued for the writer at most: one allocation evicts a whole prompt's blocks at once (a 1,500-token SmolLM2 prompt
# on a small pool: ~100 records of 360 KiB in a few ms), far faster than the writer syncs them; a bound of 64 blocks lost
# the rest of such a burst, and with it every later block of the chain (a hit ends at the first block not on disk)
QUEUE_BYTES = 256 << 20

class DiskTier:
  def __init__(self, cache, root, size_bytes: int, queue_bytes: int = QUEUE_BYTES, log=None):
    self.cache, self.bm = cache, cache.block_manager
    self.record_bytes = cache.n_layers * cache.block_nbytes
    queue_blocks = max(64, queue_bytes // self.record_bytes)
    # bm.model_id is model.fingerprint.cache_key(fingerprint, kv_dtype): another model's or KV dtype's blocks are another folder
    self.store = DiskStore(root, size_bytes, f"{self.bm.model_id}|block_size={self.bm.block_size}", queue_blocks, log)
    self.staged: OrderedDict[int, bytes] = OrderedDict()
    self.lock = threading.Lock()
    self.restored_tokens = 0
    self.plan: list | None = None                # while a reservation allocates (planned): the blocks it takes unfilled
    self.jobs: queue.SimpleQueue = queue.SimpleQueue()
    self.reader = threading.Thread(target=self._read_jobs, name="tinyhet-kv-disk-reader", daemon=True)
    self.reader.start()
    self.bm.evicted, self.bm.restore = self.evicted, self.restore

  @property
  def found_blocks(self) -> int: return self.store.found_blocks

  def evicted(self, block: int, h: int) -> None:
    """A cached block is about to be reused: its bytes to the disk, if the writer has room for them."""
    if h in self.store: return
    if not self.store.has_room(): return self.store.count_dropped()     # the copy is skipped too: counted as dropped
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

  @contextmanager
  def planned(self):
    """Around a reservation's allocation (under the node's lock): blocks the index holds are taken unfilled; yields their
    (block, hash, entry) list, filled in as the allocation goes."""
    self.plan = plan = []
    try: yield plan
    finally: self.plan = None

  def start(self, plan: list) -> RestoreJob:
    """Queue a reservation's planned blocks for the reader thread."""
    job = RestoreJob(self.cache, self.store, plan)
    self.jobs.put(job)
    return job

  def committed(self, seq_id: int, job: RestoreJob) -> None:
    """The sequence's restore checked out and it joins the batch (under the node's lock): its blocks take their hashes."""
    self.bm.adopt(seq_id, [(b, h) for b, h, _ in job.pairs])
    self.restored_tokens += job.tokens

  def _read_jobs(self):
    while (job := self.jobs.get()) is not None: job.run()

  def restore(self, h: int):
    """For BlockManager.allocate: a function writing the staged record of hash h into a block, or None. While planned: a
    function taking the block for the reader thread, for any hash the index holds."""
    if (plan := self.plan) is not None:
      with self.store.lock: e = self.store.index.get(h)
      if e is None or e.length != self.record_bytes: return None
      return lambda block: plan.append((block, h, e)) or HASH_LATER
    with self.lock: data = self.staged.pop(h, None)
    if data is None: return None
    def fill(block: int):
      nb, view = self.cache.block_nbytes, memoryview(data)
      for layer in range(self.cache.n_layers): self.cache.write_block_bytes(layer, block, view[layer * nb:(layer + 1) * nb], sync=False)
      self.restored_tokens += self.bm.block_size
    return fill

  def status(self) -> dict:
    """The tier's figures for heartbeats and decode.info (RAM hits: prefix_hit_tokens less disk_hit_tokens)."""
    return {**self.store.status(), "disk_hit_tokens": self.restored_tokens, "disk_tier_errors": self.bm.tier_errors}

  def describe(self) -> str:
    return (f"KV disk tier {self.store.dir} ({self.store.disk_bytes() / 2**30:.2f} of {self.store.size_bytes / 2**30:.2f} GiB, "
            f"{self.store.mode}): {self.found_blocks} blocks found")

  def close(self) -> None:
    self.jobs.put(None)
    self.reader.join(timeout=30)
    self.store.close()

  def _hashes(self, prompt_ids, salt: str) -> list[int]:
    bs = self.bm.block_size
    return block_hashes(prompt_ids, bs, self.bm.model_id, (len(prompt_ids) - 1) // bs, salt)
