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
