"""Correlated noise at the station: the tree mechanism's prefix sums and noise, what it
charges each member (against dp-accounting), the participation cap, and their planning."""

from __future__ import annotations

import dp_accounting as dpa
import numpy as np
import pytest
from dp_accounting import rdp

from aggregator.central_dp import NoisedMean, NoiseTree, _charges, tree_sensitivity
from aggregator.config import CloudConfig, StationConfig
from edge_client import messages as m
from edge_client.errors import ConfigError
from edge_client.privacy import PrivacyLedger


def _leaf(start, step, members, *, bound=100.0, size=2, noise=0.0):
    fold = NoisedMean(start, bound=bound, noise=noise, size=size, rng=np.random.default_rng(0))
    for d in members:
        fold.add(start + step, 1, key=d)
    return fold


def test_a_tree_releases_the_prefix_sums_of_a_rounds_mean_steps():
    start = np.zeros(3, np.float32)
    tree, model, total = NoiseTree(start, 0.0, np.random.default_rng(0)), start, 0.0
    for t in range(1, 12):
        step = np.float32(t) * np.ones(3, np.float32)
        model, _ = tree.add(_leaf(model, step, ["a", "b"]))
        total += t
        np.testing.assert_allclose(model, total, rtol=1e-6)  # every member's whole step


def test_a_trees_noise_is_that_of_the_nodes_its_prefix_sums():
    """Prefix 7 is three nodes (1-4, 5-6, 7), prefix 8 one (1-8): independent noise would
    give 7 and 8 draws; the tree gives 3 and 1."""
    n, noise, scale = 40_000, 2.0, 0.5  # scale = bound / size
    tree = NoiseTree(np.zeros(n, np.float32), noise, np.random.default_rng(1))
    models = []
    for _ in range(8):
        models.append(tree.add(_leaf(np.zeros(n, np.float32), np.zeros(n, np.float32),
                                     ["a"], bound=1.0, size=2))[0])
    sd = noise * scale
    for t, nodes in ((1, 1), (4, 1), (7, 3), (8, 1)):
        assert models[t - 1].std() == pytest.approx(sd * np.sqrt(nodes), rel=0.03)


def test_each_member_is_charged_for_every_node_its_steps_entered():
    start = np.zeros(2, np.float32)
    tree, charged = NoiseTree(start, 1.0, np.random.default_rng(0)), PrivacyLedger(1.0, 1e-5)
    seats = {"every": range(1, 11), "first": [1], "last": [10], "some": [2, 3, 7]}
    for t in range(1, 11):
        members = [d for d, at in seats.items() if t in at]
        _, charges = tree.add(_leaf(start, start, members))
        for d, times in charges.items():
            charged.record(d, times=times)
    # Leaf 1 is in nodes 1, 1-2, 1-4 and 1-8; leaf 10 only in 9-10 (10 is a right child).
    assert {d: charged.count(d) for d in seats} == {
        "every": 97, "first": 4, "last": 1, "some": _charges([2, 3, 7], 10)}
    assert tree_sensitivity(10, 10) == 97 and tree_sensitivity(10, 1) == 4


@pytest.mark.parametrize("noise, charges", [(5.0, 97), (11.0, 4 * 30), (2.0, 49)])
def test_a_tree_members_epsilon_is_dp_accountings_gaussian_of_its_sensitivity(noise, charges):
    """A member whose steps enter the tree's nodes with squared multiplicities summing to
    ``charges`` is a Gaussian mechanism of sensitivity sqrt(charges) x its step scale."""
    ledger = PrivacyLedger(noise, 1e-5)
    ledger.record("d", times=charges)
    accountant = rdp.RdpAccountant()
    accountant.compose(dpa.GaussianDpEvent(noise / np.sqrt(charges)))
    assert ledger.epsilon("d") == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-9)


def test_the_worst_seating_is_found_and_bounds_every_other():
    rng = np.random.default_rng(0)
    for k in (1, 3, 5):
        worst = tree_sensitivity(10, k)
        for _ in range(50):
            assert _charges(rng.choice(np.arange(1, 11), k, replace=False), 10) <= worst
    assert tree_sensitivity(10, 0) == 0
    assert tree_sensitivity(30, 15) >= _charges(range(1, 16), 30)  # the bound, beyond 50,000


def _station(**kw):
    from aggregator.station import Station

    devices = tuple(f"d{i}" for i in range(6))
    cfg = StationConfig(fleet="t", station_id="s", devices=devices, super_node_size=3,
                        rand_per_group=0, sync_period=4, iteration_timeout=10.0, batch_size=8,
                        central_dp_clip=1.0, central_dp_noise=1.0, noise_seeded=True, **kw)
    st = Station(cfg, num_params=8, num_classes=2, rng=np.random.default_rng(0))
    for d in devices:
        st.handle(m.DeviceStats(fleet="t", sender=d, round=0, iteration=0, station="s",
                                seen_counts=np.array([9, 9]),
                                next_batch_counts=np.array([4, 4])), 0.0)
    st.handle(m.GlobalModel(fleet="t", sender="cloud", round=0, iteration=0,
                            weights=np.ones(8), p_real=[0.5, 0.5]), 0.0)
    return st


def _run_round(st):
    seats = {}
    for it in range(st.config.sync_period):
        for d in st.members:
            seats[d] = seats.get(d, 0) + 1
            st.handle(m.DeviceUpdate(fleet="t", sender=d, round=st.round, iteration=it,
                                     station="s", weights=st.weights + np.float32(0.1),
                                     num_samples=8), 1.0)
    return seats


def test_a_capped_station_seats_no_device_past_its_cap_in_a_round():
    st = _station(max_participations=2)
    seats = _run_round(st)
    assert max(seats.values()) == 2 and sum(seats.values()) == 12  # 6 devices x 2 fill it
    assert st.counters["participation_capped"] > 0 and st.counters["dp_releases"] == 4
    free = _station()
    assert max(_run_round(free).values()) > 2  # GBP-CS alone reseats the same devices


def test_a_tree_station_charges_its_ledger_and_starts_a_tree_each_round():
    st = _station(central_dp_mechanism="tree")
    _run_round(st)
    assert st.dp.tree is not None and len(st.dp.tree) == 4
    assert st.counters["dp_tree_nodes"] == 4  # nodes 1, 1-2, 3, 1-4
    worst = tree_sensitivity(4, 4)
    assert 0 < max(st.dp.privacy.count(d) for d in st.config.devices) <= worst
    st.handle(m.GlobalModel(fleet="t", sender="cloud", round=1, iteration=4,
                            weights=np.ones(8), p_real=[0.5, 0.5]), 2.0)
    assert st.dp.tree is None  # the next round's releases start from its global model


def test_the_tree_and_the_cap_are_a_synchronous_stations():
    with pytest.raises(ConfigError, match="central_dp_mechanism"):
        StationConfig(fleet="t", station_id="s", devices=("a",), super_node_size=1,
                      central_dp_mechanism="banded")
    with pytest.raises(ConfigError, match="central_dp_mechanism"):
        StationConfig(fleet="t", station_id="s", devices=("a",), super_node_size=1,
                      mode="buffered", central_dp_mechanism="tree")
    with pytest.raises(ConfigError, match="max_participations"):
        CloudConfig(stations=("s0",), rounds=1, max_participations=2)


def test_an_experiment_plans_its_noise_for_the_mechanism_and_the_cap():
    from edge_client.privacy import noise_for_epsilon
    from lab.experiment import ExperimentConfig, _strategy

    base = dict(name="x", rounds=6, sync_period=4, central_dp_clip=1.0, central_dp_epsilon=4.0)
    plans = {(mech, cap): _strategy(ExperimentConfig(**base, central_dp_mechanism=mech,
                                                     max_participations=cap), "fedgs").station
             for mech in ("independent", "tree") for cap in (0, 1)}
    assert plans[("independent", 0)]["central_dp_noise"] == noise_for_epsilon(4.0, 24, 1e-5)
    assert plans[("independent", 1)]["central_dp_noise"] == noise_for_epsilon(4.0, 6, 1e-5)
    assert plans[("tree", 0)]["central_dp_noise"] == noise_for_epsilon(
        4.0, 6 * tree_sensitivity(4, 4), 1e-5)
    assert plans[("tree", 1)]["central_dp_mechanism"] == "tree"
    assert plans[("tree", 1)]["max_participations"] == 1
    assert "central_dp_mechanism" not in plans[("independent", 0)]  # a plain run's key
