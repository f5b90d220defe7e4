"""Privacy accounting: what a participant's Gaussian releases have cost it, as epsilon.

A release is one Gaussian mechanism: a value whose L2 sensitivity is ``C`` (a clipped step)
with noise of standard deviation ``noise_multiplier x C`` added.  Without subsampling, its
Renyi DP at order ``a`` is ``a / (2 noise_multiplier^2)`` (Mironov 2017), ``k`` releases
compose to ``k`` times that, and epsilon at ``delta`` follows from Canonne, Kamath and
Steinke's conversion (arXiv 2004.00010, Prop. 12), minimised over dp-accounting's default
orders.  The figures are dp-accounting's ``RdpAccountant`` for the same events
(``tests/test_privacy.py`` checks them against it); this module implements only the
unsampled Gaussian, so that a board needs numpy alone.  No amplification by sampling is
claimed: the super node is chosen from label histograms, not drawn at random
(``docs/privacy.md``).
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["ORDERS", "gaussian_epsilon", "PrivacyLedger"]

ORDERS = np.array([1 + x / 10.0 for x in range(1, 100)] + list(range(11, 64))
                  + [128, 256, 512, 1024], dtype=np.float64)


def gaussian_epsilon(noise_multiplier: float, releases: int, delta: float) -> float:
    """Epsilon at ``delta`` after ``releases`` Gaussian releases (0 before the first; inf
    without noise)."""
    if releases <= 0:
        return 0.0
    if noise_multiplier <= 0:
        return math.inf
    rdp = releases * ORDERS / (2.0 * noise_multiplier ** 2)
    with np.errstate(divide="ignore", invalid="ignore"):
        eps = rdp + np.log1p(-1 / ORDERS) - np.log(delta * ORDERS) / (ORDERS - 1)
    eps = np.where((delta ** 2 + np.expm1(-rdp)) > 0, 0.0, eps)  # bounded via KL already
    return float(max(0.0, eps.min()))


class PrivacyLedger:
    """Releases per participant, and the epsilon each has spent at ``delta``."""

    def __init__(self, noise_multiplier: float, delta: float) -> None:
        self.noise_multiplier, self.delta = noise_multiplier, delta
        self.releases: dict[str, int] = {}

    def record(self, participant: str) -> None:
        self.releases[participant] = self.releases.get(participant, 0) + 1

    def epsilon(self, participant: str, extra: int = 0) -> float:
        """Spent so far, or after ``extra`` more releases."""
        return gaussian_epsilon(self.noise_multiplier,
                                self.releases.get(participant, 0) + extra, self.delta)

    def worst(self) -> float:
        """The largest epsilon any participant has spent (0: none released yet)."""
        most = max(self.releases.values(), default=0)
        return gaussian_epsilon(self.noise_multiplier, most, self.delta)
