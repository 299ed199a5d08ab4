"""Defects a long-running node would hit: a caller's socket past descriptor 1,024 (select.select cannot watch it), and
sequence ids wrapping at MAX_SEQ_ID while old sequences still live."""
import itertools, os, resource, socket
import pytest
import tinyhet  # noqa: F401
from tinyhet.kv.notices import MAX_SEQ_ID
from tinyhet.service.prefill_node import Job

def high_socket(sock: socket.socket, at: int = 1500) -> socket.socket:
  """sock's descriptor duplicated at `at` (>= 1024), with the open-files limit raised for it."""
  soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
  if hard != resource.RLIM_INFINITY and hard <= at: pytest.skip(f"the open-files hard limit ({hard}) is below {at + 1}")
  if soft <= at: resource.setrlimit(resource.RLIMIT_NOFILE, (at + 1, hard))
  fd = os.dup2(sock.fileno(), at)
  return socket.socket(fileno=fd)

def test_caller_gone_watches_a_descriptor_past_1024():
  a, b = socket.socketpair()
  high = high_socket(a)
  try:
    assert high.fileno() >= 1024
    job = Job([1, 2], "decode", {}, {}, high)
    assert not job.caller_gone(), "a live caller is taken for gone"
    b.sendall(b"x")                            # a caller's next request waiting to be read is not a hang-up
    assert not job.caller_gone()
    b.close()
    assert job.caller_gone()
  finally:
    high.close()
    a.close()

def test_sequence_ids_wrap_past_live_ones():
  from tinyhet.device.memory import local_node
  from tinyhet.engine.decode_node import DecodeNode
  from tinyhet.model.llama import Llama, random_weights, small_config
  cfg = small_config(n_layers=1, dim=32, n_heads=2, n_kv_heads=1, hidden_dim=48, vocab_size=64, max_context=64)
  decode = DecodeNode(Llama(cfg, random_weights(cfg, device="MESH", seed=1), "MESH"), local_node(), kv_blocks=4, block_size=4, model_id="wrap")
  try:
    decode.seq_ids = itertools.count(MAX_SEQ_ID - 1)
    held = [decode.new_seq_id(), decode.new_seq_id(), decode.new_seq_id()]
    assert held == [MAX_SEQ_ID - 1, 0, 1]
    decode.seq_ids = itertools.count(2 * MAX_SEQ_ID - 1)           # the counter comes round again while those three live
    assert decode.new_seq_id() == 2
    decode.live_ids.discard(0)                                      # sequence 0 left (as _detach does)
    decode.seq_ids = itertools.count(MAX_SEQ_ID)
    assert decode.new_seq_id() == 0
    decode.cache.block_manager.allocate(3, 4)                       # an id the block manager holds is in use too
    decode.seq_ids = itertools.count(3)
    assert decode.new_seq_id() == 4
  finally: decode.close()
