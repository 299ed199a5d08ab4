"""`tinyhet serve --ray`: the replica spec, the placement rule (plain Python, property-tested), the one-line message without
Ray, and one Ray scenario with real processes: a ray.cluster_utils.Cluster of simulated hosts inside a network namespace
whose only interface is lo (tests/ray_driver.py), the router, the nodes as Ray actors, kill -9 of the decode actor, decode
replicas raised 1 -> 2 as a host joins, and that host leaving. Tokens are compared with a single-process greedy run."""
import json, os, socket, subprocess, sys, time
import pytest
from hypothesis import given, settings, strategies as st
from tinyhet.service.ray_cluster import ROLES, check_counts, choose_host, parse_replicas

SPEC = "random:max_context=256"
TOKEN = "ray-test-token"
ADMIN = "ray-test-admin-key"
HOST_MEMORY = 256 << 20           # tests/ray_driver.py's decode hosts

# ---- the replica spec

@given(st.dictionaries(st.sampled_from(ROLES), st.integers(0, 1024), min_size=1))
def test_replicas_spec_round_trips(counts):
  text = ",".join(f"{r}={n}" for r, n in counts.items())
  full = {**dict.fromkeys(ROLES, 0), **counts}
  if full["decode"] + full["both"] < 1:
    with pytest.raises(ValueError, match="at least one decode"): parse_replicas(text)
  else: assert parse_replicas(text) == full

@pytest.mark.parametrize("text", ["", "prefill=1", "decode", "decode=", "decode=-1", "decode=x", "gpu=1,decode=1", "decode=1;prefill=1",
                                  "decode=1.5", "decode=2000", " = "])
def test_bad_replicas_spec_says_what_to_write(text):
  with pytest.raises(ValueError) as e: parse_replicas(text)
  assert "decode" in str(e.value)

@pytest.mark.parametrize("counts", [{"decode": True}, {"decode": 1, "x": 1}, {"decode": "1"}, {"decode": 1, "prefill": -1}, {"decode": 0}])
def test_bad_counts(counts):
  with pytest.raises(ValueError): check_counts(counts)

# ---- placement

HOST = st.fixed_dictionaries({"tinyhet_decode": st.sampled_from([0, 1]), "tinyhet_prefill": st.sampled_from([0, 1, 2]),
                              "GPU": st.sampled_from([0, 1]),
                              "memory": st.integers(1 << 30, 1 << 40)})

@settings(max_examples=300, deadline=None)
@given(st.lists(HOST, min_size=1, max_size=6), st.lists(st.sampled_from(ROLES), max_size=12))
def test_placement_rules_hold_as_replicas_are_added(resources, order):
  hosts = [{"NodeID": f"h{i}", "Resources": r} for i, r in enumerate(resources)]
  taken: dict[str, list[str]] = {}
  def on(h): return taken.get(h["NodeID"], [])
  def has_decode(h): return bool({"decode", "both"} & set(on(h)))
  key = "tinyhet_prefill" if any(h["Resources"]["tinyhet_prefill"] for h in hosts) else "GPU" if any(h["Resources"]["GPU"] for h in hosts) else None
  def prefill_room(h): return h["Resources"][key] - on(h).count("prefill") if key else 1
  for role in order:
    host, res = choose_host(role, hosts, taken)
    if role in ("decode", "both"):
      marked = [h for h in hosts if h["Resources"]["tinyhet_decode"]]
      pool = [h for h in (marked or hosts) if not has_decode(h)]      # tinyhet_decode hosts when there are any; one decode node per host
      if not pool:
        assert host is None and "tinyhet_decode" in res["why"]
        continue
      assert host in pool and res == ({"tinyhet_decode": 1} if marked else {})
      apart = [h for h in pool if "prefill" not in on(h)]             # away from prefill nodes when possible, then the most memory
      assert host in (apart or pool) and host["Resources"]["memory"] == max(h["Resources"]["memory"] for h in (apart or pool))
    else:
      pool = [h for h in hosts if prefill_room(h) >= 1]
      if not pool:
        assert host is None and key in res["why"]
        continue
      assert host in pool and res == ({"tinyhet_prefill": 1} if key == "tinyhet_prefill" else {"num_gpus": 1} if key == "GPU" else {})
      if has_decode(host): assert all(has_decode(h) for h in pool), "a prefill node joined a decode node while a host without one had room"
    taken.setdefault(host["NodeID"], []).append(role)

def test_decode_goes_to_the_biggest_host_without_a_prefill_node():
  hosts = [{"NodeID": "gpu", "Resources": {"GPU": 1, "memory": 64 << 30}}, {"NodeID": "big", "Resources": {"memory": 32 << 30}},
           {"NodeID": "small", "Resources": {"memory": 8 << 30}}]
  assert choose_host("prefill", hosts, {})[0]["NodeID"] == "gpu"
  assert choose_host("decode", hosts, {"gpu": ["prefill"]})[0]["NodeID"] == "big"
  assert choose_host("decode", hosts, {"gpu": ["prefill"], "big": ["decode"]})[0]["NodeID"] == "small"
  assert choose_host("decode", hosts, {"gpu": ["prefill"], "big": ["decode"], "small": ["both"]})[0]["NodeID"] == "gpu"
  assert choose_host("decode", hosts, {"gpu": ["prefill", "decode"], "big": ["decode"], "small": ["both"]})[0] is None

# ---- the router's nodes at run time (what the Ray controller calls), with real heartbeat endpoints

def test_cluster_add_and_remove_nodes_at_run_time():
  from tinyhet.service import heartbeat
  from tinyhet.service.router import Cluster
  from tinyhet.runtime.transport import Endpoint
  status = {"model": "m", "block_size": 16, "kv_blocks": 10, "free_blocks": 10, "running": 0, "waiting": 0, "incoming": 0, "max_seqs": 4}
  nodes = [Endpoint(f"n{i}", token="t") for i in range(2)]
  for ep in nodes: heartbeat.install(ep, "decode", lambda: status)
  a, b = (ep.listen("127.0.0.1", 0) for ep in nodes)
  router = Endpoint("router", token="t")
  c = Cluster(router, {}, "m", hb_interval=0.05, hb_timeout=1.0)
  try:
    def wait(cond):
      for _ in range(200):
        if cond(): return True
        time.sleep(0.02)
    assert not c.ready()
    c.add_node(a, "decode")
    c.add_node(a, "decode")                         # twice: still one node, one watch
    assert wait(c.ready) and len(c.watches) == 1
    c.add_node(b, "decode")
    assert wait(lambda: sum(n["up"] for n in c.describe()) == 2)
    node, blocks = c._admit(16)                     # a request holds a node; removing it leaves the request its Node
    gone = c.remove_node(node.address)
    assert gone is node and gone.assigned == 1 and [n["address"] for n in c.describe()] == [b if node.address == a else a]
    c._release(gone, blocks)
    assert gone.assigned == 0 and len(c.watches) == 1 and c.remove_node(gone.address) is None
    c.remove_node(b if node.address == a else a)
    assert not c.ready() and c.watches == []
  finally:
    c.close()
    for ep in [*nodes, router]: ep.close()

# ---- without Ray

def test_ray_missing_says_in_one_line_what_to_install():
  # sys.modules["ray"] = None is Python's own way to make `import ray` fail as if the package were absent
  code = "import sys; sys.modules['ray'] = None; from tinyhet.cli.main import main; sys.exit(main(sys.argv[1:]))"
  p = subprocess.run([sys.executable, "-c", code, "serve", "--ray", "auto", "--replicas", "prefill=1,decode=1"], capture_output=True, text=True,
                     timeout=60)
  assert p.returncode != 0 and p.stdout == ""
  assert p.stderr.count("\n") == 1 and "pip install -e '.[ray]'" in p.stderr, p.stderr

@pytest.mark.parametrize("argv, says", [(["--ray", "auto", "--replicas", "decode=0"], "at least one decode"),
                                        (["--ray", "auto", "--replicas", "gpu=2"], "ROLE=COUNT"),
                                        (["--ray", "auto", "--decode", "127.0.0.1:1"], "leave out --prefill"),
                                        (["--ray", "auto", "--max-seqs", "0"], "--max-seqs"),
                                        (["--ray", "auto", "--kv-fraction", "0"], "--kv-fraction"),
                                        (["--ray", "auto", "--kv-fraction", "2"], "--kv-fraction"),
                                        (["--ray", "auto", "--kv-memory", "lots"], "--kv-memory"),
                                        (["--ray", "auto", "--max-restarts", "-5"], "--max-restarts")])
def test_bad_ray_arguments(argv, says):
  p = subprocess.run([sys.executable, "-m", "tinyhet", "serve", *argv], capture_output=True, text=True, timeout=60)
  assert p.returncode == 2 and says in p.stderr and p.stderr.count("\n") == 1, p.stderr

def test_a_ray_address_nobody_answers_on_fails_in_one_line():
  pytest.importorskip("ray", reason="Ray is not installed: pip install -e '.[ray]'")
  with socket.socket() as s:                       # a port that was free a moment ago: nothing listens there
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  p = subprocess.run([sys.executable, "-m", "tinyhet", "serve", "--ray", f"127.0.0.1:{port}", "--listen", "127.0.0.1:0", "--model", SPEC],
                     capture_output=True, text=True, timeout=60)
  assert p.returncode != 0 and "no Ray cluster answers" in p.stderr and p.stderr.count("\n") == 1, p.stderr

# ---- the Ray scenario

PROMPTS, N = [[(i * 37 + j * 11) % 250 + 1 for j in range(10)] for i in range(4)], 20     # one length: one set of compiled kernels

@pytest.fixture(scope="module")
def model():
  import tinyhet  # noqa: F401
  from tinyhet.model import spec as service_model
  return service_model.load(SPEC, "HET")[0]

@pytest.fixture(scope="module")
def scenario(model):
  """(what ray_driver.py saw, the single-process tokens of PROMPTS): the references are computed while the driver runs."""
  pytest.importorskip("ray", reason="Ray is not installed: pip install -e '.[ray]'")
  from test_transport import netns_available
  if (why := netns_available()): pytest.skip(why)
  ns = f"ray{os.getpid() % 100000}"
  try:
    for cmd in (f"ip netns add {ns}", f"ip -n {ns} link set lo up"):
      if (p := subprocess.run(cmd.split(), capture_output=True, text=True)).returncode != 0: pytest.skip(f"{cmd}: {p.stderr.strip()}")
    env = {**os.environ, "TINYHET_TOKEN": TOKEN, "TINYHET_ADMIN_KEY": ADMIN, "TINYHET_ARENA_BYTES": "256M", "RAY_USAGE_STATS_ENABLED": "0"}
    driver = os.path.join(os.path.dirname(__file__), "ray_driver.py")
    p = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, driver, SPEC, json.dumps(PROMPTS), str(N)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env)
    try:
      refs = [model.reference_generate(ids, N, temperature=0.0) for ids in PROMPTS]
      out, err = p.communicate(timeout=400)
    finally:
      if p.poll() is None:
        p.kill()
        p.communicate()
    assert p.returncode == 0 and out.strip(), err[-4000:]
    return json.loads(out.strip().splitlines()[-1]), refs
  finally:
    # whatever the driver left (a timeout, a failure: Ray's own processes included) runs inside the namespace: end it by pid
    for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split():
      try: os.kill(int(pid), 9)
      except (ProcessLookupError, ValueError): pass
    subprocess.run(["ip", "netns", "del", ns], capture_output=True)

@pytest.mark.netns
def test_ray_nodes_placed_by_resources_and_serving(scenario, model):
  from tinyhet.config import load_config
  from tinyhet.kv.paged_cache import kv_blocks_for
  s, refs = scenario
  assert s["placement"] == {"prefill": s["hosts"]["head"], "decode": s["hosts"]["big"]}        # tinyhet_prefill / tinyhet_decode hosts
  cfg = load_config()
  assert s["kv_blocks"] == kv_blocks_for(model.cfg, cfg.kv_block_size, cfg.kv_dtype, HOST_MEMORY // 4)   # a quarter of its host's memory
  assert s["served"] == [r[:N // 2] for r in refs[:2]]
  assert s["left_running"] == [], "node processes outlived their actors"

@pytest.mark.netns
def test_kill9_of_the_decode_actor_is_restarted_by_ray(scenario, model):
  s, refs = scenario
  assert s["killed"] == refs
  r = s["restart"]
  assert r["restarts"] == 1 and r["new_pid"] != r["old_pid"] and r["same_host"] and r["new_address"]
  assert not r["old_node_alive"], "the killed actor's node process lived on"
  assert r["retries"] > 0, "no request was in flight on the killed node"

@pytest.mark.netns
def test_decode_replicas_raised_while_requests_run_as_a_host_joins(scenario, model):
  s, refs = scenario
  assert s["scaling"] == refs
  sc = s["scale"]
  assert sc["want"]["decode"] == 2 and "tinyhet_decode" in sc["pending"]["decode"]          # no host for it until one joined
  assert sorted([s["hosts"]["big"], sc["joined"]]) == sc["decode_hosts"]
  assert s["after_scale"] == [r[:N // 2] for r in refs + refs]
  assert len(sc["work"]) == 2 and all(w > 0 for w in sc["work"]), sc["work"]

@pytest.mark.netns
def test_decode_replicas_lowered_while_requests_run_then_a_host_leaves(scenario):
  s, refs = scenario
  assert s["draining"] == refs, "a request was lost when its decode replica was dropped"
  d = s["drain"]
  assert d["decode"] == [s["hosts"]["big"]] and d["dropped_host"] == s["scale"]["joined"]     # the newest replica went
  assert d["dropped_address"] not in d["routed"] and not d["dropped_alive"]
  assert d["dropped_work"] > 0, "no request was running on the replica that was dropped"
  # the big host leaves: its decode replica is placed again on the host the drain freed, and serves
  assert s["left"]["moved_to"] == s["scale"]["joined"] and s["left"]["served"] == [refs[0][:N // 2]]

@pytest.mark.netns
def test_admin_endpoint_refuses_bad_requests(scenario):
  """The admin key only: neither the nodes' cluster token nor a non-ASCII header (a 401, not a 500) opens it."""
  s, _ = scenario
  statuses = [status for status, _ in s["admin_bad"]]
  assert statuses == [401] * 4 + [400] * 8, s["admin_bad"]
  assert all(set(obj["error"]) == {"message", "type", "param", "code"} for _, obj in s["admin_bad"])
  assert s["admin_after"] == {"prefill": 1, "decode": 1, "both": 0}
