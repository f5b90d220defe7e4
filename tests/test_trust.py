"""Bounded trust: robust fusion, the update guard, seen-count and selection caps, and the
station and cloud refusing what one compromised participant claims."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from aggregator.cloud import Cloud
from aggregator.config import CloudConfig, StationConfig
from aggregator.fusion import krum, median, multi_krum, trimmed_mean
from aggregator.station import Station
from aggregator.trust import (
    NormGuard,
    ReplayGuard,
    ShareCap,
    bound_seen_counts,
    claimed_total,
    majority_capped,
)
from edge_client import messages as m
from lab.attacks import tamper

# -- robust fusion rules, hand-computed --------------------------------------------------


def test_median_and_trimmed_mean_ignore_one_outlier_and_the_counts():
    models = [np.array([1.0, 2.0]), np.array([2.0, 4.0]), np.array([3.0, 6.0]),
              np.array([1e6, -1e6])]
    np.testing.assert_allclose(median(models, [1, 1, 1, 10**12]), [2.5, 3.0])
    # Four models: one dropped at each end per coordinate.
    np.testing.assert_allclose(trimmed_mean(models, [1, 1, 1, 10**12]), [2.5, 3.0])
    np.testing.assert_allclose(trimmed_mean(models[:2], [1, 1]), [1.5, 3.0])  # too few to trim


def test_krum_picks_the_model_closest_to_its_neighbours():
    models = [np.array([0.0, 0.0]), np.array([1.0, 0.0]), np.array([0.0, 1.2]),
              np.array([0.4, 0.4]), np.array([50.0, 50.0])]
    np.testing.assert_allclose(krum(models, [1] * 5), [0.4, 0.4])
    # n = 5 tolerates f = 1: Multi-Krum averages the 4 best, by their counts.
    fused = multi_krum(models, [1, 1, 1, 1, 1])
    np.testing.assert_allclose(fused, np.mean(models[:4], axis=0), rtol=1e-6)


# -- the guards ---------------------------------------------------------------------------


def test_norm_guard_starts_from_its_initial_bound_then_follows_the_median():
    guard = NormGuard(bound=0.0, factor=10.0, initial=5.0, warmup=3, hard_factor=1.0)
    start = np.zeros(4)
    assert guard.check(np.full(4, 3.0), start) == (None, 6.0, False)  # above the initial 5
    for _ in range(3):
        assert guard.check(np.full(4, 0.5), start).update is not None  # distance 1
    assert guard.limit == 10.0
    assert guard.check(np.full(4, 5.5), start).update is None
    assert NormGuard(bound=2.0, factor=10.0, initial=5.0).limit == 2.0
    assert NormGuard(bound=0.0, factor=0.0, initial=5.0).limit == float("inf")


def test_norm_guard_clips_onto_its_bound_and_refuses_beyond_the_hard_bound():
    guard = NormGuard(bound=2.0, factor=0.0, initial=0.0, hard_factor=10.0)
    start = np.array([1.0, 1.0, 1.0, 1.0], np.float32)
    within = guard.check(start + 0.5, start)  # distance 1: fused as it is
    assert within.update is not None and not within.clipped
    np.testing.assert_array_equal(within.update, start + 0.5)
    beyond = guard.check(start + np.array([3.0, 0.0, 4.0, 0.0], np.float32), start)  # 5
    assert beyond.clipped and beyond.distance == 5.0 and beyond.update is not None
    # The same direction, at the bound: the honest part of a long step still counts.
    np.testing.assert_allclose(beyond.update - start, [1.2, 0.0, 1.6, 0.0], rtol=1e-6)
    assert beyond.update.dtype == np.float32
    assert guard.check(start + 30.0, start).update is None  # 60 > 10 x 2: no honest step
    assert guard.state() == [1.0, 2.0]  # a clipped update counts at the bound, not beyond


def test_the_roster_median_of_the_others_totals_is_kept_as_reports_come(rng):
    """The median of every other device's accepted total, kept as reports replace each
    other (ties, repeats, a device's first report, a restart's fall), equals numpy's over
    the others' totals in all."""
    from aggregator.trust import SeenTotals

    totals, truth, last, carried = SeenTotals(), {}, {}, {}
    assert totals.median_without("d0") is None
    for _ in range(3000):
        device, total = f"d{rng.integers(40)}", int(rng.integers(0, 30))
        totals.set(device, total)
        if total < last.get(device, 0):  # restarted: what it had counted is carried
            carried[device] = carried.get(device, 0) + last[device]
        last[device] = total
        truth[device] = carried.get(device, 0) + total
        asked = f"d{rng.integers(45)}"  # now and then one that never reported
        others = [t for d, t in truth.items() if d != asked]
        want = float(np.median(others)) if others else None
        assert totals.median_without(asked) == want


def test_seen_counts_grow_at_a_bounded_rate_and_share():
    counts = np.array([10**15, 0, 0])
    got, clipped = bound_seen_counts(counts, previous_total=100, allowance=50,
                                     roster_median=100.0, share=4.0, floor=50)
    assert clipped and got.sum() <= 150 and got[1] == 0
    honest, clipped = bound_seen_counts(np.array([60, 60, 20]), 100, 50, 110.0, 4.0, 50)
    assert not clipped and honest.sum() == 140
    # However slowly it grows, a device cannot outweigh 4 median devices.
    got, _ = bound_seen_counts(np.array([5000, 0, 0]), 4900, 50, 100.0, 4.0, 50)
    assert got.sum() <= 400
    # While the fleet is young the floor lets a device start with a full allowance.
    got, clipped = bound_seen_counts(np.array([40, 0, 0]), 0, 50, 1.5, 4.0, 50)
    assert not clipped


def test_no_device_outweighs_the_rest_of_its_factory():
    counts = [np.array([5000, 0]), np.array([100, 100]), np.array([50, 150])]
    total, capped = majority_capped(counts)
    assert capped == 1 and total.tolist() == [400 + 150, 250]  # the liar scaled to 400
    total, capped = majority_capped([np.array([5000, 0]), np.array([10, 30])])
    assert capped == 1 and total.tolist() == [50, 30]  # a roster of two: half at most
    honest = [np.array([300, 100]), np.array([100, 100]), np.array([150, 50])]
    total, capped = majority_capped(honest)  # the largest holds exactly the others' 400
    assert capped == 0 and total.tolist() == [550, 250]
    assert majority_capped([np.array([7, 1])])[1] == 0  # alone, it is the factory
    # Others that have seen nothing leave nothing to weigh against: no shape is invented.
    assert majority_capped([np.array([7, 1]), np.array([0, 0])])[1] == 0
    # Raised, in the same shape, to the samples the station consumed; never above the claims.
    total, _ = majority_capped(counts, at_least=1000)
    assert total.sum() == 1000 and total[0] / total.sum() == pytest.approx(550 / 800, abs=2e-3)
    assert majority_capped(counts, at_least=10**9)[0].sum() == 5400
    # A claim whose total is past the int64 range (a checkpoint written before the bounds)
    # is capped like any other, not an overflow.
    total, capped = majority_capped([np.array([WIRE_MAX, WIRE_MAX]), np.array([10, 30])])
    assert capped == 1 and total.tolist() == [30, 50]


def test_a_flat_rounds_streaming_is_not_clipped():
    st = _station(local_steps=10)  # allowance 10 x 1024 samples an iteration
    _start(st)
    for d in st.config.devices:  # +5,000 each in one iteration's 10 local steps
        st.handle(_stats(d, seen=(3000, 3000)), 1.0)
    assert st.counters["clipped.seen_counts"] == 0


def test_share_cap_takes_a_device_out_of_selection_after_its_seats():
    cap = ShareCap(window=10, max_share=0.5)
    for _ in range(5):
        assert cap.eligible("d0")
        cap.record(("d0", "d1"))
    assert not cap.eligible("d0") and cap.eligible("d2")
    for _ in range(10):
        cap.record(("d2",))
    assert cap.eligible("d0")  # its seats left the window


def test_share_cap_seats_are_the_window_counted_through_and_survive_a_restore(rng):
    """The seats kept as the window moves equal the window counted through, before and
    after a checkpoint's restore."""
    cap = ShareCap(window=7, max_share=0.5)
    for _ in range(200):
        members = tuple(f"d{k}" for k in rng.choice(12, size=int(rng.integers(1, 5)),
                                                    replace=False))
        cap.record(members)
        for d in (f"d{k}" for k in range(13)):
            assert cap.seats(d) == sum(d in ms for ms in cap.recent)
    back = ShareCap(window=7, max_share=0.5)
    back.restore(cap.state())
    assert all(back.seats(f"d{k}") == cap.seats(f"d{k}") for k in range(13))


# -- the station: claims refused, refusals count as answers -------------------------------


def _station(n=3, **kw):
    cfg = StationConfig(fleet="t", station_id="s", devices=tuple(f"d{k}" for k in range(n)),
                        **{"super_node_size": n, "rand_per_group": 0, "sync_period": 2,
                           "iteration_timeout": 10.0, "batch_size": 8, "local_steps": 2, **kw})
    return Station(cfg, num_params=4, num_classes=2, rng=np.random.default_rng(0))


def _stats(did, seen=(500, 500), nxt=(4, 4)):
    return m.DeviceStats(fleet="t", sender=did, round=0, iteration=0, station="s",
                         seen_counts=np.array(seen), next_batch_counts=np.array(nxt))


def _start(st):
    for d in st.config.devices:
        st.handle(_stats(d), 0.0)
    return st.handle(m.GlobalModel(fleet="t", sender="cloud", round=0, iteration=0,
                                   weights=np.zeros(4), p_real=[0.5, 0.5]), 0.0)


def _upd(did, w=0.1, n=16, it=0):
    return m.DeviceUpdate(fleet="t", sender=did, round=0, iteration=it, station="s",
                          weights=np.full(4, w), num_samples=n)


def test_an_inflated_count_is_refused_and_the_iteration_does_not_wait_for_it():
    st = _station()
    _start(st)
    st.handle(_upd("d0", 0.1), 1.0)
    st.handle(_upd("d1", 0.3), 1.0)
    inflated = tamper(_upd("d2", 0.2), "inflate")
    assert inflated.num_samples == 10**12
    st.handle(inflated, 1.0)
    # Closed at once (no deadline wait), fused without the liar.
    assert st.iteration == 1 and st.counters["rejected.bad_count"] == 1
    assert st.counters["refused_replies"] == 1 and st.counters["replies_missed"] == 0
    np.testing.assert_allclose(st.weights, 0.2)
    st.handle(_upd("d0", n=17, it=1), 2.0)  # 2 steps x batch 8 is the most there can be
    assert st.counters["rejected.bad_count"] == 2


def test_a_scaled_update_is_refused_by_the_distance_guard():
    st = _station()
    _start(st)
    st.handle(_upd("d0", 0.1), 1.0)
    st.handle(_upd("d1", 0.3), 1.0)
    st.handle(tamper(_upd("d2", 0.2), "scale"), 1.0)
    assert st.counters["rejected.update_norm"] == 1 and st.iteration == 1
    np.testing.assert_allclose(st.weights, 0.2)


def test_a_long_step_is_clipped_onto_the_bound_and_still_fused():
    st = _station(update_norm_bound=0.25)  # ||z - w^m|| of 0.1 x 4 weights: 0.2
    _start(st)
    st.handle(_upd("d0", 0.1), 1.0)
    st.handle(_upd("d1", 0.1), 1.0)
    st.handle(_upd("d2", 0.5), 1.0)  # distance 1: 4x the bound, within the hard bound
    assert st.counters["clipped.update_norm"] == 1 and st.counters["refused_replies"] == 0
    assert not any(k.startswith("rejected.") for k in st.counters)
    # d2 fused at distance 0.25, its weights 0.125: (0.1 + 0.1 + 0.125) / 3
    np.testing.assert_allclose(st.weights, 0.325 / 3, rtol=1e-6)


def test_a_transport_refusal_closes_the_iteration_for_that_member():
    st = _station()
    _start(st)
    st.handle(_upd("d0", 0.1), 1.0)
    st.handle(_upd("d1", 0.3), 1.0)
    st.handle(m.Refusal(fleet="t", sender="d2", round=0, iteration=0, reason="non_finite",
                        role="dev", leaf="update"), 1.0)
    assert st.iteration == 1 and st.counters["refused_replies"] == 1
    np.testing.assert_allclose(st.weights, 0.2)


def test_histograms_larger_than_a_batch_are_refused():
    st = _station()
    st.handle(_stats("d0", nxt=(8, 1)), 0.0)
    assert st.counters["rejected.bad_histogram"] == 1 and "d0" not in st.stats


def test_a_huge_seen_claim_cannot_make_p_real_one_class():
    st = _station(n=4)
    _start(st)
    st.handle(tamper(_stats("d0"), "seen"), 1.0)
    seen = st.external.seen_counts()
    assert st.counters["clipped.seen_counts"] == 1
    # It counts as at most seen_share median devices: with 10, 10 of 13 devices' worth.
    share = st.config.seen_share
    assert seen.sum() <= share * 1000 + 3 * 1000 and seen[0] / seen.sum() < 0.8


WIRE_MAX = np.iinfo(np.int64).max  # the largest count a frame carries


@pytest.mark.parametrize("each", [2**62, WIRE_MAX], ids=["2^62", "int64-max"])
def test_seen_counts_whose_sum_wraps_int64_are_clipped_not_waved_through(each):
    # Two classes at 2^62 sum to 2^63: numpy's int64 sum is -2^63, which passed every bound.
    assert int(np.full(2, 2**62, np.int64).sum()) < 0 and claimed_total(np.full(2, each)) > 0
    st = _station(n=3)
    _start(st)
    lie = _stats("d0", seen=(each, each))
    st.handle(lie, 1.0)
    assert st.counters["clipped.seen_counts"] == 1
    kept = st.stats["d0"].seen_counts
    assert 0 < claimed_total(kept) <= 1000 + st.config.max_seen_rate * st.config.local_steps
    seen = st.external.seen_counts()
    assert (seen >= 0).all() and seen.sum() <= 2 * 2000  # majority-capped: half at most
    assert isinstance(st.external.stats(), m.StationStats)  # a message the cloud can read


def test_a_next_batch_whose_sum_wraps_int64_is_refused():
    st = _station()
    st.handle(_stats("d0", nxt=(WIRE_MAX, WIRE_MAX)), 0.0)
    assert st.counters["rejected.bad_histogram"] == 1 and "d0" not in st.stats
    st.handle(_stats("d1", nxt=(8, 0)), 0.0)  # exactly the batch size: kept
    assert "d1" in st.stats


def test_the_cloud_sums_station_counts_that_would_wrap_int64_exactly():
    cloud = Cloud(CloudConfig(fleet="t", stations=("a", "b"), rounds=3),
                  initial_weights=np.zeros(4), num_classes=2)
    for s, counts in (("a", [WIRE_MAX, WIRE_MAX]), ("b", [50, 50])):
        cloud.handle(m.StationStats(fleet="t", sender=s, round=0, iteration=0,
                                    seen_counts=np.array(counts)), 0.0)
    p = cloud.p_real
    assert np.isfinite(p).all() and (p >= 0).all() and p.sum() == pytest.approx(1.0)
    big = m.StationUpdate(fleet="t", sender="a", round=0, iteration=5, weights=np.ones(4),
                          num_samples=10**12, seen_counts=np.array([WIRE_MAX, WIRE_MAX]))
    cloud.handle(big, 0.0)
    assert "clipped.station_samples" not in cloud.counters  # the room is 2^64, exactly


def test_the_attack_at_the_bound_sits_on_it_and_one_more_sample_is_clipped():
    st = _station(n=3)
    _start(st)
    for d in ("d1", "d2"):  # neighbours large enough that the growth bound is the one that binds
        st.handle(_stats(d, seen=(50_000, 50_000)), 1.0)
    growth = st.config.max_seen_rate * st.config.local_steps
    memory = {"growth": growth}
    claims = []
    for it in (0, 0, 3):  # twice in iteration 0, then three iterations later
        st.iteration = it
        lie = tamper(dataclasses.replace(_stats("d0"), iteration=it), "seen_at_bound", memory)
        assert lie.seen_counts[0] == lie.seen_counts[1]  # every class alike
        claims.append(claimed_total(lie.seen_counts))
        st.handle(lie, 1.0)
    assert claims == [growth, growth, 4 * growth]  # one allowance an iteration
    assert st.tally.clipped.get("d0", 0) == 0  # its claims went through as they were
    assert claimed_total(st.stats["d0"].seen_counts) == 4 * growth
    st.iteration = 4
    over = 5 * growth + 1  # one sample past what it accepts
    st.handle(dataclasses.replace(_stats("d0", seen=(over // 2 + 1, over // 2)), iteration=4),
              1.0)
    assert st.tally.clipped["d0"] == 1
    assert claimed_total(st.stats["d0"].seen_counts) <= 5 * growth
    with pytest.raises(ValueError, match="growth"):
        tamper(_stats("d0"), "seen_at_bound", {})


def test_a_hundred_reports_in_one_iteration_grow_by_one_allowance():
    st = _station(n=3)
    _start(st)
    for d in ("d1", "d2"):
        st.handle(_stats(d, seen=(50_000, 50_000)), 1.0)
    growth = st.config.max_seen_rate * st.config.local_steps
    start = claimed_total(st.stats["d0"].seen_counts)
    st.iteration = 1
    for k in range(1, 101):  # each report claims one more allowance than the last
        st.handle(_stats("d0", seen=(start // 2 + k * growth, start // 2)), 1.0)
    assert claimed_total(st.stats["d0"].seen_counts) <= start + growth
    assert st.tally.clipped["d0"] == 99  # the first report is within the iteration's allowance
    kept = st.stats["d0"].seen_counts
    st.iteration = 2  # the next iteration brings one more allowance, exactly
    st.handle(_stats("d0", seen=(int(kept[0]) + growth, int(kept[1]))), 1.0)
    assert claimed_total(st.stats["d0"].seen_counts) == claimed_total(kept) + growth
    assert st.tally.clipped["d0"] == 99


def _trained(st, device, nxt, updates):
    """``device`` reports ``nxt`` as its next batch and has ``updates`` updates admitted."""
    st.handle(_stats(device, nxt=nxt), 1.0)
    for _ in range(updates):
        st.roster.trained_on(device)


@pytest.mark.parametrize("seen, replaced", [
    ((6250, 3750), False),  # total variation 0.25 from the trained 7:1, exactly the tolerance
    ((6249, 3751), True),   # one sample further
    ((1000, 1000), True),   # the even claim of a device that trains on 7:1
])
def test_a_claimed_seen_shape_far_from_what_the_device_trains_on_is_replaced(seen, replaced):
    from aggregator.roster import SHAPE_MIN_UPDATES, SHAPE_TOLERANCE
    assert SHAPE_TOLERANCE == 0.25
    st = _station(n=3, max_seen_rate=10**6)
    _start(st)
    _trained(st, "d0", (7, 1), SHAPE_MIN_UPDATES)
    st.handle(_stats("d0", seen=seen, nxt=(7, 1)), 1.0)
    kept = st.roster._shaped("d0", st.stats["d0"].seen_counts)
    assert st.counters["seen_shape_replaced"] == int(replaced)
    if replaced:  # the claimed total, in the trained shape
        np.testing.assert_array_equal(kept, np.floor(sum(seen) * np.array([7 / 8, 1 / 8])))
    else:
        np.testing.assert_array_equal(kept, seen)


def test_the_shape_is_checked_only_after_enough_trained_batches():
    from aggregator.roster import SHAPE_MIN_UPDATES
    st = _station(n=3)
    _start(st)
    _trained(st, "d0", (8, 0), SHAPE_MIN_UPDATES - 1)
    st.external.seen_counts()
    assert "seen_shape_replaced" not in st.counters
    st.roster.trained_on("d0")  # the eighth: an even claim of 500:500 against 8:0 is replaced
    st.external.seen_counts()
    assert st.counters["seen_shape_replaced"] == 1


def test_a_restarted_station_keeps_the_allowance_already_spent_and_the_trained_shape():
    from aggregator.roster import SHAPE_MIN_UPDATES
    st = _station(n=3)
    _start(st)
    for d in ("d1", "d2"):
        st.handle(_stats(d, seen=(50_000, 50_000)), 1.0)
    _trained(st, "d0", (8, 0), SHAPE_MIN_UPDATES)  # trains on class 0, claims an even mix
    growth = st.config.max_seen_rate * st.config.local_steps
    half = claimed_total(st.stats["d0"].seen_counts) // 2
    st.iteration = 1
    st.handle(_stats("d0", seen=(half, half + growth), nxt=(8, 0)), 1.0)  # the allowance, all
    arrays, meta = st.snapshot()
    back = _station(n=3)
    back.restore(arrays, meta)
    # Restarted within the iteration: its allowance is spent, not handed out afresh.
    back.handle(_stats("d0", seen=(half, half + 2 * growth), nxt=(8, 0)), 1.0)
    assert back.tally.clipped["d0"] == 1
    assert 2 * half + growth - 2 < claimed_total(back.stats["d0"].seen_counts) \
        <= 2 * half + growth  # (the scaled clip floors each of the two classes)
    # And the shape check still rests on the batches it was seen to train before.
    replaced = back.counters["seen_shape_replaced"]
    back.external.seen_counts()
    assert back.counters["seen_shape_replaced"] == replaced + 1


def test_an_admitted_update_adds_its_batch_to_what_the_station_saw_its_device_train():
    st = _station(n=3)
    _start(st)
    st.handle(_upd("d0", 0.1), 1.0)
    st.handle(tamper(_upd("d1", 0.2), "inflate"), 1.0)  # refused: nothing trained is seen
    assert st.roster.trained_updates == {"d0": 1}
    np.testing.assert_array_equal(st.roster.trained["d0"], st.stats["d0"].next_batch_counts)


def test_the_shape_lie_sits_just_inside_the_tolerance_and_is_kept():
    from aggregator.roster import SHAPE_MIN_UPDATES, SHAPE_TOLERANCE
    st = _station(n=3, max_seen_rate=10**6)
    _start(st)
    memory = {"growth": 4000, "tolerance": SHAPE_TOLERANCE}
    for it in range(SHAPE_MIN_UPDATES + 2):
        st.iteration = it
        lie = tamper(dataclasses.replace(_stats("d0", nxt=(7, 1)), iteration=it),
                     "seen_shape_at_bound", memory)
        st.handle(lie, 1.0)
        st.roster.trained_on("d0")
    shape = lie.seen_counts / lie.seen_counts.sum()
    apart = 0.5 * float(np.abs(shape - np.array([7 / 8, 1 / 8])).sum())
    assert 0.9 * SHAPE_TOLERANCE < apart <= SHAPE_TOLERANCE  # as far as it may go, and no more
    st.external.seen_counts()
    assert "seen_shape_replaced" not in st.counters


def test_the_uniform_lie_claims_the_wire_maximum_in_every_class():
    lie = tamper(_stats("d0"), "uniform_seen")
    assert lie.seen_counts.tolist() == [WIRE_MAX, WIRE_MAX]


def test_a_lying_histogram_cannot_buy_every_selection():
    n, size = 10, 3
    st = _station(n=n, super_node_size=size, rand_per_group=0, sync_period=1000,
                  share_window=20, update_norm_factor=0.0)
    rng = np.random.default_rng(0)
    for d in st.config.devices:  # honest devices hold skewed next batches
        c = int(rng.integers(0, 9))
        st.handle(_stats(d, nxt=(c, 8 - c)), 0.0)
    st.handle(m.GlobalModel(fleet="t", sender="cloud", round=0, iteration=0,
                            weights=np.zeros(4), p_real=[0.5, 0.5]), 0.0)
    seats = {d: 0 for d in st.config.devices}
    for it in range(200):
        st.handle(tamper(_stats("d0", nxt=(3, 5)), "balanced"), 0.0)  # "perfectly balanced"
        for d in st.members:
            seats[d] += 1
        for d in st.members:
            st.handle(_upd(d, 0.001 * (it + 1), n=8, it=it), 0.0)  # a new step each time
    cap = st.config.max_selection_share
    assert cap == pytest.approx(1.5 * size / n)
    assert seats["d0"] <= cap * 200 + st.config.share_window
    assert st.counters["selection_share_capped"] > 0


def test_a_station_below_quorum_waits_instead_of_closing_empty_iterations():
    st = _station(min_quorum=2, min_devices=1)
    st.handle(_stats("d0"), 0.0)
    out = st.handle(m.GlobalModel(fleet="t", sender="cloud", round=0, iteration=0,
                                  weights=np.zeros(4), p_real=[0.5, 0.5]), 0.0)
    assert st.state == "gathering" and not any(isinstance(x, m.Selection) for x in out)
    assert st.tick(5.0) == [] and st.iteration == 0
    st.tick(10.0)  # the timeout closes this iteration untrained, and the next one waits again
    assert st.iteration == 1 and st.state == "gathering" and st.deadline == 20.0
    assert st.tick(15.0) == [] and st.iteration == 1
    from aggregator.status import FleetStatus, format_status
    from edge_client.documents import StationSummary

    def summary(**fields):
        return {"s": StationSummary(station="s", round=0, iteration=1, devices=3, quorum=2,
                                    **fields)}
    found = FleetStatus(presence={("station", "s"): True},
                        stations=summary(state=st.state, online=st.roster.online))
    assert "s waits for devices: 1 online, quorum 2" in format_status(found, "t")
    joining = FleetStatus(stations=summary(state="joining", online=0, missing=("d1", "d2")))
    assert "s waits for its roster: missing d1, d2" in format_status(joining, "t")
    assert _station().roster.missing == ["d0", "d1", "d2"]
    out = st.handle(_stats("d1"), 16.0)  # a second device: the quorum is there
    assert st.state == "collecting" and any(isinstance(x, m.Selection) for x in out)


def test_a_device_back_after_its_last_will_is_selectable_again():
    st = _station(min_quorum=3)
    _start(st)
    offline = m.Presence(fleet="t", sender="d2", round=0, iteration=0, role="dev", online=False)
    st.handle(offline, 1.0)
    for d in ("d0", "d1"):
        st.handle(_upd(d), 1.0)
    assert st.state == "gathering"  # 2 ready < quorum 3
    st.handle(m.Presence(fleet="t", sender="d2", round=0, iteration=0, role="dev",
                         online=True), 2.0)
    assert st.state == "collecting" and st.counters["devices_back_online"] == 1


# -- the cloud ----------------------------------------------------------------------------


def test_the_cloud_clips_a_station_count_to_what_its_devices_saw():
    cloud = Cloud(CloudConfig(fleet="t", stations=("a", "b"), rounds=3),
                  initial_weights=np.zeros(4), num_classes=2)
    for s in ("a", "b"):
        cloud.handle(m.StationStats(fleet="t", sender=s, round=0, iteration=0,
                                    seen_counts=np.array([50, 50])), 0.0)

    def up(s, w, n):
        return m.StationUpdate(fleet="t", sender=s, round=0, iteration=5, weights=np.full(4, w),
                               num_samples=n, seen_counts=np.array([50, 50]))
    cloud.handle(up("a", 1.0, 100), 0.0)
    out = cloud.handle(up("b", 3.0, 10**12), 0.0)
    assert cloud.counters["clipped.station_samples"] == 1
    np.testing.assert_allclose(out[0].weights, 2.0)  # 100 vs at most 100: equal weight


def test_an_impossible_local_accuracy_is_dropped_not_the_stats():
    st = _station(n=4)
    _start(st)
    lie = dataclasses.replace(_stats("d0"), local_accuracy=7.5, local_samples=100)
    st.handle(lie, 1.0)
    assert st.counters["clipped.local_accuracy"] == 1
    assert "d0" in st.stats and st.roster.local_accuracies() == []
    st.handle(dataclasses.replace(_stats("d1"), local_accuracy=0.75, local_samples=100), 1.0)
    assert st.roster.local_accuracies() == [0.75]


def test_a_replayed_update_is_refused_and_a_fresh_one_is_not():
    st = _station()
    _start(st)
    first = [_upd("d0", 0.1), _upd("d1", 0.3), _upd("d2", 0.2)]
    for u in first:
        st.handle(u, 1.0)
    assert st.iteration == 1 and st.counters["received_updates"] == 3
    # d0 sends its first update again as iteration 1's reply (a new message, valid fields).
    st.handle(dataclasses.replace(first[0], iteration=1), 2.0)
    assert st.counters["rejected.replay"] == 1 and st.counters["refused_replies"] == 1
    st.handle(_upd("d1", 0.25, it=1), 2.0)  # honest: a new step from the new w^m
    st.handle(_upd("d2", 0.15, it=1), 2.0)
    assert st.iteration == 2 and st.counters["received_updates"] == 5
    np.testing.assert_allclose(st.weights, 0.2)  # fused without the replay
    # Kept across a restart: the resumed station still knows d0's recent updates.
    arrays, meta = st.snapshot()
    back = _station()
    back.restore(arrays, meta)
    ok, ratio = back.admission.replay.check("d0", first[0].weights, np.zeros(4))
    assert not ok and ratio == 0.0


def test_the_replay_guard_tells_a_repeat_from_an_honest_step():
    rng = np.random.default_rng(1)
    guard = ReplayGuard(100_000, seed=3)
    w = rng.normal(size=100_000).astype(np.float32)
    sent = []
    for _ in range(6):  # honest: each update one small step from the current model
        z = w - 0.01 * rng.normal(size=w.size).astype(np.float32)
        ok, ratio = guard.check("d", z, w)
        assert ok and ratio > 0.5
        sent.append(z)
        w = (w + z) / 2
    for old in sent[-4:]:  # any of its 4 recent updates again, even a little off
        off = old + 1e-7 * rng.normal(size=w.size).astype(np.float32)
        assert not guard.check("d", off, w)[0]
    assert guard.check("d", sent[0], w)[0]  # older than its depth: left to the other guards
    for _ in range(3):  # the model it was sent, unchanged, again and again: no replay
        assert guard.check("d", w.copy(), w)[0]
    assert ReplayGuard(10, seed=0, tolerance=0.0).check("d", np.ones(10), np.ones(10))[0]
    with pytest.raises(ValueError, match="memory"):  # never an honest device by mistake
        tamper(_upd("d0"), "replay")


@pytest.mark.parametrize("size, roster, cap", [(2, 3, 5 / 6), (1, 2, 0.75), (3, 3, 1.0),
                                               (5, 40, 0.1875), (3, 10, 0.45)])
def test_the_default_seat_cap_binds_whenever_there_is_a_choice(size, roster, cap):
    cfg = StationConfig(fleet="t", station_id="s", devices=tuple(f"d{k}" for k in range(roster)),
                        super_node_size=size, rand_per_group=0)
    assert cfg.max_selection_share == pytest.approx(cap)


def test_on_a_roster_of_three_a_liar_buys_neither_the_estimate_nor_every_seat():
    st = _station(n=3, super_node_size=2, rand_per_group=0, sync_period=1000,
                  update_norm_factor=0.0)
    _start(st)
    seats = 0
    for it in range(100):  # every iteration: 10^15 samples seen, a perfect next batch
        lie = tamper(tamper(_stats("d0", nxt=(1, 7)), "balanced"), "seen")
        st.handle(lie, 1.0)
        seats += "d0" in st.members
        assert len(st.members) == 2  # capped devices fill the seats nobody else can
        for d in st.members:
            st.handle(_upd(d, 0.01 * (it + 1), n=8, it=it), 1.0)
    # However long it claims, d0 never outweighs the two honest devices together.
    seen = st.external.seen_counts()
    assert seen[0] / seen.sum() <= 0.75 and seen.sum() <= 4 * 1000
    assert st.counters["seen_majority_capped"] > 0
    assert seats <= st.config.max_selection_share * 100 + st.config.share_window
    assert st.config.max_selection_share < 1.0 and st.counters["selection_share_capped"] > 0


def test_a_refused_member_sits_out_while_others_can_fill_its_seat():
    st = _station(n=3, super_node_size=2, rand_per_group=0, sync_period=1000,
                  max_selection_share=1.0)
    _start(st)
    seats = []
    for it in range(33):
        assert len(st.members) == 2
        seats += ["d0"] if "d0" in st.members else []
        for d in list(st.members):
            honest = _upd(d, 0.01 * (it + 1), n=8, it=it)
            st.handle(tamper(honest, "scale") if d == "d0" else honest, 1.0)
    # Refused each time it sits in, d0 then sits out 10 super nodes: 3 seats of 33, not 22.
    assert 1 <= len(seats) <= 3 and st.counters["rejected.update_norm"] == len(seats)
    off = _station(n=3, super_node_size=2, rand_per_group=0, refused_sit_out=0)
    assert off.config.refused_sit_out == 0


def test_a_capped_factory_still_covers_the_samples_it_consumed():
    st = _station(n=2, sync_period=3)
    for d, seen in (("d0", (5000, 0)), ("d1", (10, 30))):  # d0 alone outweighs d1 125 times
        st.handle(_stats(d, seen=seen), 0.0)
    st.handle(m.GlobalModel(fleet="t", sender="cloud", round=0, iteration=0,
                            weights=np.zeros(4), p_real=[0.5, 0.5]), 0.0)
    outs = []
    for it in range(3):
        for d in list(st.members):
            outs += st.handle(_upd(d, 0.01 * (it + 1), n=16, it=it), 1.0)
    up = next(x for x in outs if isinstance(x, m.StationUpdate))
    # Capped, the counts would total 80; the cloud would clip the 96 samples trained to that.
    assert up.num_samples == 96 and up.seen_counts.sum() == 96
    assert st.counters["seen_majority_capped"] > 0


def test_a_station_waiting_for_its_roster_for_minutes_says_so_as_a_warning_and_where_to_look():
    """Joining is news for JOIN_PATIENCE_S, then a warning naming what keeps devices away
    (a broker refusing past its file descriptors kept 85 of 1,100 out for good)."""
    import logging

    from aggregator.roster import JOIN_PATIENCE_S

    st = Station(StationConfig(fleet="t", station_id="s", devices=("d0", "d1", "d2"),
                               super_node_size=2),
                 num_params=4, num_classes=2, rng=np.random.default_rng(0))
    st.handle(m.DeviceStats(fleet="t", sender="d0", round=0, iteration=0, station="s",
                            seen_counts=np.ones(2, int), next_batch_counts=np.ones(2, int)), 0.0)
    level, text = st.roster.joining(10.0)
    assert level == logging.INFO and "1 of 3 devices reported, waiting for d1, d2" == text
    assert st.roster.joining(10.0 + JOIN_PATIENCE_S - 0.1)[0] == logging.INFO
    level, text = st.roster.joining(10.0 + JOIN_PATIENCE_S)  # exactly on the bound
    assert level == logging.WARNING and "file descriptors" in text and "docs/deploy.md" in text


def _grow(st, iterations, step, devices):
    """``devices`` report ``step`` more of each class every iteration, as honest cameras do."""
    for _ in range(iterations):
        st.iteration += 1
        for d in devices:
            seen = st.stats[d].seen_counts + step
            st.handle(_stats(d, seen=tuple(int(s) for s in seen)), 1.0)


@pytest.mark.parametrize("n", [2, 3])
def test_a_camera_restarting_does_not_clip_the_rest_of_its_line(n):
    """A camera restarted without its state counts anew from zero.  Its restart must not
    drag down the median its roster's other claims are bounded by: on a line of two
    cameras, each report of the one that kept running was clipped against the restarted
    one's few frames (52 clips in 26 minutes).  What it saw before still counts."""
    st = _station(n=n)
    _start(st)  # 1,000 each
    everyone = st.config.devices
    _grow(st, 10, 500, everyone)  # 11,000 each, an allowance's half an iteration
    restarted = everyone[1:]  # all but d0 (one camera of two, two of three)
    for d in restarted:
        st.handle(_stats(d, seen=(3, 2)), 1.0)
    _grow(st, 5, 500, everyone)
    assert st.counters["clipped.seen_counts"] == 0, dict(st.counters)
    assert claimed_total(st.stats["d0"].seen_counts) == 16_000
    # Kept across the station's own restart: a checkpoint, then the line goes on.
    arrays, meta = st.snapshot()
    back = _station(n=n)
    back.restore(arrays, meta)
    _grow(back, 3, 500, everyone)
    assert back.counters["clipped.seen_counts"] == 0
    # A liar's claim is bounded by the others' counts in all, as before any restart: ten
    # times their median, and its own growth.
    growth = back.config.max_seen_rate * back.config.local_steps
    back.iteration += 100
    back.handle(_stats("d0", seen=(10**9, 0)), 1.0)
    kept = claimed_total(back.stats["d0"].seen_counts)
    assert back.counters["clipped.seen_counts"] == 1
    assert kept <= back.config.seen_share * (11_000 + 8 * 1000 + 5)
    assert kept <= 19_000 + 100 * growth
