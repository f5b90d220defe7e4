"""Labels that arrive live, from the line itself, joined to the frames they describe.

An inspection station's verdict, a barcode reader or an operator's button publishes
``{"t": <unix seconds>, "label": <int>}`` on a topic of the device's broker seconds after
the frame.  :class:`LiveLabels` keeps the unlabelled frames in a bounded ring (with the
prediction made when each arrived), joins each label to the frame read nearest before
``t`` plus the camera's lag (``label_lag.py``) within ``window`` seconds, and drops frames
still unlabelled after ``delay_max`` seconds.  A label whose ``t`` is exactly a frame's read
time (a prediction's own ``t``, which the line answered) is the line's verdict on that very
frame, and joins it whatever the lag (``label_joined_exact``): the line then measures its
predictions on the frames the device trains on.  It is a state machine: the device service
feeds it frames and payloads and trains on what it returns; it does no I/O.
"""

from __future__ import annotations

import bisect
import heapq
import json
import logging
import math
from collections import Counter
from collections.abc import Callable

import numpy as np

from ..admission import LogLimiter
from ..catalogue import Catalogue, HeldLabels
from ..errors import MessageError
from ..messages import is_product_name
from .label_lag import LagEstimator

__all__ = ["LiveLabels", "parse_label", "MAX_LABEL_PAYLOAD"]

log = logging.getLogger(__name__)

MAX_LABEL_PAYLOAD = 1024  # bytes: a label is a few dozen
JOIN_SLACK = 1e-3  # s: a frame read this little after a label's time is the one it names
EXACT = 1e-6  # s: a label's time this close to a frame's read time names that frame


def parse_label(payload: bytes, num_classes: int, names: dict[str, int] | None = None,
                awaited: Callable[[str], int | None] | None = None) -> tuple[float, int]:
    """``(t, label)`` of one label message, its label a class number or, where the fleet
    names its classes (``names``), a product's name; a product not named yet gets the
    (negative) label ``awaited`` holds it by; :class:`MessageError` (with a counter-ready
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
    if type(label) is str:
        if not names:
            raise MessageError("unknown_product", f"label {label[:40]!r} names a product, and "
                               "this fleet's classes have no names ([model] class_names)")
        code = awaited(label) if awaited is not None and label not in names \
            and is_product_name(label) else None
        if code is not None:
            return float(t), code
        if label not in names:
            raise MessageError("unknown_product", f"no product {label[:40]!r} in this "
                               f"fleet's classes ({', '.join(list(names)[:8])}"
                               f"{', ...' if len(names) > 8 else ''})")
        return float(t), names[label]
    if type(label) is not int or not 0 <= label < num_classes:
        raise MessageError("out_of_range", f"label {str(label)[:40]!r} outside "
                           f"[0, {num_classes})")
    if names and label >= len(names):  # a free class: the line numbers what is not a product
        raise MessageError("no_product", f"class {label} is no product yet (the fleet's are "
                           f"classes 0-{len(names) - 1}): name a new one, and add it")
    return float(t), label


Joined = tuple[np.ndarray, int, int]  # (sample, label, class predicted on arrival)


class LiveLabels:
    """Frames waiting for their labels.

    Parameters
    ----------
    num_classes : int
    class_names : tuple of str
        The products' names, class 0 first: a label may name one instead of its number.
    catalogue, held : Catalogue, HeldLabels
        The fleet's products as the device last heard them (instead of ``class_names``),
        and where a label naming a product to come is held (joined to its frame, with a
        negative label: ``edge_client/catalogue.py``).
    window : float
        A label joins the frame read nearest before ``t + lag`` and at most this many
        seconds before it; a label with no such frame is ``label_unmatched``.
    delay_max : float
        Frames wait this long for a label, then are dropped (``label_expired``); labels
        wait this long for the frames read ``lag`` after their time (``label_unmatched``).
    lag : float or "auto"
        Seconds a frame reaches the device after the time a label names (``label_lag.py``):
        fixed, or ``"auto"``, measured from the labels and applied once they call for it.
        Either way the measured figure is kept (``estimate``) and a fixed lag the labels
        disagree with is warned about.
    capacity : int
        Frames held at most: the oldest go first (counted as expired) when the ring is full;
        labels waiting for their frames, likewise (counted as unmatched).
    """

    def __init__(self, num_classes: int, *, window: float, delay_max: float,
                 lag: float | str = "auto", capacity: int = 4096,
                 clock: Callable[[], float] | None = None,
                 class_names: tuple[str, ...] = (), catalogue: Catalogue | None = None,
                 held: HeldLabels | None = None) -> None:
        import time

        self.num_classes, self.window, self.delay_max = num_classes, window, delay_max
        self.catalogue = catalogue or Catalogue(num_classes, class_names)
        self.held = held
        self.capacity = capacity
        self.clock = clock or time.time
        self.auto = lag == "auto"
        self.lag = 0.0 if self.auto else float(lag)  # the lag the join applies
        self.estimator = LagEstimator(num_classes, window, delay_max)
        self.counters: Counter[str] = Counter()
        self._times: list[float] = []  # read times, ascending
        self._frames: list[tuple[np.ndarray, int]] = []  # (sample, predicted class)
        self._newest = -math.inf  # the latest read time seen
        self._waiting: list[tuple[float, float, int]] = []  # heap of (t, arrived, label)
        self._limiter = LogLimiter()

    @property
    def pending(self) -> int:
        return len(self._times)

    @property
    def newest(self) -> float:
        """The latest read time of a frame handed over (-inf before the first)."""
        return self._newest

    @property
    def estimate(self) -> float | None:
        """The lag the labels point to, once they explain the frames well enough to say
        (seconds; None before)."""
        return self.estimator.last.lag if self.estimator.last is not None else None

    def add_frames(self, x: np.ndarray, times: np.ndarray, predicted: np.ndarray) -> list[Joined]:
        """Unlabelled frames, with their read times and the predictions made on arrival;
        returns the labels that were waiting for them, joined."""
        for sample, t, p in zip(x, times, predicted, strict=True):
            i = bisect.bisect_right(self._times, float(t))  # cameras deliver in order
            self._times.insert(i, float(t))
            self._frames.insert(i, (sample, int(p)))
            self._newest = max(self._newest, float(t))
        overflow = len(self._times) - self.capacity
        if overflow > 0:
            self.counters["label_expired"] += overflow
            del self._times[:overflow], self._frames[:overflow]
        self.estimator.frames(x, np.asarray(times, dtype=np.float64))
        self._judge_lag()
        return self._join_ready()

    def add_label(self, payload: bytes) -> list[Joined]:
        """One label message: joined at once when its frame has been read, else when it is
        (:meth:`add_frames`); refused messages are counted."""
        try:
            t, label = parse_label(payload, self.num_classes, self.catalogue.index,
                                   self.held.code if self.held is not None else None)
            if t > self.clock() + self.delay_max:  # it would wait for frames for ever
                raise MessageError("bad_time", f"t = {t} is more than {self.delay_max} s ahead "
                                   "of this device's clock")
        except MessageError as exc:
            self.counters[f"label_refused.{exc.reason}"] += 1
            if self._limiter.allow("labels", exc.reason):
                log.warning("refused a label message (%s): %s; such messages are counted as "
                            "label_refused.%s", exc.reason, exc, exc.reason)
            return []
        if label >= 0:  # a product to come says nothing of the lag until its class exists
            self.estimator.label(t, label)
        i = bisect.bisect_left(self._times, t - EXACT)
        if i < len(self._times) and self._times[i] <= t + EXACT:
            self.counters["label_joined_exact"] += 1
            return [self._take(i, label)]
        if len(self._waiting) >= self.capacity:
            self.counters["label_unmatched"] += 1
            heapq.heappushpop(self._waiting, (t, self.clock(), label))
        else:
            heapq.heappush(self._waiting, (t, self.clock(), label))
        return self._join_ready()

    def _join_ready(self) -> list[Joined]:
        # Frames arrive in order: once one read after t + lag is in, the frame read nearest
        # before it is known.
        out = []
        while self._waiting and self._waiting[0][0] + self.lag <= self._newest:
            t, _, label = heapq.heappop(self._waiting)
            joined = self._join(t + self.lag, label)
            if joined is not None:
                out.append(joined)
        return out

    def _join(self, at: float, label: int) -> Joined | None:
        # A label stamped with a frame's own time (a prediction's ``t`` or ``item_t``)
        # joins that frame though the lag's arithmetic moved it by a float's last digit.
        i = bisect.bisect_right(self._times, at + JOIN_SLACK) - 1
        if i < 0 or at - self._times[i] > self.window:
            self.counters["label_unmatched"] += 1
            return None
        return self._take(i, label)

    def _take(self, i: int, label: int) -> Joined:
        del self._times[i]
        sample, predicted = self._frames.pop(i)
        self.counters["label_joined"] += 1
        return sample, label, predicted

    def _judge_lag(self) -> None:
        verdict = self.estimator.estimate(self.lag)
        if verdict is not None and verdict.ambiguous:
            self.counters["label_lag_ambiguous"] += 1
            if self._limiter.allow("labels", "ambiguous"):
                log.warning("labels fit several lags as well as %.2f s (a line whose products "
                            "pass in a fixed cycle fits a shift of a whole item too): joining "
                            "at %.2f s, the lag nearest zero; where the line knows how late "
                            "its labels name their items, set [source] label_lag "
                            "(docs/sources.md)", verdict.lag, self.lag)
        if verdict is None or not verdict.called_for or verdict.lag == self.lag:
            return
        if self.auto:
            log.info("labels name times %.2f s before this device reads their frames (they "
                     "explain %.0f%% of the frames' variance there, %.0f%% at the %.2f s "
                     "applied so far): joining them %.2f s later (label_lag = \"auto\")",
                     verdict.lag, 100 * verdict.explained, 100 * verdict.at_applied, self.lag,
                     verdict.lag)
            self.lag = verdict.lag
            self.counters["label_lag_changes"] += 1
            return
        self.counters["label_lag_mismatch"] += 1
        if self._limiter.allow("labels", "lag"):
            log.warning("labels may be joined to the wrong frames: they explain %.0f%% of the "
                        "frames' variance when they name frames read %.2f s after their time, "
                        "%.0f%% at label_lag = %.2f s; set [source] label_lag = %.2f or "
                        "\"auto\" (docs/sources.md)", 100 * verdict.explained, verdict.lag,
                        100 * verdict.at_applied, self.lag, verdict.lag)

    def expire(self) -> int:
        """Drop frames that waited longer than ``delay_max`` (returns how many), and labels
        whose frames never came (a camera that stopped)."""
        now = self.clock()
        cutoff = now - self.delay_max
        n = bisect.bisect_left(self._times, cutoff)
        if n:
            self.counters["label_expired"] += n
            del self._times[:n], self._frames[:n]
        if self._waiting and any(arrived < cutoff for _, arrived, _ in self._waiting):
            kept = [w for w in self._waiting if w[1] >= cutoff]
            self.counters["label_unmatched"] += len(self._waiting) - len(kept)
            heapq.heapify(kept)
            self._waiting = kept
        return n
