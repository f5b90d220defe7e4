"""Fusion rules and server optimisers: pure numpy, validated, never mutating inputs.

Fusion rules turn a set of model vectors into one (SAFL eq. 3, FedGS internal
and external sync); server optimisers turn the fused pseudo-gradient into the
next global model (Reddi et al., "Adaptive Federated Optimization", ICLR 2021).
Both are registered by name.  FedProx's proximal term is device-side:
:func:`edge_client.trainers.proximal_step`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from edge_client.errors import ShapeError

__all__ = ["FUSION_RULES", "fedavg", "ida", "median", "trimmed_mean", "krum", "multi_krum"]

# Keeps IDA's inverse distance finite for an update equal to the mean.
IDA_GUARD = 1e-8


def _stack(models: Sequence[np.ndarray], weights: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    if not len(models):
        raise ShapeError("nothing to fuse: no models")
    if len(weights) != len(models):
        raise ShapeError(f"{len(models)} models but {len(weights)} weights")
    vectors = [np.asarray(v, dtype=np.float32) for v in models]
    if len({v.shape for v in vectors}) != 1 or vectors[0].ndim != 1:
        raise ShapeError(f"models must be equal-length 1-D vectors, got "
                         f"{sorted({v.shape for v in vectors})}")
    stack = np.stack(vectors)
    if not np.isfinite(stack).all():
        raise ShapeError("a model contains NaN or Inf")
    w = np.asarray(weights, dtype=np.float64)
    if not (np.isfinite(w).all() and (w >= 0).all() and w.sum() > 0):
        raise ShapeError(f"weights must be non-negative with a positive sum, got {w}")
    return stack, w


def fedavg(models: Sequence[np.ndarray], num_samples: Sequence[float]) -> np.ndarray:
    """Sample-weighted average ``sum_k (n_k / n) z_k`` (McMahan et al., 2017)."""
    stack, w = _stack(models, num_samples)
    return ((w / w.sum()) @ stack).astype(np.float32)


def ida(models: Sequence[np.ndarray], num_samples: Sequence[float]) -> np.ndarray:
    """Inverse-distance aggregation (Yeganeh et al., "Inverse Distance Aggregation", 2020).

    ``eta_k ∝ n_k / (||z_k - mean(z)|| + guard)``: outlying updates count less.
    """
    stack, w = _stack(models, num_samples)
    dist = np.linalg.norm(stack - stack.mean(axis=0), axis=1)
    eta = w / (dist + IDA_GUARD)
    return ((eta / eta.sum()) @ stack).astype(np.float32)


# Byzantine-robust rules: one compromised participant must not move the fused model far.
# They ignore the reported sample counts (a count is a claim), except Multi-Krum, which
# weights the updates it keeps by their (station-verified) counts.
TRIM_FRACTION = 0.2  # trimmed mean drops this share of values at each end (at least one)


def median(models: Sequence[np.ndarray], num_samples: Sequence[float]) -> np.ndarray:
    """Coordinate-wise median (Yin et al., "Byzantine-Robust Distributed Learning", ICML 2018)."""
    stack, _ = _stack(models, num_samples)
    return np.median(stack, axis=0).astype(np.float32)


def trimmed_mean(models: Sequence[np.ndarray], num_samples: Sequence[float]) -> np.ndarray:
    """Coordinate-wise mean after dropping the ``TRIM_FRACTION`` largest and smallest values
    (Yin et al., 2018); with three or more models at least one is dropped at each end."""
    stack, _ = _stack(models, num_samples)
    n = len(stack)
    k = max(1, int(TRIM_FRACTION * n)) if n >= 3 else 0
    return np.sort(stack, axis=0)[k:n - k].mean(axis=0, dtype=np.float64).astype(np.float32)


def _krum_scores(stack: np.ndarray) -> tuple[np.ndarray, int]:
    """Krum scores: each model's summed squared distance to its ``n - f - 2`` nearest others,
    with ``f = (n - 3) // 2`` the most Byzantine models Krum tolerates among ``n``."""
    n = len(stack)
    f = max(0, (n - 3) // 2)
    s64 = stack.astype(np.float64)
    sq = (s64 * s64).sum(axis=1)
    dist = np.maximum(sq[:, None] + sq[None, :] - 2.0 * (s64 @ s64.T), 0.0)
    np.fill_diagonal(dist, np.inf)
    k = max(1, n - f - 2)
    nearest = np.sort(dist, axis=1)[:, :min(k, n - 1)] if n > 1 else np.zeros((1, 1))
    return nearest.sum(axis=1), f


def krum(models: Sequence[np.ndarray], num_samples: Sequence[float]) -> np.ndarray:
    """The one model closest to its neighbours (Blanchard et al., "Machine Learning with
    Adversaries: Byzantine Tolerant Gradient Descent", NeurIPS 2017)."""
    stack, _ = _stack(models, num_samples)
    scores, _ = _krum_scores(stack)
    return stack[int(np.argmin(scores))].copy()


def multi_krum(models: Sequence[np.ndarray], num_samples: Sequence[float]) -> np.ndarray:
    """FedAvg over the ``n - f`` best Krum scores (Blanchard et al., 2017; El Mhamdi et al.,
    2018)."""
    stack, w = _stack(models, num_samples)
    scores, f = _krum_scores(stack)
    keep = np.argsort(scores, kind="stable")[:len(stack) - f]
    return fedavg(stack[keep], w[keep] if w[keep].sum() > 0 else np.ones(len(keep)))


FUSION_RULES: dict[str, Callable[[Sequence[np.ndarray], Sequence[float]], np.ndarray]] = {
    "fedavg": fedavg,
    "ida": ida,
    "median": median,
    "trimmed_mean": trimmed_mean,
    "krum": krum,
    "multi_krum": multi_krum,
}
