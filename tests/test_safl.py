"""SAFL's annealed merge and upload gate against the paper's equations."""

from __future__ import annotations

import math

import numpy as np
import pytest

from edge_client.errors import ConfigError, ShapeError
from edge_client.safl import (
    acceptance_probability,
    annealed_merge,
    performance_gap,
    upload_probability,
)


def test_acceptance_probability_is_exp_minus_t_over_L():
    assert acceptance_probability(0, 10) == 1.0
    assert acceptance_probability(10, 10) == pytest.approx(math.exp(-1))
    assert acceptance_probability(30, 15) == pytest.approx(math.exp(-2))


def test_mix_one_returns_the_global_model_exactly(rng):
    local, glob = rng.normal(size=500).astype(np.float32), rng.normal(size=500).astype(np.float32)
    for gran in ("element", "tensor", "model"):
        out = annealed_merge(local, glob, 0, temperature=5.0, mix=1.0, rng=rng,
                             granularity=gran, layout=[200, 300])
        assert np.array_equal(out, glob)
        assert out is not glob


def test_mean_of_many_merges_matches_expectation(rng):
    local = rng.normal(size=64).astype(np.float32)
    glob = rng.normal(size=64).astype(np.float32)
    t, L, mix = 7.0, 10.0, 0.3
    draws = np.stack([annealed_merge(local, glob, t, temperature=L, mix=mix, rng=rng)
                      for _ in range(4000)])
    p = math.exp(-t / L)
    expected = glob + (1 - mix) * p * (local - glob)
    # Per-element std of the mean is |(1-mix)(local-glob)| sqrt(p(1-p)/n); 5 sigma bound.
    bound = 5 * np.abs((1 - mix) * (local - glob)) * math.sqrt(p * (1 - p) / 4000) + 1e-6
    assert (np.abs(draws.mean(axis=0) - expected) <= bound).all()


def test_element_masks_keep_each_element_with_probability_exactly_p(rng):
    # p lies halfway between two of the mask's 1/256 levels: a fixed level would be 0.002
    # off, 17 standard deviations of the mean of these 20M draws.
    p = 100.5 / 256
    local, glob = np.ones(100_000, np.float32), np.zeros(100_000, np.float32)
    rates = [annealed_merge(local, glob, -math.log(p), temperature=1.0, mix=0.0, rng=rng).mean()
             for _ in range(200)]
    assert abs(np.mean(rates) - p) < 5 * math.sqrt(p * (1 - p) / 2e7)
    assert max(abs(r - p) for r in rates) < 1 / 256 + 5 * math.sqrt(p * (1 - p) / 1e5)


def test_granularities_draw_masks_at_the_stated_level(rng):
    local, glob = np.ones(30, np.float32), np.zeros(30, np.float32)
    layout = [10, 5, 15]
    seen_element = seen_tensor = seen_model = False
    for _ in range(200):
        e = annealed_merge(local, glob, 5, temperature=5, mix=0.0, rng=rng)
        seen_element |= 0 < e.sum() < 30 and not all(
            len(set(chunk)) == 1 for chunk in np.split(e, np.cumsum(layout)[:-1]))
        t = annealed_merge(local, glob, 5, temperature=5, mix=0.0, rng=rng,
                           granularity="tensor", layout=layout)
        assert all(len(set(chunk)) == 1 for chunk in np.split(t, np.cumsum(layout)[:-1]))
        seen_tensor |= 0 < t.sum() < 30
        m = annealed_merge(local, glob, 5, temperature=5, mix=0.0, rng=rng, granularity="model")
        assert m.sum() in (0, 30)
        seen_model |= m.sum() == 30
    assert seen_element and seen_tensor and seen_model


def test_merge_does_not_modify_inputs(rng):
    local, glob = rng.normal(size=10).astype(np.float32), rng.normal(size=10).astype(np.float32)
    lc, gc = local.copy(), glob.copy()
    annealed_merge(local, glob, 0, temperature=1, mix=0.0, rng=rng)
    assert np.array_equal(local, lc) and np.array_equal(glob, gc)


def test_late_iterations_give_hard_replacement(rng):
    local, glob = np.ones(100, np.float32), np.zeros(100, np.float32)
    out = annealed_merge(local, glob, 10_000, temperature=1.0, mix=0.2, rng=rng)
    assert np.array_equal(out, glob)


def test_gate_equals_exp_minus_nu_gap():
    gap = performance_gap(0.6, 0.8)
    assert gap == pytest.approx(0.2 / (0.8 + 1e-6))
    assert upload_probability(gap, 3.0) == pytest.approx(math.exp(-3.0 * gap))
    assert upload_probability(gap, 0.0) == 1.0
    assert performance_gap(0.5, 0.0) == pytest.approx(0.5 / 1e-6)


@pytest.mark.parametrize("call, key", [
    (lambda r: acceptance_probability(1, -1.0), "temperature"),
    (lambda r: annealed_merge(np.zeros(3), np.zeros(3), 1, temperature=1, mix=1.5, rng=r), "mix"),
    (lambda r: annealed_merge(np.zeros(3), np.zeros(3), 1, temperature=1, mix=-0.1, rng=r), "mix"),
    (lambda r: annealed_merge(np.zeros(3), np.zeros(3), 1, temperature=0, mix=0.5, rng=r),
     "temperature"),
    (lambda r: annealed_merge(np.zeros(3), np.zeros(3), 1, temperature=1, mix=0.5, rng=r,
                              granularity="layer"), "granularity"),
    (lambda r: annealed_merge(np.zeros(3), np.zeros(3), 1, temperature=1, mix=0.5, rng=r,
                              granularity="tensor"), "layout"),
    (lambda r: upload_probability(0.1, -1), "nu"),
])
def test_bad_settings_name_their_key(rng, call, key):
    with pytest.raises(ConfigError, match=key):
        call(rng)


def test_shape_mismatch_is_refused(rng):
    with pytest.raises(ShapeError):
        annealed_merge(np.zeros(3), np.zeros(4), 1, temperature=1, mix=0.5, rng=rng)
