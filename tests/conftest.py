"""Shared fixtures: small real data and deterministic generators."""

from __future__ import annotations

import numpy as np
import pytest

from edge_client.errors import ShapeError


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


@pytest.fixture(scope="session")
def digits():
    """scikit-learn's bundled 8x8 digits (real data, no download)."""
    from lab.datasets import load_dataset

    return load_dataset("digits")


@pytest.fixture(scope="session")
def exported(tmp_path_factory):
    """Export zoo models once per session: ``exported(name, **kw) -> folder``."""
    pytest.importorskip("torch")
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    from models.export import export_model

    cache = {}

    def get(name, **kw):
        key = (name, tuple(sorted(kw.items())))
        if key not in cache:
            folder = tmp_path_factory.mktemp(f"art_{name}")
            export_model(name, folder, force=True, **kw)
            cache[key] = folder
        return cache[key]

    return get


@pytest.fixture
def evaluates_as_if_loaded():
    """Checks that a trainer evaluates a given vector as if it were loaded, and keeps its own
    parameters (the upload gate's evaluation of the aggregate)."""
    return _evaluates_as_if_loaded


def _evaluates_as_if_loaded(tr, x, y):
    own = tr.get_flat()
    other = np.random.default_rng(7).normal(0, 0.1, own.size).astype(np.float32)
    other.flags.writeable = False  # as a received message's weights are
    given = tr.evaluate(x, y, weights=other)
    assert np.array_equal(tr.get_flat(), own)  # nothing was swapped in
    tr.set_flat(other)
    loaded = tr.evaluate(x, y)
    assert given[1] == loaded[1] and given[0] == pytest.approx(loaded[0], rel=1e-5)
    assert given != tr.evaluate(x, y, weights=own)
    with pytest.raises(ShapeError):
        tr.evaluate(x, y, weights=own[:-1])
