import pytest
from hypothesis import given, strategies as st
from tinyhet.runtime.descriptor import RegionDescriptor, DescriptorError

descriptors = st.builds(RegionDescriptor, node=st.text(min_size=1, max_size=60).filter(lambda s: len(s.encode()) < 256),
  region_id=st.integers(0, 2**64 - 1), addr=st.integers(0, 2**64 - 1), rkey=st.integers(0, 2**32 - 1),
  offset=st.integers(0, 2**62), length=st.integers(0, 2**62),
  transports=st.sets(st.sampled_from(["tcp", "shm", "verbs"]), min_size=1).map(frozenset))

@given(descriptors)
def test_round_trip(d):
  assert RegionDescriptor.decode(d.encode()) == d
  assert RegionDescriptor.from_hex(d.to_hex()) == d

@given(st.binary(max_size=120))
def test_random_bytes_are_rejected_cleanly(data):
  try: d = RegionDescriptor.decode(data)
  except DescriptorError: return
  assert d.encode() == data   # the rare valid input decodes to exactly itself

@given(descriptors, st.data())
def test_truncated_or_extended_rejected(d, data):
  raw = d.encode()
  cut = data.draw(st.integers(0, len(raw) - 1))
  with pytest.raises(DescriptorError): RegionDescriptor.decode(raw[:cut])
  with pytest.raises(DescriptorError, match="length"): RegionDescriptor.decode(raw + b"x")

@given(descriptors, st.integers(0, 41), st.integers(1, 255))
def test_flipped_header_byte_never_crashes(d, pos, xor):
  raw = bytearray(d.encode())
  raw[pos] ^= xor
  try: RegionDescriptor.decode(bytes(raw))
  except DescriptorError: pass

def test_specific_errors():
  d = RegionDescriptor("decode0", 1, 0x1000, 0, 0, 4096)
  raw = d.encode()
  with pytest.raises(DescriptorError, match="magic"): RegionDescriptor.decode(b"XYZ" + raw[3:])
  with pytest.raises(DescriptorError, match="version 9"): RegionDescriptor.decode(raw[:3] + b"\x09" + raw[4:])
  with pytest.raises(DescriptorError, match="hex"): RegionDescriptor.from_hex("zz")
  with pytest.raises(DescriptorError, match="u32"): RegionDescriptor("n", 1, 0, 2**32, 0, 1)
  with pytest.raises(DescriptorError, match="node name"): RegionDescriptor("", 1, 0, 0, 0, 1)
  with pytest.raises(DescriptorError, match="transports"): RegionDescriptor("n", 1, 0, 0, 0, 1, frozenset({"udp"}))
  assert d.narrow(1024, 2048) == RegionDescriptor("decode0", 1, 0x1000, 0, 1024, 2048)
  with pytest.raises(DescriptorError, match="outside"): d.narrow(4000, 100)
