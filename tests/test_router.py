"""The router's choices, on node states as heartbeats report them (plain Python, no processes): where a request is decoded
and prefilled, the bounded queue, and planner.route's say over disaggregation. The processes themselves: test_service.py."""
import itertools, pathlib, threading, time
import pytest
from hypothesis import given, settings, strategies as st
from tinyhet.service.router import BadRequest, Cluster, Node, Overloaded, Unavailable

ROOT = pathlib.Path(__file__).parent.parent

NAMES = itertools.count()
def state(role: str, up=True, **status) -> Node:
  n = Node(f"{role}-{next(NAMES)}", role, up=up)
  n.status = {"model": "m", "block_size": 16, "kv_blocks": 100, "free_blocks": 100, "running": 0, "waiting": 0, "incoming": 0, "max_seqs": 8,
              "queued_tokens": 0, **status}
  return n

def cluster(*nodes: Node, **kw) -> Cluster:
  c = Cluster(None, {}, "m", **kw)          # no addresses: no heartbeat watches; the states are set here
  c.nodes = {n.address: n for n in nodes}
  return c

def test_decode_goes_where_there_is_room_and_least_load():
  full, busy, idle = state("decode", free_blocks=1), state("decode", running=6), state("decode", running=1)
  c = cluster(full, busy, idle, state("decode", up=False), state("prefill"))
  node, blocks = c._admit(100)                    # 7 blocks
  assert node is idle and blocks.blocks == 7 and idle.reserved_blocks == 7 and idle.assigned == 1
  c._release(node, blocks)
  assert idle.reserved_blocks == 0 and idle.assigned == 0

def test_router_counts_its_own_reservations_before_heartbeats_do():
  a = state("decode", kv_blocks=10, free_blocks=10)
  c = cluster(a, queue_timeout=0.2)
  c._admit(100)                                   # 7 of 10 blocks, not yet in any heartbeat
  with pytest.raises(Overloaded, match="stayed full"): c._admit(100)

def test_a_pool_that_holds_the_whole_answer_first():
  """A small idle pool (12 blocks) and a busier large one: 100 + 140 tokens (15 blocks) go to the large one, never to be cut
  short with 'length' on the small one; 100 + 80 go to the idle small one; a request no pool holds whole goes by load."""
  small, large = state("both", kv_blocks=12, free_blocks=12, max_seqs=4), state("decode", running=1, max_seqs=16)
  c = cluster(small, large)
  for new, where in ((140, large), (80, small), (100_000, small)):
    node, blocks = c._admit(100, new)
    assert node is where, (new, node.address)
    c._release(node, blocks)                      # its blocks count as free again at once (no beat needed)

def test_bounded_queue_then_503():
  a = state("decode", free_blocks=0)
  c = cluster(a, max_queue=2, queue_timeout=5)
  admitted = []
  waiters = [threading.Thread(target=lambda: admitted.append(c._admit(16))) for _ in range(2)]
  for t in waiters: t.start()
  deadline = time.monotonic() + 60
  while c.waiting < 2 and time.monotonic() < deadline: time.sleep(0.01)
  assert c.waiting == 2, "the two waiters did not queue"
  with pytest.raises(Overloaded, match="2 requests wait already"): c._admit(16)
  with c.cond:                                    # room appears: the waiters are admitted
    a.status["free_blocks"] = 100
    c.cond.notify_all()
  for t in waiters: t.join(5)
  assert c.waiting == 0 and a.assigned == 2 and [n for n, _ in admitted] == [a, a]

def test_too_large_for_every_pool_is_a_bad_request_and_no_node_is_unavailable():
  with pytest.raises(BadRequest, match="more KV blocks than any decode node"): cluster(state("decode", kv_blocks=4))._admit(100)
  with pytest.raises(Unavailable, match="no decode node is up"): cluster(state("decode", up=False), queue_timeout=0.1)._admit(16)

def test_admission_by_need_holds_the_prompt_and_a_little_headroom():
  """A request without max_tokens asks for the whole context; it is admitted with its prompt's blocks and a headroom, and
  only a prompt no pool holds is a BadRequest."""
  a = state("decode", kv_blocks=8, free_blocks=8)
  c = cluster(a)
  node, blocks = c._admit(100, 131_072 - 100)      # 100 + 16 headroom tokens: 8 blocks, not 8,192
  assert node is a and blocks.blocks == 8
  c._release(node, blocks)                         # over: its blocks count as free again, no heartbeat needed
  node, blocks = c._admit(100, 5)                  # headroom at most the tokens asked for
  assert blocks.blocks == 7
  c._release(node, blocks)
  with pytest.raises(BadRequest, match="a prompt of 129 tokens"): c._admit(129, 1)

def test_prefill_on_the_least_queued_node_or_locally():
  d, p1, p2 = state("decode"), state("prefill", queued_tokens=500), state("prefill", queued_tokens=20)
  assert cluster(d, p1, p2)._choose_prefill(d, 100, 10) is p2
  assert cluster(d, state("prefill", up=False))._choose_prefill(d, 100, 10) is None      # no prefill node: the decode node prefills
  both = state("both", queued_tokens=0)
  assert cluster(both, p1)._choose_prefill(both, 100, 10) is None     # a both node with the shorter queue prefills for itself
  busy_both = state("both", queued_tokens=900)
  assert cluster(busy_both, p2)._choose_prefill(busy_both, 100, 10) is p2
  other_both = state("both", queued_tokens=0)
  assert cluster(d, other_both, p1)._choose_prefill(d, 100, 10) is other_both          # dynamic P:D: a both node takes prefill work

def test_a_both_nodes_role_follows_queues_and_free_blocks():
  """Dynamic P:D on one pair of nodes as their heartbeats change: a `both` node B and a decode node D. Which one decodes
  follows free KV blocks and running batches; whether B prefills (for itself or for D) follows the prefill queues."""
  b, d = state("both"), state("decode", running=1)
  c = cluster(b, d)
  def served(prompt_len=100):       # the decode node, and where the prefill runs (None: on the decode node itself)
    node, blocks = c._admit(prompt_len + 10)
    try: return node, c._choose_prefill(node, prompt_len, 10)
    finally: c._release(node, blocks)
  assert served() == (b, None)                       # B idle, D busier: B decodes and prefills for itself
  d.status.update(running=0)
  b.status.update(running=3)
  assert served() == (d, b)                          # B busier decoding: D decodes, B prefills for it
  b.status.update(running=0, free_blocks=3)
  assert served() == (d, b)                          # B's pool too full for the request: the same
  b.status.update(free_blocks=100)
  d.status.update(free_blocks=2)
  assert served() == (b, None)                       # D's pool full: B does both
  p = state("prefill", queued_tokens=0)
  c.nodes[p.address] = p
  b.status.update(queued_tokens=500)
  assert served() == (b, p)                          # B's prefill queue longer than a prefill node's: that node prefills
  b.status.update(queued_tokens=0)
  p.status.update(queued_tokens=500)
  assert served() == (b, None)                       # and the other way round

def test_planner_route_keeps_short_prompts_local():
  from tinyhet.planner.cluster_file import load_cluster
  d, p = state("decode"), state("prefill")
  c = cluster(d, p, planner=(load_cluster(ROOT / "examples/clusters/spark_m3ultra.toml"), "llama-3.1-8b"))
  assert c._choose_prefill(d, 60, 32) is None and c._choose_prefill(d, 8192, 32) is p

def test_cluster_file_roles_ask_the_cost_model_for_the_pair():
  """With the nodes named in the cluster file (their roles given), the planner's cost model decides for the picked pair:
  prefill on the prefill node and stream, or prefill where the request is decoded; a long prefill queue keeps it local."""
  from tinyhet.planner.cluster_file import load_cluster
  d, p = state("decode"), state("prefill")
  spark = load_cluster(ROOT / "examples/clusters/spark_m3ultra.toml")
  c = cluster(d, p, planner=(spark, "llama-3.1-8b"), names={p.address: "spark", d.address: "mac"})
  assert c._choose_prefill(d, 60, 32) is None and c._choose_prefill(d, 8192, 32) is p
  # a prefix-cache hit on the Mac: a 16-token suffix is prefilled there (the Spark would read all its weights at 273 GB/s
  # for it, and pull the prefix over 10 GbE); a 4,096-token suffix is worth the pull
  assert c._choose_prefill(d, 8192, 32, cached=8192 - 16) is None and c._choose_prefill(d, 8192, 32, cached=4096) is p
  p.status.update(queued_tokens=100_000)
  c.prefill_s_per_token = 1.47 / 8192                      # the Spark's prefill rate, as the router would have measured it
  assert c._choose_prefill(d, 8192, 32) is None            # 18 s of queue there: the Mac prefills sooner itself
  # the README's two machines: the planner's own plan runs everything on the B200 ("gpu alone"), so planner.route never
  # disaggregates; with the roles the file gives, a CPU decode node gets even a short prompt prefilled on the GPU
  two = load_cluster(ROOT / "examples/clusters/two_machines.toml")
  c = cluster(d, p, planner=(two, "llama-3.1-8b"), names={p.address: "gpu", d.address: "cpu"})
  p.status.update(queued_tokens=0)
  assert c._choose_prefill(d, 10, 32) is p
  from tinyhet.planner.plan import route
  assert not any(route(two, "llama-3.1-8b", n, 32).disaggregate for n in (10, 8192))

@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["prefill", "decode", "both"]), st.booleans(), st.integers(0, 100), st.integers(0, 20)), min_size=1,
                max_size=6),
       st.lists(st.integers(1, 400), min_size=1, max_size=12))
def test_admission_never_overcommits(nodes, requests):
  states = [state(r, up=u, free_blocks=f, running=k) for r, u, f, k in nodes]
  c = cluster(*states, queue_timeout=0.001, max_queue=100)
  held = []
  for tokens in requests:
    try: held.append(c._admit(tokens))
    except (Overloaded, BadRequest, Unavailable): continue
    n = held[-1][0]
    assert n.up and n.can_decode and n.reserved_blocks <= n.status["free_blocks"]
  for n, b in held: c._release(n, b)
  assert all(s.reserved_blocks == 0 and s.assigned == 0 for s in states) and c.waiting == 0

def test_heartbeats_bring_nodes_up_and_another_model_keeps_them_out():
  from tinyhet.service.metrics import Metrics
  d, other = state("decode", up=False), state("decode", up=False)
  c = cluster(d, other, metrics=Metrics())
  c._beat(d, {**d.status, "model": "m"})
  c._beat(other, {**other.status, "model": "another"})
  assert d.up and not other.up and "same --model" in other.reason and c.ready()
  c._lost(d, "EOF")
  assert not d.up and d.reason == "EOF" and not c.ready()
  page = c.metrics.exposition().decode()
  assert f'tinyhet:node_up{{node="{d.address}",role="decode"}} 0.0' in page and "tinyhet:kv_cache_usage_perc" in page

def test_kv_aware_routing_follows_the_cached_prefix():
  """Heartbeat summaries of cached block hashes: a conversation's next turn goes to the node holding its prefix (unless that
  node is far busier) and needs fewer new blocks there; without a planner the prefill node still takes it (it pulls the
  cached prefix: tinyhet.kv.pull); a node that went away takes its cache with it."""
  from tinyhet.kv.block_manager import block_hashes
  ids = list(range(1, 161))                              # 10 blocks of 16
  holder, other, p = state("decode", running=2), state("decode", running=1), state("prefill")
  c = cluster(holder, other, p)
  c._beat(holder, {**holder.status, "cached_hashes": block_hashes(ids[:144], 16, "m")})   # 9 blocks cached
  assert holder.cached_tokens(ids) == 144 and other.cached_tokens(ids) == 0
  assert holder.cached_tokens(ids[:100] + [0] * 60) == 96                              # the chain stops at the first other block
  node, blocks = c._admit(len(ids), 8, ids)
  assert node is holder and blocks.blocks == 11 - 9                                           # (160 + 8) tokens: 11 blocks, 9 cached
  c._release(node, blocks)
  assert c._choose_prefill(holder, len(ids), 8, holder.cached_tokens(ids)) is p        # no planner: the prefill node (it pulls)
  assert c._choose_prefill(holder, len(ids), 8, 32) is p                               # mostly uncached: the prefill node
  c._beat(holder, {**holder.status, "running": 8})                                     # full, the other idle: the load wins
  c._beat(other, {**other.status, "running": 0})
  assert c._admit(len(ids), 8, ids)[0] is other
  c._beat(holder, {**holder.status, "cached_hashes": "junk"})                         # a bad summary is no summary
  assert holder.cached_tokens(ids) == 0

def test_cached_tokens_count_the_clients_prompt_only():
  """usage's cached_tokens: prompt tokens served from the cache, never more than prompt_tokens. After a lost node the new
  attempt's prompt is the client's prompt + the tokens sent so far, and the new node may hold more of it than the prompt."""
  from tinyhet.service.router import Request
  d = state("decode")
  c = cluster(d)
  req = Request(list(range(1, 21)), 40, lambda *a: None)
  req.generated = list(range(30))                        # 30 tokens streamed before the first node was lost
  c._done(req, d, {"cached_tokens": 48}, 50)             # the second node had 48 of the 50-token attempt cached
  assert req.cached_tokens == 20
  for reported, want in ((16, 16), (0, 0), (-3, 0), ("lots", 0), (True, 0), (None, 0), (2**70, 20)):
    c._done(req, d, {"cached_tokens": reported}, 50)
    assert req.cached_tokens == want, reported

def cache_ops():
  """Random prompts entering and leaving a real prefix-caching BlockManager (evicting cached blocks as the pool fills)."""
  return st.lists(st.tuples(st.integers(0, 5), st.integers(1, 200)), min_size=1, max_size=25)

@settings(max_examples=150, deadline=None)
@given(cache_ops(), st.sampled_from([4, 16, 1 << 18]))
def test_the_routers_view_of_a_cache_is_the_nodes_beat_after_beat(ops, limit):
  """node_roles.CacheSummary's beats (the whole set, then what changed) rebuild in the router exactly the node's cached
  hashes (the newest `limit` of them), however many there are: no window of the newest 1,024."""
  from tinyhet.kv.block_manager import BlockManager, block_hashes
  from tinyhet.service.node_roles import CacheSummary
  from tinyhet.service.router import cache_view
  bm = BlockManager(64, 4, prefix_cache=True, model_id="m")
  summary, view = CacheSummary(bm, limit), set()
  for i, (conv, n) in enumerate(ops):
    ids = [conv] * 3 + [(conv * 7 + j) % 50 for j in range(n)]     # conversations sharing their first tokens
    if not bm.can_allocate(len(ids), ids): continue
    bm.allocate(i, len(ids), ids)
    bm.deallocate(i, ids)
    view = cache_view(view, summary())
    assert view == set(list(bm.hash_block)[-limit:]) and len(view) <= limit
    if limit > 64: assert view == set(bm.hash_block) and all(h in view for h in block_hashes(ids, 4, "m"))    # the prompt just cached
  assert cache_view(view, {}) == view and cache_view(view, {"cached_added": "junk"}) == set()

def test_kv_aware_routing_finds_a_conversation_longer_than_a_thousand_blocks():
  """Real heartbeat streams: a decode node's block manager holds a 3,000-block conversation, then more conversations on
  top; the router's walk finds all of it (the heartbeat used to carry the newest 1,024 hashes: the chain's start was
  missing and the conversation routed as uncached). A second router's stream starts whole."""
  from tinyhet.kv.block_manager import BlockManager
  from tinyhet.runtime.transport import Endpoint
  from tinyhet.service import heartbeat
  from tinyhet.service.node_roles import CacheSummary
  bm = BlockManager(8000, 16, prefix_cache=True, model_id="m")
  long_ids = [(j * 13) % 997 for j in range(3000 * 16 + 5)]
  bm.allocate(1, len(long_ids), long_ids)
  bm.deallocate(1, long_ids)
  status = {"model": "m", "block_size": 16, "kv_blocks": 8000, "free_blocks": 8000, "running": 0, "waiting": 0, "incoming": 0, "max_seqs": 4}
  node = Endpoint("n", token="t")
  heartbeat.install(node, "decode", lambda: status, per_stream=lambda: CacheSummary(bm))
  address, router = node.listen("127.0.0.1", 0), Endpoint("router", token="t")
  routers = [Cluster(router, {address: "decode"}, "m", hb_interval=0.05, hb_timeout=5.0)]
  def wait(c, cond, what):
    deadline = time.monotonic() + 60
    while not cond(c.nodes[address]) and time.monotonic() < deadline: time.sleep(0.02)
    assert cond(c.nodes[address]), what
  try:
    wait(routers[0], lambda n: n.cached_tokens(long_ids) == 3000 * 16, "the long conversation")
    for k in range(3):                               # 3 x 1,000 newer blocks
      other = [k + 1000] + [(j * 7 + k) % 991 for j in range(1000 * 16 - 1)]
      bm.allocate(10 + k, len(other), other)
      bm.deallocate(10 + k, other)
    wait(routers[0], lambda n: len(n.cached) == len(bm.hash_block) == 6000, "the newer conversations")
    assert routers[0].nodes[address].cached_tokens(long_ids) == 3000 * 16
    routers.append(Cluster(router, {address: "decode"}, "m", hb_interval=0.05, hb_timeout=5.0))
    wait(routers[1], lambda n: n.cached == set(bm.hash_block), "a second router's whole view")
    assert routers[1]._admit(len(long_ids), 8, long_ids)[0].cached_tokens(long_ids) == 3000 * 16
  finally:
    for c in routers: c.close()
    for ep in (node, router): ep.close()

def test_kv_aware_routing_hashes_with_the_nodes_cache_key_and_the_tenants_salt():
  """A node's heartbeat names the key its block hashes are made with (its model's fingerprint and KV dtype); the router
  finds a tenant's prefix there under that tenant's salt only (tinyhet.service.tenancy), and admits it by that hit."""
  from tinyhet.kv.block_manager import block_hashes
  ids = list(range(1, 161))
  holder, other = state("decode", running=2), state("decode", running=1)
  c = cluster(holder, other)
  c._beat(holder, {**holder.status, "cache_key": "fp/float16", "cached_hashes": block_hashes(ids[:144], 16, "fp/float16", salt="t1")})
  assert holder.cached_tokens(ids, "t1") == 144
  assert holder.cached_tokens(ids) == 0 and holder.cached_tokens(ids, "t2") == 0     # another tenant (or none) sees no hit
  assert c._admit(len(ids), 8, ids, salt="t1")[0] is holder
  assert c._admit(len(ids), 8, ids, salt="t2")[0] is other                          # no hit for it: the less loaded node

def test_disk_hits_score_below_ram_hits_and_need_their_blocks():
  """A node whose disk tier holds a prompt's blocks (its beat's disk summary) beats a node holding none, loses to one holding
  them in RAM at equal load, and needs every block still (a restored block takes a free one); /metrics counts RAM and disk
  hits and the disk bytes from the beats' figures."""
  from tinyhet.kv.block_manager import block_hashes
  from tinyhet.service.cache_view import DISK_WEIGHT
  from tinyhet.service.metrics import Metrics
  assert 0 < DISK_WEIGHT < 1
  ids = list(range(1, 161))
  ram, disk, cold = state("decode", running=1), state("decode", running=1), state("decode", running=1)
  c = cluster(disk, cold, metrics=Metrics())
  hashes = block_hashes(ids[:144], 16, "m")
  c._beat(disk, {**disk.status, "disk_hashes": hashes[2:], "cached_hashes": hashes[:2], "disk_hit_tokens": 32, "prefix_hit_tokens": 80,
                 "disk_written_bytes": 4096, "disk_read_bytes": 1024})
  assert disk.cached_tokens(ids) == 32 and disk.overlap(ids) == 32 + DISK_WEIGHT * 112
  node, blocks = c._admit(len(ids), 8, ids)
  assert node is disk and blocks.blocks == 11 - 2                                 # the RAM hit's 2 blocks only are saved
  c._release(node, blocks)
  c.nodes[ram.address] = ram
  c._beat(ram, {**ram.status, "cached_hashes": hashes})
  assert c._admit(len(ids), 8, ids)[0] is ram
  c._beat(disk, {**disk.status, "disk_hit_tokens": 48, "prefix_hit_tokens": 100, "disk_written_bytes": 8192, "disk_read_bytes": 1024,
                 "disk_dropped_spills": 3, "disk_bad_blocks": 1})
  page = c.metrics.exposition().decode()
  for line in ("tinyhet:prefix_cache_disk_hits_total 48.0", "tinyhet:prefix_cache_ram_hits_total 52.0",
               "tinyhet:kv_disk_written_bytes_total 8192.0", "tinyhet:kv_disk_read_bytes_total 1024.0",
               "tinyhet:kv_disk_dropped_spills_total 3.0", "tinyhet:kv_disk_bad_blocks_total 1.0"):
    assert line in page, line
  c._beat(disk, {**disk.status, "disk_hashes": "junk"})
  assert disk.overlap(ids) == disk.cached_tokens(ids)

def test_a_request_after_one_that_ended_waits_for_no_heartbeat():
  """A 10-block pool, two requests of 7 blocks one after the other, heartbeats 8 s apart. The router used to count the
  first one's blocks as taken for two beat intervals after its admission (node.recent) and to trust a beat made while it
  ran: the second waited for beats that had nothing new to say (a small pool's turns took 0.5 or 1 s, whatever their
  prefill). Now the first one's end frees its count at once, and with only the node's stale figures in the way the router
  asks the node (node.status) instead of waiting for its next beat."""
  from tinyhet.runtime.transport import Endpoint
  from tinyhet.service import heartbeat
  status = {"model": "m", "block_size": 16, "kv_blocks": 10, "free_blocks": 10, "running": 0, "waiting": 0, "incoming": 0, "max_seqs": 4}
  node = Endpoint("n", token="t")
  heartbeat.install(node, "decode", lambda: dict(status))
  address, router = node.listen("127.0.0.1", 0), Endpoint("router", token="t")
  c = Cluster(router, {address: "decode"}, "m", hb_interval=8.0, hb_timeout=60.0, queue_timeout=4.0)
  try:
    deadline = time.monotonic() + 60
    while not c.ready() and time.monotonic() < deadline: time.sleep(0.01)     # the first beat
    n = c.nodes[address]
    first, adm = c._admit(100)                      # 7 blocks
    assert first is n
    status["free_blocks"] = 3                       # the node holds them ...
    c._landed(n, adm)
    c._beat(n, {"role": "decode", "node": "n", "time": time.time(), **status})    # ... and a beat made while it runs shows it
    status["free_blocks"] = 10                      # it ends: the node frees them; the next beat is 8 s away
    c._release(n, adm)
    t0 = time.monotonic()
    second, adm = c._admit(100)                     # before: Overloaded after queue_timeout (no beat came within it)
    assert second is n and time.monotonic() - t0 < 4.0
    assert n.free_blocks() == 3 and n.status["free_blocks"] == 10 and n.recent == [adm]
    c._beat(n, {"role": "decode", "node": "n", "time": n.asked_at - 1, **{**status, "free_blocks": 0}})   # older news arriving late
    assert n.status["free_blocks"] == 10 and n.up
    c._release(n, adm)
  finally:
    c.close()
    for ep in (node, router): ep.close()
