import os
# Tests must not pick up a developer's tinyhet.toml or environment.
for var in [v for v in os.environ if v.startswith("TINYHET_") or v == "HET_BACKEND"]: del os.environ[var]
