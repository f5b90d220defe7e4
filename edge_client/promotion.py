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

Judging is lazy (:class:`Promoter`): a candidate waits as the pending one until the next
labelled samples or the next broadcast, and a newer candidate replaces it unscored, so one
score is paid in ``promote_every`` station iterations.  One newer candidate does not: a
selected device's merged model is scored beside the broadcast it was merged from, and the
better of the two is the candidate.  Judged alone, the merge could keep the broadcast off
the line: a camera line's devices step a solved head on label bursts of one or two
classes, and their own models and the merges that keep part of them (the annealed merge,
early on) predicted one class (docs/sources.md, "Safe promotion").
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from . import messages as m
from .config import InferenceConfig
from .inference import NOT_PREDICTED, predict
from .trainers import Trainer

__all__ = ["MIN_EVIDENCE", "Promoter", "ShadowWindow", "Verdict", "judge_on"]

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
    choice: int = 0  # which of the candidates scored together was the better


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

    def judge(self, trainer: Trainer, candidates: Sequence[np.ndarray], deployed: np.ndarray,
              margin: float, affordable: Callable[[int], int] = lambda n: n) -> Verdict:
        """Score ``candidates`` beside ``deployed`` on the window's samples whose deployed
        hits are known, after filling in as many unknown ones (the newest first) as
        ``affordable`` pays for (all of them where nothing limits the line), and up to
        :data:`MIN_EVIDENCE` known in any case.  A slow board predicts few
        samples on arrival, and filling in the rest doubled each shadow score's cost.  The
        verdict is the better candidate's (the first on a tie); a promoted candidate's hits
        become the deployed model's."""
        n = len(self)
        x, y, hits = self._x[:n], self._y[:n], self._hits[:n]
        unknown = self._newest_first(np.flatnonzero(hits == _UNKNOWN))
        known = n - len(unknown)
        fill = max(affordable(len(unknown)), min(MIN_EVIDENCE, n) - known)
        if fill:
            some = unknown[:fill]
            hits[some] = _classes(trainer, x[some], deployed) == y[some]
        scored = np.flatnonzero(hits != _UNKNOWN)
        choice, shadow = _better(trainer, x[scored], y[scored], candidates)
        verdict = _verdict(float(shadow.mean()), float(hits[scored].mean()), margin,
                           len(scored), choice)
        if verdict.promoted:
            hits[:] = _UNKNOWN
            hits[scored] = shadow
        return verdict

    def _newest_first(self, slots: np.ndarray) -> np.ndarray:
        """Ring ``slots`` ordered from the most recently written back."""
        age = (self._written - 1 - slots) % self.size
        return slots[np.argsort(age, kind="stable")]


def judge_on(trainer: Trainer, x: np.ndarray, y: np.ndarray,
             candidates: Sequence[np.ndarray], deployed: np.ndarray, margin: float) -> Verdict:
    """Score ``candidates`` beside ``deployed`` on samples kept for nothing else (the
    held-out slice); the verdict is the better candidate's."""
    choice, shadow = _better(trainer, x, y, candidates)
    return _verdict(float(shadow.mean()), float(np.mean(_classes(trainer, x, deployed) == y)),
                    margin, len(y), choice)


def _better(trainer: Trainer, x: np.ndarray, y: np.ndarray, candidates: Sequence[np.ndarray]
            ) -> tuple[int, np.ndarray]:
    """The candidate that classifies more of ``x`` right (the first on a tie), and its hits."""
    hits = [_classes(trainer, x, c) == y for c in candidates]
    choice = int(np.argmax([h.mean() for h in hits]))
    return choice, hits[choice]


def _classes(trainer: Trainer, x: np.ndarray, weights: np.ndarray) -> np.ndarray:
    return np.concatenate([predict(trainer, x[i:i + CHUNK], weights)[0]
                           for i in range(0, len(x), CHUNK)])


def _verdict(shadow: float, deployed: float, margin: float, n: int, choice: int = 0
             ) -> Verdict:
    return Verdict(shadow >= deployed - margin, shadow, deployed, n, choice)


Holdout = Callable[[], tuple[np.ndarray, np.ndarray]]


class Promoter:
    """The candidates a device is offered, which one is judged when, and the verdicts.

    ``offer`` keeps the newest candidate; ``judge`` scores it once ``promote_every``
    station iterations have passed since the last score (a final model, or one offered
    while nothing is deployed, at once) and returns it where it goes into use.
    """

    def __init__(self, config: InferenceConfig, sample_shape: tuple[int, ...],
                 counters: Counter[str], name: str) -> None:
        self.config, self.counters, self.name = config, counters, name
        self.window = (ShadowWindow(config.promote_window, sample_shape)
                       if config.promote == "not_worse" else None)
        self.last_verdict = Verdict(True)
        # The candidate's model, its weights (a merge's, then its broadcast's) and merged
        self._pending: tuple[m.StationModel, list[np.ndarray], bool] | None = None
        self._scored_at = -1 << 62  # station iteration of the last scored candidate
        self._refused_in_a_row = 0
        # What a candidate becomes before it is judged: the device's personal head beside
        # it ([inference] personal, personal_head.py), paid once per candidate scored.
        self.personalise: Callable[[np.ndarray], np.ndarray] | None = None

    def offer(self, model: m.StationModel, weights: np.ndarray, deployed: bool,
              merged: bool = False) -> bool:
        """``weights`` of ``model``'s round (a broadcast, or, ``merged``, the device's merge
        of it) are the newest candidate; an older one not yet judged is passed over, but
        for the broadcast a merge came from, which is scored beside it (see the module).
        Whether to judge it at once: nothing to compare (no window, nothing ``deployed``)
        or a final model."""
        beside: list[np.ndarray] = []
        if self._pending is not None:
            was, kept, was_merged = self._pending
            if merged and not was_merged and was.iteration == model.iteration:
                beside = kept
            else:
                self.counters["promotions.waiting"] += 1
        self._pending = (model, [weights, *beside], merged)
        return self.window is None or not deployed or model.final

    def judge(self, trainer: Trainer, deployed: np.ndarray | None, holdout: Holdout,
              affordable: Callable[[int], int] = lambda n: n
              ) -> tuple[m.StationModel, np.ndarray] | None:
        """Score the pending candidate if it is due; the candidate where it is promoted.
        ``affordable``: how many of the window's unknown deployed hits may be filled in."""
        if self._pending is None:
            return None
        model, candidates, merged = self._pending
        scored = self.window is not None and deployed is not None
        # The merge of an iteration whose broadcast was judged already is due as well:
        # samples that came between the two must not keep the device's own model out.
        if scored and not model.final and not (merged and model.iteration == self._scored_at) \
                and 0 <= model.iteration - self._scored_at < self.config.promote_every:
            return None
        self._pending = None
        if self.personalise is not None:
            candidates = [self.personalise(w) for w in candidates]
        if scored:
            self._scored_at = model.iteration
        verdict = self.last_verdict = (self._verdict(trainer, candidates, deployed, holdout,
                                                     affordable)
                                       if deployed is not None and scored else Verdict(True))
        if verdict.promoted:
            self.counters["promotions"] += 1
            # the broadcast scored better than the device's merge of it
            self.counters["promotions.broadcast_over_merge"] += verdict.choice > 0
            self._refused_in_a_row = 0
            return model, candidates[verdict.choice]
        self.counters["promotions_refused"] += 1
        self._refused_in_a_row += 1
        say = log.warning if self._refused_in_a_row == 1 else log.debug  # once a streak
        say("device %s: the model of round %d (iteration %d)%s scored %.3f on %d recent "
            "samples, the deployed one %.3f: the line keeps the deployed one", self.name,
            model.round, model.iteration,
            " (the better of its merge and the broadcast)" if len(candidates) > 1 else "",
            verdict.shadow_accuracy, verdict.samples, verdict.deployed_accuracy)
        return None

    def _verdict(self, trainer: Trainer, candidates: list[np.ndarray], deployed: np.ndarray,
                 holdout: Holdout, affordable: Callable[[int], int]) -> Verdict:
        """On the recent labelled samples, or the held-out slice while too few have
        arrived; promoted unscored where no evidence exists (``promotions.unscored``)."""
        assert self.window is not None
        margin = self.config.promote_margin
        if len(self.window) >= min(MIN_EVIDENCE, self.window.size):
            return self.window.judge(trainer, candidates, deployed, margin, affordable)
        hx, hy = holdout()
        if len(hy) >= MIN_EVIDENCE:
            return judge_on(trainer, hx, hy, candidates, deployed, margin)
        self.counters["promotions.unscored"] += 1
        return Verdict(True)
