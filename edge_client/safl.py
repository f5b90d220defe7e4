"""SAFL: the annealed merge and the upload gate (Gradual FL with Simulated Annealing).

Equations (SPEC §3): the perturbation state ``eps*zbar + (1-eps)*z`` is accepted
entry-wise with probability ``p_t = exp(-t/L)``, which rewrites as
``w_t = zbar + (1-eps) * u * (z - zbar)``; the extended algorithm uploads the
local update with probability ``q = exp(-nu * Delta)``.  These four functions
are the only implementation; the device role and every simulator call them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from .errors import ConfigError, ShapeError

__all__ = [
    "GRANULARITIES",
    "acceptance_probability",
    "annealed_merge",
    "performance_gap",
    "upload_probability",
]

GRANULARITIES = ("element", "tensor", "model")

# The paper's division guard in Delta; named apart from the mix weight ``eps``.
GAP_GUARD = 1e-6


def acceptance_probability(t: float, temperature: float) -> float:
    """Probability ``exp(-t/L)`` of accepting the perturbation (local) state.

    Parameters
    ----------
    t : float
        Global iteration index (>= 0), as carried in the model header.
    temperature : float
        The paper's "maximum temperature" ``L`` (> 0).
    """
    if not temperature > 0:
        raise ConfigError("temperature", f"must be > 0, got {temperature!r}")
    if t < 0:
        raise ConfigError("t", f"iteration index must be >= 0, got {t!r}")
    return math.exp(-t / temperature)


def annealed_merge(
    local: np.ndarray,
    global_model: np.ndarray,
    t: float,
    *,
    temperature: float,
    mix: float,
    rng: np.random.Generator,
    granularity: str = "element",
    layout: Sequence[int] | None = None,
) -> np.ndarray:
    """Merge a device's last local model into the received aggregate.

    Returns ``global + (1 - mix) * u * (local - global)`` with
    ``u ~ Bernoulli(exp(-t/temperature))`` drawn per element, per tensor or once
    for the whole model.  ``mix = 1`` returns the aggregate (FedAvg's hard
    replacement).  Inputs are not modified.

    Parameters
    ----------
    layout : sequence of int, optional
        Sizes of the tensors in the flat vector; required for ``"tensor"``.
    """
    if not 0.0 <= mix <= 1.0:
        raise ConfigError("mix", f"must lie in [0, 1], got {mix!r}")
    if granularity not in GRANULARITIES:
        raise ConfigError("granularity", f"must be one of {GRANULARITIES}, got {granularity!r}")
    local = np.asarray(local, dtype=np.float32)
    zbar = np.asarray(global_model, dtype=np.float32)
    if local.shape != zbar.shape or local.ndim != 1:
        raise ShapeError(f"local {local.shape} and global {zbar.shape} must be equal 1-D vectors")
    p = acceptance_probability(t, temperature)
    if mix == 1.0 or p == 0.0:
        return zbar.copy()
    if granularity == "element":
        u = _element_mask(rng, zbar.size, p)
    elif granularity == "model":
        if not rng.random() < p:
            return zbar.copy()
        u = None
    else:
        if layout is None:
            raise ConfigError("layout", "granularity 'tensor' needs the tensor sizes")
        sizes = np.asarray(layout, dtype=np.int64)
        if sizes.sum() != zbar.size or (sizes <= 0).any():
            raise ShapeError(f"layout sizes sum to {sizes.sum()}, model has {zbar.size}")
        u = np.repeat(rng.random(sizes.size) < p, sizes)
    # zbar + (1 - mix) * u * (local - zbar), in place on one float32 buffer: no boolean
    # indexing (which gathers and scatters), 7x faster on a 100k-parameter model.
    out: np.ndarray = np.subtract(local, zbar)
    if u is not None:
        out *= u
    out *= np.float32(1.0 - mix)
    out += zbar
    return out


# Element masks compare one random byte per element with a threshold in steps of 1/256.
MASK_LEVELS = 256


def _element_mask(rng: np.random.Generator, size: int, p: float) -> np.ndarray | None:
    """Bernoulli(``p``) per element from 8 random bits each; None when every element is kept.

    The threshold is ``floor(256 p)`` or one more, chosen at random with the odds that make
    every element's probability exactly ``p`` over merges (within one merge it is a multiple
    of 1/256 next to ``p``).  Raw generator words, not floats: a float32 per element cost
    0.45 ms of a 0.50 ms merge at 100k parameters, these bytes 0.07 ms (bench/device_footprint.py).
    """
    scaled = p * MASK_LEVELS
    threshold = math.floor(scaled)
    if rng.random() < scaled - threshold:
        threshold += 1
    if threshold >= MASK_LEVELS:
        return None
    bits = rng.bit_generator.random_raw((size + 7) // 8).view(np.uint8)[:size]
    return bits < np.uint8(threshold)


def performance_gap(local_acc: float, global_acc: float) -> float:
    """Relative accuracy gap ``|h(z) - h(zbar)| / (h(zbar) + 1e-6)`` on held-out data."""
    for key, value in (("local_acc", local_acc), ("global_acc", global_acc)):
        if not (math.isfinite(value) and value >= 0):
            raise ConfigError(key, f"accuracy must be a finite number >= 0, got {value!r}")
    return abs(local_acc - global_acc) / (global_acc + GAP_GUARD)


def upload_probability(gap: float, nu: float) -> float:
    """Upload-gate probability ``q = exp(-nu * gap)``; ``nu = 0`` always uploads."""
    if not nu >= 0:
        raise ConfigError("nu", f"must be >= 0, got {nu!r}")
    if not gap >= 0:
        raise ConfigError("gap", f"must be >= 0, got {gap!r}")
    return math.exp(-nu * gap)
