"""A cluster file's node addresses and roles (tinyhet.planner.cluster_nodes): what `tinyhet serve --cluster FILE` routes to. The
router started from such a file, with real nodes: test_service.py."""
import pathlib, subprocess, sys, tomllib
import pytest
from hypothesis import given, strategies as st
from tinyhet.planner.cluster_file import ClusterFileError, load_cluster, parse_cluster, read_toml
from tinyhet.planner.cluster_nodes import ROLES, check_address, serving_nodes

ROOT = pathlib.Path(__file__).parent.parent
TWO = """
[nodes.gpu]
device = "dgx-spark"
{gpu}
[nodes.cpu]
device = "m3-ultra"
{cpu}
[[links]]
nodes = ["gpu", "cpu"]
bandwidth_gbit_s = 100
"""

def two(gpu: str = 'role = "prefill"\naddress = "10.0.0.1:7471"', cpu: str = 'role = "decode"\naddress = "10.0.0.2:7470"') -> dict:
  return tomllib.loads(TWO.format(gpu=gpu, cpu=cpu))

def test_a_file_with_addresses_is_still_the_planners():
  data = two()
  assert serving_nodes(data) == {"10.0.0.1:7471": "prefill", "10.0.0.2:7470": "decode"}
  assert [n.name for n in parse_cluster(data).nodes] == ["gpu", "cpu"]          # the planner reads the same file
  assert serving_nodes(two(cpu="")) == {"10.0.0.1:7471": "prefill"}             # a node without both keys is the planner's only
  assert serving_nodes(read_toml(ROOT / "examples/clusters/spark_m3ultra.toml")) == {}
  readme = ROOT / "examples/clusters/two_machines.toml"                        # the README's two-machine cluster
  assert serving_nodes(read_toml(readme)) == {"10.0.0.1:7471": "prefill", "10.0.0.2:7470": "decode"} and load_cluster(readme)

hosts = st.one_of(st.from_regex(r"[a-z][a-z0-9.-]{0,20}", fullmatch=True), st.ip_addresses(v=4).map(str))
addresses = st.builds(lambda h, p: f"{h}:{p}", hosts, st.integers(1, 65535))

@given(st.lists(st.tuples(st.sampled_from(ROLES), st.lists(addresses, min_size=1, max_size=3)), min_size=1, max_size=6))
def test_every_node_and_replica_in_file_order(nodes):
  data = {"nodes": {f"n{i}": {"device": "m3-ultra", "role": role, "address": addrs if len(addrs) > 1 else addrs[0], "replicas": len(addrs)}
                    for i, (role, addrs) in enumerate(nodes)}}
  flat = [(a, role) for role, addrs in nodes for a in addrs]
  if len({a for a, _ in flat}) < len(flat):
    with pytest.raises(ClusterFileError, match="also nodes.n"): serving_nodes(data)
  else: assert list(serving_nodes(data).items()) == flat

@given(st.text(max_size=30))
def test_check_address_accepts_only_host_port(text):
  host, _, port = text.rpartition(":")
  ok = bool(host) and not any(c.isspace() for c in text) and port.isdigit() and 0 < int(port) < 65536
  assert (check_address(text) is None) == ok

@pytest.mark.parametrize("gpu, key, problem", [
  ('address = "10.0.0.1:7471"', "nodes.gpu.role", "missing"),
  ('role = "prefill"', "nodes.gpu.address", "missing"),
  ('role = "decoder"\naddress = "10.0.0.1:7471"', "nodes.gpu.role", "is 'decoder'"),
  ('role = 3\naddress = "10.0.0.1:7471"', "nodes.gpu.role", "is 3"),
  ('role = "prefill"\naddress = "10.0.0.1"', "nodes.gpu.address", "is '10.0.0.1', not HOST:PORT"),
  ('role = "prefill"\naddress = "10.0.0.1:0"', "nodes.gpu.address", "has port '0'"),
  ('role = "prefill"\naddress = "10.0.0.1:70000"', "nodes.gpu.address", "has port '70000'"),
  ('role = "prefill"\naddress = ":7471"', "nodes.gpu.address", "not HOST:PORT"),
  ('role = "prefill"\naddress = "a host:7471"', "nodes.gpu.address", "not HOST:PORT"),
  ('role = "prefill"\naddress = 7471', "nodes.gpu.address", "not a string"),
  ('role = "prefill"\naddress = "10.0.0.2:7470"', "nodes.cpu.address", "also nodes.gpu's address"),
  ('role = "prefill"\naddress = ["10.0.0.1:1", "10.0.0.1:2"]', "nodes.gpu.address", "2 addresses for 1 replicas"),
  ('role = "prefill"\nreplicas = 2\naddress = "10.0.0.1:1"', "nodes.gpu.address", "one address for 2 replicas"),
])
def test_bad_node_entries_say_the_key_and_the_fix(tmp_path, gpu, key, problem):
  data = two(gpu=gpu)
  with pytest.raises(ClusterFileError) as e: serving_nodes(data, "c.toml")
  assert e.value.key == key and problem in e.value.problem and e.value.fix and "\n" not in str(e.value)
  path = tmp_path / "c.toml"
  path.write_text(TWO.format(gpu=gpu, cpu='role = "decode"\naddress = "10.0.0.2:7470"'))
  if "replicas" not in gpu:       # (replicas need a link of their own first)
    with pytest.raises(ClusterFileError, match=key.replace(".", r"\.")): load_cluster(path)    # `tinyhet plan` says it too

def serve(*args) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "tinyhet", "serve", "--listen", "127.0.0.1:0", *args], capture_output=True, text=True, timeout=120)

def test_serve_says_what_is_wrong_with_the_file_in_one_line(tmp_path):
  bad, planner_only, good = tmp_path / "bad.toml", tmp_path / "planner.toml", tmp_path / "good.toml"
  bad.write_text(TWO.format(gpu='role = "prefill"', cpu=""))
  planner_only.write_text(TWO.format(gpu="", cpu=""))
  good.write_text(TWO.format(gpu='role = "prefill"\naddress = "127.0.0.1:7471"', cpu='role = "decode"\naddress = "127.0.0.1:7470"'))
  for args, message in [((bad,), "nodes.gpu.address: missing"), ((planner_only,), "no decode-capable node"),
                        ((good, "--both", "127.0.0.1:7470"), "127.0.0.1:7470 is given as a decode node and with --both")]:
    out = serve("--cluster", str(args[0]), "--cluster-model", "smollm2", *map(str, args[1:]))
    assert out.returncode != 0 and message in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
