"""Shared fixtures: small real data and deterministic generators."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


@pytest.fixture(scope="session")
def digits():
    """scikit-learn's bundled 8x8 digits (real data, no download)."""
    from aggregator.datasets import load_dataset

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
