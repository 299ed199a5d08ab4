"""The OpenAI surface of the router with real processes on loopback (nodes and routers as tests/test_service.py starts
them, one set for the module): API keys, `model` left out, sampling options, logprobs read by the `openai` client, and
cancellation of non-streaming requests."""
import http.client, json, socket, time
import pytest
from test_service import Router, node, prompt, reference, SPEC  # noqa: F401  (SPEC: the nodes' model)

KEYS = ("key-one", "key-two")

@pytest.fixture(scope="module")
def model():
  import tinyhet  # noqa: F401
  from tinyhet.model import spec as service_model
  m, tok, model_id = service_model.load(SPEC, "HET")
  return m, model_id

@pytest.fixture(scope="module")
def nodes():
  """A prefill node, a decode node, a `both` node with 12 KV blocks (192 tokens); an open router over prefill + decode, a keyed
one over the `both` node."""
  procs = {"prefill": node("prefill"), "decode": node("decode", "--kv-memory", "16M"), "both": node("both", "--kv-memory", "48K")}
  try:
    procs["router"] = Router("--prefill", procs["prefill"].address, "--decode", procs["decode"].address)
    procs["keyed"] = Router("--both", procs["both"].address, "--api-key", KEYS[0], env={"TINYHET_API_KEY": f" ,{KEYS[1]}"})
    procs["router"].wait_ready(nodes_up=2)
    procs["keyed"].wait_ready(nodes_up=1)
    yield procs
  finally:
    for p in procs.values(): p.stop()

def call(router, method: str, path: str, body=None, headers=None) -> tuple[int, dict]:
  host, port = router.address.rsplit(":", 1)
  c = http.client.HTTPConnection(host, int(port), timeout=120)
  try:
    c.request(method, path, body=None if body is None else json.dumps(body), headers={"Content-Type": "application/json", **(headers or {})})
    r = c.getresponse()
    text = r.read()
    try: return r.status, json.loads(text)
    except json.JSONDecodeError: return r.status, {"text": text.decode(errors="replace")}
  finally: c.close()

def test_api_keys(nodes, model):
  keyed, body = nodes["keyed"], {"prompt": prompt(1), "max_tokens": 3, "temperature": 0}
  for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "key-one"}, {"Authorization": "Bearer key-one-and-more"},
                  {"Authorization": "Basic a2V5LW9uZQ=="}):
    for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models"), ("GET", "/v1/nothing-here")):
      status, obj = call(keyed, method, path, body if method == "POST" else None, headers)
      assert status == 401 and set(obj["error"]) == {"message", "type", "param", "code"} and obj["error"]["code"] == "invalid_api_key", obj
  for path in ("/health", "/ready", "/metrics"): assert call(keyed, "GET", path)[0] == 200, path
  for key in KEYS:                                  # the flag's key and the environment's (its empty entry is no key)
    status, obj = call(keyed, "POST", "/v1/completions", body, {"Authorization": f"Bearer {key}"})
    assert status == 200 and obj["usage"]["completion_tokens"] == 3, obj
  assert call(keyed, "POST", "/v1/completions", body, {"Authorization": "Bearer "})[0] == 401
  assert call(nodes["router"], "POST", "/v1/completions", body)[0] == 200      # no keys given: open
  openai = pytest.importorskip("openai")
  with pytest.raises(openai.AuthenticationError):
    openai.OpenAI(base_url=f"http://{keyed.address}/v1", api_key="nope", max_retries=0).models.list()
  client = openai.OpenAI(base_url=f"http://{keyed.address}/v1", api_key=KEYS[1], max_retries=0)
  assert [m.id for m in client.models.list().data] == [model[1]]

def test_model_may_be_left_out(nodes, model):
  router, ids = nodes["router"], prompt(2)
  status, obj = call(router, "POST", "/v1/completions", {"prompt": ids, "max_tokens": 4, "temperature": 0, "return_token_ids": True})
  assert status == 200 and obj["choices"][0]["token_ids"] == reference(model, ids, 4) and obj["model"] == model[1], obj
  status, obj = call(router, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
  assert status == 200 and obj["usage"]["completion_tokens"] == 2
  status, obj = call(router, "POST", "/v1/completions", {"model": "gpt-9", "prompt": ids, "max_tokens": 2})
  assert status == 404 and obj["error"]["code"] == "model_not_found"
  assert call(router, "POST", "/v1/completions", {"model": None, "prompt": ids, "max_tokens": 2})[0] == 200

def started_tokens(router, before: float, timeout: float = 60) -> None:
  deadline = time.monotonic() + timeout
  while router.metric("tinyhet:generation_tokens_total") <= before and time.monotonic() < deadline: pass

def settled(router, timeout: float = 60) -> None:
  deadline = time.monotonic() + timeout
  while router.metric("tinyhet:num_requests_running") > 0 and time.monotonic() < deadline: time.sleep(0.05)
  assert router.metric("tinyhet:num_requests_running") == 0

def hang_up(c: http.client.HTTPConnection) -> None:
  c.sock.shutdown(socket.SHUT_RDWR)
  c.close()

def post(router, body: dict) -> http.client.HTTPConnection:
  host, port = router.address.rsplit(":", 1)
  c = http.client.HTTPConnection(host, int(port), timeout=60)
  c.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
  return c

def test_non_streaming_request_is_cancelled_while_tokens_flow(nodes, model):
  router = nodes["router"]
  tokens, done = router.metric("tinyhet:generation_tokens_total"), router.metric("tinyhet:request_success_total")
  c = post(router, {"prompt": prompt(3), "max_tokens": 240, "temperature": 0})
  started_tokens(router, tokens)
  hang_up(c)                                   # the client goes away while the answer is being made
  settled(router)
  assert router.metric("tinyhet:request_success_total") == done
  assert router.metric("tinyhet:generation_tokens_total") - tokens < 240, "the request ran to its end: it was not cancelled"
  state = next(n for n in router.request("GET", "/ready")[2]["nodes"] if n["address"] == nodes["decode"].address)
  deadline = time.monotonic() + 20
  while state["free_blocks"] != state["kv_blocks"] and time.monotonic() < deadline:
    time.sleep(0.2)
    state = next(n for n in router.request("GET", "/ready")[2]["nodes"] if n["address"] == nodes["decode"].address)
  assert state["free_blocks"] == state["kv_blocks"] and state["running"] == 0, state

@pytest.mark.parametrize("stream", [False, True])
def test_request_waiting_for_kv_room_is_cancelled_when_its_client_goes(nodes, model, stream):
  """Every block of the `both` node held by a reservation made here: the request queues in the router for room; its client
  hangs up; once the room comes back the request is gone, not run for nobody."""
  from tinyhet.config import load_config
  from tinyhet.runtime.control import ControlClient
  from tinyhet.runtime.transport import Endpoint
  from test_service import TOKEN
  router, auth = nodes["keyed"], {"Authorization": f"Bearer {KEYS[0]}"}
  ep = Endpoint("test-holder", token=TOKEN, config=load_config(env={}))
  ctl = ControlClient(ep, nodes["both"].address)
  try:
    r = ctl.call("decode.reserve", prompt_ids=prompt(4, 180), max_new_tokens=1, timeout=10)      # a 180-token prompt: all 12 blocks
    deadline = time.monotonic() + 20
    while next(n for n in router.request("GET", "/ready")[2]["nodes"])["free_blocks"] > 0 and time.monotonic() < deadline: time.sleep(0.1)
    done = router.metric("tinyhet:request_success_total")
    host, port = router.address.rsplit(":", 1)
    c = http.client.HTTPConnection(host, int(port), timeout=60)
    c.request("POST", "/v1/completions", body=json.dumps({"prompt": prompt(5), "max_tokens": 8, "temperature": 0, "stream": stream}),
              headers={"Content-Type": "application/json", **auth})
    deadline = time.monotonic() + 20
    while router.metric("tinyhet:num_requests_waiting") < 1 and time.monotonic() < deadline: time.sleep(0.05)
    assert router.metric("tinyhet:num_requests_waiting") == 1
    hang_up(c)
    deadline = time.monotonic() + 20
    while router.metric("tinyhet:num_requests_waiting") > 0 and time.monotonic() < deadline: time.sleep(0.05)
  finally:
    ctl.call("decode.release", seq_id=r["seq_id"], writes_done=True)
    ctl.close()
    ep.close()
  settled(router)
  assert router.metric("tinyhet:request_success_total") == done, "a request whose client left was served"
  status, obj = call(router, "POST", "/v1/completions", {"prompt": prompt(5), "max_tokens": 2}, auth)
  assert status == 200, obj
