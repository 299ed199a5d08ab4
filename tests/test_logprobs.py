"""The OpenAI logprobs shapes (tinyhet.service.logprobs) on a byte tokenizer (token i is byte i): text_offset is the character
offset of each token in the text the tokens decode to, a character split across tokens counted once."""
from hypothesis import given, strategies as st
from tinyhet.service.logprobs import LogprobFormatter

class ByteTokenizer:     # no token_text: token_bytes reads token i as the byte i
  pass

def offsets(text: str, start: int = 0, pieces: int = 1) -> tuple[list[int], list[str]]:
  ids = list(text.encode())
  f = LogprobFormatter(ByteTokenizer(), chat=False, offset=start)
  got = {"text_offset": [], "tokens": []}
  step = max(1, len(ids) // pieces)
  for i in range(0, len(ids), step):           # as a stream: entries() called chunk by chunk keeps counting
    out = f.entries([(t, {"logprob": -1.0, "top_logprobs": [(t, -1.0)]}) for t in ids[i:i + step]])
    got["text_offset"] += out["text_offset"]
    got["tokens"] += out["tokens"]
  return got["text_offset"], got["tokens"]

def test_split_character_counts_once():
  assert offsets("éa")[0] == [0, 0, 1]         # é is two bytes: the token that completes it still starts at 0; a starts at 1
  assert offsets("a€b", start=5)[0] == [5, 6, 6, 6, 7]

@given(st.text(max_size=40), st.integers(0, 100), st.integers(1, 5))
def test_offsets_index_the_text(text, start, pieces):
  """Each token's offset is the length of the text decoded from the bytes before it, whatever the chunking."""
  got, _ = offsets(text, start, pieces)
  b = text.encode()
  assert got == [start + len(b[:i].decode(errors="ignore")) for i in range(len(b))]
  assert got == sorted(got)

def test_chat_shape_has_bytes():
  f = LogprobFormatter(ByteTokenizer(), chat=True)
  out = f.entries([(0xc3, {"logprob": -0.5, "top_logprobs": [(0xc3, -0.5), (0x61, -1.0)]}), (0x61, None)])
  [e] = out["content"]
  assert e["bytes"] == [0xc3] and e["logprob"] == -0.5 and [t["bytes"] for t in e["top_logprobs"]] == [[0xc3], [0x61]]
