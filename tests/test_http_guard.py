"""tinyhet.service.http_guard without a server (the router's tests in test_openai_api.py send the same over HTTP): a body's
nesting depth counted as a parser would (brackets in strings skipped), a body too deep refused as a 400 before Python's
parser can recurse, keys compared as bytes for any header, and an admin key that is another credential refused."""
import json
import pytest
from hypothesis import given, strategies as st
from tinyhet.service.api_schema import ApiError
from tinyhet.service.http_guard import MAX_JSON_DEPTH, check_admin_key, json_depth, key_matches, parse_body

TEXT = st.text(alphabet=st.sampled_from('ab[]{}"\\,: \u00e9\n'), max_size=8)     # strings full of what a depth count must skip
VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | TEXT,
                      lambda c: st.lists(c, max_size=3) | st.dictionaries(TEXT, c, max_size=3), max_leaves=30)

def depth(v) -> int:
  if isinstance(v, list): return 1 + max(map(depth, v), default=0)
  if isinstance(v, dict): return 1 + max(map(depth, v.values()), default=0)
  return 0

@given(VALUES, st.booleans())
def test_json_depth_is_the_parsed_value_depth(v, ascii_only):
  raw = json.dumps(v, ensure_ascii=ascii_only).encode()
  assert json_depth(raw) == depth(v)
  assert parse_body(raw) == v

@pytest.mark.parametrize("n", [MAX_JSON_DEPTH + 1, 10_000, 1_000_000])
def test_too_deep_is_a_400_not_a_recursion(n):
  for raw in (b"[" * n + b"]" * n, b'{"a": ' * n + b"1" + b"}" * n, b"[" * n):
    with pytest.raises(ApiError) as e: parse_body(raw)
    assert e.value.status == 400 and e.value.code == "json_too_deep"
  assert parse_body(b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH) is not None

@pytest.mark.parametrize("raw", [b"{not json", b"\xff\xfe", b"", b'"unterminated [[[['])
def test_not_json_is_a_400(raw):
  with pytest.raises(ApiError) as e: parse_body(raw)
  assert e.value.status == 400

@given(st.binary(max_size=40), st.binary(min_size=1, max_size=20))
def test_any_header_is_a_match_or_not_never_an_error(header, key):
  assert key_matches(header, [key]) == (header[:7].lower() == b"bearer " and header[7:].strip() == key)
  assert key_matches(b"Bearer " + key, [key]) == (key.strip() == key)
  assert not key_matches(None, [key]) and not key_matches(header, [])

def test_admin_key_must_be_its_own_credential():
  assert check_admin_key(None, "tok", []) is None and check_admin_key("", "tok", []) is None
  assert check_admin_key("caf\u00e9-admin", "tok", ["k"]) == "caf\u00e9-admin".encode()
  with pytest.raises(ValueError, match="TINYHET_TOKEN"): check_admin_key("tok", "tok", [])
  with pytest.raises(ValueError, match="API key"): check_admin_key("k2", "tok", ["k1", "k2"])
