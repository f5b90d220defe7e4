"""A trainer held to a slower board's pace, for field rehearsals on a faster machine.

A rehearsal of a fleet of Raspberry Pis on one x86 server (``lab/relay.py``'s check of the
virtual clock) needs devices that take a Pi's time per step.  :class:`PacedTrainer` wraps
any backend and sleeps out what is left of each call's budget: ``step_s`` per local step of
:data:`REFERENCE_BATCH` samples, a third of that per sample for a forward pass (evaluation,
prediction), as ``lab/clock.py`` prices them.  It can only slow a trainer down: a call that
already took longer than its budget returns at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .base import Trainer

__all__ = ["PacedTrainer", "REFERENCE_BATCH"]

REFERENCE_BATCH = 32  # lab/clock.py's profiles are per step of this many samples
FORWARD_SHARE = 1 / 3  # a forward pass against a training step (forward, backward, update)


class PacedTrainer:
    """``trainer``, each call taking at least its share of ``step_s`` (see the module)."""

    def __init__(self, trainer: Trainer, step_s: float,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.inner = trainer
        self.layout = trainer.layout
        self.per_sample = step_s / REFERENCE_BATCH
        self.sleep = sleep
        self.padded_s = 0.0  # slept in all: what the rehearsal added to the real compute

    @property
    def lr(self) -> float:
        return self.inner.lr

    @lr.setter
    def lr(self, value: float) -> None:
        self.inner.lr = value

    @property
    def num_params(self) -> int:
        return self.inner.num_params

    def get_flat(self) -> np.ndarray:
        return self.inner.get_flat()

    def set_flat(self, flat: np.ndarray) -> None:
        self.inner.set_flat(flat)

    def train_step(self, x: np.ndarray, y: np.ndarray) -> float:
        return self._paced(len(x), lambda: self.inner.train_step(x, y))

    def logits(self, x: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
        return self._paced(len(x) * FORWARD_SHARE, lambda: self.inner.logits(x, weights))

    def evaluate(self, x: np.ndarray, y: np.ndarray,
                 weights: np.ndarray | None = None) -> tuple[float, float]:
        return self._paced(len(x) * FORWARD_SHARE, lambda: self.inner.evaluate(x, y, weights))

    def _paced(self, samples: float, call: Callable[[], Any]) -> Any:
        started = time.perf_counter()
        out = call()
        left = samples * self.per_sample - (time.perf_counter() - started)
        if left > 0:
            self.padded_s += left
            self.sleep(left)
        return out
