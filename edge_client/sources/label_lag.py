"""How late a camera's frames reach the device, measured from the labels the line sends.

A label names the time the line saw its item; the device stamps a frame when it reads it.
A network camera delivers frames late (ffmpeg's MJPEG server to OpenCV: two frames, 1 s at
2 fps), so the frame read nearest before a label's ``t`` shows what was in front of the
camera a lag earlier, and the label trains the model on the wrong picture.  MJPEG over HTTP
carries no capture time, and an RTSP camera's clock is not the line's, so the device measures
the lag where it can: from its labelled window.  Joined at the right shift, frames of one
class look alike and frames of different classes do not; joined at a wrong one, each class
gathers whatever passed the camera a lag earlier.  The estimate is the shift at which the
labels explain most of the frames' variance (the R^2 of the class means, as in a one-way
analysis of variance).  It needs no trained model: a model the mis-joined labels trained
agrees with nothing when the lag is longer than an item stays in view, so the shift that
best agrees with the model in use would find no signal exactly where the lag hurts most.

:class:`LagEstimator` keeps what it has read (time, and the frame or embedding reduced to
``DIMS`` random projections) and, for each label once the frames ``MAX_LAG`` seconds past
its time are in, takes the frame read nearest before ``t + shift`` for every shift of a grid
(``STEP`` apart, 0 to ``MAX_LAG``).  Over the last ``KEEP`` labels the estimate is the middle
of the run of shifts within ``TIE`` of the best R^2; it is made only when that R^2 is well
above what labels independent of the frames would give (``INFORMATIVE``).  A state machine:
no I/O.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

import numpy as np

from ..config.sources import MAX_LABEL_LAG as MAX_LAG

__all__ = ["LagEstimator", "LagVerdict", "MAX_LAG", "STEP"]

STEP = 0.05  # s between the shifts tried
DIMS = 16  # random projections a frame is reduced to: 64 bytes a frame kept
KEEP = 400  # labels the estimate is made over
MIN_LABELS = 64  # labels scored before any estimate
EVERY = 16  # labels scored between two estimates
TIE = 0.02  # R^2 within this of the best counts as the best (the noise of a few hundred)
INFORMATIVE = 0.1  # R^2 above what independent labels give that an estimate needs
BETTER = 0.05  # R^2 a shift must gain over the lag in use to call for it
HISTORY = 16384  # frames kept (labels may come label_delay_max late)


@dataclass(frozen=True)
class LagVerdict:
    """An estimate: the lag, the share of the frames' variance the labels explain there and
    at the lag in use, and whether the labels call for the estimate."""

    lag: float
    explained: float
    at_applied: float

    @property
    def called_for(self) -> bool:
        return self.explained - self.at_applied >= BETTER


class LagEstimator:
    """Frames as read and labels as named, to the lag between them (see the module)."""

    def __init__(self, num_classes: int, window: float, history_s: float) -> None:
        self.num_classes, self.window, self.history_s = num_classes, window, history_s
        self.grid = np.round(np.arange(0.0, MAX_LAG + STEP / 2, STEP), 6)
        self._projection: np.ndarray | None = None  # drawn at the first frame, fixed seed
        # Frames read, oldest first, in [lo, hi) of two arrays of twice the history: appends
        # are slices, and the scoring searches the live part in place.
        self._t = np.empty(2 * HISTORY)
        self._v = np.empty((2 * HISTORY, DIMS), dtype=np.float32)
        self._lo = self._hi = 0
        self._waiting: list[tuple[float, int]] = []  # (t, label) until frames pass t + MAX_LAG
        # Per scored label: the projected frame joined at each shift, and whether one was.
        self._rows: deque[np.ndarray] = deque(maxlen=KEEP)
        self._found: deque[np.ndarray] = deque(maxlen=KEEP)
        self._labels: deque[int] = deque(maxlen=KEEP)
        self._scored_since = 0
        self.last: LagVerdict | None = None

    def frames(self, x: np.ndarray, times: np.ndarray) -> None:
        """Frames (or embeddings) read, with their read times, ascending."""
        n = min(len(times), HISTORY)
        if not n:
            return
        flat = np.asarray(x, dtype=np.float32).reshape(len(times), -1)[-n:]
        if self._projection is None or self._projection.shape[0] != flat.shape[1]:
            rng = np.random.default_rng(0)
            self._projection = rng.standard_normal((flat.shape[1], DIMS)).astype(np.float32)
        if self._hi + n > len(self._t):  # move the newest to the front
            keep = min(self._hi - self._lo, HISTORY - n)
            self._t[:keep] = self._t[self._hi - keep:self._hi]
            self._v[:keep] = self._v[self._hi - keep:self._hi]
            self._lo, self._hi = 0, keep
        self._t[self._hi:self._hi + n] = np.asarray(times, dtype=np.float64)[-n:]
        self._v[self._hi:self._hi + n] = flat @ self._projection
        self._hi += n
        oldest = self._t[self._hi - 1] - self.history_s - MAX_LAG - self.window
        self._lo += int(np.searchsorted(self._t[self._lo:self._hi], oldest))
        self._lo = max(self._lo, self._hi - HISTORY)
        self._score(self._t[self._hi - 1])

    def label(self, t: float, label: int) -> None:
        if len(self._waiting) < HISTORY:
            heapq.heappush(self._waiting, (t, label))

    def _score(self, newest: float) -> None:
        ready = []
        while self._waiting and self._waiting[0][0] + MAX_LAG <= newest:
            ready.append(heapq.heappop(self._waiting))
        if not ready:
            return
        times, seen = self._t[self._lo:self._hi], self._v[self._lo:self._hi]
        target = np.array([r[0] for r in ready])[:, None] + self.grid[None, :]
        i = np.searchsorted(times, target, side="right") - 1
        found = (i >= 0) & (target - times[np.maximum(i, 0)] <= self.window)
        self._rows.extend(seen[np.maximum(i, 0)])
        self._found.extend(found)
        self._labels.extend(r[1] for r in ready)
        self._scored_since += len(ready)

    def explained(self) -> np.ndarray:
        """R^2 of the class means at each shift (NaN where too few labels found a frame)."""
        x = np.stack(self._rows).astype(np.float64)  # (labels, shifts, DIMS)
        found = np.stack(self._found).astype(np.float64)  # (labels, shifts)
        onehot = np.eye(self.num_classes)[np.array(self._labels)]  # (labels, classes)
        x = x * found[:, :, None]
        n = found.sum(axis=0)  # (shifts,)
        total = x.sum(axis=0)  # (shifts, DIMS)
        square = (x ** 2).sum(axis=(0, 2))
        per_class = np.einsum("lc,lsd->csd", onehot, x)
        counts = np.einsum("lc,ls->cs", onehot, found)
        mean_sq = (total ** 2).sum(axis=1) / np.maximum(n, 1)
        between = ((per_class ** 2).sum(axis=2) / np.maximum(counts, 1)).sum(axis=0) - mean_sq
        within_total = square - mean_sq
        with np.errstate(invalid="ignore", divide="ignore"):
            r2 = between / within_total
        return np.where((n >= MIN_LABELS // 2) & (within_total > 0), r2, np.nan)

    def estimate(self, applied: float) -> LagVerdict | None:
        """A new verdict every ``EVERY`` labels scored, once ``MIN_LABELS`` are; None between
        them or while the labels explain the frames no better than independent labels."""
        if len(self._rows) < MIN_LABELS or self._scored_since < EVERY:
            return None
        self._scored_since = 0
        r2 = self.explained()
        if np.isnan(r2).all():
            return None
        best = int(np.nanargmax(r2))
        # Independent labels explain (classes - 1) / (labels - 1) of the variance.
        classes = len(set(self._labels))
        if classes < 2 or r2[best] < (classes - 1) / (len(self._labels) - 1) + INFORMATIVE:
            return None
        lo = hi = best
        while lo > 0 and r2[lo - 1] >= r2[best] - TIE:
            lo -= 1
        while hi < len(r2) - 1 and r2[hi + 1] >= r2[best] - TIE:
            hi += 1
        lag = round(float(np.round((self.grid[lo] + self.grid[hi]) / 2 / STEP) * STEP), 3)
        at = float(r2[int(np.argmin(np.abs(self.grid - applied)))])
        self.last = LagVerdict(lag, float(r2[best]), 0.0 if np.isnan(at) else at)
        return self.last
