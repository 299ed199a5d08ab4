"""The prefill side of disaggregated generation: prefill a prompt on HET one layer at a time and write each layer's K, V
into the decode node's reserved blocks as soon as that layer exists, while the next layer computes; then stream the
tokens the decode node generates.
"""
from __future__ import annotations
import time
from dataclasses import dataclass, field
from tinygrad import Tensor, dtypes
from tinyhet.decode_node import notice_value
from tinyhet.devices import NotRegistered, region_of
from tinyhet.kernels.kv_pack import pack_kv
from tinyhet.memory import LocalNode
from tinyhet.model import Llama
from tinyhet.runtime.control import ControlClient
from tinyhet.runtime.descriptor import RegionDescriptor
from tinyhet.runtime.transport import Span, Transfer
from tinyhet.sampling import Sampler

class IncompatibleDecodeNode(RuntimeError):
  """The decode node serves another model (or another KV layout) than this prefill node."""

@dataclass
class GenerationStats:
  prompt_tokens: int = 0
  ttft_s: float = 0.0               # request start -> first token sampled (prefill on HET, the transfer overlapping it)
  prefill_s: float = 0.0
  kv_bytes: int = 0                 # bytes written to the decode node (whole blocks, all layers)
  transfer_s: float = 0.0           # time some layer's write was in flight (the union of the writes' intervals)
  transfer_gbps: float = 0.0        # kv_bytes / transfer_s
  hidden_share: float = 0.0         # 1 - (prefill end -> last layer landed) / transfer_s
  decode_tokens: int = 0
  decode_tok_s: float = 0.0
  transport: str = ""
  preemptions: int = 0
  layer_landed_s: list[float] = field(default_factory=list)
  last_logits: list[float] | None = None   # with return_logits: the logits the last token was sampled from

def prefill_bucket(n: int) -> int:
  """The padded prompt length: tinygrad compiles kernels per shape, so prompts share the kernels of their bucket. Buckets
  grow with the length (steps of 16 tokens up to 255, then 1/8 to 1/16 of the length), so padding costs at most ~12%."""
  step = max(16, 1 << max(0, n.bit_length() - 4))
  return -(-n // step) * step

def busy_time(intervals: list[tuple[float, float]]) -> float:
  """Length of the union of [start, end) intervals: how long at least one transfer was in flight."""
  total, end = 0.0, float("-inf")
  for a, b in sorted(intervals):
    if b <= end: continue
    total += b - max(a, end)
    end = b
  return total

class DecodeClient:
  """A prefill node's handle on one decode node: checks the model matches, then runs requests against it."""
  def __init__(self, node: LocalNode, address: str, model: Llama, model_id: str = "", transport: str | None = None):
    self.node, self.model = node, model
    self.ctl = ControlClient(node.endpoint, address)
    self.info = self.ctl.call("decode.info")
    mine = {k: getattr(model.cfg, k) for k in ("n_layers", "n_kv_heads", "head_dim", "vocab_size", "dim")}
    theirs = {k: self.info["config"].get(k) for k in mine}
    if mine != theirs or (model_id and self.info["model"] and model_id != self.info["model"]):
      raise IncompatibleDecodeNode(f"decode node {self.ctl.peer} at {address} serves {self.info['model'] or 'a model'} {theirs}, "
                                   f"this node has {model_id or 'a model'} {mine}: start both with the same --model")
    self.peer = node.endpoint.connect(address, transport)
    self.kv_dtype = getattr(dtypes, self.info["kv_dtype"])

  def generate(self, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0, seed: int | None = 0,
               stop_ids: tuple[int, ...] = (), on_token=None, return_logits: bool = False) -> tuple[list[int], GenerationStats]:
    """Prefill here, decode there. on_token(id) sees each token as it arrives (the first one as soon as prefill ends)."""
    stats = GenerationStats(prompt_tokens=len(prompt_ids), transport=self.peer.transport)
    t0 = time.perf_counter()
    r = self.ctl.call("decode.reserve", prompt_ids=list(prompt_ids), max_new_tokens=max_new_tokens)
    seq_id, blocks, block_bytes, block_size = r["seq_id"], r["blocks"], r["block_bytes"], r["block_size"]
    pools = [RegionDescriptor.from_hex(h) for h in r["pools"]]
    transfers: list[Transfer] = []
    keep: list[Tensor] = []                  # packed layers stay alive until their writes have landed

    def send_layer(layer: int, k: Tensor, v: Tensor):
      # (blocks, 2, KVH, block_size*D): the pool's bytes. Rows past the prompt (pads) only reach the slack of the last block,
      # which the decode node masks until its own tokens overwrite it.
      packed = pack_kv(k, v, block_size, self.kv_dtype).contiguous().realize()
      try: region, offset = region_of(packed.uop.buffer)
      except NotRegistered:      # HET on a GPU: one copy into registered host memory (GPUDirect writes from GPU memory: not built yet)
        packed = packed.to("MESH").realize()
        region, offset = region_of(packed.uop.buffer)
      spans = [Span(region, offset + i * block_bytes, pools[layer], b * block_bytes, block_bytes) for i, b in enumerate(blocks)]
      transfers.append(self.node.endpoint.write(self.peer, spans, notify=notice_value(seq_id, layer)))
      keep.append(packed)

    padded = list(prompt_ids) + [0] * (prefill_bucket(len(prompt_ids)) - len(prompt_ids))
    try:
      logits = self.model.prefill(Tensor([padded], dtype=dtypes.int32, device=self.model.device), on_layer=send_layer, kv_dtype=self.kv_dtype,
                                  n_valid=len(prompt_ids))
      t_prefill = time.perf_counter()
      sampler = Sampler(temperature, top_p, seed)
      first = sampler(logits.numpy()[0])
      stats.ttft_s, stats.prefill_s = time.perf_counter() - t0, t_prefill - t0
      if on_token is not None: on_token(first)
      out = [first]
      # the decode node continues this sampler's random stream: the same seed gives the tokens one device would give
      for item in self.ctl.stream("decode.generate", seq_id=seq_id, first_token=first, temperature=temperature, top_p=top_p,
                                  rng_state=sampler.rng.bit_generator.state, stop_ids=list(stop_ids), return_logits=return_logits):
        if "token" in item:
          out.append(item["token"])
          if on_token is not None: on_token(item["token"])
        elif item.get("done"):
          stats.decode_tokens, stats.decode_tok_s, stats.preemptions = item["decode_tokens"], item["decode_tok_s"], item["preemptions"]
          stats.last_logits = item.get("logits", logits.numpy()[0].tolist() if return_logits and len(out) == 1 else None)
    except BaseException:
      for t in transfers:          # the packed layers in `keep` must outlive the writes reading them
        try: t.wait(30)
        except Exception: pass
      try: self.ctl.call("decode.release", seq_id=seq_id, writes_done=True, reply_timeout=10)   # every posted write was waited for
      except Exception: pass
      raise
    for t in transfers: t.wait(60)
    last_landed = max(t.finished for t in transfers)
    stats.kv_bytes = sum(t.nbytes for t in transfers)
    stats.transfer_s = busy_time([(t.started, t.finished) for t in transfers])
    stats.transfer_gbps = stats.kv_bytes / stats.transfer_s / 1e9 if stats.transfer_s > 0 else 0.0
    stats.hidden_share = 1 - max(0.0, last_landed - t_prefill) / stats.transfer_s if stats.transfer_s > 0 else 1.0
    stats.layer_landed_s = [t.finished - t0 for t in transfers]
    return out, stats

  def close(self):
    self.ctl.close()
    self.peer.close()
