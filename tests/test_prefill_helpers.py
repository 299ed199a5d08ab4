from hypothesis import given, strategies as st
from tinyhet.engine.prefill import busy_time, prefill_bucket
from tinyhet.kv.notices import notice_value, split_notice, MAX_SEQ_ID, LAYER_BITS

@given(st.integers(1, 200_000))
def test_prefill_bucket(n):
  b = prefill_bucket(n)
  assert b >= n and b % 16 == 0 and b - n < max(16, n / 8 + 1)
  assert prefill_bucket(b) == b            # a bucket is its own bucket: padded prompts compile nothing new

@given(st.lists(st.tuples(st.floats(0, 100), st.floats(0, 10)), max_size=20))
def test_busy_time_is_the_union_of_intervals(raw):
  intervals = [(a, a + d) for a, d in raw]
  got = busy_time(intervals)
  assert got <= sum(b - a for a, b in intervals) + 1e-9
  assert got >= max((b - a for a, b in intervals), default=0) - 1e-9
  # checked against a fine grid
  grid = [i / 20 for i in range(0, 2200)]
  covered = sum(1 for x in grid if any(a <= x < b for a, b in intervals)) / 20
  assert abs(got - covered) <= 0.05 * (2 * len(intervals) + 1)

@given(st.integers(0, MAX_SEQ_ID - 1), st.integers(0, (1 << LAYER_BITS) - 1))
def test_notice_values_round_trip(seq_id, layer):
  v = notice_value(seq_id, layer)
  assert 0 <= v < 1 << 32 and split_notice(v) == (seq_id, layer)

def test_long_prefill_shows_progress_short_one_stays_quiet(capsys):
  """prefill_progress: nothing while a prefill is young; past the threshold, a line per quarter of the layers with the rate."""
  import time
  from tinyhet.engine.prefill import prefill_progress
  quiet = prefill_progress(100, 8, after_s=10.0)
  for layer in range(1, 9): quiet(layer)
  assert capsys.readouterr().err == ""
  loud = prefill_progress(100, 8, after_s=0.05)
  time.sleep(0.1)
  loud(0)                                        # the clock starts with the prefill, not when the callback was made
  loud(1)
  assert capsys.readouterr().err == ""
  time.sleep(0.1)
  for layer in range(1, 9): loud(layer)
  lines = capsys.readouterr().err.strip().splitlines()
  assert [ln.split(":")[2].split()[0] for ln in lines] == ["2/8", "4/8", "6/8", "8/8"], lines
  assert all("of 100 tokens" in ln and ln.endswith("tokens/s") for ln in lines)
