"""`tinyhet keygen --out FILE`: a new Ed25519 key pair for a node. The private key goes to FILE (PEM, readable by its
owner only: the node's key_file / TINYHET_KEY_FILE); the public key is printed, for the other nodes' peer_keys or the
cluster file's `public_key` under the node's [nodes.NAME]."""
from __future__ import annotations
import sys
from tinyhet.cli.common import ArgumentParser

def main(argv=None) -> int:
  ap = ArgumentParser(prog="tinyhet keygen", description=__doc__.splitlines()[0])
  ap.add_argument("--out", required=True, help="where to write the private key (a new file; it is never overwritten)")
  args = ap.parse_args(argv)
  from tinyhet.runtime.identity import Identity
  me = Identity.generate()
  try: me.save(args.out)
  except FileExistsError:
    print(f"tinyhet keygen: {args.out} exists: choose another --out (a key is never overwritten)", file=sys.stderr)
    return 2
  except OSError as e:
    print(f"tinyhet keygen: cannot write {args.out}: {e.strerror}", file=sys.stderr)
    return 2
  print(me.public)
  return 0
