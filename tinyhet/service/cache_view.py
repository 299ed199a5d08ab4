"""The router's view of a decode node's cached KV, from its heartbeats: the block hashes its RAM prefix cache holds
("cached_*", tinyhet.service.node_roles.CacheSummary over the block manager) and those its disk tier holds ("disk_*", the
same summary over the tier's index). A prompt's chain of block hashes is walked through RAM first, then on through the
disk: a disk hit saves the prefill as a RAM hit does but costs a read and a fresh block, so the KV-aware score counts it at
DISK_WEIGHT of a RAM hit (and admission still counts its blocks as needed: a restored block takes a free one).
"""
from __future__ import annotations
from tinyhet.kv.block_manager import block_hashes

DISK_WEIGHT = 0.5          # a disk-hit token against a RAM-hit token in the router's overlap score
SUMMARIES = {"cached": ("cached_hashes", "cached_added", "cached_removed"), "disk": ("disk_hashes", "disk_added", "disk_removed")}
SUMMARY_KEYS = SUMMARIES["cached"] + SUMMARIES["disk"]

def cache_view(view: set, beat: dict, kind: str = "cached") -> set:
  """A node's block hashes (kind "cached": its RAM cache, "disk": its disk tier) after one of its beats: the whole set, or the
  one before with what was added and removed (a beat without a summary leaves it; a malformed one empties it: no summary is
  better than a wrong one)."""
  whole, plus, minus = SUMMARIES[kind]
  def ints(key):
    v = beat.get(key, [])
    return {h for h in v if isinstance(h, int) and not isinstance(h, bool)} if isinstance(v, list) else None
  if whole in beat: return ints(whole) or set()
  added, removed = ints(plus), ints(minus)
  if added is None or removed is None: return set()
  return (view - removed) | added if added or removed else view

def chain_tokens(status: dict, ram: set, disk: set, ids: list[int], salt: str = "") -> tuple[int, int]:
  """(RAM-hit tokens, disk-hit tokens after them) of prompt ids on a node whose heartbeat is status, its views ram and disk."""
  if not ids or not (ram or disk): return 0, 0
  bs, n_ram, n_disk = status.get("block_size", 16), 0, 0
  for h in block_hashes(ids, bs, status.get("cache_key", status.get("model", "")), (len(ids) - 1) // bs, salt):
    if not n_disk and h in ram: n_ram += bs
    elif h in disk or h in ram: n_disk += bs     # past the RAM hit, a block still in RAM is shared at restore as a hit is
    else: break
  return n_ram, n_disk
