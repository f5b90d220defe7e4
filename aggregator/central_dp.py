"""Central differential privacy where an aggregator fuses: a station over its factory's
devices, the cloud over its stations (``docs/privacy.md``).

With ``central_dp_noise > 0`` a fusion is one release: :class:`NoisedMean` clips each
contributor's step from the current model, adds Gaussian noise to the sum and divides by the
number asked; :class:`CentralDP` draws the noise, counts each contributor's releases on a
:class:`~edge_client.privacy.PrivacyLedger` and hands the ledger to whoever keeps it on disk
before the release leaves.
"""

from __future__ import annotations

import math
import secrets
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from edge_client.config import check_range
from edge_client.errors import ConfigError, ShapeError
from edge_client.privacy import LedgerState, PrivacyLedger

from .checkpoint import CheckpointError
from .fusion import Fold, fold_weight, model_vector

__all__ = ["CentralPrivacy", "CentralDP", "NoisedMean"]


@dataclass(frozen=True, kw_only=True)
class CentralPrivacy:
    """Central DP settings of an aggregator: each contribution's step clipped to
    ``central_dp_clip``, Gaussian noise of ``central_dp_noise`` x that bound on the sum,
    divided by the number asked (DP-FedAvg); it takes the place of the fusion rule.
    0: off.  The aggregator keeps its ledger in its state directory."""

    central_dp_clip: float = 0.0
    central_dp_noise: float = 0.0
    # Adaptive clipping (Andrew et al. 2021): the bound moves each release so that about
    # this fraction of steps fits under it (0: the bound stays central_dp_clip, its start),
    # by the geometric rate central_dp_clip_lr, from a count of the steps that fit noised
    # with standard deviation central_dp_count_noise (0: a twentieth of the participants
    # asked, as the paper suggests).  The count is a release too, on the ledger.
    central_dp_quantile: float = 0.0
    central_dp_clip_lr: float = 0.2
    central_dp_count_noise: float = 0.0
    privacy_delta: float = 1e-5
    # Seed the noise from the role's seed (reproducible simulations), not the OS's entropy.
    noise_seeded: bool = False

    def check_privacy(self, fusion: str) -> None:
        check_range("central_dp_clip", self.central_dp_clip, 0)
        check_range("central_dp_noise", self.central_dp_noise, 0)
        check_range("privacy_delta", self.privacy_delta, 0, 1, low_open=True)
        check_range("central_dp_quantile", self.central_dp_quantile, 0, 1)
        check_range("central_dp_clip_lr", self.central_dp_clip_lr, 0, low_open=True)
        check_range("central_dp_count_noise", self.central_dp_count_noise, 0)
        if self.central_dp_noise and not self.central_dp_clip:
            raise ConfigError("central_dp_clip", "central DP's noise is scaled to the clip "
                              "bound: set central_dp_clip > 0")
        if self.central_dp_noise and fusion != "fedavg":
            raise ConfigError("fusion", f"central DP replaces the fusion rule by a noised mean "
                              f"of clipped steps; {fusion!r} cannot be kept with it")


class NoisedMean(Fold):
    """Central differential privacy for one release (DP-FedAvg, McMahan et al. 2018): each
    update's step from ``start`` is clipped to L2 norm ``bound``, the steps are summed,
    Gaussian noise of ``noise x bound`` is added to the sum, and the sum is divided by
    ``size``, the number of participants asked (fixed before anyone answered, so neither
    the divisor nor the weights reveal who did).  One participant moves the sum by at most
    ``bound``: the sensitivity the noise is scaled to.  ``contributors`` are whose data the
    release used, for the privacy ledger."""

    def __init__(self, start: np.ndarray, *, bound: float, noise: float, size: int,
                 rng: np.random.Generator) -> None:
        self._start = model_vector(start, None)
        self._sum = np.zeros_like(self._start)
        self._bound, self._noise, self.size, self._rng = bound, noise, max(1, size), rng
        self._total = 0.0
        self.contributors: list[str] = []
        self.clipped = 0  # steps longer than the bound: the rest fit under it

    def add(self, model: np.ndarray, weight: float, key: str = "") -> None:
        step = model_vector(model, self._start.shape) - self._start
        norm = float(np.linalg.norm(step))
        if norm > self._bound:
            step *= np.float32(self._bound / norm)
            self.clipped += 1
        self._sum += step
        self._total += fold_weight(weight)
        self.contributors.append(key)

    def result(self) -> np.ndarray:
        if not self.contributors:
            raise ShapeError("nothing to fuse: no models")
        noise = self._rng.standard_normal(self._sum.size, dtype=np.float32)
        noise *= np.float32(self._noise * self._bound)
        return self._start + (self._sum + noise) / np.float32(self.size)

    def __len__(self) -> int:
        return len(self.contributors)

    @property
    def total(self) -> float:
        return self._total


class CentralDP:
    """An aggregator's central DP: its noise, its folds, its ledger of contributors."""

    def __init__(self, settings: CentralPrivacy, seed: int) -> None:
        self.settings = settings
        self.enabled = settings.central_dp_noise > 0
        # The noise comes from the OS's entropy unless a simulation seeds it.
        self.rng = np.random.default_rng([seed, 0x401CE] if settings.noise_seeded
                                         else secrets.randbits(128))
        self.privacy = PrivacyLedger(settings.central_dp_noise, settings.privacy_delta)
        self.on_release: Callable[[LedgerState], None] | None = None  # keeps the ledger
        self.bound = settings.central_dp_clip  # moves with adaptive clipping

    @property
    def adaptive_bound(self) -> float | None:
        """The bound a checkpoint keeps: only adaptive clipping moves it."""
        return self.bound if self.settings.central_dp_quantile else None

    def resume(self, bound: float | None) -> None:
        """Continue adaptive clipping from a checkpoint's bound, not from its start (a fixed
        bound, or a checkpoint without one, keeps ``central_dp_clip``)."""
        if bound is None or not self.settings.central_dp_quantile:
            return
        if not (math.isfinite(bound) and bound > 0):
            raise CheckpointError(f"the checkpoint's clip bound {bound} cannot be one")
        self.bound = float(bound)

    def fold(self, start: np.ndarray, size: int) -> NoisedMean:
        return NoisedMean(start, bound=self.bound, noise=self.settings.central_dp_noise,
                          size=size, rng=self.rng)

    def _adapt(self, fold: NoisedMean) -> None:
        """Move the bound towards the target quantile of step norms, from a noised count of
        the steps that fit (each contributor moves the count by at most 1: a Gaussian
        release of multiplier ``count noise``, recorded for every contributor)."""
        s = self.settings
        sigma = s.central_dp_count_noise or fold.size / 20
        fit = len(fold) - fold.clipped + sigma * float(self.rng.standard_normal())
        self.bound *= float(np.exp(-s.central_dp_clip_lr * (fit / fold.size
                                                             - s.central_dp_quantile)))
        for contributor in fold.contributors:
            self.privacy.record(contributor, noise=sigma)

    def released(self, fold: Fold, counters: Counter[str]) -> None:
        """A noised fusion was made: each contributor's data is on the ledger (and on disk,
        before the result leaves the aggregator)."""
        if not isinstance(fold, NoisedMean):
            return
        for contributor in fold.contributors:
            self.privacy.record(contributor)
        if self.settings.central_dp_quantile:
            self._adapt(fold)
        counters["dp_releases"] += 1
        counters["clipped.dp_step"] += fold.clipped
        if self.on_release is not None:
            self.on_release(self.privacy.state())
