"""Inference on the stream: what the deployable model says about each sample, and the
prequential (test-then-train) accuracy of those predictions.

Prequential evaluation, as in MOA and river: every labelled sample is predicted before it
is trained on, and scored when its label is known, so accuracy is measured on the data the
device sees next with nothing held back.  :class:`Prequential` keeps the last ``window``
scores, overall and per class; :func:`predict` is the one forward pass, through the
trainer interface every backend implements; :class:`PredictionBudget` keeps a slow board's
predictions and shadow scores to a share of its time, and :class:`FallingBehind` says when
that leaves the line without most of its predictions.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .trainers import Trainer

__all__ = ["Prequential", "PredictionBudget", "FallingBehind", "predict", "one_in",
           "NOT_PREDICTED"]

log = logging.getLogger(__name__)

NOT_PREDICTED = -1  # a sample's prediction slot when it was skipped (fps, backlog, no model)


def one_in(every: int, first: int, n: int) -> np.ndarray:
    """Indices among ``n`` arrivals, numbered from ``first``, of those predicted when one
    sample in ``every`` is (``[inference] every``)."""
    return np.flatnonzero((first + np.arange(n)) % every == 0)


def predict(trainer: Trainer, x: np.ndarray, weights: np.ndarray,
            allowed: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Predicted classes and their softmax confidences for ``x`` under ``weights``, among
    the ``allowed`` classes only (the fleet's products less the retired: catalogue.py)."""
    logits = np.asarray(trainer.logits(x, weights), dtype=np.float64)
    if allowed is not None:
        logits[:, ~allowed] = -np.inf
    shifted = logits - logits.max(axis=1, keepdims=True)
    probs = np.exp(shifted)
    probs /= probs.sum(axis=1, keepdims=True)
    labels = probs.argmax(axis=1)
    return labels.astype(np.int64), probs[np.arange(len(labels)), labels]


class PredictionBudget:
    """The share of a device's time its line may spend in forward passes of its own.

    Profiled under emulation (an arm64 Pi running the numpy ``small_cnn``), a device spent
    73% of its time predicting every replayed sample, 16% scoring candidates in shadow and
    3% training: its replies came too late for every deadline and its inbox fell behind.
    Credit accrues at ``share`` seconds per second of wall time (at most ``BURST`` seconds
    of it kept); a prediction costs what the last ones cost a sample, a shadow score what
    it took (the line's debt where it took more than was left).  Samples beyond the credit
    go unpredicted, the newest kept, so training keeps pace; ``share`` 1: no limit.
    """

    BURST = 2.0  # seconds of credit a quiet spell may save: no long stall later

    def __init__(self, share: float, clock: Callable[[], float] = time.perf_counter) -> None:
        self.share, self.clock = share, clock
        self.credit = self.BURST
        self._at: float | None = None
        self._per_sample = 0.0  # seconds a prediction took a sample, last measured

    @property
    def limited(self) -> bool:
        return self.share < 1.0

    def affordable(self, n: int) -> int:
        """How many of ``n`` predictions the credit pays for now (all, unlimited)."""
        if not self.limited:
            return n
        now = self.clock()
        if self._at is not None:
            self.credit = min(self.BURST, self.credit + self.share * (now - self._at))
        self._at = now
        if self.credit <= 0:
            return 0
        return n if self._per_sample <= 0 else min(n, int(self.credit / self._per_sample))

    def charge(self, seconds: float, samples: int = 0) -> None:
        """Forward passes that took ``seconds`` (``samples`` predictions, whose cost sets
        the next estimate; 0 for a shadow score)."""
        if samples:
            self._per_sample = seconds / samples
        if self.limited:
            self.credit -= seconds


class FallingBehind:
    """The share of the frames chosen for a prediction that went unpredicted over the last
    ``WINDOW`` seconds (``predictions_behind``), said at warning level when it passes
    ``BEHIND`` and at info when it is back under: a camera the line hears too little from
    (a personal head solved on the prediction path once starved two cameras' predictions,
    34 and 0 in 9 minutes, with nothing logged)."""

    WINDOW = 60.0
    BEHIND = 0.5  # a camera predicting fewer than half the frames it was asked to

    def __init__(self, name: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.name, self.clock = name, clock
        self.share = 0.0  # of the last whole window
        self._start: float | None = None
        self._chosen = self._skipped = 0

    def note(self, chosen: int, skipped: int) -> None:
        now = self.clock()
        if self._start is None:
            self._start = now
        self._chosen += chosen
        self._skipped += skipped
        if now - self._start < self.WINDOW:
            return
        was, self.share = self.share, self._skipped / max(self._chosen, 1)
        if self.share > self.BEHIND >= was:
            log.warning("device %s: its predictions fall behind the camera: %d of the %d "
                        "frames of the last %.0f s went unpredicted, over its [inference] "
                        "budget", self.name, self._skipped, self._chosen, now - self._start)
        elif was > self.BEHIND >= self.share:
            log.info("device %s: its predictions keep up with the camera again",
                     self.name)
        self._start, self._chosen, self._skipped = now, 0, 0


class Prequential:
    """Sliding-window accuracy of predictions made before training, overall and per class."""

    def __init__(self, window: int, num_classes: int) -> None:
        self.window, self.num_classes = window, num_classes
        self._labels = np.zeros(window, dtype=np.int64)
        self._hits = np.zeros(window, dtype=bool)
        self._written = 0  # scores ever taken; the ring holds the last ``window``
        self.hits = 0  # of the scores ever taken, those right

    def score(self, y: np.ndarray, predicted: np.ndarray) -> int:
        """Score the predictions of labelled samples (slots of ``NOT_PREDICTED`` are left
        out); returns how many were scored."""
        y, predicted = np.asarray(y), np.asarray(predicted)
        keep = predicted != NOT_PREDICTED
        y, hits = y[keep], predicted[keep] == y[keep]
        self.hits += int(hits.sum())
        self._written += len(y)
        tail = min(len(y), self.window)  # what the ring keeps of them
        pos = (self._written - tail + np.arange(tail)) % self.window
        self._labels[pos], self._hits[pos] = y[len(y) - tail:], hits[len(y) - tail:]
        return len(y)

    def reported(self) -> dict[str, Any]:
        """What a device's stats carry of it: the window's accuracy and size, and the scores
        and hits since it started (its station's drift watch, aggregator/drift.py)."""
        return {"prequential_accuracy": self.accuracy if self.samples else 0.0,
                "prequential_samples": self.samples, "prequential_scored": self.scored,
                "prequential_hits": self.hits}

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
