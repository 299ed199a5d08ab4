import os
# Tests must not pick up a developer's tinyhet.toml or environment.
for var in [v for v in os.environ if v.startswith("TINYHET_") or v == "HET_BACKEND"]: del os.environ[var]
# `tinyhet run` in a test loads its model in its own process and leaves nothing resident (tests/test_resident.py tests that)
os.environ["TINYHET_KEEP_ALIVE"] = "0"
# nodes started by tests build no captures beyond their decode step's: the warm-up's own tests (tests/test_warm_up.py) build them
os.environ["TINYHET_WARM_UP"] = "off"

import pytest  # noqa: E402

@pytest.fixture(scope="session")
def guarded_node():
  """One small random-weight decode node process (tests/decode_util.py) for the guard, fuzz and soak tests. It caches KV that
  pf-trusted, kv-writer and kv-intruder write (its trusted writers); every other peer's serves its own request only."""
  from decode_util import TRUSTED_WRITER, DecodeNodeProcess
  n = DecodeNodeProcess(trusted=(TRUSTED_WRITER, "kv-writer", "kv-intruder"))
  yield n
  n.close()
