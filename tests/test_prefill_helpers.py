from hypothesis import given, strategies as st
from tinyhet.engine.prefill import busy_time, prefill_bucket
import pytest
from tinyhet.kv.notices import Landing, notice_value, split_notice, MAX_PIECES, MAX_SEQ_ID, LAYER_BITS

@given(st.integers(1, 200_000), st.sampled_from([16, 100, 512, 2048]))
def test_prefill_bucket(n, chunk):
  b = prefill_bucket(n, chunk)
  assert n <= b <= max(16, -(-3 * n // 2))   # at most a third of a bucket past 16 tokens is padding
  assert prefill_bucket(b, chunk) == b     # a bucket is its own bucket: padded prompts compile nothing new

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

@given(st.integers(0, MAX_SEQ_ID - 1), st.integers(0, (1 << LAYER_BITS) - 1), st.integers(0, MAX_PIECES - 1), st.booleans())
def test_notice_values_round_trip(seq_id, layer, piece, last):
  v = notice_value(seq_id, layer, piece, last)
  assert 0 <= v < 1 << 32 and split_notice(v) == (seq_id, layer, piece, last)
  assert split_notice(notice_value(seq_id, layer)) == (seq_id, layer, 0, True)      # a layer sent whole: piece 0, the last

def test_notice_fields_out_of_range_are_refused():
  for bad in ((MAX_SEQ_ID, 0), (0, 1 << LAYER_BITS), (0, 0, MAX_PIECES), (-1, 0)):
    with pytest.raises(ValueError): notice_value(*bad)

@given(st.integers(1, 4), st.data())
def test_a_layer_lands_once_all_its_pieces_have_whatever_the_order(n_layers, data):
  pieces = {l: data.draw(st.integers(1, 6)) for l in range(n_layers)}
  notices = data.draw(st.permutations([(l, p, p == n - 1) for l, n in pieces.items() for p in range(n)]))
  land = Landing(n_layers)
  for i, (l, p, last) in enumerate(notices):
    assert not land.complete()
    assert land.add(l, p, last)
    assert land.add(l, p, last)                                          # a repeat (a resend) counts once, harmlessly
    assert land.done == {m for m in pieces if all(x in notices[:i + 1] for x in [(m, q, q == pieces[m] - 1) for q in range(pieces[m])])}
  assert land.complete() and len(land) == n_layers

@given(st.lists(st.tuples(st.integers(-1, 3), st.integers(0, MAX_PIECES - 1), st.booleans()), max_size=30))
def test_hostile_notices_never_land_a_layer_with_a_piece_missing(notices):
  # any stream of notices: a layer is counted only when its last piece k and every piece 0..k were accepted, and nothing
  # past a layer's accepted last piece, nor a second different last, is accepted
  land, accepted = Landing(2), []
  for l, p, last in notices:
    if land.add(l, p, last): accepted.append((l, p, last))
  for l in range(2):
    lasts = {p for m, p, z in accepted if m == l and z}
    assert len(lasts) <= 1
    got = {p for m, p, _ in accepted if m == l}
    if lasts: assert max(got) == next(iter(lasts))
    assert (l in land.done) == (bool(lasts) and got == set(range(next(iter(lasts)) + 1)))
  assert all(0 <= l < 2 for l, _, _ in accepted)

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
