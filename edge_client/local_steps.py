"""A selected device's local training: the annealed merge it starts from, the SGD steps it
takes (with FedProx's term where asked), and the device-local accuracy it measures.

:class:`LocalModel` keeps the device's own last model, which SAFL's merge draws from
(SPEC §3), and its accuracy on the held-out slice; :class:`LocalSteps` is what one
selection is about to train, so that a simulator may run a super node's members at once.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from . import messages as m
from .buffer import StreamBuffer
from .config import DeviceConfig
from .safl import annealed_merge
from .trainers import Trainer, proximal_step

__all__ = ["LocalModel", "LocalSteps"]


@dataclass(frozen=True)
class LocalSteps:
    """The local steps a selected device is about to take: SGD at ``lr`` from ``start`` over
    ``batches`` (drawn from its buffer) after ``model`` came."""

    model: m.StationModel
    start: np.ndarray
    batches: list[tuple[np.ndarray, np.ndarray]]
    lr: float
    started: float  # perf_counter: a measurement for metrics, not an input to SAFL


class LocalModel:
    """The device's own model between selections, and what it measured of it."""

    def __init__(self, config: DeviceConfig, trainer: Trainer, buffer: StreamBuffer,
                 rng: np.random.Generator, counters: Counter[str]) -> None:
        self.config, self.trainer, self.buffer, self.counters = config, trainer, buffer, counters
        self.rng = rng  # the device's own: the merge masks draw between its gate draws
        self.weights: np.ndarray | None = None
        self.iteration = 0  # station iteration at which the weights were trained
        self.accuracy: tuple[float, int] = (0.0, 0)  # device-local accuracy, samples
        self._evaluated_at: int | None = None
        self._due: np.ndarray | None = None  # a start whose accuracy is to be measured
        self._tensor_sizes = [int(np.prod(shape)) for _, shape in trainer.layout]
        # Each round's closed-form solve replaces the whole model trained here (a linear
        # head on a frozen body, head_resolve = "every"): an upload would count for nothing,
        # the station's next model being the solve whatever the steps made of it (the
        # statistics, sent as samples arrive, are what counts).  Set by HeadStatsPath.attach.
        self.head_solved = False

    @property
    def spares_sgd(self) -> bool:
        """A solved head that no merge keeps (``mix = 1``, FedGS): its SGD steps would be
        spent too.  SAFL's annealed merge keeps them: the device's own model, the one it
        deploys, is personal (0.917 device-local against the solve's 0.876, lab fleet)."""
        return self.head_solved and self.config.mix >= 1.0

    def start(self, zbar: np.ndarray, t: int) -> np.ndarray:
        """The annealed merge of the aggregate with the local model, while that is fresh.

        Under partial participation a device's last local model may be many iterations
        old; merging it would pull the aggregate back towards a past model.
        """
        cfg = self.config
        if self.weights is None:
            return zbar
        if t - self.iteration > cfg.merge_max_age:
            self.counters["merge.stale_local"] += 1
            return zbar
        return annealed_merge(self.weights, zbar, t, temperature=cfg.temperature, mix=cfg.mix,
                              rng=self.rng, granularity=cfg.granularity,
                              layout=self._tensor_sizes)

    def keep(self, z: np.ndarray, t: int) -> None:
        """``z``, trained at iteration ``t``, is the local model a later merge draws from."""
        if self.config.mix < 1.0:  # only a merge reads it: with mix = 1 no copy is kept
            self.weights, self.iteration = z, t

    def schedule(self, start: np.ndarray, t: int) -> None:
        """Measure the device-local accuracy of ``start``, the model it would deploy from
        iteration ``t``, where it is due: in :meth:`catch_up`, after the reply has left.
        Under emulation the held-out pass took as long as three training steps, and made the
        reply of every iteration that measured one miss its deadline."""
        cfg = self.config
        if not cfg.local_eval_interval or (self._evaluated_at is not None and
                                           t - self._evaluated_at < cfg.local_eval_interval):
            return
        if self.buffer.held_out < max(1, cfg.gate_min_holdout):
            return
        self._due, self._evaluated_at = start, t

    def catch_up(self) -> None:
        """The measurement :meth:`schedule` left, if any (a role's tick, or the next
        selection where nothing ticks between: the simulators)."""
        if self._due is None:
            return
        start, self._due = self._due, None
        hx, hy = self.buffer.holdout()
        _, acc = self.trainer.evaluate(hx, hy, weights=start)
        self.accuracy = (float(acc), len(hy))
        self.counters["local_evaluations"] += 1

    def batches(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """Up to ``local_steps`` fresh batches from the buffer (fewer where it runs out)."""
        out = []
        for _ in range(self.config.local_steps):
            x, y = self.buffer.next_batch(self.config.batch_size)
            if not len(y):
                break
            out.append((x, y))
        return out

    def take(self, steps: LocalSteps) -> np.ndarray:
        """SGD from the start the trainer holds; the trained vector (the trainer holds it)."""
        if self.spares_sgd:
            return steps.start
        zbar, mu = steps.model.weights, self.config.prox_mu
        for x, y in steps.batches:
            before = self.trainer.get_flat() if mu else None
            self.trainer.train_step(x, y)
            if before is not None:
                self.trainer.set_flat(proximal_step(before, self.trainer.get_flat(), zbar,
                                                    lr=self.trainer.lr, mu=mu))
        return self.trainer.get_flat() if steps.batches else steps.start
