"""The Ray scenario of tests/test_ray.py, run inside a network namespace whose only interface is lo (Ray then binds
127.0.0.1): a ray.cluster_utils.Cluster of simulated hosts, `tinyhet serve --ray` over it, requests, kill -9 of the decode
actor's process, decode replicas raised 1 -> 2 as a host joins, that host leaving. Prints one JSON object of what it saw;
the test compares the tokens with a single-process run. Every phase streams some of the same prompts, so that one set of
single-process runs checks them all. usage: python ray_driver.py MODEL_SPEC PROMPTS_JSON MAX_TOKENS"""
import http.client, json, os, signal, subprocess, sys, threading, time
from ray.cluster_utils import Cluster

SPEC, PROMPTS, N, TOKEN = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), os.environ["TINYHET_TOKEN"]
ADMIN = os.environ["TINYHET_ADMIN_KEY"]        # the router's admin key: /admin/replicas and /ready's node list
HOST_MEMORY = 256 << 20            # the Ray memory of each decode host: its KV pool is a quarter of it
out: dict = {"phases": {}}
NODE_PIDS: set[int] = set()

class Router:
  def __init__(self, address: str):
    self.host, port = address.rsplit(":", 1)
    self.port = int(port)
  def request(self, method, path, body=None, token=ADMIN, raw=None):
    c = http.client.HTTPConnection(self.host, self.port, timeout=120)
    try:
      headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
      c.request(method, path, body=raw if raw is not None else (json.dumps(body) if body is not None else None), headers=headers)
      r = c.getresponse()
      text = r.read().decode()
      try: return r.status, json.loads(text)
      except json.JSONDecodeError: return r.status, text
    finally: c.close()
  def stream(self, ids, n, on_chunk=None) -> list[int]:
    c = http.client.HTTPConnection(self.host, self.port, timeout=180)
    c.request("POST", "/v1/completions", body=json.dumps({"model": SPEC_ID, "prompt": ids, "max_tokens": n, "temperature": 0, "stream": True,
                                                          "return_token_ids": True}), headers={"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200: return [f"HTTP {r.status}: {r.read()[:200]!r}"]
    toks = []
    for line in r:
      if line.startswith(b"data: {"):
        obj = json.loads(line[6:])
        if "error" in obj: return [*toks, obj["error"]["message"]]
        toks += obj["choices"][0].get("token_ids", [])
        if on_chunk: on_chunk(toks)
    c.close()
    return toks
  def wait(self, check, what: str, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
      if (v := check()): return v
      time.sleep(0.2)
    raise TimeoutError(f"{what}: {self.request('GET', '/admin/replicas')[1]} {self.request('GET', '/ready')[1]}")
  def up(self) -> int:
    status, obj = self.request("GET", "/ready")
    return sum(n["up"] for n in obj["nodes"]) if isinstance(obj, dict) else 0
  def replicas(self, role=None) -> list[dict]:
    reps = self.request("GET", "/admin/replicas")[1]["replicas"]
    NODE_PIDS.update(r["node_pid"] for r in reps if r["node_pid"])
    return [r for r in reps if role in (None, r["role"])]
  def metric(self, name: str, **labels) -> float:
    text = self.request("GET", "/metrics")[1]
    return sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines() if l.startswith(name) and all(f'{k}="{v}"' in l for k, v in labels.items()))

def many(router, prompts, n, after=None) -> tuple:
  """Stream the prompts at once; join() -> their tokens. after: an Event set once the first request has 3 tokens."""
  got = {}
  def one(i):
    def chunk(toks):
      if after is not None and len(toks) >= 3: after.set()
    got[i] = router.stream(prompts[i], n, chunk)
  threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
  for t in threads: t.start()
  def join():
    for t in threads: t.join(200)
    return [got.get(i) for i in range(len(prompts))]
  return join

def alive(pid: int) -> bool:
  try: os.kill(pid, 0)
  except ProcessLookupError: return False
  try:
    with open(f"/proc/{pid}/stat") as f: return f.read().split(")")[-1].split()[0] != "Z"
  except OSError: return False

def outlives(pids, timeout: float = 30) -> list[int]:
  """The pids still alive after waiting up to timeout seconds for them to end (a process killed by its parent's death signal
  ends a moment after its parent, not at once)."""
  deadline = time.monotonic() + timeout
  while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline: time.sleep(0.1)
  return left

t0 = time.monotonic()
# the GPU host (head: tinyhet_prefill) and a big-memory host (tinyhet_decode)
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"tinyhet_prefill": 1}, "include_dashboard": False})
big = cluster.add_node(num_cpus=1, resources={"tinyhet_decode": 1}, memory=HOST_MEMORY)
proc = subprocess.Popen([sys.executable, "-m", "tinyhet", "serve", "--ray", cluster.address, "--listen", "127.0.0.1:0", "--model", SPEC,
                         "--replicas", "prefill=1,decode=1", "--max-seqs", "8", "--stdin-stop"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                        text=True)
try:
  first = json.loads(proc.stdout.readline())
  threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()     # the router's later lines: keep its pipe drained
  SPEC_ID, router = first["model"], Router(first["address"])
  router.wait(lambda: router.up() >= 2, "the first two nodes")
  reps = router.replicas()
  out["hosts"] = {"head": cluster.head_node.node_id, "big": big.node_id}
  out["placement"] = {r["role"]: r["node_id"] for r in reps}
  out["kv_blocks"] = next(n["kv_blocks"] for n in router.request("GET", "/ready")[1]["nodes"] if n["role"] == "decode")
  out["served"] = many(router, PROMPTS[:2], N // 2)()
  out["phases"]["start+serve"] = time.monotonic() - t0

  # kill -9 the decode actor's process while 6 requests stream
  t = time.monotonic()
  old = router.replicas("decode")[0]
  join = many(router, PROMPTS, N, after=(streaming := threading.Event()))
  assert streaming.wait(120), "no request streamed"
  os.kill(old["pid"], signal.SIGKILL)
  out["killed"] = join()
  new = router.wait(lambda: (r := router.replicas("decode")) and r[0]["restarts"] >= 1 and r[0]["address"] and r[0], "the restart")
  out["restart"] = {"old_pid": old["pid"], "new_pid": new["pid"], "same_host": old["node_id"] == new["node_id"], "restarts": new["restarts"],
                    "old_node_alive": bool(outlives([old["node_pid"]])), "new_address": new["address"] != old["address"],
                    "retries": router.metric("tinyhet:request_retries_total")}
  out["phases"]["kill9"] = time.monotonic() - t

  # decode 1 -> 2 while requests run: the second waits for a host, which then joins
  t = time.monotonic()
  scaled = {}
  join = many(router, PROMPTS, N, after=(streaming := threading.Event()))
  assert streaming.wait(120), "no request streamed"
  scaled["post"] = router.request("POST", "/admin/replicas", {"decode": 2})[1]
  # the POST starts a reconcile on a thread of its own: wait for it to say why the new replica has no host yet
  scaled["pending"] = router.wait(lambda: (p := router.request("GET", "/admin/replicas")[1]["pending"]).get("decode") and p,
                                  "the pending replica", 30)
  scaled["host"] = cluster.add_node(num_cpus=1, resources={"tinyhet_decode": 1}, memory=HOST_MEMORY)      # Ray wants the main thread here
  out["scaling"] = join()
  router.wait(lambda: router.up() >= 3, "the second decode node")
  out["scale"] = {"want": scaled["post"]["want"], "pending": scaled["pending"],
                  "decode_hosts": sorted(r["node_id"] for r in router.replicas("decode")), "joined": scaled["host"].node_id}
  out["after_scale"] = many(router, PROMPTS + PROMPTS, N // 2)()
  out["scale"]["work"] = [router.metric("tinyhet:node_requests_total", node=r["address"]) for r in router.replicas("decode")]
  out["phases"]["scale"] = time.monotonic() - t

  # decode 2 -> 1 while requests stream: the newest replica leaves routing, then stops once its requests are done
  t = time.monotonic()
  dropped = next(r for r in router.replicas("decode") if r["node_id"] == scaled["host"].node_id)
  work_before = router.metric("tinyhet:node_requests_total", node=dropped["address"])
  # the router balances by the load the nodes' heartbeats report: wait until they show the last phase's sequences gone, or a
  # beat still counting them steers every request of this phase to the other node
  router.wait(lambda: all(n.get("running", 0) + n.get("incoming", 0) + n.get("waiting", 0) == 0 for n in router.request("GET", "/ready")[1]["nodes"]),
              "the decode nodes' heartbeats to show them idle", 30)
  join = many(router, PROMPTS, N, after=(streaming := threading.Event()))
  assert streaming.wait(120), "no request streamed"
  router.request("POST", "/admin/replicas", {"decode": 1})
  out["draining"] = join()
  router.wait(lambda: not router.request("GET", "/admin/replicas")[1]["draining"], "the drain", 90)
  out["drain"] = {"decode": [r["node_id"] for r in router.replicas("decode")], "dropped_host": dropped["node_id"],
                  "dropped_alive": bool(outlives([dropped["node_pid"]])),
                  "routed": [n["address"] for n in router.request("GET", "/ready")[1]["nodes"]],
                  "dropped_address": dropped["address"],
                  "dropped_work": router.metric("tinyhet:node_requests_total", node=dropped["address"]) - work_before}
  out["phases"]["drain"] = time.monotonic() - t

  # the decode replica's host leaves the cluster: the replica is placed again on the host that is free now
  t = time.monotonic()
  gone = router.replicas("decode")[0]
  cluster.remove_node(big)
  moved = router.wait(lambda: (r := router.replicas("decode")) and r[0]["address"] and r[0]["node_id"] != gone["node_id"] and r[0],
                      "the replacement", 90)
  router.wait(lambda: router.up() >= 2 and all(n["address"] != gone["address"] for n in router.request("GET", "/ready")[1]["nodes"]),
              "the replacement's node", 90)
  out["left"] = {"moved_to": moved["node_id"], "served": many(router, PROMPTS[:1], N // 2)()}
  out["phases"]["leave"] = time.monotonic() - t

  # the admin endpoint's bad input: nothing changes
  # no key, a wrong one, the nodes' cluster token (not the admin's), a non-ASCII one (bytes, not a 500); then bad counts
  bad = [("POST", {"decode": 3}, None), ("GET", None, "wrong"), ("POST", {"decode": 3}, TOKEN), ("GET", None, "caf\xe9"),
         ("POST", {"decode": -1}, ADMIN), ("POST", {"decode": 0, "both": 0}, ADMIN), ("POST", {"wizard": 1}, ADMIN), ("POST", {"decode": "2"}, ADMIN),
         ("POST", {"decode": True}, ADMIN), ("POST", [1], ADMIN), ("POST", "{not json", ADMIN), ("POST", {"decode": 10**6}, ADMIN)]
  out["admin_bad"] = [router.request(m, "/admin/replicas", b if not isinstance(b, str) else None, token=tok, raw=b if isinstance(b, str) else None)
                      for m, b, tok in bad]
  out["admin_after"] = router.request("GET", "/admin/replicas")[1]["want"]
finally:
  try:
    proc.stdin.close()
    proc.wait(30)
  except (subprocess.TimeoutExpired, OSError): proc.kill()
  cluster.shutdown()
  out["left_running"] = outlives(NODE_PIDS)          # every node process ends with its actor
  out["phases"]["total"] = time.monotonic() - t0
  print(json.dumps(out))
