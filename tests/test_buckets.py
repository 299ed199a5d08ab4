from hypothesis import given, strategies as st
import pytest
from tinyhet.engine.decode_engine import BATCH_BUCKETS, batch_bucket
from tinyhet.model.buckets import below_chunk, bucket, sizes
from tinyhet.model.chunked_prefill import padded_plan

@given(n=st.integers(1, 1 << 17), chunk=st.integers(16, 4096))
def test_any_length_up_to_the_context_maps_to_a_bucket_it_fits_with_bounded_padding(n, chunk):
  b = bucket(n, chunk)
  assert n <= b <= max(16, -(-3 * n // 2))            # past 16 tokens at most a third of the bucket is padding
  assert b in sizes(chunk, n) and bucket(b, chunk) == b
  if b > chunk:   # past the chunk length: whole chunks and at most one half chunk, so the last chunk is a captured length
    plan = padded_plan(b, chunk, 0, below_chunk(chunk))
    assert [C for _, _, C in plan[:-1]] == [chunk] * (len(plan) - 1) and plan[-1][2] in (chunk, *below_chunk(chunk))

@given(chunk=st.integers(16, 4096), limit=st.integers(1, 1 << 17))
def test_the_bucket_set_is_small_sorted_and_holds_the_limit(chunk, limit):
  s = sizes(chunk, limit)
  assert list(s) == sorted(set(s)) and s[-1] >= limit and chunk in s
  assert len(s) <= 2 * (chunk.bit_length() + max(limit // chunk, 1).bit_length()) + 2    # logarithmic in both: a few dozen at most
  assert all(b < 1.5 * a + 1 for a, b in zip(s, s[1:]))

@given(st.integers(1, 4096))
def test_batch_sizes_round_up_to_their_bucket(n):
  b = batch_bucket(n)
  assert n <= b <= max(2, -(-3 * n // 2)) + 64 * (n > 128)
  assert b in BATCH_BUCKETS or b % 64 == 0

def test_bad_lengths_are_refused():
  with pytest.raises(ValueError, match="positive"): bucket(0, 512)
  with pytest.raises(ValueError, match="positive"): sizes(0, 512)
