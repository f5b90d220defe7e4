"""Labels that arrive live, from the line itself, joined to the frames they describe.

An inspection station's verdict, a barcode reader or an operator's button publishes
``{"t": <unix seconds>, "label": <int>}`` on a topic of the device's broker seconds after
the frame.  :class:`LiveLabels` keeps the unlabelled frames in a bounded ring (with the
prediction made when each arrived), joins each label to the frame captured nearest before
``t`` within ``window`` seconds, and drops frames still unlabelled after ``delay_max``
seconds.  It is a state machine: the device service feeds it frames and payloads and
trains on what it returns; it does no I/O.
"""

from __future__ import annotations

import bisect
import json
import logging
import math
from collections import Counter
from collections.abc import Callable

import numpy as np

from ..admission import LogLimiter
from ..errors import MessageError

__all__ = ["LiveLabels", "parse_label", "MAX_LABEL_PAYLOAD"]

log = logging.getLogger(__name__)

MAX_LABEL_PAYLOAD = 1024  # bytes: a label is a few dozen


def parse_label(payload: bytes, num_classes: int) -> tuple[float, int]:
    """``(t, label)`` of one label message; :class:`MessageError` (with a counter-ready
    reason) for anything else."""
    if len(payload) > MAX_LABEL_PAYLOAD:
        raise MessageError("oversized", f"{len(payload)} bytes, more than {MAX_LABEL_PAYLOAD}")
    try:
        doc = json.loads(payload)
    except (ValueError, UnicodeDecodeError):
        raise MessageError("malformed", "not JSON") from None
    if not isinstance(doc, dict) or "t" not in doc or "label" not in doc:
        raise MessageError("malformed", 'expected {"t": <unix seconds>, "label": <int>}')
    t, label = doc["t"], doc["label"]
    if type(t) not in (int, float) or not math.isfinite(t) or t < 0:
        raise MessageError("bad_time", f"t = {str(t)[:40]!r} is not a finite unix time")
    if type(label) is not int or not 0 <= label < num_classes:
        raise MessageError("out_of_range", f"label {str(label)[:40]!r} outside "
                           f"[0, {num_classes})")
    return float(t), label


class LiveLabels:
    """Frames waiting for their labels.

    Parameters
    ----------
    num_classes : int
    window : float
        A label joins the frame captured nearest before its ``t`` and at most this many
        seconds before it; a label with no such frame is ``label_unmatched``.
    delay_max : float
        Frames wait this long for a label, then are dropped (``label_expired``).
    capacity : int
        Frames held at most: the oldest go first (counted as expired) when the ring is full.
    """

    def __init__(self, num_classes: int, *, window: float, delay_max: float,
                 capacity: int = 4096, clock: Callable[[], float] | None = None) -> None:
        import time

        self.num_classes, self.window, self.delay_max = num_classes, window, delay_max
        self.capacity = capacity
        self.clock = clock or time.time
        self.counters: Counter[str] = Counter()
        self._times: list[float] = []  # capture times, ascending
        self._frames: list[tuple[np.ndarray, int]] = []  # (sample, predicted class)
        self._limiter = LogLimiter()

    @property
    def pending(self) -> int:
        return len(self._times)

    def add_frames(self, x: np.ndarray, times: np.ndarray, predicted: np.ndarray) -> None:
        """Unlabelled frames, with their capture times and the predictions made on arrival."""
        for sample, t, p in zip(x, times, predicted, strict=True):
            i = bisect.bisect_right(self._times, float(t))  # cameras deliver in order
            self._times.insert(i, float(t))
            self._frames.insert(i, (sample, int(p)))
        overflow = len(self._times) - self.capacity
        if overflow > 0:
            self.counters["label_expired"] += overflow
            del self._times[:overflow], self._frames[:overflow]

    def add_label(self, payload: bytes) -> tuple[np.ndarray, int, int] | None:
        """Join one label message: ``(sample, label, predicted)`` of the frame it labels, or
        None (refused, or no frame to label; each counted)."""
        try:
            t, label = parse_label(payload, self.num_classes)
        except MessageError as exc:
            self.counters[f"label_refused.{exc.reason}"] += 1
            if self._limiter.allow("labels", exc.reason):
                log.warning("refused a label message (%s): %s; such messages are counted as "
                            "label_refused.%s", exc.reason, exc, exc.reason)
            return None
        i = bisect.bisect_right(self._times, t) - 1
        if i < 0 or t - self._times[i] > self.window:
            self.counters["label_unmatched"] += 1
            return None
        del self._times[i]
        sample, predicted = self._frames.pop(i)
        self.counters["label_joined"] += 1
        return sample, label, predicted

    def expire(self) -> int:
        """Drop frames that waited longer than ``delay_max``; returns how many."""
        cutoff = self.clock() - self.delay_max
        n = bisect.bisect_left(self._times, cutoff)
        if n:
            self.counters["label_expired"] += n
            del self._times[:n], self._frames[:n]
        return n
