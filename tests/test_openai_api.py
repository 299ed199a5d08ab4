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
  for field, value in (("n", 2), ("response_format", {"type": "xml"}), ("tools", [{"type": "function"}]), ("top_k", -2),
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
