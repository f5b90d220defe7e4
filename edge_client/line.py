"""The line: the model a device predicts with, how its predictions are scored, and which
candidate replaces it.

A device trains one model and serves another: the *deployable* model, the last candidate
safe promotion put into use (``promotion.py``).  :class:`Line` owns it, predicts with it,
scores the predictions it made on arrival once their labels come (prequential accuracy,
``inference.py``) and offers it each candidate; the device only says what arrived.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

import numpy as np

from . import messages as m
from .config import InferenceConfig
from .inference import (
    NOT_PREDICTED,
    FallingBehind,
    PredictionBudget,
    Prequential,
    one_in,
    predict,
)
from .promotion import Promoter, Verdict
from .trainers import Trainer

__all__ = ["Line"]


class Line:
    """The deployable model of one device, its predictions and its promotions."""

    def __init__(self, inference: InferenceConfig | None, trainer: Trainer, *,
                 num_classes: int, sample_shape: tuple[int, ...], counters: Counter[str],
                 name: str, holdout: Callable[[], tuple[np.ndarray, np.ndarray]]) -> None:
        self.inference, self.trainer, self.counters = inference, trainer, counters
        self._holdout = holdout
        self.prequential = (Prequential(inference.window, num_classes)
                            if inference is not None and inference.enabled else None)
        # The model the line predicts with: the last candidate promoted (a broadcast, or
        # the aggregate after the annealed merge when selected).  Its round, for whoever
        # acts on a prediction.
        self.deployable: np.ndarray | None = None
        self.deployable_round = self.deployable_iteration = 0
        # Candidates are judged against it on the recent labelled samples.
        self.promoter = (Promoter(inference, sample_shape, counters, name)
                         if inference is not None else None)
        self.last_inference_s = 0.0  # per sample, of the last prediction
        self.budget = PredictionBudget(inference.budget if inference is not None else 1.0)
        self.behind = FallingBehind(name)
        self.allowed: np.ndarray | None = None  # the classes it may name (catalogue.py)

    @property
    def last_verdict(self) -> Verdict:
        """The last candidate's shadow score (promoted unscored where none was taken)."""
        return self.promoter.last_verdict if self.promoter is not None else Verdict(True)

    def infer(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """The deployable model's classes and confidences for ``x`` (None before any model
        arrived: an untrained model's guesses would be scored and acted on)."""
        if self.deployable is None:
            self.counters["inference.no_model"] += len(x)
            return None
        self.counters["predictions"] += len(x)
        started = time.perf_counter()
        out = predict(self.trainer, x, self.deployable, self.allowed)
        took = time.perf_counter() - started
        self.last_inference_s = took / max(1, len(x))
        self.budget.charge(took, len(x))
        return out

    def within_budget(self, chosen: np.ndarray) -> np.ndarray:
        """The newest of the ``chosen`` sample indices the prediction budget pays for; the
        rest are counted (``inference.over_budget``) and go unpredicted."""
        n = self.budget.affordable(len(chosen)) if len(chosen) else 0
        self.behind.note(len(chosen), len(chosen) - n)
        if n < len(chosen):
            self.counters["inference.over_budget"] += len(chosen) - n
            chosen = chosen[len(chosen) - n:]
        return chosen

    def predict_every(self, x: np.ndarray, seen: int) -> np.ndarray:
        """Predictions of one sample in ``[inference] every`` of ``x`` (``seen`` samples
        came before it), ``NOT_PREDICTED`` elsewhere."""
        predicted = np.full(len(x), NOT_PREDICTED, dtype=np.int64)
        every = self.inference.every if self.inference is not None else 1
        chosen = self.within_budget(one_in(every, seen, len(x)))
        if len(chosen):
            out = self.infer(x[chosen])
            if out is not None:
                predicted[chosen] = out[0]
        return predicted

    def take(self, x: np.ndarray, y: np.ndarray, predicted: np.ndarray | None) -> None:
        """Labelled samples the device accepted, with the predictions made on arrival: the
        shadow window and the prequential score take them, and a pending candidate that is
        due is judged on them."""
        if self.promoter is not None and self.promoter.window is not None:
            self.promoter.window.add(x, y, predicted)
            self.promote()
        if self.prequential is not None and predicted is not None:
            self.counters["prequential.scored"] += self.prequential.score(y, predicted)

    def offer(self, model: m.StationModel, weights: np.ndarray, merged: bool = False) -> None:
        """Offer ``weights`` (of ``model``'s round; a broadcast, or, ``merged``, the
        device's own start from it) as the newest candidate."""
        if self.promoter is not None \
                and self.promoter.offer(model, weights, self.deployable is not None, merged):
            self.promote()

    def promote(self) -> None:
        """Judge the pending candidate where it is due, and put it into use if it won."""
        if self.promoter is None:
            return
        started = time.perf_counter()
        won = self.promoter.judge(self.trainer, self.deployable, self._holdout,
                                  self.budget.affordable)
        self.budget.charge(time.perf_counter() - started)
        if won is not None:
            model, weights = won
            self.restore(model.round, model.iteration, weights)

    def restore(self, round_: int, iteration: int, weights: np.ndarray) -> None:
        """Put ``weights`` into use (a promotion, or what a restart found on disk)."""
        self.deployable = weights
        self.deployable_round, self.deployable_iteration = round_, iteration

    def gauges(self) -> dict[str, float]:
        """Prequential accuracy overall and per class (the classes in the window), the
        per-frame inference time, the deployed round and the last shadow score."""
        pre = self.prequential
        if pre is None:
            return {}
        per = pre.per_class()
        verdict = self.last_verdict
        return {"prequential_accuracy": pre.accuracy,
                **{f"prequential_accuracy.class_{k}": float(a) for k, a in enumerate(per)
                   if a == a},
                "inference_seconds": self.last_inference_s,
                "deployed_round": self.deployable_round,
                **({"shadow_accuracy": verdict.shadow_accuracy,
                    "deployed_accuracy": float(verdict.deployed_accuracy or 0.0)}
                   if verdict.shadow_accuracy is not None else {})}
