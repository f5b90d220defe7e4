"""Inference on the stream: what the deployable model says about each sample, and the
prequential (test-then-train) accuracy of those predictions.

Prequential evaluation, as in MOA and river: every labelled sample is predicted before it
is trained on, and scored when its label is known, so accuracy is measured on the data the
device sees next with nothing held back.  :class:`Prequential` keeps the last ``window``
scores, overall and per class; :func:`predict` is the one forward pass, through the
trainer interface every backend implements.
"""

from __future__ import annotations

import numpy as np

from .trainers import Trainer

__all__ = ["Prequential", "predict", "one_in", "NOT_PREDICTED"]

NOT_PREDICTED = -1  # a sample's prediction slot when it was skipped (fps, backlog, no model)


def one_in(every: int, first: int, n: int) -> np.ndarray:
    """Indices among ``n`` arrivals, numbered from ``first``, of those predicted when one
    sample in ``every`` is (``[inference] every``)."""
    return np.flatnonzero((first + np.arange(n)) % every == 0)


def predict(trainer: Trainer, x: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray,
                                                                          np.ndarray]:
    """Predicted classes and their softmax confidences for ``x`` under ``weights``."""
    logits = np.asarray(trainer.logits(x, weights), dtype=np.float64)
    shifted = logits - logits.max(axis=1, keepdims=True)
    probs = np.exp(shifted)
    probs /= probs.sum(axis=1, keepdims=True)
    labels = probs.argmax(axis=1)
    return labels.astype(np.int64), probs[np.arange(len(labels)), labels]


class Prequential:
    """Sliding-window accuracy of predictions made before training, overall and per class."""

    def __init__(self, window: int, num_classes: int) -> None:
        self.window, self.num_classes = window, num_classes
        self._labels = np.zeros(window, dtype=np.int64)
        self._hits = np.zeros(window, dtype=bool)
        self._written = 0  # scores ever taken; the ring holds the last ``window``

    def score(self, y: np.ndarray, predicted: np.ndarray) -> int:
        """Score the predictions of labelled samples (slots of ``NOT_PREDICTED`` are left
        out); returns how many were scored."""
        y, predicted = np.asarray(y), np.asarray(predicted)
        keep = predicted != NOT_PREDICTED
        y, hits = y[keep][-self.window:], (predicted[keep] == y[keep])[-self.window:]
        pos = (self._written + np.arange(len(y))) % self.window
        self._labels[pos], self._hits[pos] = y, hits
        self._written += len(y)
        return len(y)

    @property
    def samples(self) -> int:
        """Scores in the window."""
        return min(self._written, self.window)

    @property
    def scored(self) -> int:
        """Scores ever taken."""
        return self._written

    @property
    def accuracy(self) -> float:
        """Accuracy over the window (NaN before the first score)."""
        n = self.samples
        return float(self._hits[:n].mean()) if n else float("nan")

    def per_class(self) -> np.ndarray:
        """Accuracy per true class over the window (NaN for a class not in it)."""
        n = self.samples
        seen = np.bincount(self._labels[:n], minlength=self.num_classes)
        hits = np.bincount(self._labels[:n], weights=self._hits[:n], minlength=self.num_classes)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(seen > 0, hits / np.maximum(seen, 1), np.nan)
