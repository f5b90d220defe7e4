"""Bounded trust in what participants report: every field is a claim to check.

A station cannot verify a device's data, but it can bound what one device can do:
its update may move the model only about as far as honest updates do
(:class:`NormGuard`), its claimed history may grow only at a plausible rate and
to a bounded share of the roster (:func:`bound_seen_counts`), and it may sit in
at most a bounded share of recent super nodes (:class:`ShareCap`).  Pure numpy,
no I/O; the station role applies them (``docs/reliability.md``).
"""

from __future__ import annotations

from collections import deque

import numpy as np

__all__ = ["NormGuard", "bound_seen_counts", "ShareCap"]


class NormGuard:
    """Bounds ``||z - w||``, an update's distance from the model it started from.

    With ``bound > 0`` that fixed bound applies.  Otherwise, once ``warmup`` updates
    were accepted, the bound is ``factor`` times the median of the last ``window``
    accepted distances (honest updates shrink as training converges, and the median
    follows them; one device cannot move it); before that it is ``initial``, which the
    station derives from the devices' learning rate and steps.  ``factor = 0`` with
    ``bound = 0`` turns the guard off.
    """

    def __init__(self, *, bound: float, factor: float, initial: float, window: int = 64,
                 warmup: int = 8) -> None:
        self.fixed, self.factor, self.initial, self.warmup = bound, factor, initial, warmup
        self.history: deque[float] = deque(maxlen=window)

    @property
    def enabled(self) -> bool:
        return self.fixed > 0 or self.factor > 0

    @property
    def limit(self) -> float:
        """The distance above which an update is refused now."""
        if self.fixed > 0:
            return self.fixed
        if not self.enabled:
            return float("inf")
        if len(self.history) < self.warmup:
            return self.initial
        return self.factor * float(np.median(self.history))

    def check(self, update: np.ndarray, start: np.ndarray) -> tuple[bool, float]:
        """``(accepted, distance)``; an accepted distance joins the history."""
        distance = float(np.linalg.norm(np.subtract(update, start, dtype=np.float64)))
        if distance > self.limit:
            return False, distance
        self.history.append(distance)
        return True, distance

    def state(self) -> list[float]:
        return list(self.history)

    def restore(self, history: list[float]) -> None:
        self.history.extend(float(h) for h in history)


def bound_seen_counts(counts: np.ndarray, previous_total: int, allowance: int,
                      roster_totals: list[int], share: float, floor: int
                      ) -> tuple[np.ndarray, bool]:
    """A device's claimed seen-label counts, scaled down to what is plausible.

    The total may grow by at most ``allowance`` since the last accepted report, and may be
    at most ``share`` times the median total of the other devices, or ``floor`` while the
    fleet is young.  Returns the counts to use and whether they were clipped.
    """
    total = int(counts.sum())
    cap = previous_total + allowance
    if roster_totals:
        cap = min(cap, max(int(share * float(np.median(roster_totals))), floor))
    if total <= cap:
        return counts, False
    scaled = np.floor(counts.astype(np.float64) * (cap / total)).astype(np.int64)
    return scaled, True


class ShareCap:
    """Caps the share of the last ``window`` super nodes a device may sit in.

    GBP-CS favours the histograms that balance the super node, so a device that lies
    about its next batch could otherwise buy a seat in every one.
    """

    def __init__(self, window: int, max_share: float) -> None:
        self.window, self.max_share = window, max_share
        self.recent: deque[tuple[str, ...]] = deque(maxlen=window)

    def eligible(self, device: str) -> bool:
        if self.max_share >= 1.0:
            return True
        seats = sum(device in members for members in self.recent)
        return seats < self.max_share * self.window

    def record(self, members: tuple[str, ...]) -> None:
        self.recent.append(members)

    def state(self) -> list[list[str]]:
        return [list(ms) for ms in self.recent]

    def restore(self, recent: list[list[str]]) -> None:
        self.recent.extend(tuple(ms) for ms in recent)
