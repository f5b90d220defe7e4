"""Fusion rules: pure numpy, validated, never mutating inputs.

Fusion rules turn a set of model vectors into one (SAFL eq. 3, FedGS internal and
external sync), registered by name in :data:`FUSION_RULES`; what the cloud then does with
the fused model is ``server_optimizers.py``'s.  A :class:`Fold` builds a rule's result one
update at a time, so a station or cloud need not keep every reply: FedAvg streams into a
running float32 sum; the other rules need every update at once and keep them.  FedProx's
proximal term is device-side: :func:`edge_client.trainers.proximal_step`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from edge_client.errors import ShapeError

__all__ = ["FUSION_RULES", "Fold", "WeightedSum", "Gathered", "fold_for", "fedavg", "ida",
           "median", "trimmed_mean", "krum", "multi_krum", "model_vector", "fold_weight"]

# Keeps IDA's inverse distance finite for an update equal to the mean.
IDA_GUARD = 1e-8


def model_vector(model: np.ndarray, shape: tuple[int, ...] | None) -> np.ndarray:
    v = np.asarray(model, dtype=np.float32)
    if v.ndim != 1 or (shape is not None and v.shape != shape):
        raise ShapeError(f"models must be equal-length 1-D vectors, got {v.shape}"
                         + ("" if shape is None else f" beside {shape}"))
    return v


def fold_weight(weight: float) -> float:
    w = float(weight)
    if not (math.isfinite(w) and w >= 0):
        raise ShapeError(f"a weight must be finite and non-negative, got {weight!r}")
    return w


class Fold:
    """A fusion rule's result built one update at a time: :meth:`add`, then :meth:`result`."""

    def add(self, model: np.ndarray, weight: float, key: str = "") -> None:
        raise NotImplementedError

    def result(self) -> np.ndarray:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    @property
    def total(self) -> float:
        """The sum of the weights added."""
        raise NotImplementedError


class WeightedSum(Fold):
    """``sum_k w_k z_k / sum_k w_k`` in one float32 pass, holding one vector whatever the count.

    The running vector is kept scaled by the last weight (``sum / w_last``), so an update is
    folded in place, ``acc *= w_last / w; acc += z``, with no scratch vector.  float32 is
    enough: against a float64 sum of 300 small-CNN updates it differs by about 3e-8
    (bench/fusion.py), and the order of arrival changes the result only at that rounding.
    ``equal_if_unweighted`` averages equally when every weight is zero (a cloud round in
    which no station consumed data) instead of refusing.
    """

    def __init__(self, *, equal_if_unweighted: bool = False) -> None:
        self._acc: np.ndarray | None = None  # sum_k w_k z_k / w_last
        self._plain: np.ndarray | None = None  # sum_k z_k, kept only while every weight is 0
        self._shape: tuple[int, ...] | None = None
        self._last = 0.0
        self._total = 0.0
        self._count = 0
        self._equal = equal_if_unweighted

    def add(self, model: np.ndarray, weight: float, key: str = "") -> None:
        v, w = model_vector(model, self._shape), fold_weight(weight)
        self._shape = v.shape
        self._count += 1
        if w == 0:
            if self._equal and self._acc is None:
                self._plain = v.copy() if self._plain is None else np.add(self._plain, v,
                                                                          out=self._plain)
            return
        if self._acc is None:
            self._acc, self._plain = v.copy(), None
        else:
            if w != self._last:
                self._acc *= np.float32(self._last / w)
            self._acc += v
        self._last = w
        self._total += w

    def result(self) -> np.ndarray:
        if not self._count:
            raise ShapeError("nothing to fuse: no models")
        if self._acc is not None:
            out = self._acc * np.float32(self._last / self._total)
        elif self._plain is not None:
            out = self._plain / np.float32(self._count)
        else:
            raise ShapeError("weights must be non-negative with a positive sum, got all zero")
        # Checked once here, not per update: messages arrive checked finite already.
        if not np.isfinite(out.sum()):
            raise ShapeError("a model contains NaN or Inf")
        return out

    def __len__(self) -> int:
        return self._count

    @property
    def total(self) -> float:
        return self._total


class Gathered(Fold):
    """Keeps every update for a rule that needs them all at once (IDA, median, trimmed mean,
    Krum); the result is independent of arrival order (sorted by ``key``)."""

    def __init__(self, rule: Callable[[Sequence[np.ndarray], Sequence[float]], np.ndarray], *,
                 equal_if_unweighted: bool = False) -> None:
        self._rule = rule
        self._items: list[tuple[str, np.ndarray, float]] = []
        self._equal = equal_if_unweighted

    def add(self, model: np.ndarray, weight: float, key: str = "") -> None:
        shape = self._items[0][1].shape if self._items else None
        self._items.append((key, model_vector(model, shape), fold_weight(weight)))

    def result(self) -> np.ndarray:
        items = sorted(self._items, key=lambda item: item[0])
        weights = [w for _, _, w in items]
        if self._equal and not any(weights):
            weights = [1.0] * len(items)
        return self._rule([v for _, v, _ in items], weights)

    def __len__(self) -> int:
        return len(self._items)

    @property
    def total(self) -> float:
        return sum(w for _, _, w in self._items)


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


def _weighted_sum(models: Sequence[np.ndarray] | np.ndarray,
                  weights: Sequence[float] | np.ndarray) -> np.ndarray:
    if len(weights) != len(models):
        raise ShapeError(f"{len(models)} models but {len(weights)} weights")
    fold = WeightedSum()
    for z, w in zip(models, weights, strict=True):
        fold.add(z, w)
    return fold.result()


def fedavg(models: Sequence[np.ndarray] | np.ndarray,
           num_samples: Sequence[float] | np.ndarray) -> np.ndarray:
    """Sample-weighted average ``sum_k (n_k / n) z_k`` (McMahan et al., 2017), streamed."""
    return _weighted_sum(models, num_samples)


def ida(models: Sequence[np.ndarray], num_samples: Sequence[float]) -> np.ndarray:
    """Inverse-distance aggregation (Yeganeh et al., "Inverse Distance Aggregation", 2020).

    ``eta_k ∝ n_k / (||z_k - mean(z)|| + guard)``: outlying updates count less.  Two passes
    over the kept updates, neither stacking them: the plain mean, then the weighted sum.
    """
    if len(num_samples) != len(models):
        raise ShapeError(f"{len(models)} models but {len(num_samples)} weights")
    mean = _weighted_sum(models, [1.0] * len(models))
    dist = np.array([np.linalg.norm(np.subtract(z, mean, dtype=np.float64)) for z in models])
    eta = np.asarray(num_samples, dtype=np.float64) / (dist + IDA_GUARD)
    return _weighted_sum(models, eta)


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


def fold_for(rule: str, *, equal_if_unweighted: bool = False) -> Fold:
    """The fold that builds ``FUSION_RULES[rule]``: streamed for FedAvg, gathered otherwise."""
    if rule == "fedavg":
        return WeightedSum(equal_if_unweighted=equal_if_unweighted)
    return Gathered(FUSION_RULES[rule], equal_if_unweighted=equal_if_unweighted)
