"""Logprobs in OpenAI's shapes, from what the decode node sends per token ({"logprob", "top_logprobs": [(id, logprob)]}):
  chat         choices[].logprobs = {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}
  completions  choices[].logprobs = {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}
A token's text is its bytes decoded alone (a piece of a character shows as U+FFFD); `bytes` are the token's own bytes."""
from __future__ import annotations
import codecs
from functools import lru_cache

@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
  """GPT-2's byte-level BPE alphabet (the printable stand-in of each byte) -> the byte."""
  bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
  cs, n = bs[:], 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + n)
      n += 1
  return {chr(c): b for b, c in zip(bs, cs)}

def token_bytes(tok, i: int) -> bytes:
  """The bytes token i stands for: a byte tokenizer's byte, a byte-level BPE piece's bytes, else its text in UTF-8."""
  if not hasattr(tok, "token_text"): return bytes([i]) if 0 <= i < 256 else b""
  text = tok.token_text(i)
  if text is None: return b""
  dec = _byte_decoder()
  if all(c in dec for c in text): return bytes(dec[c] for c in text)
  return text.replace("▁", " ").encode()        # a SentencePiece piece

def token_str(tok, i: int) -> str: return token_bytes(tok, i).decode(errors="replace")

class LogprobFormatter:
  """Builds one choice's logprobs as tokens arrive; `chat` picks the shape. text_offset counts characters of the answer text
  (for echo, of the prompt text and then the answer): the characters the tokens' bytes before it decode to, through one
  incremental UTF-8 decoder, so a character split across tokens counts once, at the token that completes it."""
  def __init__(self, tok, chat: bool, offset: int = 0):
    self.tok, self.chat, self.offset = tok, chat, offset
    self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

  def entries(self, items: list[tuple[int, dict | None]]) -> dict:
    """The logprobs object for these (token, logprobs) pairs: a stream chunk's, or with every token, the whole answer's."""
    if self.chat:
      content = []
      for t, lp in items:
        if lp is None: continue
        b = token_bytes(self.tok, t)
        content.append({"token": b.decode(errors="replace"), "logprob": lp["logprob"], "bytes": list(b),
                        "top_logprobs": [{"token": token_str(self.tok, a), "logprob": v, "bytes": list(token_bytes(self.tok, a))}
                                         for a, v in lp["top_logprobs"]]})
      return {"content": content}
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t, lp in items:
      b = token_bytes(self.tok, t)
      out["tokens"].append(b.decode(errors="replace"))
      out["token_logprobs"].append(None if lp is None else lp["logprob"])
      top = None if lp is None else {}
      for a, v in (lp or {}).get("top_logprobs", ()): top.setdefault(token_str(self.tok, a), v)
      out["top_logprobs"].append(top)
      out["text_offset"].append(self.offset)
      self.offset += len(self.utf8.decode(b))
    return out
