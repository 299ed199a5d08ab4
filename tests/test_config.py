import pytest
from hypothesis import given, strategies as st
from tinyhet.config import Config, ConfigError, load_config, parse_bytes

def test_defaults():
  cfg = load_config(env={})
  assert cfg == Config() and cfg.transport == "auto" and cfg.kv_block_size == 16

def test_file_then_env_then_overrides(tmp_path):
  p = tmp_path / "c.toml"
  p.write_text('transport = "tcp"\narena_bytes = "64M"\nkv_block_size = 32\n[peers]\nd0 = "10.0.0.2:7470"\n')
  cfg = load_config(p, env={"TINYHET_TRANSPORT": "shm"}, kv_block_size=8)
  assert (cfg.transport, cfg.arena_bytes, cfg.kv_block_size, cfg.peers) == ("shm", 64 << 20, 8, {"d0": "10.0.0.2:7470"})

def test_env_file_variable(tmp_path):
  p = tmp_path / "c.toml"
  p.write_text('tcp_streams = 2\n')
  assert load_config(env={"TINYHET_CONFIG": str(p)}).tcp_streams == 2
  with pytest.raises(ConfigError, match="no such file"): load_config(env={"TINYHET_CONFIG": str(tmp_path / "missing.toml")})

@pytest.mark.parametrize("text, message", [
  ('transport = "carrier-pigeon"', "transport"), ('bogus = 1', "unknown key 'bogus'"), ('arena_bytes = "lots"', "not a size"),
  ('tcp_streams = 0', "tcp_streams"), ('hugepages = "maybe"', "boolean"), ('[peers]\nx = "nohostport"', "host:port"),
  ('transport = ', "config file"), ('kv_dtype = "int4"', "kv_dtype"),
  ('rdma_device = "mlx5 0"', "rdma_device"), ('rdma_port = 0', "rdma_port"), ('rdma_port = "one"', "not an integer"),
  ('rdma_gid_index = -2', "rdma_gid_index"), ('rdma_gid_index = 256', "rdma_gid_index"), ('trusted_writers = 5', "trusted_writers"),
])
def test_bad_files_name_the_problem(tmp_path, text, message):
  (p := tmp_path / "c.toml").write_text(text)
  with pytest.raises(ConfigError, match=message): load_config(p, env={})

def test_bad_env():
  with pytest.raises(ConfigError, match="TINYHET_TCP_STREAMS"): load_config(env={"TINYHET_TCP_STREAMS": "many"})
  with pytest.raises(ConfigError, match="TINYHET_PEERS"): load_config(env={"TINYHET_PEERS": "a=b"})
  assert load_config(env={"TINYHET_PEERS": "a=h:1,b=h2:2"}).peers == {"a": "h:1", "b": "h2:2"}

@given(st.integers(1, 1 << 40), st.sampled_from(["", "k", "M", "G", "KiB", "GB"]))
def test_parse_bytes(n, unit):
  mult = 1024 ** "_kmgt".index(unit[:1].lower() or "_")
  assert parse_bytes(f"{n}{unit}") == n * mult

@given(st.text(max_size=20))
def test_parse_bytes_rejects_or_parses(text):
  try: assert parse_bytes(text) > 0
  except ConfigError: pass

def test_rdma_options():
  assert (Config().rdma_device, Config().rdma_port, Config().rdma_gid_index) == ("", 1, -1)
  cfg = load_config(env={"TINYHET_RDMA_DEVICE": "mlx5_1", "TINYHET_RDMA_PORT": "2", "TINYHET_RDMA_GID_INDEX": "3"})
  assert (cfg.rdma_device, cfg.rdma_port, cfg.rdma_gid_index) == ("mlx5_1", 2, 3)
  with pytest.raises(ConfigError, match="TINYHET_RDMA_PORT"): load_config(env={"TINYHET_RDMA_PORT": "first"})
  with pytest.raises(ConfigError, match="rdma_port = 300 must be a port number"): load_config(env={"TINYHET_RDMA_PORT": "300"})
  with pytest.raises(ConfigError, match="rdma_device = 'a/b' is not an RDMA device name"): load_config(env={"TINYHET_RDMA_DEVICE": "a/b"})

def test_trusted_writers():
  """The peers whose KV a decode node caches: none by default; a comma list in the environment, a list in the file."""
  assert Config().trusted_writers is None                       # none (or a cluster file's prefill nodes: tests/test_identity.py)
  assert load_config(env={"TINYHET_TRUSTED_WRITERS": "prefill0, prefill1,"}).trusted_writers == ("prefill0", "prefill1")
  assert load_config(env={}, trusted_writers=("p",)).trusted_writers == ("p",)
  with pytest.raises(ConfigError, match="trusted_writers"): load_config(env={"TINYHET_TRUSTED_WRITERS": "x" * 201})
  with pytest.raises(ConfigError, match="trusted_writers"): load_config(env={}, trusted_writers=(1,))

# the transports' fields are checked by one rule (runtime/settings.py), whichever layer meets the value first
TRANSPORT_FIELDS = ("transport", "tcp_streams", "rdma_device", "rdma_port", "rdma_gid_index")

def test_transport_settings_are_the_configs_defaults():
  from tinyhet.runtime.settings import TransportSettings, TRANSPORTS
  import tinyhet.config
  assert tinyhet.config.TRANSPORTS is TRANSPORTS
  assert TransportSettings.of(load_config(env={})) == TransportSettings()
  cfg = load_config(env={"TINYHET_TOKEN": "s", "TINYHET_RDMA_DEVICE": "rxe0", "TINYHET_RDMA_GID_INDEX": "1"})
  assert TransportSettings.of(cfg) == TransportSettings(token="s", rdma_device="rxe0", rdma_gid_index=1)

@given(st.sampled_from(TRANSPORT_FIELDS), st.one_of(st.integers(-3, 300), st.text(max_size=70), st.booleans(), st.none()))
def test_config_and_transport_settings_agree_on_every_value(name, value):
  from tinyhet.runtime.settings import TransportSettings
  def outcome(make):
    try: make()
    except (ConfigError, ValueError) as e: return str(e).split(": ", 1)[1]      # without the source ("config: ", "transport settings: ")
    return None
  assert outcome(lambda: Config(**{name: value})) == outcome(lambda: TransportSettings(**{name: value}))

def test_warm_up_and_prefill_budget():
  assert load_config(env={}).warm_up == "background" and load_config(env={}).prefill_budget == 128
  assert load_config(env={"TINYHET_WARM_UP": "Before", "TINYHET_PREFILL_BUDGET": "64"}) == Config(warm_up="before", prefill_budget=64)
  with pytest.raises(ConfigError, match="TINYHET_WARM_UP: warm_up = 'later' is not one of background, before, off"):
    load_config(env={"TINYHET_WARM_UP": "later"})
  for bad in ("0", "100000"):
    with pytest.raises(ConfigError, match="prefill_budget .* must be between 1 and 65536"): load_config(env={"TINYHET_PREFILL_BUDGET": bad})
  with pytest.raises(ConfigError, match="TINYHET_PREFILL_BUDGET"): load_config(env={"TINYHET_PREFILL_BUDGET": "lots"})
