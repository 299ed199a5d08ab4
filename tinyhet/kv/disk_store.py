"""Blocks' bytes on a local disk, keyed by block hash: append-only segment files, an append-only index log beside them, one
writer thread. Bytes only: it never looks inside a block (any KV dtype, any layout); tinyhet.kv.disk_tier puts it under a pool.

  store = DiskStore(root, size_bytes, key)   # replays root/<digest of key>/index.log: the blocks a run before left
  store.put(h, data)                         # queued for the writer; False (dropped) when the queue is full or the disk is
  store.get(h)                               # the bytes put, or None (absent, or its checksum failed: then dropped)
  store.flush(); store.close()

On disk (one folder per key, the model fingerprint and KV dtype: another model's or dtype's folder is never opened):
  seg-00000001.kv   records, each at a 4096-byte boundary: a 64-byte header (magic "TKV1", key digest, hash, length,
                    checksum = BLAKE2b-128 over key digest, hash and the bytes) then the bytes, zero-padded to 4096
  index.log         "TKVIDX1\\n" + the key digest, then 48-byte records (hash, segment, offset, length, checksum, crc32 of
                    those): appended after the batch's segment bytes are written and fdatasync-ed, so an entry names bytes
                    on the disk; replayed at start up to the first torn record (a crash mid-append), the rest cut off
A record whose header or checksum does not match (a torn or foreign write) is dropped when it is read, never returned.

The writer takes what is queued (up to BATCH_BYTES) and writes it with one pwrite into the current segment, then one
fdatasync, then the batch's index records: large sequential writes, off every caller's path. It opens segments with
O_DIRECT where the filesystem allows it (the page cache is bypassed; buffers and offsets are 4096-aligned), else buffered
(tmpfs, overlayfs): `mode` says which. Past size_bytes the oldest segments are deleted (their blocks with them). A full disk
(ENOSPC, EDQUOT, EFBIG: a file-size limit) stops the writing, logged once; get goes on.
"""
from __future__ import annotations
import errno, hashlib, mmap, os, pathlib, queue, struct, sys, threading, zlib
from dataclasses import dataclass

ALIGN = 4096
HEADER = struct.Struct("<4s16sQQ16s")           # magic, key digest, hash, length, checksum: 52 bytes of a 64-byte header
HEADER_BYTES = 64
INDEX = struct.Struct("<QIQQ16sI")              # hash, segment, offset, length, checksum, crc32 of the fields before
INDEX_MAGIC = b"TKVIDX1\n"
BATCH_BYTES = 8 << 20
SEGMENT_BYTES = 64 << 20
FULL_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)

def key_digest(key: str) -> bytes: return hashlib.blake2b(key.encode(), digest_size=16, person=b"tinyhet-kvdisk").digest()

def checksum_start(kd: bytes, h: int):
  """A record's checksum before its bytes: update it with them (in pieces, in order: tinyhet.kv.disk_restore), then digest."""
  return hashlib.blake2b(kd + h.to_bytes(8, "little"), digest_size=16)

def checksum(kd: bytes, h: int, data) -> bytes:
  c = checksum_start(kd, h)
  c.update(data)
  return c.digest()

def _aligned(n: int) -> int: return -(-n // ALIGN) * ALIGN

@dataclass(frozen=True)
class Entry:
  segment: int
  offset: int
  length: int
  checksum: bytes

class DiskStore:
  def __init__(self, root, size_bytes: int, key: str, queue_blocks: int = 64, log=None):
    if size_bytes < ALIGN: raise ValueError(f"the disk tier needs at least {ALIGN} bytes, got {size_bytes}")
    self.kd = key_digest(key)
    self.dir = pathlib.Path(root) / self.kd.hex()
    self.dir.mkdir(parents=True, exist_ok=True)
    self.size_bytes, self.key = size_bytes, key
    self.segment_bytes = max(ALIGN, min(SEGMENT_BYTES, _aligned(size_bytes // 4)))
    self.log = log or (lambda msg: print(f"tinyhet node: {msg}", file=sys.stderr, flush=True))
    self.lock = threading.Lock()                 # the index and the figures: the writer adds, readers drop
    self.index: dict[int, Entry] = {}
    self.segments: dict[int, int] = {}           # segment -> bytes on disk, oldest first
    self.pending: set[int] = set()               # hashes queued, not yet written
    self.written_bytes = self.read_bytes = self.dropped_queue_full = self.dropped_bad = self.torn_index = 0
    self.stopped: str | None = None              # why writing stopped (a full disk, an I/O error), or None
    self.direct = hasattr(os, "O_DIRECT")
    self.fd, self.index_fd, self.seg, self.seg_off = -1, -1, 0, 0   # the segment being written: none until the first batch
    self._replay()
    self.found_blocks, self.seg = len(self.index), max(self.segments, default=0)
    self.queue: queue.Queue = queue.Queue(maxsize=max(1, queue_blocks))
    self.thread = threading.Thread(target=self._run, name="tinyhet-kv-disk", daemon=True)
    self.thread.start()

  @property
  def mode(self) -> str: return "O_DIRECT" if self.direct else "buffered + fdatasync"
  def disk_bytes(self) -> int: return sum(self.segments.values())
  def __contains__(self, h: int) -> bool: return h in self.index or h in self.pending
  def hashes(self) -> list[int]:
    with self.lock: return list(self.index)

  # ***** the callers' side *****

  def put(self, h: int, data: bytes) -> bool:
    """Queue data to be written under hash h; never blocks. False: dropped (queue full, writing stopped, or known already)."""
    with self.lock:
      if self.stopped is not None or h in self.index or h in self.pending: return False
      try: self.queue.put_nowait((h, data))
      except queue.Full:
        self.dropped_queue_full += 1
        return False
      self.pending.add(h)
    return True

  def count_dropped(self) -> None:
    """A spill the caller skipped because has_room() said no (disk_dropped_spills, as a put a full queue refused)."""
    with self.lock: self.dropped_queue_full += 1

  def has_room(self) -> bool:
    """Whether a put now would be queued (check before copying a block's bytes out)."""
    return self.stopped is None and not self.queue.full()

  def get(self, h: int) -> bytes | None:
    """The bytes put under h, checked; None if absent or bad (a bad record is dropped from the index)."""
    with self.lock: e = self.index.get(h)
    if e is None: return None
    try:
      fd = os.open(self._path(e.segment), os.O_RDONLY)
      try: raw = os.pread(fd, HEADER_BYTES + e.length, e.offset)
      finally: os.close(fd)
    except OSError: raw = b""                    # its segment was deleted meanwhile (the size bound), or unreadable
    data = memoryview(raw)[HEADER_BYTES:]
    if not (len(raw) == HEADER_BYTES + e.length and self.header_ok(raw, h, e) and checksum(self.kd, h, data) == e.checksum):
      self.drop_bad(h, e)
      return None
    self.count_read(e.length)
    return bytes(data)

  def header_ok(self, raw, h: int, e) -> bool:
    """Whether raw begins with the header h's index entry e was written with (a torn or foreign record's does not)."""
    return len(raw) >= HEADER_BYTES and HEADER.unpack_from(raw) == (b"TKV1", self.kd, h, e.length, e.checksum)

  def drop_bad(self, h: int, e) -> None:
    """A record that failed its check out of the index (a later chain ends before it), counted in disk_bad_blocks."""
    with self.lock:
      if self.index.get(h) == e: del self.index[h]
      self.dropped_bad += 1

  def count_read(self, nbytes: int) -> None:
    """Bytes read back elsewhere (a restore's layer by layer reads, tinyhet.kv.disk_restore), for the figures."""
    with self.lock: self.read_bytes += nbytes

  def flush(self) -> None:
    """Wait until everything queued so far is written (or dropped)."""
    self.queue.join()

  def close(self) -> None:
    if self.thread.is_alive():
      self.queue.put(None)
      self.thread.join(timeout=30)
    if self.fd >= 0: os.close(self.fd)
    self.fd = -1
    if self.index_fd >= 0: os.close(self.index_fd)
    self.index_fd = -1

  def status(self) -> dict:
    with self.lock:
      return {"disk_blocks": len(self.index), "disk_bytes": self.disk_bytes(), "disk_written_bytes": self.written_bytes,
              "disk_read_bytes": self.read_bytes, "disk_dropped_spills": self.dropped_queue_full, "disk_bad_blocks": self.dropped_bad,
              "disk_writing": self.stopped is None}

  # ***** start: the index log *****

  def _path(self, segment: int) -> pathlib.Path: return self.dir / f"seg-{segment:08d}.kv"

  def _replay(self):
    for p in self.dir.glob("seg-*.kv"):
      try: self.segments[int(p.stem[4:])] = p.stat().st_size
      except (ValueError, OSError): continue
    self.segments = dict(sorted(self.segments.items()))
    path, head = self.dir / "index.log", INDEX_MAGIC + self.kd
    raw = path.read_bytes() if path.exists() else b""
    if raw[:len(head)] != head:                  # none yet, or another key's (a copied file): set aside, never read
      if raw: path.replace(self.dir / "index.log.ignored")
      raw = head
    good, records = len(head), 0
    while good + INDEX.size <= len(raw):
      *fields, crc = INDEX.unpack_from(raw, good)
      if zlib.crc32(raw[good:good + INDEX.size - 4]) != crc: break
      h, seg, off, length, csum = fields
      if seg in self.segments and off + HEADER_BYTES + length <= self.segments[seg]: self.index[h] = Entry(seg, off, length, csum)
      good, records = good + INDEX.size, records + 1
    self.torn_index = len(raw) - good
    if records > 2 * len(self.index) + 1024:    # mostly deleted segments' entries: write the live ones only
      raw, good = head + b"".join(self._index_record(h, e) for h, e in self.index.items()), None
      tmp = path.with_suffix(".tmp")
      tmp.write_bytes(raw)
      tmp.replace(path)
    elif good != len(raw) or not path.exists(): path.write_bytes(raw[:good])   # the torn tail cut off
    self.index_fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    self._bound()

  def _index_record(self, h: int, e: Entry) -> bytes:
    body = INDEX.pack(h, e.segment, e.offset, e.length, e.checksum, 0)[:-4]
    return body + struct.pack("<I", zlib.crc32(body))

  # ***** the writer *****

  def _run(self):
    while (item := self.queue.get()) is not None:
      batch, nbytes = [item], _aligned(HEADER_BYTES + len(item[1]))
      while nbytes < BATCH_BYTES:
        try: nxt = self.queue.get_nowait()
        except queue.Empty: break
        if nxt is None:
          self.queue.put(None)                   # close() after this batch
          self.queue.task_done()
          break
        batch.append(nxt)
        nbytes += _aligned(HEADER_BYTES + len(nxt[1]))
      try:
        if self.stopped is None: self._write(batch)
      except OSError as e: self._stop(e)
      finally:
        with self.lock: self.pending.difference_update(h for h, _ in batch)
        for _ in batch: self.queue.task_done()
    self.queue.task_done()

  def _write(self, batch):
    run: list = []                               # records for the current segment
    for h, data in batch:
      size = _aligned(HEADER_BYTES + len(data))
      if self.fd < 0 or self.seg_off + size > self.segment_bytes and self.seg_off > 0:
        self._write_run(run)
        run = []
        self._roll()
      run.append((h, data, size))
    self._write_run(run)

  def _roll(self):
    if self.fd >= 0: os.close(self.fd)
    self.seg, self.seg_off = self.seg + 1, 0
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    try: self.fd = os.open(self._path(self.seg), flags | (os.O_DIRECT if self.direct else 0), 0o600)
    except OSError as e:
      if not self.direct or e.errno != errno.EINVAL: raise
      self.direct = False                        # the filesystem refuses O_DIRECT (tmpfs): buffered from now on
      self.fd = os.open(self._path(self.seg), flags, 0o600)
    with self.lock: self.segments[self.seg] = 0

  def _write_run(self, run):
    if not run: return
    total = sum(size for _, _, size in run)
    buf = mmap.mmap(-1, total)                   # page-aligned, zeroed: O_DIRECT's alignment, and the records' padding
    entries, pos = [], 0
    for h, data, size in run:
      c = checksum(self.kd, h, data)
      buf[pos:pos + HEADER.size] = HEADER.pack(b"TKV1", self.kd, h, len(data), c)
      buf[pos + HEADER_BYTES:pos + HEADER_BYTES + len(data)] = data
      entries.append((h, Entry(self.seg, self.seg_off + pos, len(data), c)))
      pos += size
    try:
      try: n = os.pwrite(self.fd, buf, self.seg_off)
      except OSError as e:
        if not self.direct or e.errno != errno.EINVAL: raise
        self.direct = False                      # accepted at open, refused at write (some FUSE filesystems): buffered
        os.close(self.fd)
        self.fd = os.open(self._path(self.seg), os.O_WRONLY)
        n = os.pwrite(self.fd, buf, self.seg_off)
      if n != total: raise OSError(errno.ENOSPC, f"short write ({n} of {total} bytes)")
      os.fdatasync(self.fd)
    finally: buf.close()
    self.seg_off += total
    os.write(self.index_fd, b"".join(self._index_record(h, e) for h, e in entries))
    os.fdatasync(self.index_fd)
    with self.lock:
      self.index.update(entries)
      self.segments[self.seg] = self.seg_off
      self.written_bytes += sum(e.length for _, e in entries)
      self._bound()

  def _bound(self):
    """Delete the oldest segments while over size_bytes (never the one being written)."""
    while self.disk_bytes() > self.size_bytes and len(self.segments) > (1 if self.fd >= 0 else 0):
      seg = next(iter(self.segments))
      if seg == self.seg and self.fd >= 0: break
      del self.segments[seg]
      for h in [h for h, e in self.index.items() if e.segment == seg]: del self.index[h]
      try: self._path(seg).unlink()
      except OSError: pass

  def _stop(self, e: OSError):
    why = "full" if e.errno in FULL_ERRORS else "failing"
    with self.lock:
      if self.stopped is not None: return
      self.stopped = f"{why}: {e.strerror or e}"
    self.log(f"the KV disk tier {self.dir} is {why} ({e.strerror or e}): blocks evicted from RAM are no longer written there; "
             "serving goes on (blocks already there are still read)")
    self.seg_off = self.segment_bytes            # the partial write is never appended to
