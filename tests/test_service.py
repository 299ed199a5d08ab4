"""The cluster service with real processes on loopback: prefill and decode nodes (`tinyhet node`), the router (`tinyhet
serve`), its OpenAI-compatible API, and recovery from nodes killed with SIGKILL. Every node holds the same small random
model (`random:`), so tokens are compared with a single-process greedy run here. The nodes are shared by the module's
tests; the two tests that kill nodes run last."""
import http.client, json, os, re, signal, socket, subprocess, sys, threading, time
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

SPEC = "random:max_context=256"
TOKEN = "service-test-token"
ADMIN = "service-test-admin-key"       # the routers' admin key: /ready's node list
ENV = {**os.environ, "TINYHET_TOKEN": TOKEN, "TINYHET_ARENA_BYTES": "256M"}

class Proc:
  """A tinyhet process that prints one JSON line when ready and stops when its stdin closes."""
  def __init__(self, *args, env: dict | None = None):
    self.args = args
    self.p = subprocess.Popen([sys.executable, "-m", "tinyhet", *args, "--stdin-stop"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env={**ENV, **(env or {})})
  def info(self) -> dict:
    if not hasattr(self, "_info"):
      line = self.p.stdout.readline()
      if not line: raise RuntimeError(f"tinyhet {' '.join(self.args)} did not start (exit {self.p.wait()})")
      self._info = json.loads(line)
    return self._info
  @property
  def address(self) -> str: return self.info()["address"]
  def kill9(self):
    self.p.send_signal(signal.SIGKILL)
    self.p.wait(10)
  def stop(self):
    if self.p.poll() is None:
      try:
        self.p.stdin.close()
        self.p.wait(15)
      except (subprocess.TimeoutExpired, OSError): self.p.kill()
    self.p.wait(5)

def node(role: str, *extra, listen="127.0.0.1:0", env: dict | None = None) -> Proc:
  return Proc("node", "--role", role, "--listen", listen, "--model", SPEC, "--quiet", *extra, env=env)

def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]

class Router(Proc):
  def __init__(self, *args, env: dict | None = None):
    super().__init__("serve", "--listen", "127.0.0.1:0", "--model", SPEC, *args, env={"TINYHET_ADMIN_KEY": ADMIN, **(env or {})})
  @property
  def nodes(self) -> dict[str, str]: return self.info()["nodes"]
  def request(self, method: str, path: str, body=None, raw: bytes | None = None, timeout=120, headers: dict | None = None) -> tuple[int, dict, dict]:
    """One HTTP request; /ready is asked with the admin key (its node list), unless headers say otherwise."""
    host, port = self.address.rsplit(":", 1)
    c = http.client.HTTPConnection(host, int(port), timeout=timeout)
    if headers is None: headers = {"Authorization": f"Bearer {ADMIN}"} if path == "/ready" else {}
    try:
      data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
      c.request(method, path, body=data, headers={"Content-Type": "application/json", **headers})
      r = c.getresponse()
      text = r.read()
      try: obj = json.loads(text)
      except json.JSONDecodeError: obj = {"text": text.decode(errors="replace")}
      return r.status, {k.lower(): v for k, v in r.getheaders()}, obj
    finally: c.close()
  def wait_ready(self, timeout=180, nodes_up=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
      status, _, obj = self.request("GET", "/ready")
      if status == 200 and (nodes_up is None or sum(n["up"] for n in obj["nodes"]) >= nodes_up): return obj
      time.sleep(0.2)
    raise TimeoutError(f"router not ready: {obj}")
  def metric(self, name: str, **labels) -> float:
    _, _, obj = self.request("GET", "/metrics")
    total = 0.0
    for line in obj["text"].splitlines():
      if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()): total += float(line.rsplit(" ", 1)[1])
    return total
  def stream(self, body: dict, on_chunk=None) -> list[int]:
    """A streaming completion with return_token_ids: the ids, in the order they arrived (on_chunk sees each list)."""
    host, port = self.address.rsplit(":", 1)
    c = http.client.HTTPConnection(host, int(port), timeout=120)
    c.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True, "return_token_ids": True}),
              headers={"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200, r.read()
    ids, done = [], False
    for line in r:
      line = line.decode().strip()
      if line == "data: [DONE]": done = True
      elif line.startswith("data: "):
        obj = json.loads(line[6:])
        assert "error" not in obj, obj
        ids += obj["choices"][0].get("token_ids", [])
        if on_chunk is not None: on_chunk(ids)
    c.close()
    assert done
    return ids

@pytest.fixture(scope="module")
def model():
  """The nodes' model in this process, for single-process reference runs."""
  import tinyhet  # noqa: F401
  from tinyhet.model import spec as service_model
  m, tok, model_id = service_model.load(SPEC, "HET")
  return m, model_id

@pytest.fixture(scope="module")
def cluster():
  """1 prefill node, 2 decode nodes, the router; started together (each loads its model while the others do)."""
  prefill_port = free_port()
  procs = {"prefill": node("prefill", listen=f"127.0.0.1:{prefill_port}"), "d1": node("decode", "--kv-memory", "16M", "--max-seqs", "16"),
           "d2": node("decode", "--kv-memory", "16M", "--max-seqs", "16")}
  try:
    router = Router("--prefill", procs["prefill"].address, "--decode", procs["d1"].address, "--decode", procs["d2"].address)
    procs["router"] = router
    router.wait_ready(nodes_up=3)
    yield procs
  finally:
    for p in procs.values(): p.stop()

def prompt(i: int, n: int = 10) -> list[int]: return [(i * 37 + j * 11) % 250 + 1 for j in range(n)]

_refs: dict = {}
def reference(model, ids: list[int], n: int, **sampling) -> list[int]:
  if (key := (tuple(ids), n, tuple(sorted(sampling.items())))) not in _refs:
    _refs[key] = model[0].reference_generate(ids, n, **{"temperature": 0.0, **sampling})
  return _refs[key]

def test_openai_client_streaming_and_not(cluster, model):
  openai = pytest.importorskip("openai")
  router = cluster["router"]
  client = openai.OpenAI(base_url=f"http://{router.address}/v1", api_key="unused", max_retries=0)
  assert [m.id for m in client.models.list().data] == [model[1]]
  ids = prompt(1)
  want = reference(model, ids, 8)
  out = client.completions.create(model=model[1], prompt=ids, max_tokens=8, temperature=0)
  assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 8 and out.usage.prompt_tokens == len(ids)
  chunks = list(client.completions.create(model=model[1], prompt=ids, max_tokens=8, temperature=0, stream=True))
  assert "".join(c.choices[0].text for c in chunks) == out.choices[0].text == bytes(want).decode(errors="replace")
  chat = client.chat.completions.create(model=model[1], messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0)
  stream = list(client.chat.completions.create(model=model[1], messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0,
                                               stream=True, stream_options={"include_usage": True}))
  assert all(c.object == "chat.completion.chunk" for c in stream) and stream[-1].usage.completion_tokens == 6 and stream[-1].choices == []
  assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == chat.choices[0].message.content
  text = out.choices[0].text
  if (cut := next((i for i in range(1, len(text)) if text[i].isascii() and text[i].isprintable()), None)) is not None:
    stopped = client.completions.create(model=model[1], prompt=ids, max_tokens=8, temperature=0, stop=[text[cut]])
    streamed = "".join(c.choices[0].text for c in client.completions.create(model=model[1], prompt=ids, max_tokens=8, temperature=0,
                                                                             stop=[text[cut]], stream=True))
    assert stopped.choices[0].text == streamed == text[:text.index(text[cut])] and stopped.choices[0].finish_reason == "stop"
  with pytest.raises(openai.NotFoundError): client.completions.create(model="no-such-model", prompt="x", max_tokens=2)

@pytest.mark.parametrize("path, body, status, param", [
  ("/v1/completions", b"{not json", 400, None),
  ("/v1/completions", [1, 2], 400, None),
  ("/v1/completions", {"model": 7, "prompt": "x", "max_tokens": 2}, 400, "model"),
  ("/v1/completions", {"model": "gpt-9", "prompt": "x"}, 404, "model"),
  ("/v1/completions", {"model": "M", "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
  ("/v1/completions", {"model": "M", "prompt": "x", "max_tokens": 10**9}, 400, "max_tokens"),
  ("/v1/completions", {"model": "M", "prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
  ("/v1/completions", {"model": "M", "prompt": "x" * 300, "max_tokens": 1}, 400, "prompt"),
  ("/v1/completions", {"model": "M", "prompt": [1, 999]}, 400, "prompt"),
  ("/v1/completions", {"model": "M", "prompt": "x", "temperature": "hot"}, 400, "temperature"),
  ("/v1/chat/completions", {"model": "M", "messages": "hello"}, 400, "messages"),
  ("/v1/chat/completions", {"model": "M", "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
  ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "x"}], "n": 0}, 400, "n"),
  ("/v1/completions", {"model": "M", "prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
])
def test_bad_input_gets_4xx_in_openai_shape(cluster, model, path, body, status, param):
  raw = body if isinstance(body, bytes) else json.dumps(body).replace('"M"', json.dumps(model[1])).encode()
  got, _, obj = cluster["router"].request("POST", path, raw=raw)
  assert got == status, obj
  assert set(obj["error"]) == {"message", "type", "param", "code"} and obj["error"]["message"] and obj["error"]["param"] == param

BAD_FIELDS = {"max_tokens": st.one_of(st.integers(max_value=0), st.integers(min_value=300), st.text(), st.floats(), st.none().map(lambda _: [])),
              "temperature": st.one_of(st.floats(min_value=2.01), st.floats(max_value=-0.01), st.text()),
              "top_p": st.one_of(st.floats(max_value=0), st.floats(min_value=1.01), st.booleans()),
              "prompt": st.one_of(st.integers(), st.lists(st.integers(min_value=256), min_size=1), st.dictionaries(st.text(), st.text())),
              "stream": st.one_of(st.integers(), st.text()), "n": st.one_of(st.integers(max_value=0), st.integers(min_value=129)),
              "seed": st.one_of(st.floats(), st.text()),
              "stop": st.one_of(st.integers(), st.lists(st.text(min_size=1), min_size=5)), "model": st.one_of(st.integers(), st.text()),
              "messages": st.one_of(st.integers(), st.text(), st.lists(st.dictionaries(st.text(), st.text()), min_size=1))}
JSONISH = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
                       lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=10), c, max_size=4), max_leaves=10)

def test_fuzzed_bodies_get_only_4xx(cluster, model):
  router = cluster["router"]
  @settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
  @given(field=st.sampled_from(sorted(BAD_FIELDS)), data=st.data(), extra=st.dictionaries(st.text(max_size=12), JSONISH, max_size=3),
         chat=st.booleans(), garbage=st.one_of(st.none(), st.binary(max_size=40)))
  def check(field, data, extra, chat, garbage):
    if field in ("prompt", "messages"): field = "messages" if chat else "prompt"     # a bad field the endpoint reads
    body = {**extra, "model": model[1], ("messages" if chat else "prompt"): [{"role": "user", "content": "x"}] if chat else "x",
            field: data.draw(BAD_FIELDS[field])}
    if field == "model" and body["model"] == model[1]: body["model"] = 1
    raw = garbage if garbage is not None and not garbage.strip().startswith((b"{", b"[")) else json.dumps(body).encode()
    status, _, obj = router.request("POST", "/v1/chat/completions" if chat else "/v1/completions", raw=raw)
    assert 400 <= status < 500, (body, status, obj)
    assert "message" in obj["error"]
  check()

def test_32_concurrent_streams_match_single_process(cluster, model):
  router, n_new = cluster["router"], 12
  prompts = [prompt(i) for i in range(8)]          # one length: one set of compiled kernels for the reference runs here
  wants = [reference(model, p, n_new) for p in prompts]
  got: dict[int, list[int]] = {}
  def one(i):
    got[i] = router.stream({"model": model[1], "prompt": prompts[i % 8], "max_tokens": n_new, "temperature": 0})
  threads = [threading.Thread(target=one, args=(i,)) for i in range(32)]
  for t in threads: t.start()
  for t in threads: t.join(120)
  assert {i: got.get(i) for i in range(32)} == {i: wants[i % 8] for i in range(32)}
  assert all(router.metric("tinyhet:node_requests_total", node=cluster[d].address) > 0 for d in ("d1", "d2")), "one decode node got nothing"
  assert router.metric("tinyhet:kv_transfer_bytes_total") > 0 and router.metric("tinyhet:time_to_first_token_seconds_count") >= 32

@pytest.fixture(scope="module")
def tiny_both():
  """A `--role both` node with a KV pool of 12 blocks (192 tokens), a prefill budget of 16 (the default 128 is more than a
  test prompt: no decode step would fall inside a prefill job)."""
  both = node("both", "--kv-memory", "48K", "--max-seqs", "4", env={"TINYHET_PREFILL_BUDGET": "16"})   # a 100-token job: 6 paced steps
  yield both
  both.stop()

def test_tiny_kv_pool_completes_or_503_and_both_role(cluster, model, tiny_both):
  """The tiny `both` node serving 12 requests of 50 tokens each, prefilled on itself or on the prefill node: each completes
  with the reference tokens or gets 503 with Retry-After; the node survives."""
  both = tiny_both
  router = Router("--both", both.address, "--prefill", cluster["prefill"].address, "--max-queue", "3", "--queue-timeout", "3")
  try:
    router.wait_ready(nodes_up=2)
    ids = prompt(5, 10)
    want = reference(model, ids, 40)
    results = []
    def one():
      results.append(router.request("POST", "/v1/completions", {"model": model[1], "prompt": ids, "max_tokens": 40, "temperature": 0,
                                                                  "return_token_ids": True}))
    threads = [threading.Thread(target=one) for _ in range(12)]
    for t in threads: t.start()
    for t in threads: t.join(120)
    assert len(results) == 12
    done = [r for r in results if r[0] == 200]
    assert done and all(r[2]["choices"][0]["token_ids"] == want for r in done)
    assert all(r[0] == 503 and r[1].get("retry-after") for r in results if r[0] != 200), [r for r in results if r[0] != 200]
    assert both.p.poll() is None and router.request("GET", "/ready")[0] == 200
    local, remote = (router.metric("tinyhet:node_requests_total", node=both.address, role=r) for r in ("prefill+decode", "decode"))
    assert local + remote == len(done), (local, remote, len(done))
  finally: router.stop()

def test_both_node_prefills_for_a_decode_node(cluster, model, tiny_both):
  """Dynamic P:D: with a decode node and a `both` node, the both node decodes some requests (prefilling them itself) and
  prefills the decode node's."""
  router = Router("--decode", cluster["d2"].address, "--both", tiny_both.address)
  try:
    router.wait_ready(nodes_up=2)
    prompts, got = [prompt(60 + i) for i in range(4)], {}
    def one(i): got[i] = router.stream({"model": model[1], "prompt": prompts[i], "max_tokens": 10, "temperature": 0})
    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads: t.start()
    for t in threads: t.join(120)
    assert [got.get(i) for i in range(4)] == [reference(model, p, 10) for p in prompts]
    assert router.metric("tinyhet:node_requests_total", node=tiny_both.address, role="prefill") > 0
    assert router.metric("tinyhet:node_requests_total", node=cluster["d2"].address, role="decode") > 0
  finally: router.stop()

def test_both_nodes_prefill_jobs_keep_its_decoding_sequences_at_their_pace(cluster, model, tiny_both):
  """While the `both` node decodes a request of its own, the decode node's prompts come to it as prefill jobs: between a
  job's layers it steps its decoding sequence (KeepPace, paced_steps in its heartbeat), and every request still gets the
  reference tokens (the job's prefill and the decoding sequence's steps are the same computations, in another order)."""
  router = Router("--decode", cluster["d2"].address, "--both", tiny_both.address)
  try:
    router.wait_ready(nodes_up=2)
    idle_nodes(router, cluster["d2"], tiny_both)     # the last test's sequences gone from both heartbeats: the loads start equal
    before = node_state(router, tiny_both).get("paced_steps", 0)
    prompts, got, threads, streaming = {i: prompt(80 + i, 100) for i in range(5)}, {}, [], threading.Event()
    def one(i, n, on_chunk=None): got[i] = router.stream({"model": model[1], "prompt": prompts[i], "max_tokens": n, "temperature": 0}, on_chunk)
    def jobs(ids):                   # the both node decodes its own now: the decode node's next prompts are prefill jobs there
      if len(ids) == 1 and not threads[2:]:
        threads.extend(threading.Thread(target=one, args=(i, 8)) for i in (2, 3, 4))
        for t in threads[2:]: t.start()
    # 100 + 140 tokens: only the decode node's pool holds them whole (the both node's holds 192): decoded there, prefilled on the both node
    threads.append(threading.Thread(target=one, args=(0, 140, lambda ids: streaming.set())))
    threads[0].start()
    assert streaming.wait(120), "the first request never streamed"
    threads.append(threading.Thread(target=one, args=(1, 80, jobs)))   # to the both node, the other one busy: decoded there
    threads[1].start()
    for t in threads[:2]: t.join(120)
    for t in threads[2:]: t.join(120)
    assert {i: got.get(i) for i in prompts} == {i: reference(model, prompts[i], 140 if i == 0 else 80 if i == 1 else 8) for i in prompts}
    deadline = time.monotonic() + 10
    while (paced := node_state(router, tiny_both).get("paced_steps", 0)) == before and time.monotonic() < deadline: time.sleep(0.1)
    assert paced > before, "no decode step ran between the layers of a prefill job"
  finally: router.stop()

def node_state(router, proc) -> dict:
  return next(n for n in router.request("GET", "/ready")[2]["nodes"] if n["address"] == proc.address)

def idle_nodes(router, *procs, timeout: float = 30.0):
  """Wait until the router's view of each node (its heartbeat) shows no sequence running, waiting or incoming."""
  deadline = time.monotonic() + timeout
  while any(node_state(router, p).get(k, 0) for p in procs for k in ("running", "waiting", "incoming")):
    assert time.monotonic() < deadline, "the nodes still report sequences from an earlier test"
    time.sleep(0.05)

def test_client_disconnect_frees_the_sequence(cluster, model):
  router = cluster["router"]
  host, port = router.address.rsplit(":", 1)
  tokens_before, done_before = router.metric("tinyhet:generation_tokens_total"), router.metric("tinyhet:request_success_total")
  c = http.client.HTTPConnection(host, int(port), timeout=60)
  c.request("POST", "/v1/completions", body=json.dumps({"model": model[1], "prompt": prompt(3), "max_tokens": 240, "temperature": 0,
                                                         "stream": True}), headers={"Content-Type": "application/json"})
  r = c.getresponse()
  assert r.status == 200 and r.readline().startswith(b"data: ")
  c.sock.shutdown(socket.SHUT_RDWR)            # the client goes away mid-stream
  c.close()
  deadline = time.monotonic() + 60
  while time.monotonic() < deadline:          # the nodes free the blocks, and the router's request thread sees the hang-up
    states = [node_state(router, cluster[d]) for d in ("d1", "d2")]
    if all(s["free_blocks"] == s["kv_blocks"] and s["running"] == 0 for s in states) and router.metric("tinyhet:num_requests_running") == 0: break
    time.sleep(0.2)
  assert all(s["free_blocks"] == s["kv_blocks"] and s["running"] == 0 for s in states), states
  assert router.metric("tinyhet:num_requests_running") == 0 and router.metric("tinyhet:request_success_total") == done_before
  assert router.metric("tinyhet:generation_tokens_total") - tokens_before < 240, "the request ran to its end: it was not cancelled"

def test_silent_node_is_noticed_within_seconds_and_rejoins(cluster, model):
  """SIGSTOP: the node's connections stay open but its heartbeats stop; requests go to the other decode node meanwhile."""
  router, d2 = cluster["router"], cluster["d2"]
  d2.p.send_signal(signal.SIGSTOP)
  try:
    t0 = time.monotonic()
    while node_state(router, d2)["up"] and time.monotonic() - t0 < 30: time.sleep(0.1)
    noticed = time.monotonic() - t0
    assert not node_state(router, d2)["up"] and noticed < 10, f"a silent node noticed after {noticed:.1f} s"
    ids = prompt(9)
    assert router.stream({"model": model[1], "prompt": ids, "max_tokens": 6, "temperature": 0}) == reference(model, ids, 6)
  finally: d2.p.send_signal(signal.SIGCONT)
  router.wait_ready(nodes_up=3, timeout=30)

CLUSTER_FILE = """
[nodes.gpu]
device = "dgx-spark"
role = "prefill"
address = "{prefill}"
[nodes.cpu]
device = "m3-ultra"
replicas = 2
role = "decode"
address = ["{d1}", "{d2}"]
[[links]]
nodes = ["gpu", "cpu"]
bandwidth_gbit_s = 10
[[links]]
nodes = ["cpu", "cpu"]
bandwidth_gbit_s = 10
"""

def test_router_from_a_cluster_file_alone(cluster, model, tmp_path):
  """`tinyhet serve --cluster FILE --cluster-model M` with no node flags: the file's addresses and roles are the nodes."""
  path = tmp_path / "cluster.toml"
  path.write_text(CLUSTER_FILE.format(**{k: cluster[k].address for k in ("prefill", "d1", "d2")}))
  router = Router("--cluster", str(path), "--cluster-model", "smollm2")
  try:
    assert router.nodes == {cluster["prefill"].address: "prefill", cluster["d1"].address: "decode", cluster["d2"].address: "decode"}
    ready = router.wait_ready(nodes_up=3)
    assert {n["address"]: n["role"] for n in ready["nodes"]} == router.nodes
    ids = prompt(13)
    assert router.stream({"model": model[1], "prompt": ids, "max_tokens": 6, "temperature": 0}) == reference(model, ids, 6)
  finally: router.stop()

class CutOnce:
  """A TCP forwarder in front of a node. The first tcp transport stream through it (a prefill node's KV writes; control
  channels and heartbeats pass) is closed after half of the first bytes that follow its handshake: a link broken
  mid-transfer, once."""
  def __init__(self, upstream: str):
    self.upstream, self.cut, self.lock = upstream.rsplit(":", 1), threading.Event(), threading.Lock()
    self.srv = socket.create_server(("127.0.0.1", 0))
    self.address = f"127.0.0.1:{self.srv.getsockname()[1]}"
    self.socks: list[socket.socket] = []
    threading.Thread(target=self._accept, daemon=True).start()

  def _accept(self):
    while True:
      try: client, _ = self.srv.accept()
      except OSError: return
      server = socket.create_connection((self.upstream[0], int(self.upstream[1])))
      with self.lock: self.socks += [client, server]
      threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
      threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

  def _pump(self, src: socket.socket, dst: socket.socket, upstream: bool):
    data_stream = False
    try:
      while (chunk := src.recv(65536)):
        if upstream and not data_stream and re.search(rb'"transport":\s*"tcp"', chunk): data_stream = True   # its handshake
        elif data_stream and not self.cut.is_set():
          with self.lock:
            if not self.cut.is_set():
              self.cut.set()
              dst.sendall(chunk[:len(chunk) // 2])
              raise OSError("cut")
        dst.sendall(chunk)
    except OSError: pass
    for s in (src, dst):
      try: s.shutdown(socket.SHUT_RDWR)
      except OSError: pass

  def close(self):
    self.srv.close()
    with self.lock:
      for s in self.socks: s.close()

def test_kv_stream_cut_mid_transfer_is_sent_again(cluster, model):
  """A transport error: the prefill node's tcp link to the decode node breaks during a KV write; it connects again and
  sends every layer again, and the request ends with the single-process tokens without the router starting it over."""
  proxy = CutOnce(cluster["d1"].address)
  pf = node("prefill", env={"TINYHET_TRANSPORT": "tcp"})        # tcp, so the KV goes through the forwarder (shm would not)
  router = None
  try:
    router = Router("--prefill", pf.address, "--decode", proxy.address)
    router.wait_ready(nodes_up=2)
    ids = prompt(14, 40)
    assert router.stream({"model": model[1], "prompt": ids, "max_tokens": 6, "temperature": 0}) == reference(model, ids, 6)
    assert proxy.cut.is_set(), "no tcp KV stream went through the forwarder"
    assert router.metric("tinyhet:request_retries_total") == 0, "the router started the request over: the prefill node did not resend"
    assert router.metric("tinyhet:node_requests_total", node=pf.address, role="prefill") == 1
  finally:
    for p in (router, pf):
      if p is not None: p.stop()
    proxy.close()

def _kill_when_streaming(router, model, pick_victim, n_new: int, after_tokens: int, reasons: tuple[str, ...], n: int = 8,
                         sampled: bool = False) -> Proc:
  """n streaming requests; once the first has after_tokens tokens, SIGKILL pick_victim(); every request must still end
  with the single-process tokens, and at least one must have been moved off the victim. sampled: every other request
  samples (temperature 0.8, a seed of its own), and must end with the single-process tokens for that seed too."""
  prompts = [prompt(100 + i) for i in range(n)]
  samplings = [dict(temperature=0.8, top_p=0.95, seed=1000 + i) if sampled and i % 2 else {"temperature": 0} for i in range(n)]
  wants = [reference(model, p, n_new, **s) for p, s in zip(prompts, samplings)]
  got, started = {}, threading.Semaphore(0)
  def one(i):
    seen = [False]
    def on_chunk(ids):
      if len(ids) >= after_tokens and not seen[0]:
        seen[0] = True
        started.release()
    got[i] = router.stream({"model": model[1], "prompt": prompts[i], "max_tokens": n_new, **samplings[i]}, on_chunk)
  before = sum(router.metric("tinyhet:request_retries_total", reason=r) for r in reasons)
  threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
  for t in threads: t.start()
  assert started.acquire(timeout=120)
  (victim := pick_victim()).kill9()
  for t in threads: t.join(120)
  assert {i: got.get(i) for i in range(n)} == {i: wants[i] for i in range(n)}
  assert sum(router.metric("tinyhet:request_retries_total", reason=r) for r in reasons) > before, "no request was in flight on the killed node"
  return victim

def test_kill9_decode_node_while_decoding(cluster, model):
  router = cluster["router"]
  def busiest():        # the decode node with the most sequences, as its last heartbeat said
    return max((cluster[d] for d in ("d1", "d2")), key=lambda p: (s := node_state(router, p))["running"] + s["incoming"])
  # a request decoding there loses its stream (decode node lost); one still being prefilled loses its KV's destination (prefill failed).
  # The sampled ones continue their (seed, position) stream on the other node: the tokens a clean run samples.
  victim = _kill_when_streaming(router, model, busiest, n_new=48, after_tokens=3, reasons=("decode node lost", "prefill failed"), sampled=True)
  assert router.metric("tinyhet:node_up", node=victim.address) == 0

def test_kill9_prefill_node_during_prefill_then_it_rejoins(cluster, model):
  router, old = cluster["router"], cluster["prefill"]
  # 8 requests queue on the one prefill node; it dies when the first has its first token, with the rest queued or in flight
  _kill_when_streaming(router, model, lambda: old, n_new=12, after_tokens=1, reasons=("prefill node lost",))
  cluster["prefill"] = new = node("prefill", listen=old.address)       # the same address: the router's heartbeat finds it again
  assert new.address == old.address
  router.wait_ready(nodes_up=2)
  before = router.metric("tinyhet:node_requests_total", node=new.address, role="prefill")
  ids = prompt(7)
  assert router.stream({"model": model[1], "prompt": ids, "max_tokens": 5, "temperature": 0}) == reference(model, ids, 5)
  assert router.metric("tinyhet:node_requests_total", node=new.address, role="prefill") == before + 1

# ---------------------------------------------------------------- two hosts: network namespaces joined by a veth pair

CLIENT_IN_NETNS = """
import http.client, json
out = []
for ids in {prompts!r}:
  c = http.client.HTTPConnection({host!r}, {port}, timeout=300)
  c.request("POST", "/v1/completions", body=json.dumps({{"model": {model!r}, "prompt": ids, "max_tokens": 8, "temperature": 0, "stream": True,
                                                        "return_token_ids": True}}), headers={{"Content-Type": "application/json"}})
  toks = []
  for line in c.getresponse():
    if line.startswith(b"data: {{"): toks += json.loads(line[6:])["choices"][0].get("token_ids", [])
  out.append(toks)
c = http.client.HTTPConnection({host!r}, {port}, timeout=30)
c.request("GET", "/metrics")
kv = sum(float(l.split()[-1]) for l in c.getresponse().read().decode().splitlines() if l.startswith("tinyhet:kv_transfer_bytes_total"))
print(json.dumps({{"tokens": out, "kv_bytes": kv}}))
"""

@pytest.mark.netns
def test_two_hosts_over_veth(model):
  """The prefill node on host A, the decode node and the router on host B (two network namespaces joined by a veth pair):
  the KV crosses the link over tcp, and the tokens are the single-process ones."""
  from test_transport import netns_available, veth_hosts
  if (why := netns_available()): pytest.skip(why)
  procs = []
  with veth_hosts(f"sv{os.getpid() % 100000}", "10.204.0") as (a, b):
    try:
      def start(ns, *args):
        p = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "tinyhet", *args, "--stdin-stop"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=ENV)
        procs.append(p)
        return p
      pf = start(a, "node", "--role", "prefill", "--listen", "10.204.0.1:7471", "--model", SPEC, "--quiet")
      dc = start(b, "node", "--role", "decode", "--listen", "10.204.0.2:7470", "--model", SPEC, "--quiet", "--kv-memory", "8M")
      for p in (pf, dc): json.loads(p.stdout.readline())
      router = start(b, "serve", "--listen", "127.0.0.1:8123", "--model", SPEC, "--prefill", "10.204.0.1:7471", "--decode", "10.204.0.2:7470")
      json.loads(router.stdout.readline())
      prompts = [prompt(40 + i, 9) for i in range(3)]
      code = CLIENT_IN_NETNS.format(prompts=prompts, host="127.0.0.1", port=8123, model=model[1])
      ready = "import http.client, time\nfor _ in range(600):\n  c = http.client.HTTPConnection('127.0.0.1', 8123, timeout=5)\n" \
              "  c.request('GET', '/ready')\n  r = c.getresponse(); r.read()\n  if r.status == 200: break\n  time.sleep(0.2)\n"
      out = subprocess.run(["ip", "netns", "exec", b, sys.executable, "-c", ready + code], capture_output=True, text=True, timeout=300)
      assert out.returncode == 0, out.stderr
      r = json.loads(out.stdout)
      assert r["tokens"] == [reference(model, p, 8) for p in prompts] and r["kv_bytes"] > 0
    finally:
      for p in procs[::-1]:
        try:
          p.stdin.close()
          p.wait(15)
        except (subprocess.TimeoutExpired, OSError): p.kill()

def test_draft_mode_on_a_node_without_a_draft_model_says_so(cluster):
  status, _, obj = cluster["router"].request("POST", "/v1/completions", {"prompt": prompt(3), "max_tokens": 4, "speculative": {"mode": "draft"}})
  assert status == 400 and "needs a draft model" in obj["error"]["message"], (status, obj)
