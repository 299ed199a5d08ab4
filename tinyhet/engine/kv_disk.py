"""The disk tier hooked into a decode node (`tinyhet node --kv-disk DIR --kv-disk-size 200G`): attach_disk_tier puts a
DiskTier (tinyhet.kv.disk_tier) under the node's pool and wraps four of its control requests, so decode_node.py itself
knows nothing of it:

  decode.reserve, decode.submit   the prompt's blocks past its RAM hit are read from disk first (DiskTier.stage), on the
                                  request's thread without the node's lock; admission then restores them into fresh blocks
                                  (BlockManager.allocate): they count as cached, a prefill node pulls them as any hit
  decode.lookup                   cached_tokens counts the RAM hit and the disk blocks that follow it
  decode.info                     the tier's figures (disk_hit_tokens, disk_written_bytes, disk_read_bytes, ...)

The node's heartbeats carry the same figures (tinyhet.service.node_roles.decode_status reads decode.disk).
"""
from __future__ import annotations
from tinyhet.engine.checks import check_prompt
from tinyhet.kv.disk_tier import DiskTier

def _stageable(cfg, prompt_ids, salt) -> bool:
  """Whether a request's prompt is good enough to look up (a bad one is left to the request's own checks and error)."""
  try: check_prompt(cfg, prompt_ids)
  except ValueError: return False
  return isinstance(salt, str) and len(salt.encode()) <= 256

def attach_disk_tier(decode, root, size_bytes: int, log=None) -> DiskTier:
  """A disk tier at root (at most size_bytes on disk) under decode's pool, its requests wrapped; decode.disk is the tier."""
  tier = DiskTier(decode.cache, root, size_bytes, log=log)
  decode.disk = tier
  handlers, cfg, bm = decode.node.endpoint.handlers, decode.model.cfg, decode.cache.block_manager

  def staging(name: str, always: bool):
    inner = handlers[name]
    def serve(conn, **kw):                 # control requests come as keyword arguments (tinyhet.runtime.control)
      ids, salt = kw.get("prompt_ids"), kw.get("cache_salt", "")
      if (always or kw.get("use_cache") is True) and bm.prefix_cache and _stageable(cfg, ids, salt): tier.stage(ids, salt)
      return inner(conn, **kw)
    handlers[name] = serve

  staging("decode.reserve", always=False)
  if "decode.submit" in handlers: staging("decode.submit", always=True)
  lookup, info = handlers["decode.lookup"], handlers["decode.info"]

  def serve_lookup(conn, prompt_ids=None, cache_salt: str = ""):
    reply = lookup(conn, prompt_ids=prompt_ids, cache_salt=cache_salt)     # checks the prompt and the salt
    start = reply["cached_tokens"] // bm.block_size
    return {"cached_tokens": reply["cached_tokens"] + tier.chain(prompt_ids, cache_salt, start) * bm.block_size}

  handlers["decode.lookup"] = serve_lookup
  handlers["decode.info"] = lambda conn, *a, **kw: {**info(conn, *a, **kw), **tier.status()}
  return tier
