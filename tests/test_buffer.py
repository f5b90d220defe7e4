"""StreamBuffer (SPEC §2): FIFO overwrite, one-shot batches, held-out slice, histograms."""

from __future__ import annotations

import numpy as np
import pytest

from edge_client.buffer import StreamBuffer
from edge_client.errors import ConfigError, ShapeError


def _stream(n, start=0, classes=4):
    idx = np.arange(start, start + n)
    return idx.astype(np.float32).reshape(n, 1), idx % classes


def test_batches_are_oldest_first_and_one_shot():
    buf = StreamBuffer(100, 4, (1,), holdout_every=0)
    buf.push(*_stream(10))
    x, y = buf.next_batch(4)
    assert x.ravel().tolist() == [0, 1, 2, 3]
    x, _ = buf.next_batch(4)
    assert x.ravel().tolist() == [4, 5, 6, 7]
    x, _ = buf.next_batch(4)
    assert x.ravel().tolist() == [8, 9]
    assert len(buf.next_batch(4)[1]) == 0


def test_overwrite_drops_oldest_unread_and_counts_them():
    buf = StreamBuffer(5, 4, (1,), holdout_every=0)
    buf.push(*_stream(3))
    buf.next_batch(2)  # 0, 1 consumed
    buf.push(*_stream(6, start=3))  # 9 arrivals in a ring of 5: 0..3 are gone
    assert buf.overwritten_unread == 2  # samples 2 and 3 were never trained on
    assert buf.next_batch(10)[0].ravel().tolist() == [4, 5, 6, 7, 8]
    assert buf.unread == 0


def test_holdout_takes_every_nth_sample_and_is_never_trained_on():
    buf = StreamBuffer(100, 4, (1,), holdout_every=5, holdout_capacity=3)
    buf.push(*_stream(30))
    hx, _ = buf.holdout()
    assert hx.ravel().tolist() == [19, 24, 29]  # bounded: the oldest held-out fell off
    trained = buf.next_batch(100)[0].ravel()
    assert not set(trained) & {4, 9, 14, 19, 24, 29}
    assert len(trained) == 24


def test_histograms_of_everything_seen_and_of_next_batch():
    buf = StreamBuffer(100, 4, (1,), holdout_every=0)
    buf.push(*_stream(10))
    assert buf.seen_counts.tolist() == [3, 3, 2, 2]
    assert buf.next_batch_counts(3).tolist() == [1, 1, 1, 0]
    x, y = buf.next_batch(3)
    assert np.bincount(y, minlength=4).tolist() == [1, 1, 1, 0]
    assert buf.next_batch_counts(3).tolist() == [1, 1, 0, 1]
    assert buf.samples_seen == 10


def test_push_larger_than_capacity_keeps_the_newest():
    buf = StreamBuffer(4, 4, (1,), holdout_every=0)
    buf.push(*_stream(10))
    assert buf.next_batch(10)[0].ravel().tolist() == [6, 7, 8, 9]
    assert buf.overwritten_unread == 6


def test_bad_input_is_refused_and_leaves_the_buffer_intact():
    buf = StreamBuffer(10, 4, (1,), holdout_every=0)
    buf.push(*_stream(3))
    with pytest.raises(ShapeError):
        buf.push(np.zeros((2, 3), np.float32), np.array([0, 1]))
    with pytest.raises(ShapeError):
        buf.push(np.zeros((2, 1), np.float32), np.array([0, 7]))
    with pytest.raises(ShapeError):
        buf.push(np.array([[np.nan]], np.float32), np.array([0]))
    assert buf.unread == 3 and buf.seen_counts.sum() == 3
    with pytest.raises(ConfigError, match="capacity"):
        StreamBuffer(0, 4, (1,))


def test_a_pinned_batch_survives_overwrites_and_is_the_next_batch():
    buf = StreamBuffer(6, 4, (1,), holdout_every=0)
    buf.push(*_stream(3))
    assert not buf.pin(4)  # a partial batch may still fill: not pinned
    buf.push(*_stream(3, start=3))
    assert buf.pin(4)
    counts = buf.next_batch_counts(4)
    buf.push(*_stream(12, start=6))  # the ring is rewritten twice over
    np.testing.assert_array_equal(buf.next_batch_counts(4), counts)
    assert buf.unread == 4 + 6
    x, _ = buf.next_batch(4)
    assert x.ravel().tolist() == [0, 1, 2, 3]
    x, _ = buf.next_batch(4)  # then the oldest unread again
    assert x.ravel().tolist() == [12, 13, 14, 15]
