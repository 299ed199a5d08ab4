"""The model a service node or the router loads: a GGUF file or Hugging Face directory (tinyhet.model.weights), or `random:` — a
small Llama with seeded random weights and a byte tokenizer (token id = byte), so that clusters of real processes can be
tested and benchmarked in seconds, with every node holding the same weights.

  random:                          the tests' tiny model (2 layers, dim 64, vocabulary 256, context 128, seed 7)
  random:n_layers=4,dim=128,seed=3 any small_config field, and seed
"""
from __future__ import annotations

class ModelSpecError(ValueError):
  """A `random:` model spec that does not parse; the message names the fields allowed."""

RANDOM_DEFAULTS = dict(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, hidden_dim=96, vocab_size=256, max_context=128, seed=7)

def random_spec(spec) -> dict | None:
  """The fields of a `random:` model spec, or None when spec names a file."""
  if spec is None or not str(spec).startswith("random:"): return None
  fields = dict(RANDOM_DEFAULTS)
  for part in filter(None, str(spec)[len("random:"):].split(",")):
    key, _, value = part.partition("=")
    if key not in fields or not value.isdigit() or int(value) < 1:
      raise ModelSpecError(f"model spec {spec!r}: {part!r} is not one of {', '.join(f'{k}=N' for k in fields)} with N a positive integer")
    fields[key] = int(value)
  if fields["vocab_size"] < 256: raise ModelSpecError(f"model spec {spec!r}: the byte tokenizer needs vocab_size >= 256")
  return fields

class ByteTokenizer:
  """Token id = one UTF-8 byte: text round-trips for any vocabulary of at least 256 ids. No special tokens, no stop ids."""
  stop_ids: tuple[int, ...] = ()
  chat_template = None
  vocab_size = 256
  def encode(self, text: str, add_special: bool = True) -> list[int]: return list(text.encode())
  def decode(self, ids: list[int], skip_special: bool = True, spaces_between_special: bool = False) -> str:
    return bytes(i for i in ids if i < 256).decode(errors="replace")
  def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + ("assistant: " if add_generation_prompt else "")
    return self.encode(text)
  def stream_decoder(self, skip_special: bool = True, spaces_between_special: bool = False):
    from tinyhet.model.tokenizer import StreamDecoder
    return StreamDecoder(self, skip_special, spaces_between_special)

def model_id(spec) -> str:
  """The name clients ask for (`model` in a request): the file name, or the random spec itself."""
  if (fields := random_spec(spec)) is not None: return "random:" + ",".join(f"{k}={v}" for k, v in fields.items())
  from tinyhet.model.weights import model_name
  return model_name(spec)

def weights_nbytes(spec, packed: bool) -> int:
  if (f := random_spec(spec)) is not None: return 4 * f["n_layers"] * 12 * f["dim"] ** 2 + 4 * f["vocab_size"] * f["dim"]
  from tinyhet.model.weights import model_nbytes
  return model_nbytes(spec, packed)

def load(spec, device: str, max_context: int | None = None, quiet: bool = False, packed: bool = True):
  """(Llama, tokenizer, model id) on device."""
  if (f := random_spec(spec)) is not None:
    from tinyhet.model.llama import Llama, small_config, random_weights
    f = dict(f)
    seed = f.pop("seed")
    if max_context: f["max_context"] = min(f["max_context"], max_context)
    cfg = small_config(**f)
    return Llama(cfg, random_weights(cfg, device=device, seed=seed), device), ByteTokenizer(), model_id(spec)
  from tinyhet.model.weights import load_model
  model, tok = load_model(spec, device=device, max_context=max_context, quiet=quiet, packed=packed)
  return model, tok, model_id(spec)

def load_tokenizer(spec):
  """The tokenizer alone (the router needs no weights)."""
  if random_spec(spec) is not None: return ByteTokenizer()
  import pathlib
  from tinyhet.model.tokenizer import Tokenizer
  from tinyhet.model.weights import embedded_model_path, read_gguf
  path = embedded_model_path() if spec is None else pathlib.Path(spec)
  return Tokenizer.from_hf_dir(path) if path.is_dir() else Tokenizer.from_gguf_metadata(read_gguf(path).metadata)
