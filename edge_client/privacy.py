"""Privacy accounting: what a participant's Gaussian releases have cost it, as epsilon.

A release is one Gaussian mechanism: a value whose L2 sensitivity is ``C`` (a clipped step)
with noise of standard deviation ``noise_multiplier x C`` added.  Without subsampling, its
Renyi DP at order ``a`` is ``a / (2 noise_multiplier^2)`` (Mironov 2017), ``k`` releases
compose to ``k`` times that, and epsilon at ``delta`` follows from Canonne, Kamath and
Steinke's conversion (arXiv 2004.00010, Prop. 12), minimised over dp-accounting's default
orders.  The figures are dp-accounting's ``RdpAccountant`` for the same events
(``tests/test_privacy.py`` checks them against it); this module implements only the
unsampled Gaussian, so that a board needs numpy alone.  :func:`keep_privacy_ledger` keeps a
role's ledger in its service's state directory.  No amplification by sampling is
claimed: the super node is chosen from label histograms, not drawn at random
(``docs/privacy.md``).
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import numpy as np

from .errors import ConfigError
from .files import write_atomic

__all__ = ["ORDERS", "gaussian_epsilon", "noise_for_epsilon", "PrivacyLedger",
           "keep_privacy_ledger", "PRIVACY_FILE"]

PRIVACY_FILE = "privacy.json"  # in a service's state directory: releases a restart must keep

ORDERS = np.array([1 + x / 10.0 for x in range(1, 100)] + list(range(11, 64))
                  + [128, 256, 512, 1024], dtype=np.float64)


def _epsilon(rdp: np.ndarray, delta: float) -> float:
    with np.errstate(divide="ignore", invalid="ignore"):
        eps = rdp + np.log1p(-1 / ORDERS) - np.log(delta * ORDERS) / (ORDERS - 1)
    eps = np.where((delta ** 2 + np.expm1(-rdp)) > 0, 0.0, eps)  # bounded via KL already
    return float(max(0.0, eps.min()))


def _rdp(releases: dict[float, int]) -> np.ndarray:
    """Renyi DP at every order of releases at each noise multiplier (they compose)."""
    total = np.zeros_like(ORDERS)
    for noise, count in releases.items():
        total += count * ORDERS / (2.0 * noise ** 2) if noise > 0 else np.inf
    return total


def gaussian_epsilon(noise_multiplier: float, releases: int, delta: float) -> float:
    """Epsilon at ``delta`` after ``releases`` Gaussian releases (0 before the first; inf
    without noise)."""
    if releases <= 0:
        return 0.0
    if noise_multiplier <= 0:
        return math.inf
    return _epsilon(_rdp({noise_multiplier: releases}), delta)


def noise_for_epsilon(epsilon: float, releases: int, delta: float) -> float:
    """The smallest noise multiplier (to 0.1%) whose ``releases`` Gaussian releases spend at
    most ``epsilon`` at ``delta``: how an operator turns a budget for a planned run into
    ``central_dp_noise``.  Epsilon falls as the multiplier grows, so bisection finds it."""
    if not (epsilon > 0 and math.isfinite(epsilon)) or releases < 1:
        raise ValueError(f"no noise gives epsilon {epsilon} over {releases} releases")
    low, high = 0.0, 1.0
    while gaussian_epsilon(high, releases, delta) > epsilon:
        low, high = high, 2 * high
    while high - low > 1e-3 * high:
        mid = (low + high) / 2
        low, high = (low, mid) if gaussian_epsilon(mid, releases, delta) <= epsilon \
            else (mid, high)
    return high


@functools.lru_cache(maxsize=4096)
def _spent(counts: tuple[tuple[float, int], ...], delta: float) -> float:
    """Epsilon of these releases (multiplier, count) at ``delta``, remembered."""
    return _epsilon(_rdp(dict(counts)), delta)


class PrivacyLedger:
    """Releases per participant, by noise multiplier, and the epsilon each has spent at
    ``delta``; a service keeps :meth:`state` on disk, so a restart does not reset it."""

    def __init__(self, noise_multiplier: float, delta: float) -> None:
        self.noise_multiplier, self.delta = noise_multiplier, delta
        self.releases: dict[str, dict[float, int]] = {}

    def record(self, participant: str, noise: float | None = None, times: int = 1) -> None:
        """``times`` releases of ``participant``'s data, at ``noise`` (default: the ledger's
        multiplier).  A Gaussian release of ``s`` times the unit sensitivity costs what
        ``s^2`` unit releases do, so a tree node holding ``n`` of its steps is ``n^2``."""
        z = self.noise_multiplier if noise is None else float(noise)
        counts = self.releases.setdefault(participant, {})
        counts[z] = counts.get(z, 0) + times

    def count(self, participant: str) -> int:
        return sum(self.releases.get(participant, {}).values())

    def epsilon(self, participant: str, extra: int = 0) -> float:
        """Spent so far, or after ``extra`` more releases at the current multiplier (computed
        once per ledger entry: summaries and scrapes ask for it far more often than a
        release changes it)."""
        counts = dict(self.releases.get(participant, {}))
        if extra:
            counts[self.noise_multiplier] = counts.get(self.noise_multiplier, 0) + extra
        if not any(counts.values()):
            return 0.0
        return _spent(tuple(sorted(counts.items())), self.delta)

    def worst(self) -> float:
        """The largest epsilon any participant has spent (0: none released yet)."""
        return max((self.epsilon(p) for p in self.releases), default=0.0)

    def state(self) -> dict[str, list[list[float]]]:
        """JSON-ready: each participant's ``[noise multiplier, releases]`` pairs."""
        return {p: [[noise, count] for noise, count in sorted(c.items())]
                for p, c in self.releases.items()}

    def restore(self, state: dict[str, list[list[float]]]) -> None:
        """Add a kept ledger's releases; a multiplier <= 0 or a negative count cannot be one
        (and would hand budget back), so it raises ``ValueError``."""
        for participant, pairs in state.items():
            counts = self.releases.setdefault(str(participant), {})
            for noise, count in pairs:
                z, k = float(noise), int(count)
                if not (math.isfinite(z) and z > 0) or k < 0:
                    raise ValueError(f"{participant}: {k} releases at multiplier {z}")
                counts[z] = counts.get(z, 0) + k


LedgerState = dict[str, list[list[float]]]


class _Releasing(Protocol):
    """A role that makes private releases: a device (local DP) or a station (central DP)."""

    privacy: PrivacyLedger
    on_release: Callable[[LedgerState], None] | None


def keep_privacy_ledger(role: _Releasing, folder: str | Path | None) -> None:
    """Restore a role's privacy ledger from its state directory, and keep it there after
    each release (written before the release is sent).  Differential privacy without a state
    directory is refused: a restart would give every participant its budget back."""
    if not folder:
        raise ConfigError("state_dir", "differential privacy keeps its ledger in [service] "
                          "state_dir: set it, or every restart would reset the privacy spent")
    path = Path(folder) / PRIVACY_FILE
    if path.exists():
        try:
            role.privacy.restore(json.loads(path.read_text())["releases"])
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError("state_dir", f"{path} is not a privacy ledger ({exc}); nothing "
                              "will guess what was spent") from exc

    def keep(state: LedgerState) -> None:
        write_atomic(path, json.dumps({"releases": state}).encode())

    role.on_release = keep
