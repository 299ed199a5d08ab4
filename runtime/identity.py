"""Who a peer is: each node holds an Ed25519 key pair, and a handshake proves a node's name by a signature over the
other side's fresh nonce. The shared token (wire.proof) says a peer belongs to the cluster; the signature says which node
it is, and a name that the settings bind to a public key (peer_keys) can be claimed only with that key's private half.

A name no setting binds is held by the first key that proves it until the last connection under it closes (Names; TCP
keepalive frees the name of a peer that vanished without closing within ~25 s):
two live connections never hold one name under different keys, but such a name is only as strong as "whoever held it
first", so a node that grants anything to a peer (a decode node's trusted writers) should bind that peer's key.

What this proves is who opened a connection. The bytes after the handshake are neither encrypted nor authenticated, so
it holds against other peers, not against someone on the network path who can inject into a live TCP stream (run the
cluster on a network you trust, or under WireGuard/IPsec).

Key files are PKCS#8 PEM (`openssl genpkey -algorithm ed25519 -out node.key`, or `tinyhet keygen`), readable by their
owner only; public keys are written as 64 hex digits (the raw 32 bytes).
"""
from __future__ import annotations
import os, re, stat, threading
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from tinyhet.runtime.settings import PUBLIC_KEY

SIGNATURE = re.compile(r"[0-9a-f]{128}")

class Identity:
  """This node's key pair. `public` is the hex a peer's peer_keys names it by."""
  def __init__(self, key: Ed25519PrivateKey, source: str = "generated for this process"):
    self.key, self.source = key, source
    self.public = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw).hex()

  @staticmethod
  def generate() -> Identity: return Identity(Ed25519PrivateKey.generate())

  @staticmethod
  def load(path: str) -> Identity:
    """The key pair in a PEM file; refuses one that others may read (as ssh does), with the fix."""
    try:
      st = os.stat(path)
      data = open(path, "rb").read()
    except OSError as e: raise ValueError(f"key_file {path!r}: {e.strerror}: create one with `tinyhet keygen --out {path}`") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO): raise ValueError(f"key_file {path!r} is readable by others: chmod 600 {path}")
    try: key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as e: raise ValueError(f"key_file {path!r} is not an unencrypted PEM private key: {e}") from None
    if not isinstance(key, Ed25519PrivateKey): raise ValueError(f"key_file {path!r} holds a {type(key).__name__}, not an Ed25519 key")
    return Identity(key, path)

  def save(self, path: str):
    """Write the private key (PKCS#8 PEM) to a new file that only its owner can read."""
    pem = self.key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f: f.write(pem)

  def sign(self, message: str) -> str: return self.key.sign(message.encode()).hex()

def verify(public: str, message: str, signature) -> bool:
  """Whether signature (hex) is public's (hex) over message; False for anything malformed."""
  if not isinstance(public, str) or not PUBLIC_KEY.fullmatch(public) or not isinstance(signature, str) or not SIGNATURE.fullmatch(signature):
    return False
  try: Ed25519PublicKey.from_public_bytes(bytes.fromhex(public)).verify(bytes.fromhex(signature), message.encode())
  except InvalidSignature: return False
  return True

def transcript(role: str, name: str, key: str, other: str, their_nonce: str, own_nonce: str, transport: str = "") -> str:
  """What a side signs: its role, name and key, the other side's name and fresh nonce (so a signature answers one
  challenge of one node, and cannot be replayed to another), its own nonce and the transport asked for."""
  return f"tinyhet-identity|1|{role}|{name}|{key}|{other}|{their_nonce}|{own_nonce}|{transport}"

class Names:
  """Which key holds each peer name on this endpoint's live connections. bound: name -> the only key that may hold it."""
  def __init__(self, bound: dict[str, str], own: tuple[str, str]):
    self.bound, self.lock = dict(bound), threading.Lock()
    self.bound.setdefault(*own)              # nobody else takes this node's own name
    self.live: dict[str, list] = {}          # name -> [key, live connections]

  def claim(self, name: str, key: str) -> str | None:
    """Hold name for one more connection under key; None, or why not (the peer is refused with it)."""
    if (want := self.bound.get(name)) is not None and want != key: return f"the key presented for {name!r} is not the one bound to that name"
    with self.lock:
      held = self.live.get(name)
      if held is not None and held[0] != key: return f"{name!r} is held by another live connection under a different key"
      if held is None: self.live[name] = [key, 1]
      else: held[1] += 1
    return None

  def release(self, name: str):
    with self.lock:
      held = self.live.get(name)
      if held is None: return
      held[1] -= 1
      if held[1] <= 0: del self.live[name]
