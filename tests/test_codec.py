"""Wire codec: round trips, corruption of every kind, chunking and reassembly."""

from __future__ import annotations

import dataclasses
import hashlib
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edge_client import messages as m
from edge_client.codec import WIRE_VERSION, decode, encode, split, stream
from edge_client.errors import MessageError
from edge_client.reassembly import Reassembler, is_chunk

H = dict(fleet="f", sender="x", round=2, iteration=7)
W = np.linspace(-1, 1, 1000, dtype=np.float32)
SAMPLES = [
    m.DeviceStats(**H, station="s", seen_counts=[1, 2, 3], next_batch_counts=[0, 1, 0]),
    m.DeviceUpdate(**H, station="s", weights=W, num_samples=32),
    m.SkipNotice(**H, station="s", gap=0.25),
    m.StationModel(**H, weights=W),
    m.Selection(**H, members=("a", "b"), deadline=12.5),
    m.StationStats(**H, seen_counts=[4, 5]),
    m.StationUpdate(**H, weights=W, num_samples=64, seen_counts=[4, 5]),
    m.GlobalModel(**H, weights=W, p_real=[0.25, 0.75], final=True),
    m.Presence(**H, role="dev", online=False),
]


def _checksum(frame: bytes) -> tuple[slice, bytes]:
    """Where docs/protocol.md puts a frame's checksum in its wire version, and the checksum
    it should hold, computed here from the bytes without the codec."""
    if frame[4] == 1:
        return slice(20, 52), hashlib.sha256(frame[:20] + frame[52:]).digest()
    assert frame[4] == 2
    return slice(len(frame) - 4, len(frame)), zlib.crc32(frame[:-4]).to_bytes(4, "little")


def _same(a: m.Message, b: m.Message) -> bool:
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            if x.dtype != y.dtype or not np.array_equal(x, y):
                return False
        elif x != y:
            return False
    return type(a) is type(b)


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda x: type(x).__name__)
def test_round_trip(msg):
    frame = decode(encode(msg, layout_hash="abc"), max_size=1 << 20)
    assert _same(frame.message, msg) and frame.layout_hash == "abc"


def test_fp16_halves_the_payload_and_comes_back_as_float32():
    msg = SAMPLES[1]
    full, half = encode(msg), encode(msg, fp16=True)
    assert len(full) - len(half) == W.size * 2
    back = decode(half, max_size=1 << 20).message
    assert back.weights.dtype == np.float32
    np.testing.assert_allclose(back.weights, W, atol=1e-3)


def test_wire_overhead_is_small():
    msg = m.DeviceUpdate(**H, station="s", weights=np.zeros(100_000, np.float32),
                         num_samples=32)
    assert len(encode(msg, layout_hash="0123456789abcdef")) / (100_000 * 4) < 1.002


def test_every_truncation_is_refused():
    data = encode(SAMPLES[3])
    for cut in range(len(data)):
        with pytest.raises(MessageError):
            decode(data[:cut], max_size=1 << 20)


def test_trailing_garbage_and_oversize_are_refused():
    data = encode(SAMPLES[1])
    with pytest.raises(MessageError) as err:
        decode(data + b"junk", max_size=1 << 20)
    assert err.value.reason == "wrong_length"
    with pytest.raises(MessageError) as err:
        decode(data, max_size=len(data) - 1)
    assert err.value.reason == "oversize"


@settings(max_examples=200, deadline=None)
@given(position=st.integers(0, 10_000), flip=st.integers(1, 255))
def test_any_flipped_byte_is_refused(position, flip):
    data = bytearray(encode(SAMPLES[1]))
    data[position % len(data)] ^= flip
    with pytest.raises(MessageError):
        decode(bytes(data), max_size=1 << 20)


@pytest.mark.parametrize("version", [1, 2])
def test_nan_weights_are_refused_even_with_a_valid_checksum(version):
    good = encode(SAMPLES[3], wire_version=version)
    bad_weights = np.array(W)
    bad_weights[5] = np.nan
    # Build a frame whose checksum is right but whose payload holds a NaN.
    forged = encode(m.StationModel(**H, weights=np.zeros_like(W)), wire_version=version)
    forged = forged[: len(forged) - W.nbytes] + bad_weights.tobytes()
    at, digest = _checksum(forged)
    forged = forged[:at.start] + digest + forged[at.stop:]
    assert len(forged) == len(good)
    with pytest.raises(MessageError) as err:
        decode(forged, max_size=1 << 20)
    assert err.value.reason == "non_finite"


def test_frames_of_both_wire_versions_decode_and_others_are_refused_by_name():
    assert WIRE_VERSION == 2 and encode(SAMPLES[1])[4] == 2
    for version in (1, 2):
        frame = encode(SAMPLES[1], wire_version=version, message_id=bytes(16))
        at, digest = _checksum(frame)
        assert frame[4] == version and frame[at] == digest
        assert _same(decode(frame, max_size=1 << 20).message, SAMPLES[1])
        # The reserved byte, the header, the last weight, the checksum itself.
        for flip in (7, 60, len(frame) - 40, at.start):
            bad = bytearray(frame)
            bad[flip] ^= 0x10
            with pytest.raises(MessageError) as err:
                decode(bytes(bad), max_size=1 << 20)
            assert err.value.reason == "bad_checksum"
    # Both versions carry the same header and payload: version 1 puts sha256 after the
    # prefix, version 2 ends the frame with CRC-32.
    one, two = (encode(SAMPLES[1], wire_version=v, message_id=bytes(16)) for v in (1, 2))
    assert one[52:] == two[20:-4] and len(one) - len(two) == 28
    unknown = bytearray(two)
    unknown[4] = 3
    with pytest.raises(MessageError) as err:
        decode(bytes(unknown), max_size=1 << 20)
    assert err.value.reason == "version"


def test_chunks_reassemble_in_any_order_once():
    frame = encode(m.StationModel(**H, weights=np.arange(50_000, dtype=np.float32)))
    chunks = split(frame, 16 * 1024)
    assert len(chunks) > 10 and all(is_chunk(c) and len(c) <= 16 * 1024 for c in chunks)
    rng = np.random.default_rng(0)
    order = list(rng.permutation(len(chunks))) + [0, 3]  # with QoS 1 duplicates
    r = Reassembler(max_size=1 << 20, memory_cap=1 << 20, timeout=5.0)
    outs = [r.add("topic", chunks[i], 0.0) for i in order]
    whole = [o for o in outs if o is not None]
    assert whole == [frame] and r.buffered == 0
    assert r.counters["duplicate_chunks"] == 2
    assert split(frame, len(frame)) == [frame]


@pytest.mark.parametrize("version", [1, 2])
def test_chunks_are_hashed_as_they_arrive_and_decode_checks_that_digest(version):
    frame = encode(m.StationModel(**H, weights=np.arange(50_000, dtype=np.float32)),
                   wire_version=version)
    span = _checksum(frame)[1]
    chunks = split(frame, 16 * 1024)
    assert {c[4] for c in chunks} == {version}  # a v1 receiver can reassemble v1 chunks
    for order in (range(len(chunks)), [2, 0, 1, *range(3, len(chunks))]):
        r = Reassembler(max_size=1 << 20, memory_cap=1 << 20, timeout=5.0)
        whole = [o for o in (r.add("t", chunks[i], 0.0) for i in order) if o is not None]
        assert whole == [frame] and r.last_digest == span  # out of order: caught up in order
    assert decode(frame, max_size=1 << 20, digest=span).message.weights[-1] == 49_999
    # decode trusts the digest it is given to be the frame's: a wrong one is a bad checksum.
    with pytest.raises(MessageError) as err:
        decode(frame, max_size=1 << 20, digest=bytes(len(span)))
    assert err.value.reason == "bad_checksum"
    # Chunks shorter than the prefix are folded in all the same; a first chunk too short to
    # name the wire version leaves the check to decode.
    small = encode(m.StationModel(**H, weights=W), wire_version=version)
    for size, expected in ((37 + 12, _checksum(small)[1]), (37 + 4, None)):
        r = Reassembler(max_size=1 << 20, memory_cap=1 << 20, timeout=5.0)
        assert [o for o in (r.add("t", c, 0.0) for c in split(small, size))
                if o is not None] == [small]
        assert r.last_digest == expected
    # A corrupted chunk is caught by the check the reassembler folded in as it arrived.
    bad = [bytearray(c) for c in chunks]
    bad[1][-5] ^= 0x01
    r = Reassembler(max_size=1 << 20, memory_cap=1 << 20, timeout=5.0)
    got = [o for o in (r.add("t", bytes(c), 0.0) for c in bad) if o is not None][0]
    with pytest.raises(MessageError) as err:
        decode(got, max_size=1 << 20, digest=r.last_digest)
    assert err.value.reason == "bad_checksum"


@settings(max_examples=150, deadline=None)
@given(n=st.integers(0, 3000), extra=st.integers(-6, 6), parts=st.integers(2, 5),
       version=st.sampled_from([1, 2]))
def test_streamed_chunks_are_the_split_frame(n, extra, parts, version):
    """The transport's chunks, checksummed as they go, are byte for byte the frame's
    chunks; chunk sizes around the frame's length put the CRC trailer across a boundary."""
    msg = m.StationModel(**H, weights=np.arange(n, dtype=np.float32))
    frame = encode(msg, message_id=bytes(16), wire_version=version)
    size = max(-(-len(frame) // parts) + 37 + extra, 41)

    def same_id(chunks):  # the chunk-set id is random per message
        return [c[:5] + c[21:] if is_chunk(c) else c for c in chunks]

    got = list(stream(msg, chunk_size=size, message_id=bytes(16), wire_version=version))
    assert same_id(got) == same_id(split(frame, size))
    r = Reassembler(max_size=1 << 20, memory_cap=1 << 20, timeout=5.0)
    whole = [o for o in (r.add("t", c, 0.0) for c in got) if o is not None] if len(got) > 1 \
        else got
    assert whole == [frame] and decode(frame, max_size=1 << 20).message.weights.size == n


def test_reassembly_timeout_and_memory_cap():
    frame = encode(m.StationModel(**H, weights=np.arange(20_000, dtype=np.float32)))
    chunks = split(frame, 8 * 1024)
    r = Reassembler(max_size=1 << 20, memory_cap=1 << 20, timeout=5.0)
    r.add("t", chunks[0], 0.0)
    assert r.buffered > 0
    r.expire(10.0)
    assert r.buffered == 0 and r.counters["chunk_timeout"] == 1
    small = Reassembler(max_size=1 << 20, memory_cap=20 * 1024, timeout=5.0)
    with pytest.raises(MessageError) as err:
        for c in chunks:
            small.add("t", c, 0.0)
    assert err.value.reason == "oversize" and small.buffered == 0
    with pytest.raises(MessageError):
        Reassembler(max_size=1000, memory_cap=1 << 20, timeout=5.0).add("t", chunks[0], 0.0)


def test_a_decoded_model_is_frozen_without_a_copy_and_a_built_one_with_one():
    w = np.arange(6, dtype=np.float32)
    msg = m.DeviceUpdate(fleet="f", sender="d", round=0, iteration=0, station="s",
                         weights=w, num_samples=3)
    w[0] = 99.0  # the sender's array is not the message's
    assert msg.weights[0] == 0.0 and not msg.weights.flags.writeable
    frame = encode(msg)
    got = decode(frame, max_size=1 << 20).message
    np.testing.assert_array_equal(got.weights, msg.weights)
    # Read straight from the (immutable) frame: nothing can make it writeable again.
    assert np.shares_memory(got.weights, np.frombuffer(frame, dtype=np.uint8))
    with pytest.raises(ValueError):
        got.weights.flags.writeable = True
