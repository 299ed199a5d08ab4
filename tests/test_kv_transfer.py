"""A sequence's KV blocks on a decode node (MESH, another process) filled through a transport write land in the right slots."""
import json, os, subprocess, sys
import numpy as np, pytest
from tinygrad import Tensor, dtypes
from tinyhet.device.backend import region_of
from tinyhet.kernels.kv_pack import pack_kv
from tinyhet.device.memory import local_node
from tinyhet.runtime.descriptor import RegionDescriptor
from tinyhet.runtime.transport import Span

LAYERS, KVH, D, BLOCKS = 2, 2, 8, 24

DECODE_SIDE = """
import json, sys, numpy as np, tinyhet
from tinyhet.device.backend import region_of
from tinyhet.kv.paged_cache import PagedKVCache
from tinyhet.kernels.kv_pack import unpack_kv
from tinyhet.device.memory import local_node
node = local_node()
cache = PagedKVCache({layers}, {kvh}, {d}, {blocks}, {bs}, "float16", device="MESH", max_seq_len=512)
bm = cache.block_manager
bm.allocate(99, 5)                     # another sequence first, so that ours does not start at block 0
bm.reserve(1, {n})
pools = [node.expose(*region_of(cache.pool_buffer(l))).narrow(0, cache.pool_buffer(l).nbytes) for l in range({layers})]
print(json.dumps({{"address": node.serve(), "pools": [p.to_hex() for p in pools], "blocks": bm.block_table(1),
                  "block_bytes": cache.block_nbytes}}), flush=True)
sys.stdin.readline()
got = [node.endpoint.wait_notice(10).value for _ in range({layers})]
out = {{"notices": sorted(got)}}
for l in range({layers}):
  blocks = np.concatenate([np.frombuffer(cache.read_block_bytes(l, b), np.float16) for b in bm.block_table(1)])
  blocks = blocks.reshape(len(bm.block_table(1)), 2, {kvh}, {bs} * {d})
  from tinygrad import Tensor
  k, v = unpack_kv(Tensor(blocks), {n}, {d})
  out[f"k{{l}}"], out[f"v{{l}}"] = k.numpy().tolist(), v.numpy().tolist()
  others = [b for b in range({blocks}) if b not in bm.block_table(1)]
  out[f"others{{l}}"] = int(sum(np.frombuffer(cache.read_block_bytes(l, b), np.uint8).any() for b in others))
print(json.dumps(out), flush=True)
"""

@pytest.mark.parametrize("transport, n, bs", [("tcp", 13, 4), ("shm", 13, 4), ("tcp", 32, 8), ("shm", 7, 16)])
def test_blocks_written_through_a_transport_land_in_their_slots(transport, n, bs):
  env = {**os.environ, "TINYHET_TOKEN": "kv-test", "TINYHET_NODE": "kvnode", "TINYHET_ARENA_BYTES": "64M"}
  code = DECODE_SIDE.format(layers=LAYERS, kvh=KVH, d=D, blocks=BLOCKS, bs=bs, n=n)
  proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
  try:
    info = json.loads(proc.stdout.readline())
    node = local_node()
    node.endpoint.token = "kv-test"
    peer = node.endpoint.connect(info["address"], transport)
    pools, blocks, block_bytes = [RegionDescriptor.from_hex(h) for h in info["pools"]], info["blocks"], info["block_bytes"]
    rng = np.random.default_rng(n * bs)
    want, keep = [], []
    for layer in range(LAYERS):
      k, v = (rng.standard_normal((n, KVH, D)).astype(np.float16) for _ in range(2))
      want.append((k, v))
      packed = pack_kv(Tensor(k, device="HET"), Tensor(v, device="HET"), bs, dtypes.float16).contiguous().realize()
      region, off = region_of(packed.uop.buffer)
      spans = [Span(region, off + i * block_bytes, pools[layer], b * block_bytes, block_bytes) for i, b in enumerate(blocks)]
      node.endpoint.write(peer, spans, notify=layer).wait(30)
      keep.append(packed)
    proc.stdin.write("go\n")
    proc.stdin.flush()
    out = json.loads(proc.stdout.readline())
    assert out["notices"] == list(range(LAYERS))
    for layer, (k, v) in enumerate(want):
      np.testing.assert_array_equal(np.array(out[f"k{layer}"], np.float16), k)
      np.testing.assert_array_equal(np.array(out[f"v{layer}"], np.float16), v)
      assert out[f"others{layer}"] == 0          # no other block of the pool was touched
    peer.close()
  finally:
    proc.stdin.close()
    proc.wait(30)
