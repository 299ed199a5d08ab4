"""Layers packed in device memory that no transport sends from leave through N staging buffers (tinyhet.device.gpu_staging), copied
and written by the writer thread: the bytes equal the synchronous path's, a staging buffer is never reused while a write
reads it, and the prefill thread waits only when every buffer is in flight. The device is tinygrad's own CPU device (its
kernels run on worker threads, its memory is not registered: what a GPU is to tinyhet) and its PYTHON emulator."""
import pathlib, subprocess, sys, threading
import numpy as np, pytest
from hypothesis import given, settings, strategies as st
import tinyhet  # noqa: F401
from tinygrad import Tensor, dtypes
from tinyhet.kernels.kv_pack import pack_kv, pack_kv_host
from tinyhet.device.memory import local_node
from tinyhet.kv.sender import LayerWriter, SendBuffers, post_packed
from tinyhet.runtime.transport import Span, Transfer
from tinyhet.device.gpu_staging import StagingRing, start_copy

KVH, D = 2, 8

class SlowTransport:
  """A transport whose writes read their source only when they land: lazily (when someone waits for them, so a write lands
  only when prefill or finish() needs it to) or after a delay on a timer thread. At landing it checks that the source bytes
  are still those it was handed at posting: a staging buffer reused while in flight fails the check."""
  def __init__(self, dest: np.ndarray, delay: float | None = None):
    self.dest, self.delay, self.lock = dest, delay, threading.Lock()
    self.overwritten: list[int] = []
    self.in_flight, self.most_in_flight, self.timers = 0, 0, []

  def write(self, peer, spans: list[Span], notify: int | None = None) -> Transfer:
    at_post = [bytes(s.local.view(s.local_offset, s.nbytes)) for s in spans]
    transport = self
    class SlowTransfer(Transfer):
      def land(self):
        with transport.lock:
          if self.done(): return
          for s, before in zip(spans, at_post):
            now = bytes(s.local.view(s.local_offset, s.nbytes))
            if now != before: transport.overwritten.append(notify)
            transport.dest[s.remote_offset:s.remote_offset + s.nbytes] = np.frombuffer(now, np.uint8)
          transport.in_flight -= 1
          self.finish()
      def wait(self, timeout=60.0):
        if transport.delay is None: self.land()
        return super().wait(timeout)
    t = SlowTransfer("decode", "slow", notify or 0, sum(s.nbytes for s in spans))
    with self.lock:
      self.in_flight += 1
      self.most_in_flight = max(self.most_in_flight, self.in_flight)
    if self.delay is not None:
      self.timers.append(timer := threading.Timer(self.delay, t.land))
      timer.start()
    return t

def layers_kv(n_layers: int, n_tokens: int, seed: int):
  rng = np.random.default_rng(seed)
  return [tuple(rng.standard_normal((n_tokens, KVH, D)).astype(np.float16) for _ in range(2)) for _ in range(n_layers)]

def send_all(kv, bs: int, device: str, n_buffers: int, transport: SlowTransport):
  """What DecodeClient.generate does per layer on its way out: pack on the device, post_packed. Layer l goes to the
  destination's l-th slot of layer_bytes. Returns the ring (None for the synchronous path)."""
  node = local_node()
  nb = -(-len(kv[0][0]) // bs)
  layer_bytes = nb * 2 * KVH * bs * D * 2
  regions = [node.arena("MESH").alloc(layer_bytes + 64, align=4096) for _ in range(n_buffers)]   # + 64: a buffer may be larger
  ring = StagingRing(regions) if regions else None
  writer, keep = LayerWriter(transport, None), []
  try:
    for layer, (k, v) in enumerate(kv):
      packed = pack_kv(Tensor(k, device=device), Tensor(v, device=device), bs, dtypes.float16).contiguous().realize()
      block = layer_bytes // nb
      spans_from = lambda region, offset, layer=layer: [Span(region, offset + i * block, None, (layer * nb + i) * block, block) for i in range(nb)]
      keep.append(post_packed(writer, layer, packed, layer_bytes, spans_from, layer, ring))
    writer.finish(30)
  finally:
    for t in transport.timers: t.join()
    for r in regions: r.free()
  return ring

def expected(kv, bs: int) -> np.ndarray:
  nb = -(-len(kv[0][0]) // bs)
  out = np.zeros((len(kv), nb, 2, KVH, bs * D), np.float16)
  for layer, (k, v) in enumerate(kv): pack_kv_host(k, v, out[layer])
  return out.view(np.uint8).reshape(-1)

@settings(max_examples=20, deadline=None)
@given(n_layers=st.integers(1, 5), n_buffers=st.integers(1, 4), n_tokens=st.integers(1, 40), bs=st.sampled_from([4, 16]), lazy=st.booleans())
def test_staged_bytes_equal_the_synchronous_path(n_layers, n_buffers, n_tokens, bs, lazy):
  """Over layer counts, buffer counts, prompt lengths: the decode side holds the same bytes through N staging buffers as
  through the synchronous copy, and as numpy's packing; no write found its source changed while it was in flight."""
  kv = layers_kv(n_layers, n_tokens, seed=n_layers * 100 + n_tokens)
  want = expected(kv, bs)
  sync, staged = SlowTransport(np.zeros_like(want), None if lazy else 0.01), SlowTransport(np.zeros_like(want), None if lazy else 0.01)
  assert send_all(kv, bs, "CPU", 0, sync) is None
  ring = send_all(kv, bs, "CPU", n_buffers, staged)
  np.testing.assert_array_equal(sync.dest, want)
  np.testing.assert_array_equal(staged.dest, want)
  assert staged.overwritten == [] and staged.most_in_flight <= n_buffers
  if lazy: assert ring.waits == max(0, n_layers - n_buffers)     # writes land only when waited on: every take past N waits
  else: assert ring.waits <= max(0, n_layers - n_buffers)

@pytest.mark.parametrize("n_buffers", [1, 2, 3, 6])
def test_prefill_waits_only_when_every_buffer_is_in_flight(n_buffers):
  """With writes that land only when waited on, 6 layers through N buffers: the prefill thread waits exactly 6 - N times
  (never while a buffer is free), N writes are in flight at most, and none saw its staging buffer overwritten."""
  kv = layers_kv(6, 13, seed=3)
  slow = SlowTransport(np.zeros_like(expected(kv, 4)))
  ring = send_all(kv, 4, "CPU", n_buffers, slow)
  assert ring.waits == max(0, 6 - n_buffers) and slow.most_in_flight == min(6, n_buffers) and slow.overwritten == []
  np.testing.assert_array_equal(slow.dest, expected(kv, 4))

def test_emulated_device_stages_the_same_bytes():
  """tinygrad's PYTHON emulator (a non-CPU backend, as a GPU is to tinyhet) through two staging buffers."""
  kv = layers_kv(3, 5, seed=9)
  slow = SlowTransport(np.zeros_like(expected(kv, 4)), delay=0.02)
  ring = send_all(kv, 4, "PYTHON", 2, slow)
  np.testing.assert_array_equal(slow.dest, expected(kv, 4))
  assert slow.overwritten == [] and ring.waits <= 1

def test_a_failed_write_reaches_the_prefill_thread():
  """A write that fails is raised where the prefill thread next takes a buffer that waits for it, or by finish()."""
  class Broken:
    def write(self, peer, spans, notify=None):
      t = Transfer("decode", "broken", 0, 1)
      t.finish("link down")
      return t
  node = local_node()
  region = node.arena("MESH").alloc(4096)
  try:
    ring, writer = StagingRing([region]), LayerWriter(Broken(), None)
    packed = pack_kv(Tensor(np.ones((4, KVH, D), np.float16), device="CPU"), Tensor(np.ones((4, KVH, D), np.float16), device="CPU"), 4).realize()
    post_packed(writer, 0, packed, packed.nbytes(), lambda r, o: [Span(r, o, None, 0, packed.nbytes())], 0, ring)
    with pytest.raises(Exception, match="link down"): post_packed(writer, 1, packed, packed.nbytes(), lambda r, o: [Span(r, o, None, 0, 8)], 1, ring)
    with pytest.raises(Exception, match="link down"): writer.finish(10)
  finally: region.free()

def test_bad_staging_requests_are_refused():
  region = local_node().arena("MESH").alloc(256)
  try:
    with pytest.raises(ValueError, match="at least one buffer"): StagingRing([])
    packed = Tensor.ones(64, device="CPU").contiguous().realize()        # 256 bytes
    with pytest.raises(ValueError, match="cannot stage 300 bytes"): start_copy(packed.uop.buffer, region, 300)
    with pytest.raises(ValueError, match="cannot stage 0 bytes"): start_copy(packed.uop.buffer, region, 0)
    small = local_node().arena("MESH").alloc(64)
    try:
      with pytest.raises(ValueError, match="in a 64-byte staging buffer"): start_copy(packed.uop.buffer, small, 128)
    finally: small.free()
  finally: region.free()

@pytest.mark.parametrize("bad", ["-1", "65", "two"])
def test_bad_staging_buffer_counts_name_the_option(bad):
  from tinyhet.config import ConfigError, load_config
  assert load_config(env={}).staging_buffers == 2 and load_config(env={"TINYHET_STAGING_BUFFERS": "0"}).staging_buffers == 0
  with pytest.raises(ConfigError, match="TINYHET_STAGING_BUFFERS"): load_config(env={"TINYHET_STAGING_BUFFERS": bad})

def test_bench_staging_refuses_bad_arguments():
  for args in (["--rounds", "0"], ["--buffers", "2,0"], ["--link-gbps", "-1"]):
    p = subprocess.run([sys.executable, "-m", "tinyhet", "bench", "staging", *args], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "must be positive" in p.stderr, (args, p.stderr[-500:])

def test_gpu_check_table_shows_every_section():
  """The GPU check's summary (bench/gpu_check.py) from a report with every section its steps fill: a GPU run is too rare
  for its last line to fail there."""
  sys.path.insert(0, str(pathlib.Path(__file__).parent.parent / "bench"))
  from gpu_check import table
  step = {"ok": True, "seconds": 1.0}
  report = {"device": "CUDA", "gpu": "NVIDIA H200", "date": "2026-12-01 00:00 UTC", "elapsed_s": 200.0, "ok": True,
            "steps": {"het CUDA": step, "het NV": {"ok": False, "skipped": "NV does not open here"}, "run staged": step},
            "ttft_s": 0.1, "ttft_no_transfer_s": 0.09, "overhead_s": 0.01, "kv_bytes": 2**20, "tokens": [1, 2], "tokens_equal": True,
            "ttft_sync_copy_s": 0.12, "overhead_sync_copy_s": 0.03,
            "70b": {"layers": 2, "prefill_s": 0.5, "prefill_cpu_s": 9.0, "tokens_equal": True},
            "bench_staging": {"no_transfer_s": 0.2, "pinned_buffers": 2,
                              "staged 2 / slow": {"prefill_s": 0.21, "handoff_ms_per_layer": 0.1, "staging_waits": 0}}}
  text = table(report)
  for want in ("NVIDIA H200", "NV does not open here", "overhead +0.010 s", "copy on the prefill thread", "70B shapes, 2 layers",
               "2 staging buffers page-locked", "staged 2 / slow 0.210 s", "PASS"):
    assert want in text, want

def test_a_senders_device_layers_leave_through_the_ring_without_a_host_region():
  """KVSender with K, V in device memory (the PYTHON emulator) sends every layer through the ring and never allocates the
  n_layers x layer host region that host-memory layers are packed into; with K, V in host memory it does."""
  from tinyhet.kv.sender import KVSender, SendBuffers
  from tinyhet.model.llama import small_config
  from tinyhet.runtime.descriptor import RegionDescriptor
  cfg, bs, n_tokens = small_config(n_layers=3, dim=KVH * D * 2, n_heads=2 * KVH, n_kv_heads=KVH), 4, 10
  kv = layers_kv(cfg.n_layers, n_tokens, seed=4)
  nb = -(-n_tokens // bs)
  block = 2 * KVH * bs * D * 2
  want = expected(kv, bs)
  for device, host_made in (("PYTHON", False), ("MESH", True)):
    pools = [RegionDescriptor("decode", l, 4096, 0, 0, nb * block).to_hex() for l in range(cfg.n_layers)]
    reservation = {"seq_id": 1, "blocks": list(range(nb)), "pools": pools, "block_bytes": block, "block_size": bs}
    slow = SlowTransport(np.zeros(cfg.n_layers * nb * block, np.uint8))
    buffers = SendBuffers(local_node(), 2)
    sender = KVSender(slow, None, reservation, cfg, dtypes.float16, buffers)
    sender._spans = lambda layer, region, offset: [Span(region, offset + i * block, None, (layer * nb + i) * block, block) for i in range(nb)]
    for layer, (k, v) in enumerate(kv):
      sender.send(layer, Tensor(k, device=device).realize(), Tensor(v, device=device).realize())
    sender.finish(30)
    assert (buffers.host_region is not None) == host_made, device
    np.testing.assert_array_equal(slow.dest, want, err_msg=device)
    buffers.free()

def test_a_senders_small_layers_are_posted_on_the_prefill_thread_and_large_ones_by_the_writer(monkeypatch):
  """A short prompt's layers (at most INLINE_LAYER_BYTES) are packed and posted on the thread that sends them, never
  through the writer thread's queue (waking it cost ~1 ms a layer: +34 ms TTFT at 100 tokens); past the threshold they go
  to the writer thread. Either way the same bytes land with the same notices, in layer order."""
  import tinyhet.kv.sender as sender_mod
  from tinyhet.kv.notices import notice_value
  from tinyhet.model.llama import small_config
  from tinyhet.runtime.descriptor import RegionDescriptor
  cfg, bs, n_tokens = small_config(n_layers=3, dim=KVH * D * 2, n_heads=2 * KVH, n_kv_heads=KVH), 4, 10
  kv = layers_kv(cfg.n_layers, n_tokens, seed=5)
  nb = -(-n_tokens // bs)
  block = 2 * KVH * bs * D * 2
  want = expected(kv, bs)
  class Recording(SlowTransport):
    def write(self, peer, spans, notify=None):
      self.posts.append((threading.current_thread(), notify))
      return super().write(peer, spans, notify)
  for threshold, inline in ((sender_mod.INLINE_LAYER_BYTES, True), (nb * block - 1, False)):
    monkeypatch.setattr(sender_mod, "INLINE_LAYER_BYTES", threshold)
    pools = [RegionDescriptor("decode", l, 4096, 0, 0, nb * block).to_hex() for l in range(cfg.n_layers)]
    reservation = {"seq_id": 7, "blocks": list(range(nb)), "pools": pools, "block_bytes": block, "block_size": bs}
    transport = Recording(np.zeros(cfg.n_layers * nb * block, np.uint8))
    transport.posts = []
    buffers = SendBuffers(local_node(), 0)
    sender = sender_mod.KVSender(transport, None, reservation, cfg, dtypes.float16, buffers)
    sender._spans = lambda layer, region, offset: [Span(region, offset + i * block, None, (layer * nb + i) * block, block) for i in range(nb)]
    for layer, (k, v) in enumerate(kv):
      sender.send(layer, Tensor(k, device="MESH").realize(), Tensor(v, device="MESH").realize())
    assert (sender.writer.thread is None) == inline, threshold
    assert sender.writer.inlined == (cfg.n_layers if inline else 0)
    sender.finish(30)
    threads = {t for t, _ in transport.posts}
    assert threads == ({threading.current_thread()} if inline else {sender.writer.thread}), threshold
    assert [n for _, n in transport.posts] == [notice_value(7, layer) for layer in range(cfg.n_layers)]
    np.testing.assert_array_equal(transport.dest, want)
    buffers.free()

class Holding(SlowTransport):
  """A transport that can hold notices (as shm can): records each write's thread and notice, and when the held notices
  were sent (how many writes had been posted by then)."""
  def __init__(self, dest):
    super().__init__(dest)
    self.posts, self.holds, self.sent_after = [], 0, []
  def hold_notices(self, peer) -> bool:
    self.holds += 1
    return True
  def send_notices(self, peer): self.sent_after.append(len(self.posts))
  def write(self, peer, spans, notify=None):
    self.posts.append((threading.current_thread(), notify))
    return super().write(peer, spans, notify)

@pytest.mark.parametrize("chunked", [False, True])
def test_a_requests_notices_are_held_until_its_final_write_and_chunk_pieces_post_on_the_prefill_thread(chunked):
  """A request's notices are held from its first write (one hold) and sent once, just before its final write (every
  layer's last piece), which sends its own: the decode node is woken once, not once a write. A chunked prefill's pieces
  (send_chunk, from the prefill's pool in host memory) are posted on the sending thread whatever their size (no writer
  thread: on a CPU prefill it overlaps nothing and cost a wake-up per piece), a chunk's together at its last layer
  (GROUP_BYTES), the final group after the held notices; the bytes and notices are the same."""
  from tinyhet.kv.notices import notice_value
  from tinyhet.kv.sender import KVSender
  from tinyhet.model.llama import small_config
  from tinyhet.runtime.descriptor import RegionDescriptor
  cfg, bs, n_tokens = small_config(n_layers=3, dim=KVH * D * 2, n_heads=2 * KVH, n_kv_heads=KVH), 4, 12
  kv = layers_kv(cfg.n_layers, n_tokens, seed=6)
  nb, block = -(-n_tokens // bs), 2 * KVH * bs * D * 2
  want = expected(kv, bs)
  pools = [RegionDescriptor("decode", l, 4096, 0, 0, nb * block).to_hex() for l in range(cfg.n_layers)]
  reservation = {"seq_id": 3, "blocks": list(range(nb)), "pools": pools, "block_bytes": block, "block_size": bs}
  transport = Holding(np.zeros(cfg.n_layers * nb * block, np.uint8))
  buffers = SendBuffers(local_node(), 0)
  sender = KVSender(transport, None, reservation, cfg, dtypes.float16, buffers)
  sender.writer.inline_bytes = 0                         # even a tiny piece is past the whole-layer threshold
  # each layer's blocks at its own slot of the destination (the descriptors above are stand-ins)
  sender._spans = lambda layer, region, offset: [Span(region, offset + i * block, None, (layer * nb + i) * block, block) for i in range(nb)]
  if chunked:    # two pieces a layer, chunk-major as chunked_prefill posts them: blocks 0..1, then 2..nb-1
    import tinyhet.kv.sender as sender_mod
    real = sender_mod.block_spans
    sender_mod.block_spans = lambda region, offset, pool, blocks, bb: [Span(region, offset + i * bb, None, (pool.region_id * nb + b) * bb, bb)
                                                                       for i, b in enumerate(blocks)]
    try:
      pool_of = [Tensor(want[l * nb * block:(l + 1) * nb * block]).bitcast(dtypes.float16).reshape(nb, 2, KVH, bs * D).to("MESH").realize()
                 for l in range(cfg.n_layers)]
      for piece, (b0, b1) in enumerate(((0, 2), (2, nb))):
        for layer in range(cfg.n_layers): assert sender.send_chunk(layer, pool_of[layer], b0, b1, piece, 2)
    finally: sender_mod.block_spans = real
    notices = [notice_value(3, layer, piece, piece == 1) for piece in range(2) for layer in range(cfg.n_layers)]
  else:
    for layer, (k, v) in enumerate(kv): sender.send(layer, Tensor(k, device="MESH").realize(), Tensor(v, device="MESH").realize())
    notices = [notice_value(3, layer) for layer in range(cfg.n_layers)]
  sender.finish(30)
  # once, right before the final write; chunk pieces go in groups (here a chunk's, posted at its last layer): before the final group
  assert transport.holds == 1 and transport.sent_after == [len(notices) - (cfg.n_layers if chunked else 1)]
  assert [n for _, n in transport.posts] == notices
  if chunked: assert {t for t, _ in transport.posts} == {threading.current_thread()} and sender.writer.thread is None
  np.testing.assert_array_equal(transport.dest, want)
  buffers.free()

class Grouping(Holding):
  """Holding, with write_many: records each call's writes."""
  def __init__(self, dest):
    super().__init__(dest)
    self.calls: list[list[int]] = []
  def write_many(self, peer, writes):
    self.calls.append([n for _, n in writes])
    return [self.write(peer, spans, n) for spans, n in writes]

@settings(max_examples=25, deadline=None)
@given(n_layers=st.integers(1, 4), nb=st.integers(1, 6), data=st.data())
def test_chunk_pieces_go_in_groups_that_end_at_a_chunks_last_layer_and_keep_every_piece_in_order(n_layers, nb, data):
  """A chunked prefill's pieces are posted in groups (one write_many each): every piece once, in the order sent, each
  group ending at a chunk's last layer or where the next piece would take it past GROUP_BYTES (a piece alone may be
  larger); the held notices go out once, right before the final group; the bytes are the same."""
  import tinyhet.kv.sender as sender_mod
  from tinyhet.kv.notices import notice_value
  from tinyhet.model.llama import small_config
  from tinyhet.runtime.descriptor import RegionDescriptor
  cfg, bs = small_config(n_layers=n_layers, dim=KVH * D * 2, n_heads=2 * KVH, n_kv_heads=KVH), 4
  block = 2 * KVH * bs * D * 2
  cuts = sorted(data.draw(st.lists(st.integers(1, max(1, nb - 1)), max_size=3, unique=True))) if nb > 1 else []
  chunks = list(zip([0, *cuts], [*cuts, nb]))
  group_bytes = data.draw(st.integers(1, 3 * nb * block))
  kv = layers_kv(n_layers, nb * bs, seed=nb)
  want = expected(kv, bs)
  pools = [RegionDescriptor("decode", l, 4096, 0, 0, nb * block).to_hex() for l in range(n_layers)]
  reservation = {"seq_id": 5, "blocks": list(range(nb)), "pools": pools, "block_bytes": block, "block_size": bs}
  transport = Grouping(np.zeros(n_layers * nb * block, np.uint8))
  buffers = SendBuffers(local_node(), 0)
  real, old_group = sender_mod.block_spans, sender_mod.GROUP_BYTES
  sender_mod.block_spans = lambda region, offset, pool, blocks, bb: [Span(region, offset + i * bb, None, (pool.region_id * nb + b) * bb, bb)
                                                                     for i, b in enumerate(blocks)]
  sender_mod.GROUP_BYTES = group_bytes
  try:
    sender = sender_mod.KVSender(transport, None, reservation, cfg, dtypes.float16, buffers)
    sender.writer.inline_bytes = 0
    pool_of = [Tensor(want[l * nb * block:(l + 1) * nb * block]).bitcast(dtypes.float16).reshape(nb, 2, KVH, bs * D).to("MESH").realize()
               for l in range(n_layers)]
    order = []
    for piece, (b0, b1) in enumerate(chunks):
      for layer in range(n_layers):
        assert sender.send_chunk(layer, pool_of[layer], b0, b1, piece, len(chunks))
        order.append(notice_value(5, layer, piece, piece == len(chunks) - 1))
    sender.finish(30)
  finally: sender_mod.block_spans, sender_mod.GROUP_BYTES = real, old_group
  assert [n for _, n in transport.posts] == order and [n for c in transport.calls for n in c] == order
  sizes = {notice_value(5, l, p, p == len(chunks) - 1): (b1 - b0) * block for p, (b0, b1) in enumerate(chunks) for l in range(n_layers)}
  last_layer = {notice_value(5, n_layers - 1, p, p == len(chunks) - 1) for p in range(len(chunks))}
  for c, after in zip(transport.calls, [*transport.calls[1:], None]):
    held = sum(sizes[n] for n in c)
    assert c[-1] in last_layer or held + sizes[after[0]] > group_bytes, (c, group_bytes)
    assert (held <= group_bytes or len(c) == 1) and not any(n in last_layer for n in c[:-1])
  assert transport.holds == 1 and transport.sent_after == [len(order) - len(transport.calls[-1])]
  np.testing.assert_array_equal(transport.dest, want)
  buffers.free()

@pytest.mark.parametrize("fail_at", [None, 1])
def test_a_short_prompts_writes_to_a_holding_link_wait_for_its_last_layer(fail_at):
  """A short prompt's layers over a link that holds notices (shm) are kept back and posted together, in layer order, once
  the last layer is handed over (DEFER_SHORT): nothing is posted before, then the same bytes land with the same notices,
  which go out once, before the final write. What before_post raises at a kept-back layer (the service's caller gone)
  stops the request there, as it would have at that layer's write: nothing is posted, and check() raises it."""
  from tinyhet.kv.notices import notice_value
  from tinyhet.kv.sender import KVSender
  from tinyhet.model.llama import small_config
  from tinyhet.runtime.descriptor import RegionDescriptor
  cfg, bs, n_tokens = small_config(n_layers=4, dim=KVH * D * 2, n_heads=2 * KVH, n_kv_heads=KVH), 4, 10
  kv = layers_kv(cfg.n_layers, n_tokens, seed=8)
  nb, block = -(-n_tokens // bs), 2 * KVH * bs * D * 2
  pools = [RegionDescriptor("decode", l, 4096, 0, 0, nb * block).to_hex() for l in range(cfg.n_layers)]
  reservation = {"seq_id": 5, "blocks": list(range(nb)), "pools": pools, "block_bytes": block, "block_size": bs}
  transport = Holding(np.zeros(cfg.n_layers * nb * block, np.uint8))
  buffers = SendBuffers(local_node(), 0)
  calls = []
  def before_post():
    calls.append(len(transport.posts))
    if fail_at is not None and len(calls) > fail_at: raise RuntimeError("the caller went away")
  sender = KVSender(transport, None, reservation, cfg, dtypes.float16, buffers, before_post)
  sender._spans = lambda layer, region, offset: [Span(region, offset + i * block, None, (layer * nb + i) * block, block) for i in range(nb)]
  for layer, (k, v) in enumerate(kv):
    sender.send(layer, Tensor(k, device="MESH").realize(), Tensor(v, device="MESH").realize())
    if layer < cfg.n_layers - 1: assert transport.posts == [], layer       # kept back
  if fail_at is not None:
    assert transport.posts == [] and len(calls) == fail_at + 1
    with pytest.raises(RuntimeError, match="went away"): sender.check()
    assert sender.abort()
  else:
    sender.finish(30)
    assert sender.defer and sender.writer.thread is None
    assert [n for _, n in transport.posts] == [notice_value(5, layer) for layer in range(cfg.n_layers)]
    assert transport.holds == 1 and transport.sent_after == [cfg.n_layers - 1]
    np.testing.assert_array_equal(transport.dest, expected(kv, bs))
  buffers.free()

@settings(max_examples=60, deadline=None)
@given(blocks=st.lists(st.integers(0, 40), min_size=1, max_size=24, unique=True), offset=st.integers(0, 3))
def test_block_spans_write_each_block_where_one_span_a_block_would(blocks, offset):
  """block_spans merges runs of consecutive destination blocks: every local block i still goes to pool block blocks[i],
  and there is one span per run."""
  from tinyhet.kv.sender import block_spans
  from tinyhet.runtime.descriptor import RegionDescriptor
  bb, pool = 8, RegionDescriptor("decode", 1, 4096, 0, 0, 64 * 8)
  spans = block_spans("region", offset * bb, pool, blocks, bb)
  moved = {}
  for s in spans:
    assert s.local == "region" and s.remote == pool and s.nbytes % bb == 0
    for j in range(s.nbytes // bb): moved[s.local_offset // bb + j - offset] = s.remote_offset // bb + j
  assert moved == dict(enumerate(blocks))
  assert len(spans) == 1 + sum(b != a + 1 for a, b in zip(blocks, blocks[1:]))
