"""Tenant isolation in the prefix cache: the salt a request's block hashes carry (tinyhet.kv.block_manager), so that a
tenant never shares cached KV with another, and cannot learn from a cache hit (cached_tokens, or a short TTFT) that another
sent a prompt. The salt is a digest of the API key's identity and the request's `cache_salt` (vLLM's field): by default two
API keys never share a block, one key does; with `cache_salt`, only requests of that key and that salt share.
`tinyhet serve --shared-prefix-cache` leaves the key out (every tenant shares, `cache_salt` still separates). A server
without API keys is one tenant. Nodes take the salt as it comes (a token holder is inside the cluster); the router sends it
with decode.reserve, decode.submit and decode.lookup, and hashes with it for KV-aware routing.
"""
from __future__ import annotations
import hashlib, hmac

def key_identity(key: bytes) -> str:
  """A tenant's name from its API key: a digest, so the key itself never leaves the router."""
  return hashlib.blake2b(key, digest_size=16, person=b"tinyhet-tenant").hexdigest()

def matching_key(header: bytes | None, keys: list[bytes]) -> bytes | None:
  """The key an `Authorization: Bearer KEY` header carries, if it is one of keys: every key compared in constant time (no
  early exit on the first match either)."""
  if header is None or not header[:7].lower() == b"bearer ": return None
  given, found = header[7:].strip(), None
  for k in keys:
    if hmac.compare_digest(given, k): found = k
  return found

def tenant_salt(identity: str, cache_salt: str | None, shared: bool = False) -> str:
  """The salt of a request from the tenant `identity` ("" without API keys) with this cache_salt (None: not given); ""
  (no salt: the one shared cache) where neither applies."""
  parts = ([] if shared or not identity else [f"key={identity}"]) + ([] if cache_salt is None else [f"salt={cache_salt}"])
  if not parts: return ""
  return hashlib.blake2b("\n".join(parts).encode(), digest_size=16, person=b"tinyhet-salt").hexdigest()
