"""Which cameras drift: each device's prequential hits, as its station sees them, through
river's ADWIN (Bifet and Gavaldà, SDM 2007), and the devices whose accuracy fell.

A device reports, with each of its stats, how many of its predictions it has scored
against their labels and how many were right, both counted since it started
(``DeviceStats.prequential_scored`` and ``prequential_hits``).  The station feeds what
grew since the last report, one hit or miss at a time, to that device's ADWIN.  ADWIN
keeps the longest recent window whose halves do not differ by more than its bound
(``delta`` 0.002, river's default) and drops the older part where they do: a cut.

ADWIN finds changes either way and of any size; an operator wants the falls that matter.
A cut that drops older hits whose accuracy was above the window kept marks the level
before it (``before``: the dropped part's accuracy, the highest where several follow as
the window sheds the old level); the device is drifting while its window's
accuracy is ``DRIFT_DROP`` or more below that level (the five points a lamp change may
cost, docs/camera-line.md), and stops once its window is surely back above that bar (by
two standard errors: one lucky minute does not clear a flag); a window of fewer than
``JUDGED`` scores judges neither.  A flag stays while the accuracy stays low: a camera that
settled five points lower is still five points lower.

Why at the station and not on the device: river imports scipy, 85 MB more resident on a
board that predicts in 200 MB, and the station sees every device's counts anyway.  Why
not a hand-written detector: river's is maintained, and its bound is the paper's.

The counts are a claim: counts that went down are a restarted device (re-based, not fed);
hits below none or above the scores, or more scores than the seen counts' allowance
(``max_seen_rate x local_steps`` an iteration, and ``MAX_FED`` a report), are clipped and
counted, so that a device cannot make its station spend a second feeding it.  A
compromised device can only make its own flag wrong.
"""

from __future__ import annotations

import importlib.util
import logging
import math
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["DRIFT_DROP", "DriftWatch", "spread"]

DRIFT_DROP = 0.05  # accuracy a cut must have cost to flag a device
JUDGED = 100  # scores a window holds before its accuracy may raise or clear a flag
SHOWN_DRIFTING = 100  # devices a station's summary names (a whole hall's lamps may change)
MAX_FED = 4096  # scores fed a report at most, whatever the allowance (1.5 ms of ADWIN)


def spread(scores: int, hits: int) -> list[bool]:
    """``hits`` right of ``scores``, spread evenly (a report's order is not known, and a
    run of misses after a run of hits would be a change the camera never had)."""
    return [(i + 1) * hits // scores - i * hits // scores == 1 for i in range(scores)]


class _Camera:
    """One device's detector, the level a fall cut off and whether it is flagged."""

    def __init__(self, adwin: Any) -> None:
        self.adwin = adwin
        self.before: float | None = None
        self.flagged = False

    def feed(self, bits: list[bool]) -> None:
        a = self.adwin
        for bit in bits:
            width, mean = a.width, a.estimation
            a.update(bit)
            if a.drift_detected and width > a.width:
                dropped = (width * mean - a.width * a.estimation + bit) / (width + 1 - a.width)
                if dropped > a.estimation:  # a fall: the highest level cut off since
                    self.before = max(dropped, self.before or 0.0)
                elif not self.flagged:
                    self.before = None  # a rise: the level a fall cut off is history
        self._judge()

    def _judge(self) -> None:
        """Flag at ``DRIFT_DROP`` below the level; clear once the window is surely back
        within it (two standard errors above the bar: a short window after a cut is
        noisy); a window of fewer than ``JUDGED`` scores judges neither."""
        a = self.adwin
        if self.before is None or a.width < JUDGED:
            return
        bar, acc = self.before - DRIFT_DROP, a.estimation
        if not self.flagged and acc <= bar:
            self.flagged = True
        elif self.flagged and acc - 2 * math.sqrt(acc * (1 - acc) / a.width) > bar:
            self.flagged, self.before = False, None

    @property
    def drifting(self) -> float | None:
        """The level it fell from, while it is flagged."""
        return self.before if self.flagged else None


def _adwin() -> Any:
    """river's ADWIN, or None where river is not installed (a station without the extra)."""
    try:
        from river.drift import ADWIN
    except ImportError:
        return None
    return ADWIN


_NO_RIVER = ("river is not installed: no camera is watched for drift "
             "(pip install 'safl-edge[station]')")


class DriftWatch:
    """A station's detectors, one a device that scores its predictions."""

    def __init__(self, counters: Counter[str], clip: Callable[[str], None]) -> None:
        self.counters, self._clip = counters, clip
        self._cameras: dict[str, _Camera] = {}
        self._counts: dict[str, tuple[int, int]] = {}  # scores and hits last reported
        self._fed: dict[str, tuple[tuple[int, int], int]] = {}  # scores fed in a window
        # river is imported at the first scores a device reports, not at start-up: with
        # scipy and scikit-learn it takes 0.8 s, which every simulated station paid whether
        # or not its devices score their predictions (a short lab run's tenth).
        self._adwin: Any = None
        self.off = "" if importlib.util.find_spec("river") else _NO_RIVER
        if self.off:
            log.warning("station: %s", self.off)

    def take(self, device: str, scored: int, hits: int, window: tuple[int, int],
             per_iteration: int) -> None:
        """A report's counts since ``device`` started; ``window``: the roster's window its
        seen counts grow in (:meth:`Roster.window`), over which they may grow
        ``per_iteration`` a window's iteration: scores, which are of labelled samples, may too."""
        if self.off or scored <= 0 or not self.ready():
            return
        last_scored, last_hits = self._counts.get(device, (0, 0))
        if scored < last_scored or hits < last_hits:
            self.counters["drift.rebased"] += 1  # the device restarted and counts anew
            last_scored, last_hits = 0, 0
        new, right = scored - last_scored, hits - last_hits
        in_window, fed = self._fed.get(device, (window, 0))
        fed = fed if in_window == window else 0  # reports of one iteration share a window
        allowance = min(per_iteration * window[1] - fed, MAX_FED)
        if not 0 <= right <= new or new > allowance:
            self._clip("prequential_counts")
            keep = max(0, min(new, allowance))
            right, new = min(max(right, 0), new) * keep // max(new, 1), keep
        self._counts[device] = (scored, hits)
        self._fed[device] = (window, fed + new)
        if new:
            camera = self._cameras.get(device) or self._cameras.setdefault(
                device, _Camera(self._adwin()))
            was = camera.drifting
            camera.feed(spread(new, right))
            self._said(device, was, camera)

    def ready(self) -> bool:
        """Whether river's ADWIN is here, imported on the first call (a station service
        calls it at start, so that its first scores do not wait on the import)."""
        if self._adwin is None:
            self._adwin = _adwin()
            if self._adwin is None:  # installed, yet it would not import
                self.off = _NO_RIVER
                log.warning("station: %s", self.off)
        return self._adwin is not None

    def _said(self, device: str, was: float | None, camera: _Camera) -> None:
        now = camera.drifting
        if (was is None) == (now is None):
            return
        acc = camera.adwin.estimation
        if now is not None:
            self.counters["drift.detected"] += 1
            log.warning("device %s drifts: its prequential accuracy fell from %.3f to %.3f",
                        device, now, acc)
        else:
            log.info("device %s no longer drifts: prequential accuracy %.3f", device, acc)

    @property
    def drifting(self) -> dict[str, float]:
        """Devices drifting now, with the accuracy each fell from."""
        return {d: level for d, c in self._cameras.items()
                if (level := c.drifting) is not None}

    def shown(self) -> dict[str, float]:
        """The station summary's ``drifting``: the ``SHOWN_DRIFTING`` devices that fell
        furthest, with the level each fell from."""
        drifting = self.drifting
        fell = sorted(drifting, key=lambda d: self._cameras[d].adwin.estimation - drifting[d])
        return {d: round(drifting[d], 4) for d in sorted(fell[:SHOWN_DRIFTING])}

    def state(self) -> dict[str, Any]:
        """The checkpoint's share: the counts fed and the flags with their levels (a
        detector's window is not saved: a restarted station starts each anew, and judges a
        flag it restored once the new window is ``JUDGED`` long)."""
        return {"drift_counts": {d: list(c) for d, c in self._counts.items()},
                "drift_levels": self.drifting}

    def restore(self, counts: Mapping[str, list[int]], levels: Mapping[str, float]) -> None:
        self._counts = {d: (int(c[0]), int(c[1])) for d, c in counts.items()}
        if not levels or self.off or not self.ready():
            return
        for d, level in levels.items():
            camera = self._cameras.setdefault(d, _Camera(self._adwin()))
            camera.before, camera.flagged = float(level), True
