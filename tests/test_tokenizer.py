import heapq, json
import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st
from tinyhet.model.tokenizer import Tokenizer, TokenizerError, render_template
from tinyhet.model.weights import embedded_model_path, read_gguf

@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
  return Tokenizer.from_gguf_metadata(read_gguf(embedded_model_path()).metadata)

TEXTS = ["Hello, world!", "The capital of France is Paris.", "naïve café — déjà vu", "日本語のテキスト", "Ünïcödé ∑ ∫ ≠ ∞",
         "emoji: 🤖👍🏽🇫🇷 👨‍👩‍👧", "  leading spaces\n\n\ttabs and newlines  ", "x = [1, 2, 3]  # 12345 numbers", ""]

@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(smollm2, text):
  assert smollm2.decode(smollm2.encode(text)) == text

# SmolLM2's vocabulary has no symbol for a few bytes: ASCII controls 0x04, 0x06, 0x13, ... and the UTF-8 lead bytes 0xf1-0xf4 of
# planes 4-16 (unassigned but for private use): its own tokenizer drops those too
TEXT = st.text(st.characters(blacklist_categories=("Cs", "Cc"), max_codepoint=0x3FFFF) | st.sampled_from("\n\t\r"), max_size=60)

@settings(max_examples=60, deadline=None)
@given(TEXT)
@example("<|im_end|>")        # a special token's text is matched whole (its id) and decoded back only with skip_special off
@example("a<|im_start|>b")
def test_round_trip_any_text(smollm2, text):
  assert smollm2.decode(smollm2.encode(text), skip_special=False) == text

def test_smollm2_specifics(smollm2):
  assert smollm2.vocab_size == 49152 and smollm2.bos_id == 1 and smollm2.eos_id == 2 and not smollm2.add_bos
  assert {0, 2} <= set(smollm2.stop_ids)                                # <|endoftext|>, <|im_end|>
  assert smollm2.encode("<|im_start|>user")[:1] == [1]                 # special tokens are matched whole
  assert [smollm2.decode([i]) for i in smollm2.encode("12345")] == list("12345")   # smollm splits digits one by one
  assert smollm2.encode("Hello world")[1:] == smollm2.encode(" world")   # GPT-2 byte-level: the space belongs to the word
  assert smollm2.decode([1, 9690, 2], skip_special=True) == "system" and "<|im_start|>" in smollm2.decode([1], skip_special=False)

def test_chat_template(smollm2):
  text = smollm2.render_chat([{"role": "user", "content": "What is the capital of France?"}])
  assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
                  "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
  no_prompt = smollm2.render_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], add_generation_prompt=False)
  assert no_prompt == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
  ids = smollm2.encode_prompt("What is the capital of France?")
  assert ids[0] == 1 and ids[-4:] == smollm2.encode("<|im_start|>assistant\n") and smollm2.decode(ids, skip_special=False) == text
  assert smollm2.encode_prompt("Once upon a time", raw=True) == smollm2.encode("Once upon a time")

@settings(max_examples=30, deadline=None)
@given(TEXT)
def test_stream_decoder_pieces_add_up_and_never_show_half_characters(smollm2, text):
  d = smollm2.stream_decoder()
  pieces = [d.push(i) for i in smollm2.encode(text)]
  assert "".join(pieces) + d.flush() == text
  assert all("\ufffd" not in p for p in pieces) or "\ufffd" in text

def test_stream_decoder_holds_back_split_emoji(smollm2):
  ids = smollm2.encode("🤖")
  assert len(ids) > 1                                                      # the 4 UTF-8 bytes span several tokens
  d = smollm2.stream_decoder()
  assert [d.push(i) for i in ids] == [""] * (len(ids) - 1) + ["🤖"]

def test_template_is_sandboxed_and_errors_are_clear():
  with pytest.raises(TokenizerError, match="chat template failed"):
    render_template("{{ ''.__class__.__mro__[1].__subclasses__() }}", [])
  with pytest.raises(TokenizerError, match="only user and assistant"):
    render_template("{% if messages[0]['role'] == 'system' %}{{ raise_exception('only user and assistant') }}{% endif %}",
                    [{"role": "system", "content": "x"}])
  assert render_template("{{ messages | tojson }}", [{"role": "user", "content": "café"}]) == '[{"role": "user", "content": "café"}]'

def llama3_style_metadata() -> dict:
  """A byte-level BPE vocabulary as Llama 3's GGUF stores it (tokenizer.ggml.pre = llama-bpe): all 256 byte symbols, a few
  merges, control tokens, a chat template that writes BOS itself."""
  from tokenizers.pre_tokenizers import ByteLevel
  alphabet = sorted(ByteLevel.alphabet())
  merges = ["Ġ t", "h e", "Ġt he", "1 2", "12 3", "i n", "Ġ in"]
  words = [m.replace(" ", "") for m in merges]
  tokens = alphabet + words + ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
  return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "llama-bpe", "tokenizer.ggml.tokens": tokens,
          "tokenizer.ggml.token_type": [1] * (len(tokens) - 5) + [3] * 5, "tokenizer.ggml.merges": merges,
          "tokenizer.ggml.bos_token_id": len(tokens) - 5, "tokenizer.ggml.eos_token_id": len(tokens) - 1, "tokenizer.ggml.add_bos_token": True,
          "tokenizer.chat_template": "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
                                     "{{ m['content'] }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant"
                                     "<|end_header_id|>\n\n{% endif %}"}

def test_llama3_style_vocabulary():
  kv = llama3_style_metadata()
  tok = Tokenizer.from_gguf_metadata(kv)
  bos, eot = kv["tokenizer.ggml.bos_token_id"], kv["tokenizer.ggml.tokens"].index("<|eot_id|>")
  ids = tok.encode("12345 the in")
  assert ids[0] == bos and tok.decode(ids) == "12345 the in"               # BOS added (add_bos_token), skipped in decoding
  assert [tok.decode([i]) for i in ids[1:]] == ["123", "4", "5", " the", " in"]
  # Llama 3's split (tiktoken's regex): digits in groups of three, a space never joins digits (GPT-2's would give "Ġ67")
  assert [p for p, _ in tok.tok.pre_tokenizer.pre_tokenize_str("12345 67 !the")] == ["123", "45", "Ġ", "67", "Ġ!", "the"]
  assert eot in tok.stop_ids and kv["tokenizer.ggml.eos_token_id"] in tok.stop_ids
  chat = tok.encode_chat([{"role": "user", "content": "the"}])
  assert chat.count(bos) == 1 and chat[0] == bos                          # the template's BOS, not a second one
  for text in ["Hello\n\nworld 2024!", "naïve 🤖", "   "]: assert tok.decode(tok.encode(text)) == text

def test_tokenizer_json_directory(smollm2, tmp_path):
  smollm2.tok.save(str(tmp_path / "tokenizer.json"))
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>"},
                                                              "chat_template": [{"name": "default", "template": "{{ messages[0]['content'] }}!"}]}))
  (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
  tok = Tokenizer.from_hf_dir(tmp_path)
  assert (tok.bos_id, tok.eos_id, tok.stop_ids) == (1, 2, (0, 2))
  assert tok.render_chat([{"role": "user", "content": "hi"}]) == "hi!"
  for text in TEXTS: assert tok.encode(text) == smollm2.encode(text)

def test_unsupported_vocabularies_are_named():
  with pytest.raises(TokenizerError, match="'bert'.*supported: gpt2.*llama.*tokenizer.json"):
    Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "bert"})
  with pytest.raises(TokenizerError, match="scores"):
    Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["<unk>", "a"]})
  with pytest.raises(TokenizerError, match="'deepseek-llm'.*qwen2, tekken"):
    Tokenizer.from_gguf_metadata({**llama3_style_metadata(), "tokenizer.ggml.pre": "deepseek-llm"})
  with pytest.raises(TokenizerError, match="no tokenizer.json"): Tokenizer.from_hf_dir("/nonexistent")
  with pytest.raises(TokenizerError, match="--raw"):
    Tokenizer.from_gguf_metadata({**llama3_style_metadata(), "tokenizer.chat_template": None}).render_chat([])

# ---- SentencePiece (Llama 2, Mistral) vocabularies from a GGUF -----------------------------------------------------------------

SP = "\u2581"

def sentencepiece_vocab(seed: int, n: int = 60) -> tuple[list[str], list[float], list[int]]:
  """A Llama 2-style vocabulary: <unk> <s> </s>, the 256 byte tokens, single characters, then random longer pieces with
  distinct scores (SentencePiece's BPE scores are distinct), as tokenizer.ggml.tokens/scores/token_type hold them."""
  rng = np.random.default_rng(seed)
  chars = [SP, *"abcde"]
  pieces = set()
  while len(pieces) < n: pieces.add("".join(rng.choice(chars, rng.integers(2, 6))))
  normal = chars + sorted(pieces)
  tokens = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], *normal]
  scores = [0.0] * 259 + list(-rng.permutation(len(normal)).astype(float))
  return tokens, scores, [2, 3, 3] + [6] * 256 + [1] * len(normal)

def spm_reference(text: str, tokens: list[str], scores: list[float]) -> list[int]:
  """llama.cpp's llm_tokenizer_spm, written out: a space before the text, spaces as U+2581, then repeatedly merge the
  adjacent pair whose merged piece is a token with the highest score (leftmost on ties); characters that are no token
  become their UTF-8 bytes' <0xNN> tokens."""
  if not text: return []                                                   # no text fragment: nothing, not even the space
  vocab = {t: i for i, t in enumerate(tokens)}
  sym = list((" " + text).replace(" ", SP))
  nxt, prv = [*range(1, len(sym)), -1], list(range(-1, len(sym) - 1))
  heap = []
  def bigram(l):
    if l >= 0 and (r := nxt[l]) >= 0 and (t := sym[l] + sym[r]) in vocab: heapq.heappush(heap, (-scores[vocab[t]], l, t))
  for i in range(len(sym) - 1): bigram(i)
  while heap:
    _, l, t = heapq.heappop(heap)
    if not sym[l] or (r := nxt[l]) < 0 or sym[l] + sym[r] != t: continue    # stale: one side was merged since
    sym[l], sym[r], nxt[l] = t, "", nxt[r]
    if nxt[r] >= 0: prv[nxt[r]] = l
    bigram(prv[l]); bigram(l)
  out = []
  for s in sym:
    if s: out += [vocab[s]] if s in vocab else [vocab[f"<0x{b:02X}>"] for b in s.encode()]
  return out

def spm_metadata(tokens, scores, types) -> dict:
  return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types,
          "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0}

@settings(max_examples=150, deadline=None)
@given(st.integers(0, 2**16), st.text(st.sampled_from("abcde  éx\n"), max_size=30))
def test_sentencepiece_vocabulary_tokenizes_as_llama_cpp(seed, text):
  tokens, scores, types = sentencepiece_vocab(seed)
  tok = Tokenizer.from_gguf_metadata(spm_metadata(tokens, scores, types))
  ids = tok.encode(text)
  assert ids == [1, *spm_reference(text, tokens, scores)]                  # BOS: llama.cpp's default for SentencePiece
  assert tok.decode(ids) == text

def test_sentencepiece_specials_and_chat():
  tokens, scores, types = sentencepiece_vocab(0)
  template = "{{ bos_token }}{% for m in messages %}[{{ m['content'] }}]{{ eos_token }}{% endfor %}"
  kv = spm_metadata(tokens, scores, types) | {"tokenizer.chat_template": template}
  tok = Tokenizer.from_gguf_metadata(kv)
  assert tok.add_bos and tok.bos_id == 1 and 2 in tok.stop_ids
  # a control token is matched whole; the text after it gets its own leading space, as llama.cpp tokenizes
  assert tok.encode("ab</s>cd", add_special=False) == [*spm_reference("ab", tokens, scores), 2, *spm_reference("cd", tokens, scores)]
  assert tok.encode_chat([{"role": "user", "content": "a"}])[0] == 1 and tok.encode_chat([{"role": "user", "content": "a"}]).count(1) == 1
  assert tok.decode(tok.encode("a b\n"), skip_special=False).startswith("<s>")

def test_special_tokens_kept_and_spaced_as_vllm_asks(smollm2):
  """skip_special_tokens false keeps the specials' text; spaces_between_special_tokens (the default then) puts a space
  between each special token and the text around it, as transformers' slow tokenizers and vLLM do; the stream decoder agrees."""
  ids = smollm2.encode("<|im_start|>user\nHi<|im_end|><|im_end|>x")
  assert smollm2.decode(ids) == "user\nHix"
  assert smollm2.decode(ids, skip_special=False) == "<|im_start|>user\nHi<|im_end|><|im_end|>x"
  assert smollm2.decode(ids, skip_special=False, spaces_between_special=True) == "<|im_start|> user\nHi <|im_end|> <|im_end|> x"
  for skip, spaces in ((True, True), (False, False), (False, True)):
    d = smollm2.stream_decoder(skip, spaces)
    assert "".join(d.push(i) for i in ids) + d.flush() == smollm2.decode(ids, skip, spaces)

def test_vllm_extra_fields_parse():
  from tinyhet.service.api_fields import ApiError, check_fields, extra_sampling
  assert extra_sampling({}, (2, 0), 256)["stop_ids"] == [2, 0]
  assert extra_sampling({"ignore_eos": True, "stop_token_ids": [7]}, (2,), 256)["stop_ids"] == [7]     # ignore_eos: stop ids stay
  got = extra_sampling({"min_tokens": 3, "stop_token_ids": [7, 2]}, (2,), 256)
  assert got["stop_ids"] == [2, 7] and got["sampling_extra"] == {"min_tokens": 3, "min_tokens_ids": [2, 7]}
  check_fields({"model": "m", "prompt": "x", "response_format": {}}, chat=False)   # others' fields are known here (api_schema refuses them)
  check_fields({"messages": [], "tools": [], "tool_choice": "auto", "user": "u"}, chat=True)
  for body, chat in (({"echo": True}, True), ({"guided_whatever": 1}, False), ({"reasoning_effort": "low"}, True)):
    with pytest.raises(ApiError) as e: check_fields(body, chat)
    assert e.value.param == next(iter(body))
