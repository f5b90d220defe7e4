"""Fusion rules and server optimisers, against hand-computed values."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from aggregator.config import StationConfig
from aggregator.fusion import FUSION_RULES, WeightedSum, fedavg, fold_for, ida
from aggregator.server_optimizers import ServerOptimizerSettings, build_server_optimizer
from aggregator.station import Station
from edge_client import messages as m
from edge_client.errors import ConfigError, ShapeError


def test_fedavg_weights_by_samples():
    out = fedavg([np.array([0.0, 4.0]), np.array([2.0, 0.0])], [1, 3])
    assert out.tolist() == [1.5, 1.0]
    assert out.dtype == np.float32


def test_ida_down_weights_the_outlier():
    models = [np.array([0.0]), np.array([0.0]), np.array([3.0])]
    # mean 1; distances 1, 1, 2; eta ∝ 1, 1, 0.5 -> (0 + 0 + 1.5) / 2.5
    assert ida(models, [1, 1, 1])[0] == pytest.approx(0.6)
    assert ida(models, [1, 1, 1])[0] < fedavg(models, [1, 1, 1])[0]


def test_fusion_does_not_mutate_and_rejects_bad_input():
    a = np.array([1.0, 2.0], np.float32)
    for rule in FUSION_RULES.values():
        rule([a, a * 3], [1, 1])
        assert a.tolist() == [1.0, 2.0]
        with pytest.raises(ShapeError):
            rule([], [])
        with pytest.raises(ShapeError):
            rule([a, np.array([np.nan, 0.0])], [1, 1])
        with pytest.raises(ShapeError):
            rule([a, a], [0, 0])
        with pytest.raises(ShapeError):
            rule([a, np.zeros(3)], [1, 1])


def test_fedavg_streams_one_float32_pass_without_stacking():
    rng = np.random.default_rng(0)
    models = [rng.standard_normal(20_000).astype(np.float32) for _ in range(100)]
    counts = rng.integers(1, 321, len(models))
    exact = np.stack(models).astype(np.float64).T @ counts / counts.sum()
    tracemalloc.start()
    try:
        out = fedavg(models, counts)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert out.dtype == np.float32
    assert np.abs(out - exact).max() < 1e-6
    # A running sum and its scratch, not a stack of the 8 MB of inputs.
    assert peak < 4 * models[0].nbytes


def test_folds_average_equally_only_when_asked_and_gather_in_key_order():
    a, b = np.array([1.0, 0.0]), np.array([3.0, 2.0])
    for rule in ("fedavg", "median"):
        fold = fold_for(rule, equal_if_unweighted=True)
        fold.add(a, 0, key="x")
        fold.add(b, 0, key="y")
        assert fold.result().tolist() == [2.0, 1.0]
        strict = fold_for(rule)
        strict.add(a, 0)
        with pytest.raises(ShapeError):
            strict.result()
    # Robust rules see their inputs sorted by key, whatever the arrival order.
    models = {k: np.array([float(i), -float(i)]) for i, k in enumerate("edcba")}
    results = []
    for order in ("abcde", "edcba", "cadbe"):
        fold = fold_for("krum")
        for k in order:
            fold.add(models[k], 1, key=k)
        results.append(fold.result().tolist())
    assert results[0] == results[1] == results[2]
    with pytest.raises(ShapeError):
        WeightedSum().add(a, float("nan"))


def test_a_station_folds_each_update_as_it_arrives():
    n, params = 40, 20_000
    cfg = StationConfig(fleet="t", station_id="s", devices=tuple(f"d{k}" for k in range(n)),
                        super_node_size=n, rand_per_group=0, sync_period=5,
                        iteration_timeout=10.0, update_norm_factor=0.0)
    st = Station(cfg, num_params=params, num_classes=2, rng=np.random.default_rng(0))
    for k in range(n):
        st.handle(m.DeviceStats(fleet="t", sender=f"d{k}", round=0, iteration=0, station="s",
                                seen_counts=np.ones(2, int), next_batch_counts=np.ones(2, int)),
                  0.0)
    st.handle(m.GlobalModel(fleet="t", sender="cloud", round=0, iteration=0,
                            weights=np.zeros(params), p_real=[0.5, 0.5]), 0.0)
    assert len(st.members) == n
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for k in range(n - 1):
            st.handle(m.DeviceUpdate(fleet="t", sender=f"d{k}", round=0, iteration=0,
                                     station="s", weights=np.full(params, float(k)),
                                     num_samples=10), 0.0)
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    # 39 accepted updates (3.1 MB) are folded into one running sum, not kept; what stays
    # per member is the replay guard's 1 KB sketch (and its deque), whatever the model's size.
    assert held < 2 * params * 4 + (n - 1) * 2048
    st.handle(m.DeviceUpdate(fleet="t", sender=f"d{n - 1}", round=0, iteration=0,
                             station="s", weights=np.full(params, float(n - 1)),
                             num_samples=10), 0.0)
    assert st.iteration == 1
    np.testing.assert_allclose(st.weights, np.full(params, (n - 1) / 2), rtol=1e-6)


def _opt(kind, **params):
    return build_server_optimizer(ServerOptimizerSettings(server_optimizer=kind, **params))


def test_server_optimizers_one_step_by_hand():
    w, fused = np.array([1.0]), np.array([3.0])  # Delta = 2
    assert _opt("none").step(w, fused).tolist() == [3.0]
    m = _opt("fedavgm", server_lr=0.5, beta1=0.9)
    assert m.step(w, fused)[0] == pytest.approx(1 + 0.5 * 2)
    assert m.step(np.array([2.0]), np.array([3.0]))[0] == pytest.approx(2 + 0.5 * (0.9 * 2 + 1))
    tau = 1e-3
    for kind, v in (("fedadagrad", tau**2 + 4), ("fedadam", 0.99 * tau**2 + 0.01 * 4),
                    ("fedyogi", tau**2 - 0.01 * 4 * np.sign(tau**2 - 4))):
        opt = _opt(kind, server_lr=0.1, beta1=0.9, beta2=0.99, tau=tau)
        expected = 1 + 0.1 * (0.1 * 2) / (np.sqrt(v) + tau)
        assert opt.step(w, fused)[0] == pytest.approx(expected, rel=1e-5), kind


def test_server_optimizer_validates_its_settings():
    with pytest.raises(ConfigError, match="server_optimizer"):
        _opt("sgd")
    with pytest.raises(ConfigError, match="beta1"):
        _opt("fedadam", beta1=1.5)
