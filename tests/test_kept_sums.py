"""The head statistics an aggregator keeps (aggregator/kept_sums.py): triangles and factors
admitted in the forms they came, weighted, folded as they go upstream, checkpointed (and
read from a checkpoint of whole matrices), always the sums of everything admitted."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from aggregator.heads import HeadLedger
from aggregator.kept_sums import BATCH_ROWS, KeptSums
from edge_client import messages as m
from edge_client.errors import MessageError
from edge_client.head_stats import HeadSpec, HeadStatsPath, HeadSums

D, C = 40, 4


def _spec(kind="ridge"):
    return HeadSpec(kind, D, C, np.zeros(D, np.float32), 50.0)


def _send(spec, rows, y, *, whole=False, sender="d0"):
    """A device's send of ``rows``: a factor where few (as a device sends them), or the
    Gram's triangle."""
    if whole:
        s = spec.zeros(np.float32)
        from edge_client.head_stats import augment
        s.add_rows(augment(rows, spec.centre, spec.clip), y)
        gram, cross, counts = s.packed()
        return m.HeadStats(fleet="f", sender=sender, round=0, iteration=0, station="s",
                           gram=gram, cross=cross, counts=counts)
    path = HeadStatsPath(spec, 1, fleet="f", device=sender, station="s")
    path.take(rows, y)
    return path.first(True)[0]


def _reference(spec, sends, weights):
    total = spec.zeros()
    for msg, w in zip(sends, weights, strict=True):
        total.add(spec.unpack(msg), w)
    return total


def _close(got: HeadSums, want: HeadSums) -> None:
    np.testing.assert_allclose(got.gram, want.gram, rtol=2e-5, atol=2e-3)
    np.testing.assert_allclose(got.cross, want.cross, rtol=2e-5, atol=2e-3)
    np.testing.assert_allclose(got.counts, want.counts, atol=0.5)  # the wire rounds them


def test_triangles_and_factors_kept_in_their_forms_sum_as_the_whole_matrices_do():
    """Sends of both forms, some weighted down, more factor rows than one batch holds: the
    kept sums are the whole matrices' sum; what goes upstream is what was fresh, and the
    sums are the same after it went."""
    spec = _spec()
    rng = np.random.default_rng(0)
    sends, weights = [], []
    for i in range(80):
        k = int(rng.integers(3, 21)) if i % 5 else 30  # 30 rows: past half the side
        rows = rng.normal(0, 2.0, (k, D)).astype(np.float32)
        sends.append(_send(spec, rows, rng.integers(0, C, k)))
        weights.append(0.25 if i % 7 == 3 else 1.0)
    assert sum(msg.factor.size // (D + 1) for msg in sends) > BATCH_ROWS
    assert {bool(msg.factor.size) for msg in sends} == {True, False}
    kept = KeptSums(D, C, gram=True)
    for msg, w in zip(sends[:25], weights[:25], strict=True):
        kept.add(spec.claim(msg), w)
    _close(kept.whole(), _reference(spec, sends[:25], weights[:25]))
    tri, cross, counts = kept.take_fresh()  # a station's send upstream
    up = HeadSums.unpacked(D, C, tri, cross, counts)
    _close(up, _reference(spec, sends[:25], weights[:25]))
    assert kept.fresh_n == 0 and kept.n == round(sum(
        w * msg.counts.sum() for msg, w in zip(sends[:25], weights[:25], strict=True)))
    for msg, w in zip(sends[25:], weights[25:], strict=True):
        kept.add(spec.claim(msg), w)
    _close(kept.whole(), _reference(spec, sends, weights))
    tri, cross, counts = kept.take_fresh()  # only what came since
    _close(HeadSums.unpacked(D, C, tri, cross, counts),
           _reference(spec, sends[25:], weights[25:]))


def test_a_ledger_restarted_from_a_checkpoint_of_whole_matrices_owes_what_it_owed():
    """A station's checkpoint written before these forms held its total and its pending
    sums whole: read into them, it still owes the cloud exactly the pending part."""
    spec = _spec()
    rng = np.random.default_rng(1)
    sent, owed = (_send(spec, rng.normal(0, 2.0, (k, D)).astype(np.float32),
                        rng.integers(0, C, k), whole=True) for k in (60, 25))
    total, pending = _reference(spec, [sent, owed], [1, 1]), spec.unpack(owed)
    old = {f"head_{part}_{k}": getattr(s, k) for part, s in (("total", total),
                                                             ("pending", pending))
           for k in ("gram", "cross", "counts")}
    ledger = HeadLedger(spec, Counter(), "f", upstream=True)
    ledger.restore({**old, "head_solved": np.array([0])})
    _close(ledger.total.whole(), total)
    up = ledger.upstream(lambda: m.StationStats(fleet="f", sender="s", round=0, iteration=0,
                                                seen_counts=np.zeros(C, np.int64)), 0, 0)[1]
    _close(HeadSums.unpacked(D, C, up.gram, up.cross, up.counts), pending)
    # and its own checkpoint now round-trips, fresh part included
    ledger.admit(owed, np.full(C, 10**6))
    again = HeadLedger(spec, Counter(), "f", upstream=True)
    again.restore(ledger.arrays())
    for key, value in ledger.total.arrays().items():
        np.testing.assert_array_equal(again.total.arrays()[key], value)


def test_class_means_alone_are_kept_without_a_gram():
    spec = _spec("ncm")
    rng = np.random.default_rng(2)
    sends = [_send(spec, rng.normal(0, 2.0, (50, D)).astype(np.float32),
                   rng.integers(0, C, 50), whole=True) for _ in range(3)]
    kept = KeptSums(D, C, gram=False)
    for msg in sends:
        kept.add(spec.claim(msg))
    assert kept.whole().gram.size == 0
    _close(kept.whole(), _reference(spec, sends, [1, 1, 1]))


def test_a_device_puts_at_most_64_rows_in_a_factor_and_a_station_still_takes_128():
    """Past 64 rows the triangle costs a station less to admit (1.3 ms against 0.02 ms a
    row, bench/head_stats.py): a device sends 64 as a factor and 65 as the triangle.  A
    factor of 128 rows, as the version before sent, is still admitted, and 129 refused."""
    wide = HeadSpec("ridge", 1280, 10, np.zeros(1280, np.float32), 100.0)
    rng = np.random.default_rng(3)
    rows = rng.normal(0, 1.0, (129, 1280)).astype(np.float32)
    y = np.arange(129) % 10
    assert _send(wide, rows[:64], y[:64]).factor.size == 64 * 1281
    assert _send(wide, rows[:65], y[:65]).factor.size == 0
    ledger = HeadLedger(wide, Counter(), "f", upstream=True)
    big = _send(wide, rows[:64], y[:64])
    none = np.zeros(0, np.float32)
    old = m.HeadStats(fleet="f", sender="d0", round=0, iteration=0, station="s",
                      gram=none, cross=none, factor=np.tile(big.factor, 2),
                      factor_labels=np.tile(big.factor_labels, 2),
                      counts=2 * big.counts)
    ledger.admit(old, np.full(10, 10**6))
    assert ledger.total.n == 128
    with pytest.raises(MessageError, match="for k from 1 to 128"):
        wide.claim(m.HeadStats(fleet="f", sender="d0", round=0, iteration=0, station="s",
                               gram=none, cross=none,
                               factor=np.concatenate([old.factor, np.zeros(1281, np.float32)]),
                               factor_labels=np.concatenate([old.factor_labels,
                                                             np.zeros(10, np.float32)]),
                               counts=old.counts))
