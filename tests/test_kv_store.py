"""The decode node as a KV store, with real processes (the helpers of test_service.py): a conversation through the router
(a prefill node, two decode nodes), turn after turn: the first turn is prefilled on the prefill node, later ones land on the
decode node holding the conversation's blocks (KV-aware routing); the prefill node pulls their cached prefix out of that
node's blocks (tcp reads through the reservation's read grant), prefills the suffix only and sends only the suffix's KV,
giving the tokens of a cluster without the cache; kill -9 of that node: the next turn completes on the other (recomputed). And the default chat
request (no max_tokens: the whole context) on a 64 MiB pool, which admission by need serves where admitting
prompt + max_tokens at once answered 400."""
import http.client, json, time
import pytest
from test_service import ADMIN, Proc, Router
from tinyhet.model.spec import model_id

class StoreRouter(Router):
  def __init__(self, *args): Proc.__init__(self, "serve", "--listen", "127.0.0.1:0", "--model", SPEC, *args, env={"TINYHET_ADMIN_KEY": ADMIN})

def node(role: str, *extra, env=None) -> Proc:
  return Proc("node", "--role", role, "--listen", "127.0.0.1:0", "--model", SPEC, "--quiet", *extra, env=env)

# KV of 4 layers x 4 heads x 64 x 2 (K, V) x 2 bytes = 4 KiB a token: a 64 MiB pool holds 16,384 tokens, an eighth of the context
SPEC = "random:n_layers=4,dim=256,n_heads=4,n_kv_heads=4,hidden_dim=128,max_context=131072"
MODEL = model_id(SPEC)
LAST: dict = {}    # the conversation the multi-turn test left on a node, for the kill test

@pytest.fixture(scope="module")
def store():
  # the prefill node writes and pulls over tcp (the transport that checks every frame; on one host auto would pick shm)
  procs = {"prefill": node("prefill", env={"TINYHET_TRANSPORT": "tcp"}), "d1": node("decode", "--kv-memory", "64M", "--max-seqs", "4"),
           "d2": node("decode", "--kv-memory", "64M", "--max-seqs", "4"),
           "plain": node("decode", "--kv-memory", "64M", "--max-seqs", "4", "--no-prefix-cache")}
  routers = []
  try:
    routers.append(StoreRouter("--prefill", procs["prefill"].address, "--decode", procs["d1"].address, "--decode", procs["d2"].address))
    routers.append(StoreRouter("--decode", procs["plain"].address))
    routers[0].wait_ready(nodes_up=3)
    routers[1].wait_ready(nodes_up=1)
    yield (*routers, procs)
  finally:
    for p in [*routers, *procs.values()]: p.stop()

def holder(router) -> str | None:
  """The decode node whose heartbeat shows cached blocks, once the router has one (None after 30 s)."""
  deadline = time.monotonic() + 30
  while time.monotonic() < deadline:
    held = [n["address"] for n in router.request("GET", "/ready")[2]["nodes"] if n["up"] and n.get("cached_blocks")]
    if held: return held[0]
    time.sleep(0.2)
  return None

def complete(router, ids: list[int], n: int) -> tuple[list[int], dict]:
  status, _, obj = router.request("POST", "/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": n, "temperature": 0,
                                                               "return_token_ids": True})
  assert status == 200, obj
  return obj["choices"][0]["token_ids"], obj["usage"]

def turns(cached, plain, conversation: list[int], first: int, n: int) -> list[int]:
  for turn in range(first, first + n):
    conversation = conversation + [(turn * 13 + j) % 250 + 1 for j in range(12)]   # the user's turn
    got, usage = complete(cached, conversation, 8)
    want, usage0 = complete(plain, conversation, 8)
    assert got == want, f"turn {turn}"
    assert usage0["prompt_tokens_details"]["cached_tokens"] == 0
    if turn > first:   # every full block of the last turn's KV (its prompt and all but its last token) is cached: 16-token blocks
      assert usage["prompt_tokens_details"]["cached_tokens"] == (len(conversation) - 12 - 1) // 16 * 16, turn
    conversation += got
    if turn == first: assert holder(cached) is not None, "no decode node reports the first turn's blocks"
  return conversation

def test_multi_turn_chat_lands_on_its_cache_and_gives_the_no_cache_tokens(store):
  cached, plain, procs = store
  conversation = turns(cached, plain, [(i * 7 + 3) % 250 + 1 for i in range(150)], 0, 4)   # a 150-token "system prompt", 4 turns
  node_of = {procs[k].address: k for k in ("d1", "d2")}
  where = node_of[holder(cached)]
  assert cached.metric("tinyhet:node_requests_total", node=procs[where].address, role="decode") == 4     # every turn decoded there
  assert cached.metric("tinyhet:node_requests_total", role="prefill") == 4                              # and prefilled on the prefill node
  hits = cached.metric("tinyhet:prefix_cache_hits_total")
  assert hits > 0 and cached.metric("tinyhet:prefix_cache_queries_total") > 0
  # turns 2-4: their cached prefix pulled (the prefill node's cost model: a few hundred KiB over loopback against
  # recomputing ~150-200 tokens), 4 KiB a token
  assert cached.metric("tinyhet:kv_pulled_tokens_total") == hits
  assert cached.metric("tinyhet:kv_pulled_bytes_total") == hits * 4096
  assert cached.metric("tinyhet:prefix_cache_recomputed_tokens_total") == 0
  assert plain.metric("tinyhet:prefix_cache_hits_total") == 0
  LAST["conversation"] = conversation

def test_default_chat_request_on_a_64_mib_pool(store):
  """No max_tokens: the request asks for the rest of a 131,072-token context; the pool holds 16,384 tokens. It is admitted
  and streams tokens (the client leaves after a few: it would run until the pool's end)."""
  host, port = store[0].address.rsplit(":", 1)
  c = http.client.HTTPConnection(host, int(port), timeout=120)
  c.request("POST", "/v1/chat/completions", body=json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "stream": True}),
            headers={"Content-Type": "application/json"})
  r = c.getresponse()
  assert r.status == 200, r.read()
  chunks = 0
  for line in r:
    if line.startswith(b"data: {"):
      assert b'"error"' not in line, line
      chunks += 1
      if chunks == 4: break
  c.close()
  assert chunks == 4

def test_kill9_of_the_node_holding_the_prefix_costs_only_its_cache(store):
  """The decode node holding the conversation dies; the next turn completes on the other one, recomputed from the start."""
  cached, plain, procs = store
  conversation = LAST.get("conversation") or turns(cached, plain, [5] * 100, 10, 1)
  victim = {procs[k].address: k for k in ("d1", "d2")}[holder(cached)]
  procs[victim].kill9()
  ids = conversation + [9] * 12
  got, usage = complete(cached, ids, 8)
  assert got == complete(plain, ids, 8)[0] and usage["prompt_tokens_details"]["cached_tokens"] == 0

def test_a_pool_full_of_cached_blocks_still_admits_new_work(store):
  """A decode node with a 4 MiB pool (64 blocks of 16 tokens) behind the prefill node: three 300-token conversations fill
  it with cached blocks; new prompts are still admitted (cached blocks count as free and are evicted, least recently used
  first) and give the no-cache tokens, and the newest conversation's next turn is still a hit that the prefill node pulls."""
  _, plain, procs = store
  small = node("decode", "--kv-memory", "4M", "--max-seqs", "2")
  router = StoreRouter("--prefill", procs["prefill"].address, "--decode", small.address)
  try:
    router.wait_ready(nodes_up=2)
    prompts = [[(k * 37 + j * 11) % 250 + 1 for j in range(300)] for k in range(5)]
    for k, ids in enumerate(prompts):
      got, _ = complete(router, ids, 4)
      assert got == complete(plain, ids, 4)[0], f"prompt {k}"
      if k == 2:   # three prompts' full blocks (18 each) and their replies' fill most of the 64
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
          st = [n for n in router.request("GET", "/ready")[2]["nodes"] if n["role"] == "decode"][0]
          if st.get("cached_blocks", 0) >= 54: break
          time.sleep(0.2)
        assert st["cached_blocks"] >= 54 and st["kv_blocks"] == 64, st
    pulled = router.metric("tinyhet:kv_pulled_tokens_total")
    ids = prompts[-1] + got + [7] * 20                 # the newest conversation's next turn: its blocks were not evicted
    got2, usage = complete(router, ids, 4)
    assert got2 == complete(plain, ids, 4)[0] and usage["prompt_tokens_details"]["cached_tokens"] == 288
    assert router.metric("tinyhet:kv_pulled_tokens_total") - pulled == 288
  finally:
    router.stop()
    small.stop()
