"""Closed-form heads from summed statistics (edge_client/head_stats.py): exact against a
centralised solve, whatever the split and order; checked as claims; packed for the wire."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from edge_client.errors import MessageError
from edge_client.head_solves import (
    GCV_FLOOR,
    head_vector,
    solve_lda,
    solve_ncm,
    solve_ridge,
)
from edge_client.head_stats import HeadSpec, HeadSums, augment, check_claim

D, C = 24, 5


def _blobs(n, seed=0, skew=None):
    rng = np.random.default_rng(seed)
    centres = np.random.default_rng(99).normal(0, 1.0, (C, D)) + 3.0
    y = rng.choice(C, n, p=skew) if skew is not None else rng.integers(0, C, n)
    return (centres[y] + rng.normal(0, 1.2, (n, D))).astype(np.float32), y


def _sums(x, y, centre, clip, kind="ridge"):
    s = HeadSums.zeros(D, C, kind=kind)
    s.add_rows(augment(x, centre, clip), y)
    return s


def test_the_head_from_summed_device_statistics_is_the_centralised_ridge_head():
    """Ten devices, each of one or two classes (label skew at its worst), in any order: the
    head solved from the summed statistics is the one solved on every row at once, and
    the one an explicit regression with an unpenalised bias gives."""
    x, y = _blobs(2000)
    centre, clip, lam = np.full(D, 2.0, np.float32), 100.0, 5.0
    whole = _sums(x, y, centre, clip)
    total = HeadSums.zeros(D, C)
    order = np.random.default_rng(1).permutation(10)
    for k in order:
        mine = (y % 5 == k % 5) & (np.arange(len(y)) % 2 == k // 5)
        total.add(_sums(x[mine], y[mine], centre, clip))
    w1, b1, _ = solve_ridge(whole, lam)
    w2, b2, _ = solve_ridge(total, lam)
    np.testing.assert_allclose(w1, w2, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(b1, b2, rtol=1e-9, atol=1e-9)
    # The same regression, written out: [X 1] theta = onehot, penalty on X's columns only.
    a = np.hstack([x - centre, np.ones((len(x), 1))])
    penalty = np.diag([lam] * D + [0.0])
    theta = np.linalg.solve(a.T @ a + penalty, a.T @ np.eye(C)[y])
    np.testing.assert_allclose(w1, theta[:D].T, rtol=1e-6, atol=1e-8)
    flat = head_vector(w1, b1, centre)
    logits = x @ flat[:D * C].reshape(C, D).T + flat[D * C:]
    np.testing.assert_allclose(logits, a @ theta, rtol=1e-4, atol=1e-4)


def test_gcv_chooses_lambda_from_the_statistics_alone_and_it_predicts():
    x, y = _blobs(3000)
    xt, yt = _blobs(2000, seed=5)
    centre = x[:50].mean(axis=0)
    s = _sums(x, y, centre, 1e3)
    w, b, lam = solve_ridge(s)
    flat = head_vector(w, b, centre)
    acc = ((xt @ flat[:D * C].reshape(C, D).T + flat[D * C:]).argmax(1) == yt).mean()
    assert lam > 0 and acc > 0.9
    # and lambda tracks the noise: on pure noise labels it regularises far harder
    noise = _sums(x, np.random.default_rng(3).integers(0, C, len(y)), centre, 1e3)
    assert solve_ridge(noise)[2] > 10 * lam


def _floor(s: HeadSums) -> float:
    """GCV_FLOOR x features / samples of the centred Gram's mean eigenvalue."""
    a = s.gram[:D, :D] - np.outer(s.gram[D, :D], s.gram[D, :D]) / s.n
    return GCV_FLOOR * D / s.n * float(np.trace(a)) / D


@pytest.mark.parametrize("solve", [solve_ridge, solve_lda])
def test_a_lines_repeated_frames_do_not_take_the_penalty_to_nothing(solve):
    """A line labels the same few exemplars over and over (an item many frames in view): GCV,
    which takes rows to be independent, then chooses its grid's bottom, and a live line's
    LDA head blew up at samples near the features (docs/bodies.md).  The penalty stays at
    GCV_FLOOR x features / samples there; on independent rows GCV's own is above it."""
    rng = np.random.default_rng(0)
    exemplars, _ = _blobs(3 * C, seed=7)
    ids = np.repeat(rng.integers(0, 3 * C, 4), 10)  # four items, ten frames each: 40 < D x 2
    x = (exemplars[ids] + rng.normal(0, 1e-4, (len(ids), D))).astype(np.float32)
    y = np.arange(3 * C)[ids] % C
    repeated = _sums(x, y, np.zeros(D, np.float32), 1e3)
    assert solve(repeated)[2] == pytest.approx(_floor(repeated))
    w, _, _ = solve(repeated)
    assert np.isfinite(w).all() and np.abs(w).max() < 1e3
    independent = _sums(*_blobs(40, seed=3), np.zeros(D, np.float32), 1e3)
    assert solve(independent)[2] > 1.5 * _floor(independent)


def test_the_lda_head_from_summed_statistics_is_the_discriminant_written_out():
    """Summed over devices of one or two classes each, the LDA head is the textbook one:
    class means, the pooled within-class covariance plus lambda, equal priors; up to a score
    every class shares (the solve centres by the sums' mean), and a scale that puts a
    class's frames one above the other classes on average, as ridge's one-hot targets do."""
    x, y = _blobs(1500)
    centre, clip, lam = np.full(D, 2.0, np.float32), 100.0, 7.0
    total = HeadSums.zeros(D, C)
    for k in range(10):
        mine = (y % 5 == k % 5) & (np.arange(len(y)) % 2 == k // 5)
        total.add(_sums(x[mine], y[mine], centre, clip))
    w, b, _ = solve_lda(total, lam)
    z = (x - centre).astype(np.float64)
    means = np.stack([z[y == c].mean(axis=0) for c in range(C)])
    within = sum((z[y == c] - means[c]).T @ (z[y == c] - means[c]) for c in range(C))
    cov = (within + lam * np.eye(D)) / (len(y) - C)
    w_ref = np.linalg.solve(cov, means.T).T
    b_ref = -0.5 * (means * w_ref).sum(axis=1)
    scores, ref = z @ w.T + b, z @ w_ref.T + b_ref
    gaps, ref_gaps = scores - scores[:, :1], ref - ref[:, :1]
    scale = float((gaps * ref_gaps).sum() / (ref_gaps ** 2).sum())
    assert scale > 0
    np.testing.assert_allclose(gaps, scale * ref_gaps, rtol=1e-7, atol=1e-7)
    own = scores[np.arange(len(y)), y]
    margin = own - (scores.sum(axis=1) - own) / (C - 1)
    assert margin.mean() == pytest.approx(1.0)

def test_a_product_with_few_frames_among_thousands_is_learnt_by_lda_not_ridge():
    """Ridge on one-hot targets weighs a class by its frames: 12 frames of a new class
    among 3,000 of the others leave it scoring below them on its own frames. LDA's equal
    priors learn it from those 12, and keep the other classes as they were."""
    x, y = _blobs(3000, skew=[0.25, 0.25, 0.25, 0.25, 0.0])
    new_x, new_y = _blobs(3000, seed=3)
    new_x, new_y = new_x[new_y == 4][:12], new_y[new_y == 4][:12]
    xt, yt = _blobs(3000, seed=9)
    centre = np.zeros(D, np.float32)
    before = _sums(x, y, centre, 1e3)
    after = _sums(np.vstack([x, new_x]), np.concatenate([y, new_y]), centre, 1e3)

    def acc(solve, s, mask):
        w, b = solve(s)[:2]
        return ((xt @ w.T + b).argmax(1) == yt)[mask].mean()
    new, old = yt == 4, yt != 4
    assert acc(solve_lda, after, new) > 0.9 > 0.5 > acc(solve_ridge, after, new)
    assert acc(solve_lda, after, old) >= acc(solve_lda, before, old) - 0.01
    # a class with no frame at all scores below every seen one, everywhere
    w, b, _ = solve_lda(before)
    assert ((xt @ w.T + b).argmax(1) != 4).all() and (w[4] == 0).all()


def test_class_means_alone_make_a_cosine_head():
    x, y = _blobs(3000)
    xt, yt = _blobs(1000, seed=7)
    centre = np.zeros(D, np.float32)
    s = _sums(x, y, centre, 1e3, kind="ncm")
    assert s.gram.size == 0
    w, b = solve_ncm(s)
    flat = head_vector(w, b, centre)
    acc = ((xt @ flat[:D * C].reshape(C, D).T + flat[D * C:]).argmax(1) == yt).mean()
    assert acc > 0.85


def test_packing_for_the_wire_keeps_the_sums_and_refuses_wrong_sizes():
    x, y = _blobs(300)
    s = _sums(x, y, np.zeros(D, np.float32), 50.0)
    tri, cross, counts = s.packed()
    assert tri.size == (D + 1) * (D + 2) // 2 and tri.dtype == np.float32
    back = HeadSums.unpacked(D, C, tri, cross, counts)
    np.testing.assert_allclose(back.gram, s.gram, rtol=1e-6)
    np.testing.assert_allclose(back.cross, s.cross, rtol=1e-6)
    with pytest.raises(MessageError, match="a head on 24 features"):
        HeadSums.unpacked(D, C, tri[:-1], cross, counts)
    taken = s.taken()
    assert taken.n == 300 and s.n == 0 and not s.gram.any()


def _path(spec, every=1):
    from edge_client.head_stats import HeadStatsPath

    return HeadStatsPath(spec, every, fleet="t", device="d0", station="s")


def _model_message(k):
    from edge_client import messages as m

    return m.StationModel(fleet="t", sender="s", round=0, iteration=k,
                          weights=np.zeros(1, np.float32))


@pytest.mark.parametrize("kind", ["ridge", "lda"])
def test_a_send_of_few_rows_goes_as_a_factor_that_carries_the_same_sums(kind):
    """Fewer rows than half the Gram's side go as ``R`` and ``Q^T Y`` of their QR: bytes in
    proportion to the rows, and the sums (so the solve) the triangle's, to float32; from
    half the side on, the triangle; an increment already in the sums goes whole."""
    from edge_client.codec import encode

    spec = HeadSpec(kind, D, C, np.zeros(D, np.float32), 50.0)
    x, y = _blobs(400, seed=3)
    for k, factor in ((3, True), (12, True), (13, False), (40, False)):
        msg = _factor_message(spec, x[:k], y[:k])
        assert (msg.factor.size > 0) == factor and (msg.gram.size > 0) != factor, k
        got = spec.unpack(msg)
        want = _spec_sums(spec, x[:k], y[:k])
        np.testing.assert_allclose(got.gram, want.gram, rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(got.cross, want.cross, rtol=1e-5, atol=1e-4)
        np.testing.assert_array_equal(got.counts, want.counts)
        if factor:
            assert msg.factor.size == k * (D + 1) and msg.factor_labels.size == k * C
            whole = dataclasses.replace(msg, gram=want.packed()[0], cross=want.packed()[1],
                                        factor=msg.factor[:0], factor_labels=msg.factor[:0])
            assert len(encode(msg)) < len(encode(whole))
    # On a body's width, 19 frames (2 a second, ten station models of 0.94 s) go as 3% of
    # the triangle's 3.3 MB: their factor and labels, and a header.
    wide = HeadSpec(kind, 1280, 10, np.zeros(1280, np.float32), 10.0)
    rows = np.random.default_rng(0).normal(0, 0.2, (19, 1280)).astype(np.float32)
    msg = _factor_message(wide, rows, np.arange(19) % 10)
    assert len(encode(msg)) < 4 * 19 * (1281 + 10) + 2048, len(encode(msg))
    np.testing.assert_allclose(wide.unpack(msg).gram,
                               _spec_sums(wide, rows, np.arange(19) % 10).gram, atol=1e-5)


def test_after_its_first_send_a_device_sends_no_fewer_samples_than_the_minimum():
    """The first frames go at once; after them a send waits for MIN_SEND labelled samples,
    however many station models pass, and goes with the next one once it has them."""
    from edge_client.head_stats import HeadStatsPath

    spec = HeadSpec("ridge", D, C, np.zeros(D, np.float32), 50.0)
    x, y = _blobs(200, seed=4)
    path = _path(spec, every=1)
    path.take(x[:5], y[:5])
    assert path.first(True)[0].counts.sum() == 5
    fewer = HeadStatsPath.MIN_SEND - 1
    path.take(x[5:5 + fewer], y[5:5 + fewer])
    assert all(path.due(_model_message(k)) == [] for k in range(5))
    path.take(x[100:101], y[100:101])
    sent = path.due(_model_message(6))
    assert len(sent) == 1 and sent[0].counts.sum() == HeadStatsPath.MIN_SEND
    # Every tenth model, or at once where it holds what a factor carries (32 rows of 65).
    wide = HeadSpec("ridge", 64, C, np.zeros(64, np.float32), 50.0)
    x = np.random.default_rng(5).normal(0, 1.0, (200, 64)).astype(np.float32)
    path = _path(wide, every=10)
    path.take(x[:100], y[:100])
    path.first(True)
    path.take(x[100:131], y[100:131])
    assert path.due(_model_message(1)) == []
    path.take(x[131:132], y[131:132])
    sent = path.due(_model_message(2))
    assert len(sent) == 1 and sent[0].factor.size == 32 * 65


def _factor_message(spec, x, y):
    path = _path(spec)
    path.take(x, y)
    return path.first(True)[0]


def test_a_factor_is_checked_as_a_claim_and_refused_where_it_does_not_fit():
    """A factor's sums pass the triangle's checks (counts against the bias entries, rows
    within the clip); a factor of the wrong size, more rows than pay, or beside a whole
    Gram is refused with its reason."""
    spec = HeadSpec("ridge", D, C, np.zeros(D, np.float32), 50.0)
    x, y = _blobs(50, seed=5)
    msg = _factor_message(spec, x[:6], y[:6])
    spec.unpack(msg)
    forged = {
        "stats_inconsistent": dict(counts=msg.counts * 2),
        "wrong_length": dict(factor=msg.factor[:-1]),
        "wrong_kind": dict(gram=np.ones(3, np.float32)),
    }
    for reason, change in forged.items():
        with pytest.raises(MessageError) as err:
            spec.unpack(dataclasses.replace(msg, **change))
        assert err.value.reason == reason, (reason, err.value)
    with pytest.raises(MessageError) as err:  # rows past a tighter clip
        dataclasses.replace(spec, clip=0.5).unpack(msg)
    assert err.value.reason == "stats_out_of_bounds"
    # Exactly on the bound: the six rows twice over, 12 rows claiming twice the counts,
    # pass; one row more (of zeros: the same sums) is refused for its size alone.
    twice = dataclasses.replace(msg, factor=np.tile(msg.factor, 2),
                                factor_labels=np.tile(msg.factor_labels, 2), counts=2 * msg.counts)
    assert spec.unpack(twice).n == 2 * msg.counts.sum()
    with pytest.raises(MessageError, match="for k from 1 to 12") as err:
        spec.unpack(dataclasses.replace(
            twice, factor=np.concatenate([twice.factor, np.zeros(D + 1, np.float32)]),
            factor_labels=np.concatenate([twice.factor_labels, np.zeros(C, np.float32)])))
    assert err.value.reason == "wrong_length"


def _double_counts(s):
    s.counts *= 2


def _rows_beyond_the_clip(s):  # every row twice as long: consistent, but past the clip
    s.gram[:D, :D] *= 4.0
    s.gram[D, :D] *= 2.0
    s.gram[:D, D] *= 2.0
    s.cross[:D] *= 2.0


def _one_class_inflated(s):
    s.cross[:D, 0] *= 50.0


def _bias_row_off(s):
    s.gram[D, 0] += 40.0


@pytest.mark.parametrize("forge, reason", [
    (_double_counts, "stats_inconsistent"), (_rows_beyond_the_clip, "stats_out_of_bounds"),
    (_one_class_inflated, "stats_out_of_bounds"), (_bias_row_off, "stats_inconsistent")])
def test_statistics_are_checked_against_what_their_counts_imply(forge, reason):
    """Honest sums pass; counts that disagree with the bias entries, rows beyond the clip,
    a class's sum beyond its count times the clip, a bias row that is not the classes' sum:
    each refused with its reason."""
    x, y = _blobs(400)
    centre = x.mean(axis=0)
    clip = float(np.linalg.norm(x - centre, axis=1).max()) * 1.01  # honest rows unclipped
    s = _sums(x, y, centre, clip)
    check_claim(s, clip)
    forged = HeadSums(s.gram.copy(), s.cross.copy(), s.counts.copy())
    forge(forged)
    with pytest.raises(MessageError) as err:
        check_claim(forged, clip)
    assert err.value.reason == reason


def _spec_sums(spec, x, y):
    s = spec.zeros()
    s.add_rows(augment(x, spec.centre, spec.clip), y)
    return s


def _head_fleet(digits, spec, n_devices=4, per_device=150, sync_period=2, bus=None,
                mix=0.5):
    """Cloud, one station and devices of one or two classes each on a LocalBus, every
    device with its statistics; each device's samples ingested as a sensor delivers them."""
    from aggregator.cloud import Cloud
    from aggregator.config import CloudConfig, StationConfig
    from aggregator.heads import attach_heads
    from aggregator.station import Station
    from edge_client.config import DeviceConfig
    from edge_client.device import Device
    from edge_client.head_stats import HeadStatsPath
    from edge_client.runner import RoleRunner
    from edge_client.trainers import build_trainer
    from edge_client.transport import LocalBus

    bus, ids = bus or LocalBus(), tuple(f"d{k}" for k in range(n_devices))
    trainer = lambda seed: build_trainer("softmax", input_shape=(64,), num_classes=10,  # noqa: E731
                                         lr=0.1, seed=seed)
    w0 = trainer(0).get_flat()
    cloud = Cloud(CloudConfig(fleet="t", stations=("s",), rounds=0), initial_weights=w0,
                  num_classes=10)
    station = Station(StationConfig(fleet="t", station_id="s", devices=ids, super_node_size=2,
                                    rand_per_group=0, sync_period=sync_period,
                                    max_seen_rate=1e6),
                      num_params=w0.size, num_classes=10, rng=np.random.default_rng(0))
    attach_heads(cloud, spec)
    attach_heads(station, spec)
    x, y = digits.x_train.reshape(len(digits.x_train), -1), digits.y_train
    devices, seen = [], []
    for k, did in enumerate(ids):
        dev = Device(DeviceConfig(device_id=did, station="s", fleet="t", holdout_every=0,
                                  head_stats_every=1, mix=mix),
                     trainer(k + 1), num_classes=10, sample_shape=(64,),
                     rng=np.random.default_rng(k))
        HeadStatsPath.attach(dev, spec, 1)
        mine = np.flatnonzero(np.isin(y, (2 * k, 2 * k + 1)))[:per_device]
        dev.ingest(x[mine], y[mine], 0.0)
        seen.append(mine)
        devices.append(dev)
    clock = [0.0]
    runners = [RoleRunner(r, bus, lambda: clock[0]) for r in (cloud, station, *devices)]
    bus.run_until = lambda done: _run_until(bus, runners, clock, done)  # type: ignore[attr-defined]
    return bus, runners, cloud, station, devices, x, y, np.concatenate(seen)


def _run_until(bus, runners, clock, done) -> None:
    """Deliver, and where nothing is in flight let a second pass and tick every role
    (the cloud waits for the first statistics before round 0 goes out)."""
    for _ in range(10_000):
        if done():
            return
        if bus.deliver(limit=20) == 0:
            clock[0] += 1.0
            for r in runners:
                r.tick()
    raise AssertionError(f"the fleet stalled: {[dict(r.role.counters) for r in runners[:2]]}")


def test_the_fleet_broadcasts_the_head_its_devices_statistics_solve(digits):
    """Devices of two classes each send the statistics of what they started with when they
    start; round 0's global model (after the cloud's wait for them) is the ridge head of
    every sample they saw, as one solve over them all gives: the station passes on the
    last device's first statistics at once, though they do not double what went up (under
    label skew its classes are no one else's).  What they sense later is passed on at once
    where it doubles what went up, and is in the next round's solve."""
    from edge_client import messages as m
    from edge_client.topics import global_model_topic

    spec = HeadSpec("ridge", 64, 10, np.full(64, 4.0, np.float32), 200.0)
    bus, runners, cloud, station, devices, x, y, seen = _head_fleet(digits, spec, n_devices=5,
                                                                    sync_period=5)
    globals_: list[m.GlobalModel] = []
    bus.subscribe(global_model_topic("t"), lambda topic, msg: globals_.append(msg))
    for r in runners:
        r.start()
    bus.run_until(lambda: globals_)
    first = globals_[0]
    assert first.round == 0 and first.head_samples == len(seen) == 750
    want = spec.solve(_spec_sums(spec, x[seen], y[seen]))
    np.testing.assert_allclose(first.weights, want, rtol=1e-4, atol=1e-5)
    acc = ((x @ want[:640].reshape(10, 64).T + want[640:]).argmax(1) == y)
    assert acc.mean() > 0.9  # and it predicts what the devices saw
    more = []
    for k, dev in enumerate(devices):  # each senses as much again, of any class
        later = np.arange(600 + 150 * k, 750 + 150 * k)
        runners[2 + k].publish(dev.ingest(x[later], y[later], 1.0))
        more.append(later)
    bus.run_until(lambda: cloud.counters["head_stats"] == 5)
    assert cloud.heads.total.n == 1500  # passed on before the upload, by doubling
    bus.run_until(lambda: globals_[-1].round == 1)
    assert globals_[-1].head_samples == 1500
    every = np.concatenate([seen, *more])
    np.testing.assert_allclose(globals_[-1].weights, spec.solve(
        _spec_sums(spec, x[every], y[every])), rtol=1e-4, atol=1e-5)
    # passed on 150, 150, 300 (doubling), 150 (the roster's last first), then 750 (doubling)
    assert station.counters["head_stats"] == 10
    assert cloud.counters["head_stats"] == station.counters["head_stats_forwarded"] == 5
    # the bus counts a station's statistics apart from its devices' (they cross to the cloud)
    assert (bus.messages["HeadStats"], bus.messages["StationHeadStats"]) == (10, 5)
    assert not any(k.startswith("rejected") for k in station.counters | cloud.counters), \
        station.counters | cloud.counters


def test_a_restarted_station_and_cloud_keep_their_sums(digits):
    from aggregator.checkpoint import CloudCheckpoint, StationCheckpoint

    spec = HeadSpec("ridge", 64, 10, np.zeros(64, np.float32), 200.0)
    bus, runners, cloud, station, devices, *_ = _head_fleet(digits, spec)
    for r in runners:
        r.start()
    bus.run_until(lambda: cloud.heads.solved and station.heads.round_head is not None)
    for role, meta_cls in ((station, StationCheckpoint), (cloud, CloudCheckpoint)):
        arrays, meta = role.snapshot()
        fresh = _head_fleet(digits, spec)[3 if role is station else 2]
        fresh.restore(arrays, meta_cls.from_doc(__import__("dataclasses").asdict(meta)))
        for key, kept in role.heads.total.arrays().items():  # folded and fresh
            np.testing.assert_array_equal(fresh.heads.total.arrays()[key], kept)
        np.testing.assert_array_equal(fresh.heads.total.whole().gram,
                                      role.heads.total.whole().gram)
        assert fresh.heads.claimed == role.heads.claimed and fresh.heads.solved == role.heads.solved
        assert fresh.heads.seen_then == role.heads.seen_then  # what tells a device restarted
        if role is station:  # the round's solve its internal syncs keep
            np.testing.assert_array_equal(fresh.heads.round_head, role.heads.round_head)


def test_a_device_claiming_more_than_it_saw_counts_for_what_it_saw_and_a_forged_sum_is_refused(
        digits):
    from edge_client import messages as m

    spec = HeadSpec("ridge", 64, 10, np.zeros(64, np.float32), 200.0)
    bus, runners, cloud, station, devices, x, y, _ = _head_fleet(digits, spec)
    for r in runners:
        r.start()
    bus.deliver()
    before = station.heads.total.n
    lots = _spec_sums(spec, np.tile(x[:100], (20, 1)), np.tile(y[:100], 20))
    gram, cross, counts = lots.packed()
    station.handle(m.HeadStats(fleet="t", sender="d0", round=0, iteration=0, station="s",
                               gram=gram, cross=cross, counts=counts), 0.0)
    assert station.counters["clipped.head_stats"] == 1
    assert station.heads.claimed["d0"] <= station.stats["d0"].seen_counts.sum() + 1e-6
    forged = cross.copy()
    forged[-10:] *= 3  # counts the bias row does not carry
    station.handle(m.HeadStats(fleet="t", sender="d1", round=0, iteration=0, station="s",
                               gram=gram, cross=forged, counts=counts), 0.0)
    assert station.counters["rejected.stats_inconsistent"] == 1
    assert station.heads.total.n <= before + station.stats["d0"].seen_counts.sum()


def test_head_init_comes_to_lda_for_a_linear_head_on_a_frozen_body_and_refuses_what_cannot_solve(
        ):
    from edge_client.config import ModelConfig
    from edge_client.errors import ConfigError

    body = {"body": "efficientnet-lite0", "body_dir": "/nowhere", "input_shape": (3, 64, 64)}
    assert ModelConfig(name="linear", **body).head_kind == "lda"
    assert ModelConfig(name="linear", **body).head_resolution == "every"
    assert ModelConfig(name="linear", head_init="ridge", **body).head_kind == "ridge"
    tuned = ModelConfig(name="linear", backend="torch", train_body_blocks=1, **body)
    assert (tuned.head_kind, tuned.head_resolution) == ("ridge", "once")
    assert ModelConfig(name="mlp", **body).head_kind == "random"
    assert ModelConfig(name="linear").head_kind == "random"
    assert ModelConfig(name="linear", head_init="ncm", **body).head_kind == "ncm"
    for bad in ({"name": "mlp", "head_init": "ridge", **body}, {"name": "linear",
                                                                "head_init": "ncm"}):
        with pytest.raises(ConfigError, match="'head_init'.*needs a body and name = 'linear'"):
            ModelConfig(**bad)
    with pytest.raises(ConfigError, match="'head_resolve'"):
        ModelConfig(head_resolve="sometimes")


def test_rows_exactly_at_the_clip_pass_and_a_hair_beyond_is_refused():
    """An attacker whose every row sits on the clip is within the bound; the same sums
    scaled past the check's tolerance are not."""
    x, y = _blobs(300)
    clip = 1.0  # far below the rows' norms: augment puts every row exactly on it
    s = _sums(x, y, np.zeros(D, np.float32), clip)
    assert np.isclose(np.trace(s.gram[:D, :D]), s.n * clip * clip, rtol=1e-6)
    check_claim(s, clip)
    s.gram[:D, :D] *= 1.0021  # the trace 0.21% over n x clip^2 (the tolerance is 0.1%)
    with pytest.raises(MessageError) as err:
        check_claim(s, clip)
    assert err.value.reason == "stats_out_of_bounds"


def test_a_device_claiming_exactly_what_it_saw_counts_whole_and_one_sample_more_is_weighted(
        digits):
    from edge_client import messages as m

    spec = HeadSpec("ridge", 64, 10, np.zeros(64, np.float32), 200.0)
    bus, runners, cloud, station, devices, x, y, _ = _head_fleet(digits, spec)
    for k in (2, 3):
        devices[k].head = None  # what it claims is written here
    for r in runners:
        r.start()
    bus.deliver()
    for device, extra in (("d2", 0), ("d3", 1)):
        room = int(station.stats[device].seen_counts.sum() - station.heads.claimed.get(device, 0))
        gram, cross, counts = _spec_sums(spec, x[:room + extra], y[:room + extra]).packed()
        station.handle(m.HeadStats(fleet="t", sender=device, round=0, iteration=0,
                                   station="s", gram=gram, cross=cross, counts=counts), 0.0)
        assert station.counters["clipped.head_stats"] == extra
        assert station.heads.claimed[device] == pytest.approx(
            station.stats[device].seen_counts.sum())


def test_honest_stations_statistics_are_never_weighted_down_at_the_cloud(digits):
    """A station's statistics go up after its seen counts, before its upload: the cloud
    bounds them by counts that include the samples they were made from."""
    from edge_client import messages as m
    from edge_client.topics import global_model_topic

    spec = HeadSpec("ridge", 64, 10, np.zeros(64, np.float32), 200.0)
    bus, runners, cloud, station, devices, x, y, seen = _head_fleet(digits, spec, per_device=60)
    globals_: list[m.GlobalModel] = []
    bus.subscribe(global_model_topic("t"), lambda topic, msg: globals_.append(msg))
    for r in runners:
        r.start()
    fed = [0]

    def sensing() -> bool:
        if len(globals_) > fed[0]:  # each round, every device senses 40 samples more
            fed[0] = len(globals_)
            for k, dev in enumerate(devices):
                more = np.flatnonzero(np.isin(y, (2 * k, 2 * k + 1)))[60 + 40 * fed[0]:][:40]
                dev.ingest(x[more], y[more], 0.0)  # its next stats say so, or not
        return len(globals_) >= 4
    bus.run_until(sensing)
    assert globals_[-1].head_samples > 4 * 60  # what they sensed later came up too
    assert cloud.counters["clipped.head_stats"] == 0 and station.counters["clipped.head_stats"] == 0


def test_hostile_statistics_pass_as_claims_only_within_their_bounds(digits):
    """The lies of ``lab.attacks`` about head statistics: scaled sums are a claim of a
    thousand times the samples and count for what the device saw; flipped labels and random
    rows at the clip are within every bound (measured, not refused: experiments/
    head_attacks.toml), and the station still counts them for no more than it saw."""
    from edge_client import messages as m
    from lab.attacks import tamper

    spec = HeadSpec("ridge", 64, 10, np.zeros(64, np.float32), 60.0)
    bus, runners, cloud, station, devices, x, y, _ = _head_fleet(digits, spec)
    for k in range(4):
        devices[k].head = None  # each one's statistics are written here
    for r in runners:
        r.start()
    bus.deliver()
    gram, cross, counts = _spec_sums(spec, x[:150], y[:150]).packed()
    honest = m.HeadStats(fleet="t", sender="d0", round=0, iteration=0, station="s", gram=gram,
                         cross=cross, counts=counts)
    for k, attack in enumerate(("stats_scale", "stats_flip", "stats_random")):
        lie = tamper(dataclasses.replace(honest, sender=f"d{k}"), attack, {"clip": spec.clip})
        assert isinstance(lie, m.HeadStats) and int(lie.counts.sum()) >= 150
        station.handle(lie, 0.0)
        assert not any(key.startswith("rejected") for key in station.counters), attack
        assert station.heads.claimed[f"d{k}"] <= station.stats[f"d{k}"].seen_counts.sum() + 1e-6
    assert station.counters["clipped.head_stats"] == 1  # the scaled claim, weighted down
    flipped = tamper(honest, "stats_flip", {})
    assert np.array_equal(flipped.counts, np.roll(counts, 1))


def test_a_round_without_new_statistics_keeps_the_solved_head(digits):
    """With head_resolve = "every" the global head is the latest solve: where no statistics
    came in a round, the devices' SGD on it is not what goes out (it took a FedAvg fleet's
    head from 0.86 to 0.61 between solves)."""
    from edge_client import messages as m
    from edge_client.topics import global_model_topic

    spec = HeadSpec("ridge", 64, 10, np.full(64, 4.0, np.float32), 200.0)
    bus, runners, cloud, station, devices, x, y, seen = _head_fleet(digits, spec)
    globals_: list[m.GlobalModel] = []
    bus.subscribe(global_model_topic("t"), lambda topic, msg: globals_.append(msg))
    for r in runners:
        r.start()
    bus.run_until(lambda: len(globals_) >= 3)
    assert cloud.counters["head_solves"] == 1  # nothing new came after round 0's
    for later in globals_[1:3]:
        np.testing.assert_array_equal(later.weights, globals_[0].weights)


def test_a_broker_dropping_the_devices_statistics_is_an_error_at_the_cloud(digits, caplog):
    """Mosquitto grants a subscription its ACL refuses and drops the messages: a provisioned
    station that could not read its devices' statistics solved no head and nobody said why.
    The cloud says so, once, after two rounds of updates without any statistics."""
    from edge_client import messages as m
    from edge_client.topics import global_model_topic
    from edge_client.transport import LocalBus

    class StationAclWithoutHead(LocalBus):  # what such a broker delivers
        def publish(self, topic, message):
            if not (isinstance(message, m.HeadStats) and message.sender != message.station):
                super().publish(topic, message)

    spec = HeadSpec("ridge", 64, 10, np.full(64, 4.0, np.float32), 200.0)
    for bus, dropped in ((StationAclWithoutHead(), True), (None, False)):
        bus, runners, cloud, *_ = _head_fleet(digits, spec, bus=bus)
        seen: list[m.GlobalModel] = []
        bus.subscribe(global_model_topic("t"), lambda topic, msg, seen=seen: seen.append(msg))
        for r in runners:
            r.start()
        bus.run_until(lambda seen=seen: len(seen) >= 4)
        assert (cloud.counters["rounds_without_head_stats"] >= 2) == dropped
        assert dropped or cloud.counters["rounds_without_head_stats"] == 0
    errors = [r for r in caplog.records if "no head statistics" in r.message]
    assert [r.levelname for r in errors] == ["ERROR"]


@pytest.mark.parametrize("resolve, mix", [("every", 1.0), ("every", 0.5), ("once", 1.0)])
def test_a_stations_internal_syncs_keep_the_rounds_solve_where_the_next_replaces_them(
        digits, resolve, mix):
    """With head_resolve = "every" each round's solve replaces whatever the SGD steps made
    of the last one: fused in between, those steps moved the models a camera line scores
    off the solve (its candidates scored 0.26-0.59 against the solve's 0.59-0.65 and were
    refused, and the line was at 80% after 920 labelled frames, not 556).  Each station
    model of a round is then the round's global head; with "once" the steps fine-tune it.
    Under "every" the devices upload nothing (a skip answers each seat): work nobody would
    use; FedGS's (mix 1) take no step either, SAFL's (mix 0.5) train the model their merge
    keeps (their own, personal).  Under "once" they train and upload."""
    from edge_client import messages as m
    from edge_client.topics import global_model_topic, station_model_topic

    spec = HeadSpec("ridge", 64, 10, np.full(64, 4.0, np.float32), 200.0, resolve)
    bus, runners, cloud, station, devices, *_ = _head_fleet(digits, spec, sync_period=3,
                                                            mix=mix)
    globals_: list[m.GlobalModel] = []
    models: list[m.StationModel] = []
    bus.subscribe(global_model_topic("t"), lambda topic, msg: globals_.append(msg))
    bus.subscribe(station_model_topic("t", "s"), lambda topic, msg: models.append(msg))
    for r in runners:
        r.start()
    bus.run_until(lambda: len(globals_) >= 3)
    by_round = {g.round: g.weights for g in globals_}
    within = [s for s in models if s.round in by_round and s.iteration % 3]  # after a sync
    kept = [np.array_equal(s.weights, by_round[s.round]) for s in within]
    assert within and (all(kept) if resolve == "every" else not any(kept)), kept
    seats = sum(d.counters["skipped.head_solved"] for d in devices)
    stepped = sum(d.counters["steps"] + d.counters["samples_trained"] for d in devices)
    if resolve == "every":
        assert seats > 0 and bus.messages["DeviceUpdate"] == 0
        assert (stepped == 0) == (mix == 1.0), stepped
        assert (sum(d.counters["samples_solved"] for d in devices) > 0) == (mix == 1.0)
        assert station.counters["received_updates"] == station.counters["head_kept"] == 0
    else:
        assert seats == 0 and stepped > 0 and station.counters["received_updates"] > 0
        assert station.counters["head_kept"] == 0


def test_a_device_restarted_without_its_counts_is_not_clipped_and_nothing_counts_twice(digits):
    """A camera restarted without its state reports seen counts from zero again, and sums
    of its new frames only: its station bounds those by what it has seen since, not by
    everything it claimed before (an honest camera's statistics were clipped 175 times on
    a line after restarts).  What it sent before stays counted, once."""
    from edge_client.device import Device
    from edge_client.head_stats import HeadStatsPath
    from edge_client.trainers import build_trainer

    spec = HeadSpec("ridge", 64, 10, np.full(64, 4.0, np.float32), 200.0)
    bus, runners, cloud, station, devices, x, y, seen = _head_fleet(digits, spec, sync_period=3)
    for r in runners:
        r.start()
    bus.run_until(lambda: cloud.heads.solved)
    before = station.heads.claimed["d0"]
    assert before == 150
    fresh = Device(devices[0].config, build_trainer("softmax", input_shape=(64,), num_classes=10,
                                                    lr=0.1, seed=9),
                   num_classes=10, sample_shape=(64,), rng=np.random.default_rng(9))
    HeadStatsPath.attach(fresh, spec, 1)
    runners[2].role = fresh  # the same runner, a new process behind it
    runners[2].start()
    later = np.flatnonzero(np.isin(y, (0, 1)))[150:450]
    for k in range(0, len(later), 50):
        runners[2].publish(fresh.ingest(x[later[k:k + 50]], y[later[k:k + 50]], 2.0 + k))
        for _ in range(50):
            bus.deliver(limit=20)
    assert station.counters["head_stats.rebased"] == 1
    assert station.counters["clipped.head_stats"] == 0, dict(station.counters)
    # its new statistics whole, beside what it had claimed before
    sent = int(fresh.buffer.samples_seen)
    assert station.heads.claimed["d0"] == sent
    n = sum(d.buffer.samples_seen for d in devices[1:]) + before + sent
    assert station.heads.total.whole().n == n
    # after the restart, the bound is what it has seen since: sums of frames its station
    # never heard it see (its seen counts held back) are weighted down, as before one
    more = np.flatnonzero(np.isin(y, (4, 5)))[:300]
    fresh.head.take(x[more], y[more])  # summed, never seen as far as its station knows
    runners[2].publish(fresh.head._send(station.round, station.iteration))
    for _ in range(50):
        bus.deliver(limit=20)
    assert station.counters["clipped.head_stats"] >= 1
    assert station.heads.claimed["d0"] <= int(station.stats["d0"].seen_counts.sum())


def test_a_station_resumed_from_its_checkpoint_loses_no_statistics_and_counts_none_twice(
        digits):
    """A station resumes from the checkpoint of its round's start: the statistics it
    admitted after that died with it, though the broker had acknowledged them to their
    devices.  When its model goes back, its devices send again what they sent in the last
    rounds, and it counts each send once by its sender's running count: its sums after
    the restart are those of every sample its devices sent, once."""
    from aggregator.checkpoint import StationCheckpoint
    from edge_client import messages as m

    spec = HeadSpec("ridge", 64, 10, np.full(64, 4.0, np.float32), 200.0)
    bus, runners, cloud, station, devices, x, y, _ = _head_fleet(digits, spec, sync_period=3)
    for r in runners:
        r.start()
    bus.run_until(lambda: cloud.heads.solved)
    arrays, meta = station.snapshot()  # the checkpoint it will resume from, as written
    arrays = {k: np.array(v) for k, v in arrays.items()}  # (the sums are added in place)
    at_checkpoint = station.heads.total.whole().n
    sent = lambda: sum(d.head.sent for d in devices)  # noqa: E731
    for k, dev in enumerate(devices):  # more labelled frames, sent and admitted
        later = np.flatnonzero(np.isin(y, (2 * k, 2 * k + 1)))[150:230]
        runners[2 + k].publish(dev.ingest(x[later], y[later], 10.0))
    bus.run_until(lambda: sent() == at_checkpoint + 4 * 80 == station.heads.total.whole().n)
    before = station.heads.total.whole()
    # kill -9, and a new process from the checkpoint: its devices hear it go and come back
    fresh = _head_fleet(digits, spec, sync_period=3)[3]
    fresh.restore(arrays, StationCheckpoint.from_doc(dataclasses.asdict(meta)))
    runners[1].role = fresh
    runners[1].publish([m.Presence(fleet="t", sender="s", round=0, iteration=0, role="station",
                                   online=online) for online in (False, True)])
    runners[1].start()
    bus.run_until(lambda: fresh.heads.total.whole().n >= before.n)
    for _ in range(200):  # and the rest in flight
        bus.deliver(limit=20)
    after = fresh.heads.total.whole()
    assert after.n == before.n == sent()
    np.testing.assert_allclose(after.gram, before.gram, rtol=1e-5, atol=1e-3)
    assert fresh.counters["head_stats.duplicate"] >= 1  # what its checkpoint held, once
    assert fresh.counters["clipped.head_stats"] == 0


def test_a_station_sends_the_cloud_its_last_rounds_statistics_again_and_they_count_once(digits):
    """The cloud (re)appearing may have resumed from a checkpoint without its stations'
    last statistics: each station sends them again, and the cloud counts a send once."""
    from edge_client import messages as m

    spec = HeadSpec("ridge", 64, 10, np.full(64, 4.0, np.float32), 200.0)
    bus, runners, cloud, station, *_ = _head_fleet(digits, spec, sync_period=3)
    for r in runners:
        r.start()
    bus.run_until(lambda: cloud.heads.solved)
    counted = cloud.heads.total.whole().n
    out = station.handle(m.Presence(fleet="t", sender="cloud", round=0, iteration=0,
                                    role="cloud", online=True), 5.0)
    again = [msg for msg in out if isinstance(msg, m.HeadStats)]
    assert again and all(msg.epoch == station.heads.sends.epoch for msg in again)
    for msg in out:
        cloud.handle(msg, 5.0)
    assert cloud.counters["head_stats.duplicate"] == len(again)
    assert cloud.heads.total.whole().n == counted


def test_a_station_back_at_the_same_iteration_gets_the_last_sends_again():
    """Killed in a round's first iteration, a station resumes at the very iteration its
    devices last heard: its new process's draw (``StationModel.started``), not the
    iteration, tells them to send their statistics of its last rounds again.  A model
    repeated by the same process (for a late joiner) repeats nothing; sends older than
    two rounds are let go."""
    from edge_client import messages as m
    from edge_client.head_sends import SendLog

    def send(round_, n):
        return m.HeadStats(fleet="t", sender="d0", round=round_, iteration=5 * round_,
                           station="s", gram=np.zeros(0, np.float32),
                           cross=np.zeros(0, np.float32), counts=np.array([n, 0]))

    sends = SendLog()
    old, last = sends.stamp(send(1, 20)), sends.stamp(send(3, 30))
    assert (old.upto, last.upto) == (20, 50) and old.epoch == last.epoch == sends.epoch
    assert sends.heard(3, 15, started=7) == []
    assert sends.heard(3, 15, started=7) == []  # the same process, the same model again
    assert sends.heard(3, 15, started=9) == [old, last]  # a new process at that iteration
    assert sends.heard(3, 16, started=9) == []
    assert sends.heard(3, 15, started=9) == [old, last]  # went back: resumed
    assert sends.heard(4, 20, started=9) == []
    assert sends.heard(4, 20, started=11) == [last]  # round 1's send is past keeping


def test_a_send_at_the_count_already_counted_is_dropped_and_one_past_it_is_counted():
    """The receiver's side, at its bound: a send whose running count equals the last one
    counted in its epoch is a repeat; one sample past it is new; another epoch (a sender
    restarted without its state) counts from zero; an unstamped send is always counted."""
    from edge_client import messages as m
    from edge_client.head_sends import Counted

    def send(upto, epoch=5, sender="d0"):
        return m.HeadStats(fleet="t", sender=sender, round=0, iteration=0, station="s",
                           gram=np.zeros(0, np.float32), cross=np.zeros(0, np.float32),
                           counts=np.array([1, 0]), upto=upto, epoch=epoch)

    counted = Counted()
    counted.note(send(40))
    assert counted.already(send(40)) and counted.already(send(1))
    assert not counted.already(send(41))
    assert not counted.already(send(40, epoch=6))  # restarted: a new count
    assert not counted.already(send(40, sender="d1"))  # another sender's count is its own
    assert not counted.already(send(0, epoch=0))  # a sender before stamps
    counted.note(send(0, epoch=0))
    assert counted.through["d0"] == (5, 40)  # an unstamped send moves nothing
