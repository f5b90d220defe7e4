"""The upload path of a device: SAFL's upload gate, the privacy budget, and the update as
it leaves, through the fleet's stages with error feedback and the local-DP ledger.

The device decides when it trains; :class:`UploadPath` decides whether what it trained
goes out (SPEC §3's gate, then the budget) and in which encoding, and records each noised
release before it is sent.
"""

from __future__ import annotations

import functools
import logging
import secrets
from collections import Counter
from collections.abc import Callable

import numpy as np

from . import messages as m
from .buffer import StreamBuffer
from .config import DeviceConfig
from .pipeline import UpdatePipeline
from .privacy import LedgerState, PrivacyLedger
from .safl import performance_gap, upload_probability
from .trainers import Trainer

__all__ = ["UploadPath"]

log = logging.getLogger(__name__)


class UploadPath:
    """Whether a trained model goes out, and what goes out for it."""

    def __init__(self, config: DeviceConfig, trainer: Trainer, buffer: StreamBuffer,
                 rng: np.random.Generator, counters: Counter[str]) -> None:
        self.config, self.trainer, self.buffer, self.counters = config, trainer, buffer, counters
        self.rng = rng  # the device's own: the gate draws between its merge masks
        self.pipeline = UpdatePipeline(config.update_stages)
        self._residual: np.ndarray | None = None  # what lossy stages left out, sent later
        # Stochastic rounding draws from its own stream: compressing an update leaves the
        # merge masks and gate draws of the device as they were.
        self._rounding = np.random.default_rng([config.seed, 0x0E1C0DE])
        # Local DP: the noise comes from the OS's entropy unless a simulation asks otherwise
        # (a seeded generator's noise can be subtracted by whoever knows the seed).
        self._noise = np.random.default_rng([config.seed, 0x401CE] if config.noise_seeded
                                            else secrets.randbits(128))
        self.privacy = PrivacyLedger(self.pipeline.noise_multiplier, config.privacy_delta)
        # Called with the ledger after each noised release, before it is sent: a service
        # keeps it on disk, so a restart does not give the device its budget back.
        self.on_release: Callable[[LedgerState], None] | None = None

    @property
    def epsilon(self) -> float:
        """What this device's local differential privacy has spent (0 without noise)."""
        return self.privacy.epsilon(self.config.device_id) if self.pipeline.noise else 0.0

    def decide(self, z: np.ndarray, zbar: np.ndarray) -> tuple[float, bool]:
        """The accuracy gap and whether ``z`` goes out: the gate, then the budget."""
        gap, upload = self._gate(z, zbar)
        if upload and self._budget_spent():
            self.counters["skipped.privacy_budget"] += 1
            return gap, False
        return gap, upload

    def _gate(self, z: np.ndarray, zbar: np.ndarray) -> tuple[float, bool]:
        """Extended SAFL: upload with probability exp(-nu * Delta) (SPEC §3)."""
        if self.config.nu == 0:
            return 0.0, True
        hx, hy = self.buffer.holdout()
        if len(hy) < max(1, self.config.gate_min_holdout):
            # A few skewed samples give a gap of pure noise: it would discard paid-for steps.
            self.counters["gate.warming_up"] += 1
            return 0.0, True
        _, local_acc = self.trainer.evaluate(hx, hy)
        _, global_acc = self.trainer.evaluate(hx, hy, weights=zbar)
        gap = performance_gap(local_acc, global_acc)
        return gap, bool(self.rng.random() < upload_probability(gap, self.config.nu))

    def _budget_spent(self) -> bool:
        """Whether one more noised upload would pass the privacy budget; said once."""
        cfg, me = self.config, self.config.device_id
        if not cfg.privacy_budget or self.privacy.epsilon(me, extra=1) <= cfg.privacy_budget:
            return False
        if not self.counters["skipped.privacy_budget"]:
            log.warning("device %s: privacy budget spent (epsilon %.3g at delta %g after %d "
                        "uploads; the next would pass %g): it uploads no more", me,
                        self.epsilon, cfg.privacy_delta, self.privacy.count(me),
                        cfg.privacy_budget)
        return True

    def update(self, model: m.StationModel, z: np.ndarray, consumed: int) -> m.DeviceUpdate:
        """``z`` itself, or its step from the station's model through the fleet's stages, with
        what they lost kept for the next upload (error feedback)."""
        cfg = self.config
        update = functools.partial(m.DeviceUpdate, fleet=cfg.fleet, sender=cfg.device_id,
                                   round=model.round, iteration=model.iteration,
                                   station=cfg.station, num_samples=consumed)
        if not self.pipeline.active:
            return update(weights=z)
        enc, self._residual = self.pipeline.encode(z - model.weights, self._residual,
                                                   self._rounding, self._noise)
        if self.pipeline.noise:
            self.privacy.record(cfg.device_id)
            if self.on_release is not None:  # on disk before the release leaves the device
                self.on_release(self.privacy.state())
        return update(encoding=self.pipeline.id, weights=enc.values, indices=enc.indices,
                      half=enc.half, codes=enc.codes, scales=enc.scales)
