"""The benchmarks' prompts: exactly n token ids of plain filler text, no chat template, so every engine gets the same ids."""

FILLER = ("The history of astronomy is long. Early observers tracked the motions of the Sun, the Moon and the planets, "
          "built calendars from them, and argued about the shape of the heavens. ")

def filler_ids(tok, n: int) -> list[int]:
  ids = tok.encode(FILLER * (2 + n // 20), add_special=False)
  while len(ids) < n: ids = ids + ids
  return ids[:n]
