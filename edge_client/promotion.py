"""Safe promotion: which model a device predicts with on its line.

Every model a device could deploy (its station's broadcast, the aggregate after its own
annealed merge) is a *candidate*.  With ``[inference] promote = "not_worse"`` a candidate
is scored in shadow on the device's last ``promote_window`` labelled samples (or on its
held-out slice while fewer than :data:`MIN_EVIDENCE` have arrived) beside the deployed
model, and goes into use only if its accuracy there is at least the deployed model's less
``promote_margin``; otherwise the line keeps the deployed model and the refusal is counted
and logged.  The deployed model's hits on the window are kept, so a candidate costs one
forward pass over the window: the deployed model's are paid once, when it was promoted,
and for each sample that arrives after, by its prediction on arrival where one was made.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from .inference import NOT_PREDICTED, predict
from .trainers import Trainer

__all__ = ["ShadowWindow", "Verdict", "judge_on", "MIN_EVIDENCE"]

log = logging.getLogger(__name__)

MIN_EVIDENCE = 32  # labelled samples below which a comparison says too little to act on
CHUNK = 32  # samples a shadow forward pass takes at once: a CNN's buffers grow with it
_UNKNOWN = -1  # a window slot the deployed model has not predicted


@dataclass(frozen=True)
class Verdict:
    """A candidate's shadow score: whether it goes into use, its accuracy and the deployed
    model's on the same ``samples`` (None where nothing was compared)."""

    promoted: bool
    shadow_accuracy: float | None = None
    deployed_accuracy: float | None = None
    samples: int = 0


class ShadowWindow:
    """The last ``size`` labelled samples and the deployed model's hits on them."""

    def __init__(self, size: int, sample_shape: tuple[int, ...]) -> None:
        self.size = size
        self._x = np.zeros((size, *sample_shape), dtype=np.float32)
        self._y = np.zeros(size, dtype=np.int64)
        self._hits = np.full(size, _UNKNOWN, dtype=np.int8)
        self._written = 0

    def __len__(self) -> int:
        return min(self._written, self.size)

    def add(self, x: np.ndarray, y: np.ndarray, predicted: np.ndarray | None) -> None:
        """Samples that arrived labelled, with the deployed model's predictions on arrival
        (``NOT_PREDICTED`` or None where it made none)."""
        x, y = x[-self.size:], np.asarray(y)[-self.size:]
        hits = np.full(len(y), _UNKNOWN, dtype=np.int8)
        if predicted is not None:
            p = np.asarray(predicted)[-self.size:]
            hits = np.where(p == NOT_PREDICTED, _UNKNOWN, (p == y).astype(np.int8))
        pos = (self._written + np.arange(len(y))) % self.size
        self._x[pos], self._y[pos], self._hits[pos] = x, y, hits
        self._written += len(y)

    def judge(self, trainer: Trainer, candidate: np.ndarray, deployed: np.ndarray,
              margin: float) -> Verdict:
        """Score ``candidate`` on the window beside ``deployed`` (whose unknown hits are
        filled in first); a promoted candidate's hits become the deployed model's."""
        n = len(self)
        x, y, hits = self._x[:n], self._y[:n], self._hits[:n]
        unknown = np.flatnonzero(hits == _UNKNOWN)
        if len(unknown):
            hits[unknown] = _classes(trainer, x[unknown], deployed) == y[unknown]
        shadow = _classes(trainer, x, candidate) == y
        verdict = _verdict(float(shadow.mean()), float(hits.mean()), margin, n)
        if verdict.promoted:
            hits[:] = shadow
        return verdict


def judge_on(trainer: Trainer, x: np.ndarray, y: np.ndarray, candidate: np.ndarray,
             deployed: np.ndarray, margin: float) -> Verdict:
    """Score ``candidate`` beside ``deployed`` on samples kept for nothing else (the
    held-out slice)."""
    shadow = float(np.mean(_classes(trainer, x, candidate) == y))
    return _verdict(shadow, float(np.mean(_classes(trainer, x, deployed) == y)), margin,
                    len(y))


def _classes(trainer: Trainer, x: np.ndarray, weights: np.ndarray) -> np.ndarray:
    return np.concatenate([predict(trainer, x[i:i + CHUNK], weights)[0]
                           for i in range(0, len(x), CHUNK)])


def _verdict(shadow: float, deployed: float, margin: float, n: int) -> Verdict:
    return Verdict(shadow >= deployed - margin, shadow, deployed, n)
