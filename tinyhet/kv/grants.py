"""A reservation's grant, signed by the decode node that made it, so that the writer it names can tell a real one from a
reply someone made up.

decode.reserve names a writer (the reserving peer, or the prefill node a router names) and gives it write descriptors
for the suffix's blocks and read descriptors for a cached prefix; tcp lets only that writer use them (its proven name).
But the writer is told what to write by whoever calls prefill.run, with a reservation dict that caller hands over: a
token holder could pass a reservation of another request (to write its own prompt's KV into that request's blocks,
or to pull that request's cached prefix), or its own reservation with another prompt (so the KV in the blocks is not
the KV of the tokens the decode node reserved them for). The grant closes that: the decode node signs what it granted
(itself, the writer, the sequence, every descriptor's region id, the blocks, the cached tokens, a digest of the
prompt ids, and whether the prefix is still being read back from disk: pulled before then, it would be other bytes),
and the writer checks the signature with the key the decode node proved at its handshake, against the
prompt it was asked to prefill and its own name, before a byte is written.
"""
from __future__ import annotations
import hashlib
from tinyhet.runtime.descriptor import RegionDescriptor
from tinyhet.runtime.identity import Identity, verify

def prompt_digest(prompt_ids: list[int]) -> str:
  return hashlib.sha256(",".join(map(str, prompt_ids)).encode()).hexdigest()

def grant_text(decode: str, writer: str, reservation: dict, prompt_ids: list[int]) -> str:
  """What a grant signs. Raises ValueError for a reservation whose fields are not decode.reserve's."""
  try:
    regions = [RegionDescriptor.from_hex(d).region_id for d in (*reservation["pools"], *reservation.get("read_pools", ()))]
    blocks = "|".join(",".join(str(int(b)) for b in reservation[k]) for k in ("prefix_blocks", "blocks") if k in reservation)
  except (KeyError, TypeError, ValueError) as e: raise ValueError(f"the reservation is not decode.reserve's reply: {e}") from None
  return (f"tinyhet-grant|1|{decode}|{writer}|{reservation['seq_id']}|{','.join(map(str, regions))}|{blocks}|"
          f"{reservation.get('cached_tokens', 0)}|{prompt_digest(prompt_ids)}" + ("|restoring" if reservation.get("restoring") else ""))

def sign_grant(identity: Identity, decode: str, writer: str, reservation: dict, prompt_ids: list[int]) -> str:
  return identity.sign(grant_text(decode, writer, reservation, prompt_ids))

def check_grant(decode: str, decode_key: str, writer: str, reservation: dict, prompt_ids: list[int]):
  """Raise ValueError unless decode (whose proven key is decode_key) granted this reservation to writer for these prompt ids."""
  if not verify(decode_key, grant_text(decode, writer, reservation, prompt_ids), reservation.get("grant")):
    raise ValueError(f"the reservation was not granted by {decode} to {writer} for this prompt: refused (a grant is signed by the "
                     "decode node that reserved, for one writer, one prompt and its own descriptors)")
