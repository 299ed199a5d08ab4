"""What the router's HTTP server checks before a route reads a request (tinyhet.service.http_api mounts it):

  body size      a body over --max-body bytes (default 8 MiB) is a 413, from its Content-Length or as it arrives, read no further
  JSON depth     a body nested deeper than MAX_JSON_DEPTH arrays/objects is a 400 before it is parsed (Python's parser recurses)
  credentials    keys are compared as bytes in constant time, so no header (non-ASCII included) is anything but a match or a
                 401; the admin key (TINYHET_ADMIN_KEY, --admin-key) is its own credential: neither the cluster's token nor an
                 API key opens /admin/* or the node list of /ready
Every refusal is in OpenAI's error shape: {"error": {"message", "type", "param", "code"}}.
"""
from __future__ import annotations
import hmac, json, re
from tinyhet.service.api_schema import ApiError

MAX_BODY_BYTES = 8 << 20      # a 128k-token prompt as token ids is about 1 MB
MAX_JSON_DEPTH = 64           # OpenAI bodies nest a few levels (messages, content parts); JSON schemas a few more

def error_response(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None,
                   headers: dict | None = None):
  from starlette.responses import JSONResponse
  message = message.encode("utf-8", "backslashreplace").decode()       # a client's lone surrogates must not break the reply
  return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=status, headers=headers)

def key_matches(header: bytes | None, keys: list[bytes]) -> bool:
  """Authorization: Bearer KEY against every key, each compared in constant time (no early exit on the first match either)."""
  if header is None or not header[:7].lower() == b"bearer ": return False
  given, ok = header[7:].strip(), False
  for k in keys: ok |= hmac.compare_digest(given, k)
  return ok

def authorization(scope) -> bytes | None:
  """The raw Authorization header of an ASGI request, as the client sent its bytes."""
  return next((v for k, v in scope.get("headers", ()) if k == b"authorization"), None)

def is_admin(scope, admin_key: bytes | None) -> bool:
  return admin_key is not None and key_matches(authorization(scope), [admin_key])

def check_admin_key(admin_key: str | None, token: str | None, api_keys: list[str]) -> bytes | None:
  """The admin key as bytes (None: no admin key, /admin/* is off); ValueError when it is also another credential."""
  if not admin_key: return None
  if token and hmac.compare_digest(admin_key.encode(), token.encode()):
    raise ValueError("TINYHET_ADMIN_KEY must differ from TINYHET_TOKEN: every node holds the cluster's token, the admin key is the operator's")
  if any(hmac.compare_digest(admin_key.encode(), k.encode()) for k in api_keys):
    raise ValueError("the admin key must differ from every API key: a client's key must not change the cluster")
  return admin_key.encode()

_STRINGS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = re.compile(rb"[^\[\]{}]+")

def json_depth(raw: bytes) -> int:
  """How deep raw's arrays and objects nest (brackets inside strings do not count), without parsing it."""
  import numpy as np
  brackets = np.frombuffer(_NOT_BRACKETS.sub(b"", _STRINGS.sub(b"", raw)), np.uint8)
  if not len(brackets): return 0
  return int(np.cumsum(np.where((brackets == ord("[")) | (brackets == ord("{")), 1, -1)).max())

def parse_body(raw: bytes, max_depth: int = MAX_JSON_DEPTH):
  """A request body as JSON: ApiError (400) when it is not JSON or nests deeper than max_depth."""
  if json_depth(raw) > max_depth:
    raise ApiError(f"the body nests arrays/objects deeper than {max_depth} levels: flatten it", code="json_too_deep")
  try: return json.loads(raw)
  except (json.JSONDecodeError, UnicodeDecodeError) as e: raise ApiError(f"the body is not JSON: {e}") from None
  except RecursionError: raise ApiError(f"the body nests deeper than {max_depth} levels: flatten it", code="json_too_deep") from None

class BodyLimit:
  """ASGI middleware: reads a request's body (at most max_bytes) before the route does, and answers 413 past it."""
  def __init__(self, app, max_bytes: int = MAX_BODY_BYTES):
    self.app, self.max_bytes = app, max_bytes

  async def _too_large(self, scope, receive, send):
    reply = error_response(413, f"the request body is over {self.max_bytes} bytes: send a shorter prompt (tinyhet serve --max-body raises the limit)",
                           code="request_too_large")
    return await reply(scope, receive, send)

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http": return await self.app(scope, receive, send)
    length = next((v for k, v in scope.get("headers", ()) if k == b"content-length"), None)
    if length is not None and length.strip().isdigit() and int(length) > self.max_bytes: return await self._too_large(scope, receive, send)
    chunks, size = [], 0
    while True:
      msg = await receive()
      if msg["type"] == "http.disconnect": return          # the client left before its body was complete: nobody to answer
      size += len(body := msg.get("body", b""))
      if size > self.max_bytes: return await self._too_large(scope, receive, send)
      chunks.append(body)
      if not msg.get("more_body"): break
    whole, given = b"".join(chunks), False
    async def replay():                 # the body once, then the connection's own messages (a disconnect)
      nonlocal given
      if given: return await receive()
      given = True
      return {"type": "http.request", "body": whole, "more_body": False}
    return await self.app(scope, replay, send)
