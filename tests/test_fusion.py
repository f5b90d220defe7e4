"""Fusion rules and server optimisers, against hand-computed values."""

from __future__ import annotations

import numpy as np
import pytest

from aggregator.fusion import FUSION_RULES, fedavg, ida
from aggregator.server_optimizers import ServerOptimizerSettings, build_server_optimizer
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
