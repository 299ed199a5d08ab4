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
  # the decode node caches what the prefill node writes: it is its trusted writer (by name)
  procs = {"prefill": node("prefill", env={"TINYHET_NODE": "api-prefill"}),
           "decode": node("decode", "--kv-memory", "16M", env={"TINYHET_TRUSTED_WRITERS": "api-prefill"}), "both": node("both", "--kv-memory", "48K")}
  try:
    procs["router"] = Router("--prefill", procs["prefill"].address, "--decode", procs["decode"].address)
    procs["keyed"] = Router("--both", procs["both"].address, "--api-key", KEYS[0], env={"TINYHET_API_KEY": f" ,{KEYS[1]}"})
    procs["router"].wait_ready(nodes_up=2)
    procs["keyed"].wait_ready(nodes_up=1)
    yield procs
  finally:
    for p in procs.values(): p.stop()

def call(router, method: str, path: str, body=None, headers=None, raw: bytes | None = None) -> tuple[int, dict]:
  host, port = router.address.rsplit(":", 1)
  c = http.client.HTTPConnection(host, int(port), timeout=120)
  try:
    c.request(method, path, body=raw if raw is not None else None if body is None else json.dumps(body),
              headers={"Content-Type": "application/json", **(headers or {})})
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
  while router.metric("tinyhet:generation_tokens_total") <= before and time.monotonic() < deadline: time.sleep(0.02)
  assert router.metric("tinyhet:generation_tokens_total") > before, "no token was generated"

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
  deadline = time.monotonic() + 60
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
    deadline = time.monotonic() + 60
    while next(n for n in router.request("GET", "/ready")[2]["nodes"])["free_blocks"] > 0 and time.monotonic() < deadline: time.sleep(0.1)
    assert next(n for n in router.request("GET", "/ready")[2]["nodes"])["free_blocks"] == 0, "the router never saw the pool full"
    done = router.metric("tinyhet:request_success_total")
    host, port = router.address.rsplit(":", 1)
    c = http.client.HTTPConnection(host, int(port), timeout=60)
    c.request("POST", "/v1/completions", body=json.dumps({"prompt": prompt(5), "max_tokens": 8, "temperature": 0, "stream": stream}),
              headers={"Content-Type": "application/json", **auth})
    deadline = time.monotonic() + 60
    while router.metric("tinyhet:num_requests_waiting") < 1 and time.monotonic() < deadline: time.sleep(0.05)
    assert router.metric("tinyhet:num_requests_waiting") == 1
    hang_up(c)
    deadline = time.monotonic() + 60
    while router.metric("tinyhet:num_requests_waiting") > 0 and time.monotonic() < deadline: time.sleep(0.05)
  finally:
    ctl.call("decode.release", seq_id=r["seq_id"], writes_done=True)
    ctl.close()
    ep.close()
  settled(router)
  assert router.metric("tinyhet:request_success_total") == done, "a request whose client left was served"
  status, obj = call(router, "POST", "/v1/completions", {"prompt": prompt(5), "max_tokens": 2}, auth)
  assert status == 200, obj

def ref_logprobs(model, ids: list[int]):
  """log-softmax of every position's logits over ids, in this process (float64)."""
  import numpy as np
  from tinygrad import Tensor, dtypes
  from tinyhet.model.llama import DenseKVCache
  m, T = model[0], len(ids)
  logits = m.forward(Tensor([ids], dtype=dtypes.int32, device=m.device), Tensor.arange(T, dtype=dtypes.int32).reshape(1, T).to(m.device),
                     DenseKVCache(m.cfg, 1, T, dtypes.float16, m.device), all_rows=True).numpy()[0].astype(np.float64)
  return logits - logits.max(1, keepdims=True) - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True))

def test_logprobs_read_by_the_openai_client(nodes, model):
  openai = pytest.importorskip("openai")
  for name in ("router", "keyed"):                 # disaggregated (the prefill node samples the first token), and a `both` node's own prefill
    client = openai.OpenAI(base_url=f"http://{nodes[name].address}/v1", api_key=KEYS[0], max_retries=0)
    ids, n = prompt(7), 6
    want = reference(model, ids, n)
    lp = ref_logprobs(model, ids + want)
    out = client.completions.create(model=model[1], prompt=ids, max_tokens=n, temperature=0, logprobs=2)
    got = out.choices[0].logprobs
    assert len(got.token_logprobs) == n and got.tokens == [bytes([t]).decode(errors="replace") for t in want]
    for i, t in enumerate(want):
      assert abs(got.token_logprobs[i] - lp[len(ids) - 1 + i, t]) < 2e-2, (i, got.token_logprobs[i], lp[len(ids) - 1 + i, t])
      assert max(got.top_logprobs[i].values()) == pytest.approx(got.token_logprobs[i]) and len(got.top_logprobs[i]) <= 2   # greedy: the top one
    assert got.text_offset == sorted(got.text_offset) and "".join(got.tokens) == out.choices[0].text
    chunks = list(client.completions.create(model=model[1], prompt=ids, max_tokens=n, temperature=0, logprobs=2, stream=True))
    streamed = [x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(got.token_logprobs, abs=1e-5)
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model=model[1], messages=messages, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob == pytest.approx(c.logprob) for c in content)
    assert all(c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob >= c.top_logprobs[2].logprob and c.logprob <= 0 for c in content)
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    assert all(bytes(c.bytes).decode(errors="replace") == c.token for c in content)
    stream = list(client.chat.completions.create(model=model[1], messages=messages, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3,
                                                 stream=True))
    got_stream = [x for c in stream if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.content]
    # the same tokens; logprobs equal to float32 rounding (two requests: the kernels' split of the work may differ between them)
    assert [x.token for x in got_stream] == [x.token for x in content]
    assert [x.logprob for x in got_stream] == pytest.approx([x.logprob for x in content], abs=1e-4)
    plain = client.chat.completions.create(model=model[1], messages=messages, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None
    # echo: the prompt's own logprobs, from the node that prefilled it (lm-evaluation-harness's loglikelihood request)
    echo = client.completions.create(model=model[1], prompt=ids, max_tokens=1, temperature=0, logprobs=1, echo=True)
    e = echo.choices[0]
    assert e.text.startswith(bytes(ids).decode()) and len(e.logprobs.token_logprobs) == len(ids) + 1 and e.logprobs.token_logprobs[0] is None
    assert e.logprobs.token_logprobs[1:len(ids)] == pytest.approx([lp[i, ids[i + 1]] for i in range(len(ids) - 1)], abs=2e-2)
    assert e.logprobs.text_offset[:3] == [0, 1, 2]
    # a 40-token prompt twice: the second finds its first two blocks cached (the prefill node computes them again rather than
    # pull them; the `both` node prefills the prefix alone for its rows): the same logprobs, the reference's, either time
    long = prompt(9, 40)
    lp_long = ref_logprobs(model, long)
    for attempt in range(2):
      out = client.completions.create(model=model[1], prompt=long, max_tokens=1, temperature=0, logprobs=3, echo=True)
      assert out.usage.prompt_tokens_details.cached_tokens == 32 * attempt
      got = out.choices[0].logprobs
      assert got.token_logprobs[0] is None and len(got.token_logprobs) == len(long) + 1
      assert got.token_logprobs[1:len(long)] == pytest.approx([lp_long[i, long[i + 1]] for i in range(len(long) - 1)], abs=1e-3), attempt
      assert all(max(got.top_logprobs[i].values()) == pytest.approx(lp_long[i - 1].max(), abs=1e-3) for i in range(1, len(long)))

def test_sampling_options_on_the_nodes(nodes, model):
  router, ids = nodes["router"], prompt(8)
  def ask(**kw):
    status, obj = call(router, "POST", "/v1/completions", {"prompt": ids, "max_tokens": 6, "return_token_ids": True, **kw})
    assert status == 200, obj
    return obj["choices"][0]["token_ids"]
  assert ask(temperature=0, logit_bias={"65": 100}) == [65] * 6
  greedy = reference(model, ids, 6)
  assert ask(temperature=1.0, top_k=1, seed=3) == greedy and ask(temperature=1.5, min_p=1.0, seed=4) == greedy
  for opts in ({"frequency_penalty": 2.0}, {"presence_penalty": 1.5}, {"repetition_penalty": 1.8},
               {"presence_penalty": -1.0, "logit_bias": {"9": 3}}):
    want = model[0].reference_generate(ids, 6, options={k: v for k, v in opts.items()})
    assert ask(temperature=0, **opts) == want, opts
  sampled = dict(temperature=0.9, top_p=0.8, top_k=20, min_p=0.05, frequency_penalty=0.5, seed=11)
  want = model[0].reference_generate(ids, 6, temperature=0.9, top_p=0.8, seed=11, options=dict(top_k=20, min_p=0.05, frequency_penalty=0.5))
  assert ask(**sampled) == want
  for field, value in (("n", 0), ("n", 129), ("response_format", {"type": "xml"}), ("tools", [{"type": "function"}]), ("top_k", -2),
                       ("min_p", 1.5), ("presence_penalty", 3), ("repetition_penalty", 0), ("logit_bias", {"999": 1}),
                       ("logit_bias", {"5": 101}),
                       ("logprobs", 6), ("echo", 1), ("best_of", 3)):
    status, obj = call(router, "POST", "/v1/completions", {"prompt": ids, "max_tokens": 2, field: value})
    assert status == 400 and obj["error"]["param"] == field, (field, obj)
  for field, value in (("top_logprobs", 21), ("logprobs", 3), ("tools", [{"type": "function"}])):
    status, obj = call(router, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, field: value})
    assert status == 400 and obj["error"]["param"] == field, (field, obj)

def test_stop_strings_end_the_sequence_on_the_decode_node(nodes, model):
  """decode.submit with a stop string on a real node: the node ends the sequence at the token that completes it (its blocks
  freed then), instead of decoding to max_new_tokens for the router to cut."""
  from tinyhet.config import load_config
  from tinyhet.runtime.control import ControlClient, ControlError
  from tinyhet.runtime.transport import Endpoint
  from test_service import TOKEN
  ids = prompt(9)
  ref = reference(model, ids, 40)
  k = next(i for i in range(3, 40) if 32 < ref[i] < 127)            # a printable ASCII byte a few tokens in
  stop = chr(ref[k])
  n = next(j + 1 for j in range(40) if stop in bytes(ref[:j + 1]).decode(errors="replace"))
  ep = Endpoint("test-stopper", token=TOKEN, config=load_config(env={}))
  ctl = ControlClient(ep, nodes["both"].address)
  try:
    items = list(ctl.stream("decode.submit", prompt_ids=ids, max_new_tokens=40, temperature=0.0, stop=[stop]))
    assert [i["token"] for i in items if "token" in i] == ref[:n] and items[-1].get("done")
    with pytest.raises(ControlError, match="stop"): list(ctl.stream("decode.submit", prompt_ids=ids, max_new_tokens=4, stop=[""]))
  finally:
    ctl.close()
    ep.close()
  status, obj = call(nodes["router"], "POST", "/v1/completions", {"prompt": ids, "max_tokens": 40, "temperature": 0, "stop": [stop],
                                                                  "return_token_ids": True})
  assert status == 200 and obj["choices"][0]["finish_reason"] == "stop" and obj["choices"][0]["token_ids"] == ref[:n], obj
  # a stop string the decode node would refuse is refused here, before a token streams (it used to fail after the first)
  for stream in (False, True):
    status, obj = call(nodes["router"], "POST", "/v1/completions", {"prompt": ids, "max_tokens": 4, "stop": ["x" * 201], "stream": stream})
    assert status == 400 and obj["error"]["param"] == "stop", obj

def test_ready_and_health_show_the_nodes_only_with_the_admin_key(nodes):
  from test_service import ADMIN
  for name in ("router", "keyed"):
    router = nodes[name]
    for headers in ({}, {"Authorization": f"Bearer {KEYS[0]}"}, {"Authorization": "Bearer wrong"}, {"Authorization": "Bearer caf\xe9"},
                    {"Authorization": f"Bearer {ADMIN}x"}):
      assert call(router, "GET", "/ready", headers=headers) == (200, {"ready": True}), (name, headers)
      assert call(router, "GET", "/health", headers=headers) == (200, {"status": "ok"}), (name, headers)
    status, obj = call(router, "GET", "/ready", headers={"Authorization": f"Bearer {ADMIN}"})
    assert status == 200 and obj["ready"] and {n["address"] for n in obj["nodes"]} == set(router.nodes) - {"ray"} and \
      all("node" in n for n in obj["nodes"] if n["up"]), obj
  assert call(nodes["keyed"], "GET", "/v1/models", headers={"Authorization": "Bearer caf\xe9"})[0] == 401     # a non-ASCII key: no 500

def send(router, head: bytes, body_parts=()) -> tuple[int, dict]:
  """A raw HTTP/1.1 request (head without its blank line), its body sent in parts: (status, JSON reply)."""
  host, port = router.address.rsplit(":", 1)
  with socket.create_connection((host, int(port)), timeout=60) as s:
    s.sendall(head + b"\r\n\r\n")
    try:
      for part in body_parts: s.sendall(part)
    except (BrokenPipeError, ConnectionResetError): pass      # the server answered before the body's end, and closed
    reply = b""
    while (got := s.recv(1 << 16)): reply += got
  status = int(reply.split(b" ", 2)[1])
  return status, json.loads(reply.split(b"\r\n\r\n", 1)[1])

def test_body_size_and_json_depth_limits(nodes):
  from tinyhet.service.http_guard import MAX_BODY_BYTES, MAX_JSON_DEPTH
  router = nodes["router"]
  path = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
  status, obj = send(router, path + f"Content-Length: {MAX_BODY_BYTES + 1}".encode())           # said in advance: refused before it is sent
  assert status == 413 and obj["error"]["code"] == "request_too_large" and set(obj["error"]) == {"message", "type", "param", "code"}, obj
  over = json.dumps({"prompt": "x" * MAX_BODY_BYTES}).encode()                                   # not said: refused as it arrives
  chunks = [b"%x\r\n%s\r\n" % (len(over[i:i + (1 << 20)]), over[i:i + (1 << 20)]) for i in range(0, len(over), 1 << 20)]
  status, obj = send(router, path + b"Transfer-Encoding: chunked", [*chunks, b"0\r\n\r\n"])
  assert status == 413 and obj["error"]["code"] == "request_too_large", obj
  for depth in (MAX_JSON_DEPTH + 1, 100_000):                 # 100,000 deep: Python's parser would recurse past its limit (a 500)
    deep = '{"prompt": [1], "max_tokens": 1, "x": ' + "[" * depth + "]" * depth + "}"
    status, obj = call(router, "POST", "/v1/completions", headers={"Content-Length": str(len(deep))}, raw=deep.encode())
    assert status == 400 and obj["error"]["code"] == "json_too_deep", obj
  fine = '{"prompt": [1], "max_tokens": 1, "user": "[[[[[[", "metadata": ' + "[" * 8 + "]" * 8 + "}"   # brackets in strings do not count
  assert call(router, "POST", "/v1/completions", raw=fine.encode())[0] == 200

def node_info(address: str, **kw) -> dict:
  from tinyhet.config import load_config
  from tinyhet.runtime.control import ControlClient
  from tinyhet.runtime.transport import Endpoint
  from test_service import TOKEN
  ep = Endpoint("test-info", token=TOKEN, config=load_config(env={}))
  ctl = ControlClient(ep, address)
  try: return ctl.call("decode.info", **kw)
  finally:
    ctl.close()
    ep.close()

def test_n_samples_from_one_prefill_equal_single_requests_with_their_seeds(nodes, model):
  """n = 3 on a `both` node: 3 choices (index 0..2), sample i the tokens of a single request with seed + i, streamed and not,
  from one prefill on the node (its prefill counter moves by one)."""
  openai = pytest.importorskip("openai")
  client = openai.OpenAI(base_url=f"http://{nodes['keyed'].address}/v1", api_key=KEYS[0], max_retries=0)
  ids, kw = prompt(21, 20), dict(model=model[1], max_tokens=8, temperature=1.0, seed=77, extra_body={"return_token_ids": True})
  before = node_info(nodes["both"].address, reset_peak=True)
  out = client.completions.create(prompt=ids, n=3, **kw)
  after = node_info(nodes["both"].address)
  assert after["prefills"] - before["prefills"] == 1 and after["prefilled_tokens"] - before["prefilled_tokens"] <= len(ids)
  # KV blocks at the most: the padding row's, the prompt's full block once, and each sample's own (its copy of the partial one)
  assert after["peak_used_blocks"] == 1 + 1 + 3, after
  assert [c.index for c in out.choices] == [0, 1, 2] and out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 24
  got = [c.token_ids for c in out.choices]
  singles = [client.completions.create(prompt=ids, **{**kw, "seed": 77 + i}).choices[0].token_ids for i in range(3)]
  assert got == singles and len({tuple(g) for g in got}) > 1, got
  assert singles[0] == model[0].reference_generate(ids, 8, temperature=1.0, seed=77)
  texts = {}
  for c in client.completions.create(prompt=ids, n=3, stream=True, stream_options={"include_usage": True}, **kw):
    for ch in c.choices: texts[ch.index] = texts.get(ch.index, "") + ch.text
    if not c.choices: assert c.usage.completion_tokens == 24
  assert texts == {c.index: c.text for c in out.choices}
  chat = client.chat.completions.create(model=model[1], messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=4, seed=3)
  assert [c.index for c in chat.choices] == [0, 1] and chat.usage.completion_tokens == 8
  with pytest.raises(openai.BadRequestError, match="n must be"):        # more samples than the node's batch (--max-seqs)
    client.completions.create(prompt=ids, n=100, **kw)

def test_a_list_of_prompts_gets_a_choice_each(nodes, model):
  """Completions with a list of prompts (lm-evaluation-harness with batch_size > 1): one choice per prompt (times n) with its
  index, each the tokens of its prompt alone; token lists and strings; echo with logprobs per prompt."""
  openai = pytest.importorskip("openai")
  client = openai.OpenAI(base_url=f"http://{nodes['router'].address}/v1", api_key="unused", max_retries=0)
  prompts = [prompt(30), prompt(31, 14), prompt(32, 6)]
  out = client.completions.create(model=model[1], prompt=prompts, max_tokens=5, temperature=0, extra_body={"return_token_ids": True})
  assert [c.index for c in out.choices] == [0, 1, 2] and [c.token_ids for c in out.choices] == [reference(model, p, 5) for p in prompts]
  assert out.usage.prompt_tokens == sum(len(p) for p in prompts) and out.usage.completion_tokens == 15
  texts = client.completions.create(model=model[1], prompt=["abc", "hello"], max_tokens=3, temperature=0, n=2)
  assert [c.index for c in texts.choices] == [0, 1, 2, 3] and texts.choices[2].text == texts.choices[3].text
  lm = client.completions.create(model=model[1], prompt=prompts[:2], max_tokens=1, temperature=0, logprobs=1, echo=True)
  assert [len(c.logprobs.token_logprobs) for c in lm.choices] == [len(p) + 1 for p in prompts[:2]]
  for bad in ([], [[]], [prompts[0], "x", 5], [[1, 999]]):
    status, obj = call(nodes["router"], "POST", "/v1/completions", {"prompt": bad, "max_tokens": 2})
    assert status == 400 and obj["error"]["param"] == "prompt", (bad, obj)

def test_tokenize_detokenize_and_models(nodes, model):
  router = nodes["router"]
  status, obj = call(router, "POST", "/tokenize", {"prompt": "héllo", "return_token_strs": True})
  assert status == 200 and obj["tokens"] == list("héllo".encode()) and obj["count"] == 6 and obj["max_model_len"] == 256, obj
  assert len(obj["token_strs"]) == 6
  assert call(router, "POST", "/detokenize", {"tokens": obj["tokens"], "model": model[1]}) == (200, {"prompt": "héllo"})
  msgs = [{"role": "user", "content": "hi"}]
  status, obj = call(router, "POST", "/tokenize", {"messages": msgs})
  assert status == 200 and obj["tokens"] == list(b"user: hi\nassistant: ") and obj["token_strs"] is None
  assert call(router, "POST", "/tokenize", {"messages": msgs, "add_generation_prompt": False})[1]["tokens"] == list(b"user: hi\n")
  for path, body, param in (("/tokenize", {"prompt": 5}, "prompt"), ("/tokenize", {"prompt": "x", "bogus": 1}, "bogus"),
                            ("/detokenize", {"tokens": [256]}, "tokens"), ("/detokenize", {"tokens": "ab"}, "tokens"),
                            ("/tokenize", {"messages": [{"role": "x"}]}, "messages"), ("/tokenize", {"prompt": "x", "model": "m"}, "model")):
    status, obj = call(router, "POST", path, body)
    assert 400 <= status < 500 and obj["error"]["param"] == param, (path, body, obj)
  assert call(nodes["keyed"], "POST", "/tokenize", {"prompt": "x"})[0] == 401
  assert call(nodes["keyed"], "POST", "/tokenize", {"prompt": "x"}, {"Authorization": f"Bearer {KEYS[0]}"})[0] == 200
  status, obj = call(router, "GET", "/v1/models")
  assert status == 200 and obj["data"][0]["max_model_len"] == 256

def test_vllm_stop_fields(nodes, model):
  """stop_token_ids end the answer at that token (its text left out unless include_stop_str_in_output); min_tokens keeps
  stop ids and stop strings out of the first tokens; include_stop_str_in_output keeps a stop string."""
  router, ids = nodes["router"], prompt(40)
  ref = reference(model, ids, 24)
  def ask(**kw):
    status, obj = call(router, "POST", "/v1/completions", {"prompt": ids, "max_tokens": 24, "temperature": 0, "return_token_ids": True, **kw})
    assert status == 200, obj
    return obj["choices"][0]
  k = next(i for i in range(2, 24) if 32 < ref[i] < 127 and ref[i] not in ref[:i])    # a printable byte that first shows up at k
  c = ask(stop_token_ids=[ref[k]])
  assert c["token_ids"] == ref[:k + 1] and c["finish_reason"] == "stop" and c["text"] == bytes(ref[:k]).decode(errors="replace")
  assert ask(stop_token_ids=[ref[k]], include_stop_str_in_output=True)["text"] == bytes(ref[:k + 1]).decode(errors="replace")
  want = model[0].reference_generate(ids, 24, stop_ids=(ref[k],), options={"min_tokens": k + 3, "min_tokens_ids": [ref[k]]})
  c = ask(stop_token_ids=[ref[k]], min_tokens=k + 3)
  assert c["token_ids"] == want and ref[k] not in want[:k + 3], (c, want)
  s = chr(ref[k])
  assert ask(stop=[s])["text"] == bytes(ref[:k]).decode(errors="replace")
  assert ask(stop=[s], include_stop_str_in_output=True)["text"] == bytes(ref[:k]).decode(errors="replace") + s
  late = ask(stop=[s], min_tokens=k + 1)             # the stop string in the first k + 1 tokens does not count
  later = [j for j in range(k + 1, 24) if ref[j] == ref[k]]
  assert late["token_ids"] == (ref[:later[0] + 1] if later else ref) and s not in late["text"][:k], late
  assert ask(ignore_eos=True, skip_special_tokens=False, spaces_between_special_tokens=False)["token_ids"] == ref
  for field, value in (("stop_token_ids", [256]), ("stop_token_ids", "a"), ("min_tokens", -1), ("min_tokens", 25), ("ignore_eos", 1),
                       ("include_stop_str_in_output", "yes"), ("skip_special_tokens", 0), ("spaces_between_special_tokens", "no"),
                       ("truncate_prompt_tokens", 4), ("allowed_token_ids", [1]), ("no_such_field", 1), ("store", True), ("add_special_tokens", 2)):
    status, obj = call(router, "POST", "/v1/completions", {"prompt": ids, "max_tokens": 24, field: value})
    assert status == 400 and obj["error"]["param"] == field, (field, value, obj)
  for field, value in (("echo", True), ("chat_template", "{{ x }}"), ("add_generation_prompt", "no"), ("suffix", "x")):
    status, obj = call(router, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, field: value})
    assert status == 400 and obj["error"]["param"] == field, (field, value, obj)
  assert call(router, "POST", "/v1/completions", {"prompt": ids, "max_tokens": 2, "user": "u-1", "store": False})[0] == 200

def test_samples_are_freed_when_their_client_goes(nodes, model):
  """A streamed n = 3 request whose client hangs up mid-stream: every sample's sequence leaves the decode node and its
  blocks are free again (none runs to max_tokens for nobody)."""
  router, decode = nodes["router"], nodes["decode"]
  before = router.metric("tinyhet:generation_tokens_total")
  c = post(router, {"prompt": prompt(50), "max_tokens": 200, "temperature": 1.0, "n": 3, "stream": True})
  r = c.getresponse()
  assert r.status == 200 and r.readline().startswith(b"data: ")
  started_tokens(router, before)
  hang_up(c)
  deadline = time.monotonic() + 30
  while time.monotonic() < deadline and ((i := node_info(decode.address))["open_sequences"] or i["free_blocks"] != i["kv_blocks"]): time.sleep(0.1)
  assert i["open_sequences"] == 0 and i["free_blocks"] == i["kv_blocks"], i
  settled(router)
  assert router.metric("tinyhet:generation_tokens_total") - before < 600, "the samples ran to their end: they were not cancelled"

def test_n_samples_disaggregated_from_one_prefill_node_prefill(nodes, model):
  """n = 3 through a prefill node: one prefill.run (it samples every first token), the decode node forks the samples once
  the KV landed; sample i equals a single (disaggregated) request with seed + i, streamed and not; nothing stays behind."""
  openai = pytest.importorskip("openai")
  router = nodes["router"]
  client = openai.OpenAI(base_url=f"http://{router.address}/v1", api_key="unused", max_retries=0)
  ids, kw = prompt(60, 20), dict(model=model[1], max_tokens=6, temperature=1.0, seed=5, extra_body={"return_token_ids": True})
  prefills = lambda: router.metric("tinyhet:node_requests_total", role="prefill")
  before = prefills()
  out = client.completions.create(prompt=ids, n=3, **kw)
  assert prefills() - before == 1 and [c.index for c in out.choices] == [0, 1, 2]
  singles = [client.completions.create(prompt=ids, **{**kw, "seed": 5 + i}).choices[0].token_ids for i in range(3)]
  assert [c.token_ids for c in out.choices] == singles and len({tuple(s) for s in singles}) > 1, singles
  texts = {}
  for c in client.completions.create(prompt=ids, n=3, stream=True, **kw):
    for ch in c.choices: texts[ch.index] = texts.get(ch.index, "") + ch.text
  assert texts == {c.index: c.text for c in out.choices}
  settled(router)
  assert node_info(nodes["decode"].address)["open_sequences"] == 0

def test_structured_output_through_a_prefill_node(nodes):
  """Disaggregated: the prefill node draws the first token under the grammar, the decode node the rest (each builds the
  request's Constraint from the same grammar text and the tokens so far); the keyed `both` router serves it alone."""
  import re
  jsonschema = pytest.importorskip("jsonschema")
  schema = {"type": "object", "properties": {"k": {"enum": ["ab", "cd"]}, "v": {"type": "integer", "minimum": 0, "maximum": 999}},
            "required": ["k", "v"], "additionalProperties": False}
  for router, headers in ((nodes["router"], {}), (nodes["keyed"], {"Authorization": f"Bearer {KEYS[0]}"})):
    status, obj = call(router, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 60, "temperature": 1.0, "seed": 1,
                                                           "guided_json": schema}, headers)
    assert status == 200 and obj["choices"][0]["finish_reason"] == "stop", obj
    jsonschema.validate(json.loads(obj["choices"][0]["text"]), schema)
    status, obj = call(router, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "id?"}], "max_tokens": 20,
                                                                "temperature": 1.0, "seed": 3, "guided_regex": "[A-Z][0-9]{4}"}, headers)
    assert status == 200 and re.fullmatch("[A-Z][0-9]{4}", obj["choices"][0]["message"]["content"]), obj

def test_two_api_keys_never_share_cached_kv_and_one_key_does(nodes):
  """Tenant isolation (tinyhet.service.tenancy): a prompt's blocks cached for one API key are a hit for that key only; another
  key's identical prompt is prefilled in full (cached_tokens 0: no hit to show, in the usage or in the TTFT); cache_salt
  separates one key's requests further; --shared-prefix-cache lets the keys share."""
  keyed, ids = nodes["keyed"], [(7 * i) % 200 + 30 for i in range(40)]     # 40 tokens: 2 full blocks of 16 can be a hit
  def cached(router, key: str, ids: list[int], **extra) -> int:
    body = {"prompt": ids, "max_tokens": 2, "temperature": 0, **extra}
    status, obj = call(router, "POST", "/v1/completions", body, {"Authorization": f"Bearer {key}"})
    assert status == 200, obj
    return obj["usage"]["prompt_tokens_details"]["cached_tokens"]
  def node_hits() -> int:             # the node's own count of prompt tokens it did not compute (what a short TTFT would show)
    from test_service import ADMIN
    return call(keyed, "GET", "/ready", headers={"Authorization": f"Bearer {ADMIN}"})[1]["nodes"][0].get("prefix_hit_tokens", 0)
  before = node_hits()
  assert [cached(keyed, k, ids) for k in (KEYS[0], KEYS[0], KEYS[1], KEYS[1])] == [0, 32, 0, 32]
  deadline = time.monotonic() + 10    # the node's count arrives with its next heartbeat
  while node_hits() - before < 64 and time.monotonic() < deadline: time.sleep(0.1)
  assert node_hits() - before == 64   # two hits of 32: the other key's first request was prefilled in full, in time as in tokens
  assert [cached(keyed, KEYS[0], ids, cache_salt="s") for _ in range(2)] == [0, 32]
  assert call(keyed, "POST", "/v1/completions", {"prompt": ids, "cache_salt": 5}, {"Authorization": f"Bearer {KEYS[0]}"})[0] == 400
  shared = Router("--both", nodes["both"].address, "--api-key", KEYS[0], "--api-key", KEYS[1], "--shared-prefix-cache")
  try:
    shared.wait_ready(nodes_up=1)
    other = [t + 1 for t in ids]
    assert [cached(shared, k, other) for k in KEYS] == [0, 32]
  finally: shared.stop()
