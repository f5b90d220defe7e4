"""``InferenceConfig``: the ``[inference]`` table, how the device serves its model on the
stream and scores it prequentially (``edge_client/inference.py``)."""

from __future__ import annotations

import dataclasses

from ..errors import ConfigError
from .loading import check_range

__all__ = ["InferenceConfig", "PROMOTE"]

PROMOTE = ("not_worse", "always")


@dataclasses.dataclass(frozen=True, kw_only=True)
class InferenceConfig:
    """Predictions of the deployable model on the samples a source delivers.

    ``fps`` caps predictions per second (0: every sample); ``every`` predicts one sample in
    that many (the simulator's knob: it has no seconds).  ``max_batch`` bounds the frames
    predicted per loop turn: a backlog beyond it is skipped (``inference_skipped``) so that
    inference never holds training up.  ``window`` labelled samples make the prequential
    accuracy.  ``publish`` sends each prediction on the device's ``predictions`` topic;
    ``jsonl`` also appends them to that file ("": no file).  ``promote`` decides which
    model the line uses (``edge_client/promotion.py``): "not_worse" puts a candidate into
    use only if its accuracy on the last ``promote_window`` labelled samples is at least
    the deployed model's less ``promote_margin``, and scores one candidate in
    ``promote_every`` station iterations (the newest when labelled samples next arrive
    once they have passed, and beside a selected device's merge the broadcast it merged,
    the better of the two going in; a candidate costs a forward pass over the window, the
    rest are passed over); "always" uses every model that arrives.  ``budget`` is the share of the
    device's time its predictions and shadow scores may take (``PredictionBudget``).
    """

    enabled: bool = True  # predict on every sample the source delivers
    fps: float = 0.0
    every: int = 1
    max_batch: int = 64
    window: int = 500
    publish: bool = True
    jsonl: str = ""
    # which model the line uses: "not_worse" (safe promotion) or "always"
    promote: str = "not_worse"
    promote_window: int = 200  # labelled samples a candidate is scored on against the model in use
    promote_margin: float = 0.02  # how much worse than the model in use a candidate may score
    promote_every: int = 10  # station iterations between two candidates scored
    # share of the device's time its predictions and shadow scores may take; beyond it
    # samples go unpredicted (inference.over_budget), so a slow board keeps training (1: all)
    budget: float = 0.5
    # predict with the device's own head: the federation's ridge head pulled toward the
    # frames this device trained on (edge_client/personal_head.py), through safe promotion;
    # training and uploads keep the federation's head.  Needs head_init = "ridge".
    personal: bool = False

    def __post_init__(self) -> None:
        check_range("fps", self.fps, 0)
        check_range("every", self.every, 1)
        check_range("max_batch", self.max_batch, 1)
        check_range("window", self.window, 1)
        if self.promote not in PROMOTE:
            raise ConfigError("promote", f"must be one of {PROMOTE}, got {self.promote!r}")
        check_range("promote_window", self.promote_window, 1)
        check_range("promote_margin", self.promote_margin, 0, 1)
        check_range("promote_every", self.promote_every, 1)
        check_range("budget", self.budget, 0, 1, low_open=True)
