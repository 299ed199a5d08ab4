"""The decode node as a KV store, with real processes (the helpers of test_service.py): a conversation through the router,
turn after turn, on a decode node that prefills for itself: later turns hit the cached blocks of earlier ones and give the
tokens of a run without the cache; the default chat request (no max_tokens: the whole context) on a 64 MiB pool, which
admission by need serves where admitting prompt + max_tokens at once answered 400."""
import http.client, json
import pytest
from test_service import Proc, Router
from tinyhet.model.spec import model_id

class StoreRouter(Router):
  def __init__(self, *args): Proc.__init__(self, "serve", "--listen", "127.0.0.1:0", "--model", SPEC, *args)

def node(role: str, *extra) -> Proc: return Proc("node", "--role", role, "--listen", "127.0.0.1:0", "--model", SPEC, "--quiet", *extra)

# KV of 4 layers x 4 heads x 64 x 2 (K, V) x 2 bytes = 4 KiB a token: a 64 MiB pool holds 16,384 tokens, an eighth of the context
SPEC = "random:n_layers=4,dim=256,n_heads=4,n_kv_heads=4,hidden_dim=128,max_context=131072"
MODEL = model_id(SPEC)

@pytest.fixture(scope="module")
def store():
  cached = node("decode", "--kv-memory", "64M", "--max-seqs", "4")
  plain = node("decode", "--kv-memory", "64M", "--max-seqs", "4", "--no-prefix-cache")
  routers = []
  try:
    for n in (cached, plain):
      routers.append(r := StoreRouter("--decode", n.address))
      r.wait_ready(nodes_up=1)
    yield routers
  finally:
    for p in routers + [cached, plain]: p.stop()

def complete(router, ids: list[int], n: int) -> tuple[list[int], dict]:
  status, _, obj = router.request("POST", "/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": n, "temperature": 0,
                                                               "return_token_ids": True})
  assert status == 200, obj
  return obj["choices"][0]["token_ids"], obj["usage"]

def test_multi_turn_chat_hits_the_cache_and_gives_the_no_cache_tokens(store):
  cached, plain = store
  conversation = [(i * 7 + 3) % 250 + 1 for i in range(150)]      # a "system prompt"
  for turn in range(4):
    conversation += [(turn * 13 + j) % 250 + 1 for j in range(12)]   # the user's turn
    got, usage = complete(cached, conversation, 8)
    want, usage0 = complete(plain, conversation, 8)
    assert got == want, f"turn {turn}"
    assert usage0["prompt_tokens_details"]["cached_tokens"] == 0
    # every full block of the last turn's KV (its prompt and all but its last token) is cached: 16-token blocks
    assert usage["prompt_tokens_details"]["cached_tokens"] == (0 if turn == 0 else (len(conversation) - 12 - 1) // 16 * 16), turn
    conversation += got
  assert cached.metric("tinyhet:prefix_cache_hits_total") > 0 and cached.metric("tinyhet:prefix_cache_queries_total") > 0
  assert plain.metric("tinyhet:prefix_cache_hits_total") == 0

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
