"""A device's stats as a station takes them: every field a claim to check.

Histograms must have the fleet's width and the next batch must fit the batch size (else
the stats are refused); seen counts may grow only ``max_seen_rate x local_steps`` per
iteration and no device may claim more than ``seen_share`` of the roster's samples
(:func:`~aggregator.trust.bound_seen_counts`: clipped, and kept clipped); accuracies
outside [0, 1] and a negative epsilon are metrics no device can have measured, dropped
as not measured.  Every refusal and clip goes to the station's ``reject`` and ``clip``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from edge_client import messages as m

from .config import StationConfig
from .trust import bound_seen_counts

__all__ = ["StatsCheck"]


class StatsCheck:
    """The checks of one station's incoming stats."""

    def __init__(self, config: StationConfig, num_classes: int, *,
                 reject: Callable[[str, str], Any], clip: Callable[[str], None]) -> None:
        self.config, self.num_classes = config, num_classes
        self._reject, self._clip = reject, clip

    def check(self, msg: m.DeviceStats, stats: Mapping[str, m.DeviceStats],
              elapsed: int) -> m.DeviceStats | None:
        """``msg`` as the station keeps it, or None where it is refused; ``stats``: what the
        roster reported so far, ``elapsed``: iterations since its sender's last stats."""
        if {msg.seen_counts.size, msg.next_batch_counts.size} != {self.num_classes}:
            self._reject("wrong_length", f"histograms of width {msg.seen_counts.size}, "
                         f"expected {self.num_classes}")
            return None
        if msg.next_batch_counts.sum() > self.config.batch_size:
            self._reject("bad_histogram", f"next batch of {msg.next_batch_counts.sum()} "
                         f"samples, the batch size is {self.config.batch_size}")
            return None
        msg = self._plausible_seen(msg, stats, elapsed)
        # Only metrics, but metrics operators act on: an accuracy outside [0, 1] is dropped
        # (as not measured) and counted; the histograms still count.
        if msg.epsilon < 0:
            self._clip("epsilon")
            msg = dataclasses.replace(msg, epsilon=0.0)
        for name in ("local", "prequential", "shadow"):
            if not 0.0 <= getattr(msg, f"{name}_accuracy") <= 1.0:
                self._clip(f"{name}_accuracy")
                cleared: dict[str, Any] = {f"{name}_accuracy": 0.0, f"{name}_samples": 0}
                msg = dataclasses.replace(msg, **cleared)
        return msg

    def _plausible_seen(self, msg: m.DeviceStats, stats: Mapping[str, m.DeviceStats],
                        elapsed: int) -> m.DeviceStats:
        """Seen counts bounded in growth and share (a claim of 10^15 samples must not decide
        ``P_real``); the clipped counts are what the station keeps and sums."""
        cfg = self.config
        prev = stats.get(msg.sender)
        others = [int(s.seen_counts.sum()) for d, s in stats.items() if d != msg.sender]
        # A device senses per local step, and a flat round holds many steps between reports.
        per_iteration = cfg.max_seen_rate * cfg.local_steps
        counts, clipped = bound_seen_counts(
            msg.seen_counts, int(prev.seen_counts.sum()) if prev else 0,
            per_iteration * elapsed, others, cfg.seen_share, per_iteration)
        if not clipped:
            return msg
        self._clip("seen_counts")
        return dataclasses.replace(msg, seen_counts=counts)
