"""Wire codec: round trips, corruption of every kind, chunking and reassembly."""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edge_client import messages as m
from edge_client.codec import Reassembler, decode, encode, is_chunk, split
from edge_client.errors import MessageError

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


def test_nan_weights_are_refused_even_with_a_valid_checksum():
    good = encode(SAMPLES[3])
    bad_weights = np.array(W)
    bad_weights[5] = np.nan
    # Build a frame whose checksum is right but whose payload holds a NaN.
    forged = encode(m.StationModel(**H, weights=np.zeros_like(W)))
    forged = forged[: len(forged) - W.nbytes] + bad_weights.tobytes()
    prefix_size = 4 + 4 + 4 + 8 + 32
    hlen = int.from_bytes(forged[8:12], "little")
    digest = hashlib.sha256(forged[:prefix_size - 32] + forged[prefix_size:]).digest()
    forged = forged[:prefix_size - 32] + digest + forged[prefix_size:]
    assert hlen > 0 and len(forged) == len(good)
    with pytest.raises(MessageError) as err:
        decode(forged, max_size=1 << 20)
    assert err.value.reason == "non_finite"


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


def test_chunks_are_hashed_as_they_arrive_and_decode_checks_that_digest():
    frame = encode(m.StationModel(**H, weights=np.arange(50_000, dtype=np.float32)))
    span = hashlib.sha256(frame[:20] + frame[52:]).digest()
    chunks = split(frame, 16 * 1024)
    for order in (range(len(chunks)), [2, 0, 1, *range(3, len(chunks))]):
        r = Reassembler(max_size=1 << 20, memory_cap=1 << 20, timeout=5.0)
        whole = [o for o in (r.add("t", chunks[i], 0.0) for i in order) if o is not None]
        assert whole == [frame] and r.last_digest == span  # out of order: caught up in order
    assert decode(frame, max_size=1 << 20, digest=span).message.weights[-1] == 49_999
    # decode trusts the digest it is given to be the frame's: a wrong one is a bad checksum.
    with pytest.raises(MessageError) as err:
        decode(frame, max_size=1 << 20, digest=bytes(32))
    assert err.value.reason == "bad_checksum"
    # A first chunk shorter than the frame prefix cannot start the hash: decode hashes.
    tiny = split(frame, 60)
    r = Reassembler(max_size=1 << 20, memory_cap=1 << 20, timeout=5.0)
    assert [o for o in (r.add("t", c, 0.0) for c in tiny) if o is not None] == [frame]
    assert r.last_digest is None


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
