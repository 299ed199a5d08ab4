"""The tokenizer and chat template of a model, from GGUF metadata or a Hugging Face directory (tokenizer.json,
tokenizer_config.json), built on the Hugging Face `tokenizers` library; chat templates rendered with jinja2 in a sandbox.

GGUF vocabularies of type gpt2 are byte-level BPE (SmolLM2, Llama 3, Qwen2/3, Mistral's Tekken); tokenizer.ggml.pre picks the
pre-tokenizer the way llama.cpp does: `smollm` splits digits one by one, then GPT-2's regex; `llama-bpe` is Llama 3's
tiktoken-style regex; `qwen2` the same with single digits, after Unicode NFC (as Qwen's tokenizer.json normalizes);
`tekken` Mistral's regex that splits words at case changes.
Type llama is SentencePiece (Llama 2, Mistral): tokens, scores and token types in the GGUF. It becomes the BPE model
transformers' LlamaConverter builds from a tokenizer.model: merges of every pair of pieces that makes a normal token, ranked
by that token's score (SentencePiece's BPE merges the adjacent pair whose merged piece scores highest), byte fallback to the
<0xNN> tokens, spaces as U+2581 with one prepended to each run of text (llama.cpp's add_space_prefix).
"""
from __future__ import annotations
import datetime, json, pathlib
from typing import Any

class TokenizerError(ValueError):
  """A tokenizer that cannot be built: the message names the file or key and what is supported."""

GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LLAMA3_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
TEKKEN_SPLIT = (r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}"""
                r"""\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
STOP_TEXTS = ("<|eot_id|>", "<|end_of_text|>", "<|im_end|>", "<|endoftext|>", "<|eom_id|>")   # end-of-turn markers of common chat models
GGUF_NORMAL, GGUF_UNKNOWN, GGUF_CONTROL, GGUF_USER_DEFINED = 1, 2, 3, 4   # llama.cpp's token types; 2-4 are matched whole in text
GGUF_TOKENIZERS = ("gpt2", "llama")
SPM_SPACE = "\u2581"

def sentencepiece_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
  """BPE merges equivalent to SentencePiece's: each split of a normal token into two pieces of the vocabulary, the merges of
  higher-scoring tokens first (transformers' SentencePieceExtractor, from the GGUF's arrays instead of a tokenizer.model)."""
  vocab = {t: i for i, t in enumerate(tokens)}
  merges = []
  for i, (t, ty) in enumerate(zip(tokens, types)):
    if ty != GGUF_NORMAL or len(t) < 2: continue
    pairs = [(t[:k], t[k:]) for k in range(1, len(t)) if t[:k] in vocab and t[k:] in vocab]
    merges += [(-scores[i], vocab[a], vocab[b], a, b) for a, b in pairs]
  return [(a, b) for *_, a, b in sorted(merges)]

def _sentencepiece(kv: dict[str, Any], tokens: list[str], types: list[int]):
  from tokenizers import Tokenizer as HFTokenizer, decoders, models, normalizers
  if "tokenizer.ggml.scores" not in kv: raise TokenizerError("GGUF tokenizer.ggml.model = 'llama' without tokenizer.ggml.scores")
  scores = kv["tokenizer.ggml.scores"]
  unk = kv.get("tokenizer.ggml.unknown_token_id", 0)
  tok = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=sentencepiece_merges(tokens, scores, types),
                               unk_token=tokens[unk] if 0 <= unk < len(tokens) else None, fuse_unk=True, byte_fallback=True))
  space_prefix = kv.get("tokenizer.ggml.add_space_prefix", True)
  replace = normalizers.Replace(" ", SPM_SPACE)
  tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPM_SPACE), replace]) if space_prefix else replace
  steps = [decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
  tok.decoder = decoders.Sequence([*steps, decoders.Strip(content=" ", left=1, right=0)] if space_prefix else steps)
  return tok

def _pre_tokenizer(pre: str):
  from tokenizers import Regex, pre_tokenizers as pt
  if pre == "smollm": return pt.Sequence([pt.Digits(individual_digits=True), pt.ByteLevel(add_prefix_space=False, use_regex=True)])
  splits = {"llama-bpe": LLAMA3_SPLIT, "llama3": LLAMA3_SPLIT, "llama-v3": LLAMA3_SPLIT, "smaug-bpe": LLAMA3_SPLIT, "qwen2": QWEN2_SPLIT,
            "tekken": TEKKEN_SPLIT}
  if pre in splits: return pt.Sequence([pt.Split(Regex(splits[pre]), behavior="isolated"), pt.ByteLevel(add_prefix_space=False, use_regex=False)])
  if pre in ("default", "gpt2", "gpt-2"): return pt.ByteLevel(add_prefix_space=False, use_regex=True)
  raise TokenizerError(f"GGUF tokenizer.ggml.pre = {pre!r} is not supported (supported: smollm, llama-bpe, qwen2, tekken, default/gpt2); "
                       "use a Hugging Face directory with tokenizer.json instead")

class Tokenizer:
  """encode/decode text <-> token ids, render chat prompts, and the ids that end a reply (stop_ids)."""

  def __init__(self, tok, bos_id: int | None, eos_id: int | None, chat_template: str | None, stop_ids: tuple[int, ...], add_bos: bool):
    self.tok, self.bos_id, self.eos_id, self.chat_template, self.stop_ids, self.add_bos = tok, bos_id, eos_id, chat_template, stop_ids, add_bos

  @staticmethod
  def from_gguf_metadata(kv: dict[str, Any]) -> Tokenizer:
    """From llama.cpp's tokenizer.ggml.* keys and tokenizer.chat_template."""
    from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, normalizers
    model = kv.get("tokenizer.ggml.model")
    if model not in GGUF_TOKENIZERS:
      raise TokenizerError(f"GGUF tokenizer.ggml.model = {model!r} is not supported (supported: gpt2 = byte-level BPE as SmolLM2 and Llama 3 "
                           "use, llama = SentencePiece as Llama 2 and Mistral use); use a Hugging Face directory with tokenizer.json instead")
    if "tokenizer.ggml.tokens" not in kv: raise TokenizerError("the GGUF has no tokenizer.ggml.tokens (no vocabulary)")
    tokens: list[str] = kv["tokenizer.ggml.tokens"]
    types: list[int] = kv.get("tokenizer.ggml.token_type", [GGUF_NORMAL] * len(tokens))
    if len(types) != len(tokens): raise TokenizerError(f"GGUF tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    if model == "llama": tok, whole = _sentencepiece(kv, tokens, types), (GGUF_UNKNOWN, GGUF_CONTROL, GGUF_USER_DEFINED)
    else:
      merges = [tuple(m.split(" ", 1)) for m in kv.get("tokenizer.ggml.merges", [])]
      pre = kv.get("tokenizer.ggml.pre", "default")
      vocab = {t: i for i, t in enumerate(tokens)}
      tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in ("llama-bpe", "llama3", "llama-v3")))
      tok.pre_tokenizer = _pre_tokenizer(pre)
      if pre == "qwen2": tok.normalizer = normalizers.NFC()
      tok.decoder, whole = decoders.ByteLevel(), (GGUF_CONTROL, GGUF_USER_DEFINED)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty in whole])
    bos, eos = kv.get("tokenizer.ggml.bos_token_id"), kv.get("tokenizer.ggml.eos_token_id")
    special = {t: i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == GGUF_CONTROL}
    stops = {i for i in (eos, kv.get("tokenizer.ggml.eot_token_id"), kv.get("tokenizer.ggml.eom_token_id")) if i is not None}
    stops |= {special[t] for t in STOP_TEXTS if t in special}
    add_bos = kv.get("tokenizer.ggml.add_bos_token", model == "llama")   # llama.cpp's default: BOS for SentencePiece vocabularies
    return Tokenizer(tok, bos, eos, kv.get("tokenizer.chat_template"), tuple(sorted(stops)), bool(add_bos))

  @staticmethod
  def from_hf_dir(directory: str | pathlib.Path) -> Tokenizer:
    """From tokenizer.json, with tokenizer_config.json for BOS/EOS; the chat template from chat_template.jinja (transformers 5),
    chat_template.json or tokenizer_config.json, in that order; stop ids also from generation_config.json and config.json."""
    from tokenizers import Tokenizer as HFTokenizer
    directory = pathlib.Path(directory)
    if not (directory / "tokenizer.json").is_file(): raise TokenizerError(f"{directory}: no tokenizer.json; a Hugging Face model directory needs one")
    tok = HFTokenizer.from_file(str(directory / "tokenizer.json"))
    tok.no_padding(); tok.no_truncation()
    def load(name):
      try: return json.loads((directory / name).read_text()) if (directory / name).is_file() else {}
      except ValueError as e: raise TokenizerError(f"{directory / name}: not valid JSON ({e})") from None
    cfg, gen, model_cfg = load("tokenizer_config.json"), load("generation_config.json"), load("config.json")
    def token_id(t):
      t = t.get("content") if isinstance(t, dict) else t
      return tok.token_to_id(t) if t else None
    def ids(x): return [i for i in (x if isinstance(x, list) else [x]) if isinstance(i, int)]
    bos, eos = token_id(cfg.get("bos_token")), token_id(cfg.get("eos_token"))
    if bos is None and (b := ids(gen.get("bos_token_id", model_cfg.get("bos_token_id")))): bos = b[0]
    if eos is None and (e := ids(gen.get("eos_token_id", model_cfg.get("eos_token_id")))): eos = e[0]
    if (directory / "chat_template.jinja").is_file(): template = (directory / "chat_template.jinja").read_text()
    else: template = load("chat_template.json").get("chat_template") or cfg.get("chat_template")
    if isinstance(template, list): template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
    stops = {i for i in [eos, *ids(gen.get("eos_token_id")), *ids(model_cfg.get("eos_token_id"))] if i is not None}
    stops |= {i for t in STOP_TEXTS if (i := tok.token_to_id(t)) is not None}
    # a tokenizer.json's post-processor adds BOS itself where the model wants it (Llama 3); nothing is prepended here
    return Tokenizer(tok, bos, eos, template, tuple(sorted(stops)), add_bos=False)

  @property
  def vocab_size(self) -> int: return self.tok.get_vocab_size(with_added_tokens=True)

  def token_text(self, i: int) -> str | None: return self.tok.id_to_token(i)

  def encode(self, text: str, add_special: bool = True) -> list[int]:
    """Token ids of text; special-token texts (e.g. <|im_start|>) become their ids. add_special: BOS where the model wants it."""
    ids = self.tok.encode(text, add_special_tokens=add_special).ids
    if add_special and self.add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]: ids = [self.bos_id, *ids]
    return ids

  def decode(self, ids: list[int], skip_special: bool = True, spaces_between_special: bool = False) -> str:
    """Text of ids. skip_special: special tokens leave no text. spaces_between_special (with skip_special off; vLLM's
    spaces_between_special_tokens, as transformers' slow tokenizers do it): each special token and each run of other
    tokens decoded on its own, the pieces joined with spaces."""
    if skip_special or not spaces_between_special: return self.tok.decode(list(ids), skip_special_tokens=skip_special)
    special, runs = self.special_ids(), []
    for i in ids:
      if i in special or not runs or runs[-1][0] in special: runs.append([i])
      else: runs[-1].append(i)
    return " ".join(self.tok.decode(r, skip_special_tokens=False) for r in runs)

  def special_ids(self) -> frozenset[int]:
    if not hasattr(self, "_special"): self._special = frozenset(i for i, t in self.tok.get_added_tokens_decoder().items() if t.special)
    return self._special

  def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None) -> str:
    """The model's chat template (jinja2, sandboxed) applied to [{"role": ..., "content": ...}, ...]; tools: OpenAI's function
    list, for a template that renders tools (as transformers passes them)."""
    if not self.chat_template: raise TokenizerError("this model has no chat template; pass --raw to complete the prompt as plain text")
    text = lambda i: self.token_text(i) if i is not None else ""
    extra = {"tools": tools} if tools is not None else {}
    return render_template(self.chat_template, messages, add_generation_prompt, bos_token=text(self.bos_id), eos_token=text(self.eos_id), **extra)

  def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None) -> list[int]:
    """Token ids of the rendered chat; the template writes BOS itself where the model wants one."""
    return self.encode(self.render_chat(messages, add_generation_prompt, tools), add_special=False)

  def encode_prompt(self, prompt: str, raw: bool = False) -> list[int]:
    """A user prompt as the model should see it: in the chat template as one user turn, or (raw) as plain text to continue."""
    return self.encode(prompt) if raw or not self.chat_template else self.encode_chat([{"role": "user", "content": prompt}])

  def stream_decoder(self, skip_special: bool = True, spaces_between_special: bool = False) -> StreamDecoder:
    return StreamDecoder(self, skip_special, spaces_between_special)

def render_template(template: str, messages: list[dict[str, str]], add_generation_prompt: bool = True, **context) -> str:
  """Renders a Hugging Face chat template as transformers does: sandboxed jinja2, trim_blocks and lstrip_blocks, with
  raise_exception, strftime_now and a tojson that keeps non-ASCII text."""
  from jinja2 import TemplateError
  from jinja2.sandbox import ImmutableSandboxedEnvironment
  def raise_exception(message): raise TemplateError(message)
  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
  env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False: json.dumps(x, ensure_ascii=False, indent=indent,
                                                                                             separators=separators, sort_keys=sort_keys)
  env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
  try: return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt, **context)
  except TemplateError as e: raise TokenizerError(f"the model's chat template failed: {e}") from None

class StreamDecoder:
  """Text of a growing token sequence, piece by piece: push(id) returns the new text, holding back bytes of a UTF-8
  character split across tokens until it is complete (decoded text ending in U+FFFD is not emitted yet)."""

  def __init__(self, tokenizer: Tokenizer, skip_special: bool = True, spaces_between_special: bool = False):
    self.tokenizer, self.skip_special, self.ids, self.prefix, self.read = tokenizer, skip_special, [], 0, 0
    self.spaces = spaces_between_special

  def _decode(self, ids: list[int]) -> str:
    return self.tokenizer.decode(ids, self.skip_special, self.spaces) if self.spaces else self.tokenizer.decode(ids, self.skip_special)

  def push(self, token: int) -> str:
    self.ids.append(token)
    before = self._decode(self.ids[self.prefix:self.read])
    now = self._decode(self.ids[self.prefix:])
    if len(now) > len(before) and not now.endswith("\ufffd"):
      self.prefix, self.read = self.read, len(self.ids)   # decoding restarts a token back: byte-level merges never reach further
      return now[len(before):]
    return ""

  def flush(self) -> str:
    """Whatever is held back (an incomplete character shows as U+FFFD)."""
    before = self._decode(self.ids[self.prefix:self.read])
    now = self._decode(self.ids[self.prefix:])
    self.prefix = self.read = len(self.ids)
    return now[len(before):]
