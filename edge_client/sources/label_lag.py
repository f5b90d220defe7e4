"""How late a camera's frames reach the device, measured from the labels the line sends.

A label names the time the line saw its item; the device stamps a frame when it reads it.
A network camera delivers frames late (ffmpeg's MJPEG server to OpenCV: two frames, 1 s at
2 fps), so the frame read nearest before a label's ``t`` shows what was in front of the
camera a lag earlier, and the label trains the model on the wrong picture.  MJPEG over HTTP
carries no capture time, and an RTSP camera's clock is not the line's, so the device measures
the lag where it can: from its labelled window.  A lag may be negative: a line that stamps
its verdict when an inspection station downstream makes it names a time after its frames.
Joined at the right shift, frames of one class look alike and frames of different classes
do not; joined at a wrong one, each class gathers whatever passed the camera a lag earlier.
The estimate is a shift at which the labels explain most of the frames' variance (the R^2
of the class means, as in a one-way analysis of variance).  It needs no trained model: a
model the mis-joined labels trained agrees with nothing when the lag is longer than an item
stays in view, so the shift that best agrees with the model in use would find no signal
exactly where the lag hurts most.

:class:`LagEstimator` keeps what it has read (time, and the frame or embedding reduced to
``DIMS`` random projections) and, for each label once the frames ``MAX_LAG`` seconds past
its time are in, takes the frame read nearest before ``t + shift`` for every shift of a grid
(``STEP`` apart, ``-MAX_LAG`` to ``MAX_LAG``).  Over the last ``KEEP`` labels, the R^2 averaged
over ``SMOOTH`` neighbouring shifts, the estimate is the middle of the run of shifts within
``TIE`` of the peak nearest a lag of zero among the peaks within ``PEAK_SHARE`` of the best,
made only when the best R^2 is well above what labels independent of the frames would give
(``INFORMATIVE``).  The middle, because a label stamped at an item's start or end fits a
run as long as the item is in view, and its edges join the neighbours; the run nearest zero,
because a line whose products come in a fixed cycle fits every shift by a whole item too (the
labels then name another class consistently, which the variance cannot tell from the right
one), and a camera's own delay is the short one.  A state machine: no I/O.
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
MIN_LABELS = 64  # labels scored before any estimate ...
# ... over this many seconds of the line at least: 64 labels answering predictions at 10 a
# second are six items, which a shift of a few items can fit by chance (seen over a real
# camera: -1.75 s, then the right 0.30 s once more items were in)
MIN_SPAN = 20.0
EVERY = 16  # labels scored between two estimates
TIE = 0.02  # R^2 within this of a peak counts as the peak (the noise of a few hundred)
# A peak within this share of the best is as good a fit: a line whose products come in a
# fixed cycle fits a shift of a whole item as well as the right one, to its noise.
PEAK_SHARE = 0.1
SMOOTH = 3  # shifts the R^2 is averaged over before its peaks are found (0.15 s)
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
    # Other peaks fit as well (PEAK_SHARE): products in a fixed cycle, whose labels the
    # variance cannot place; the estimate takes the peak nearest zero ...
    ambiguous: bool = False
    # ... and the lag in use stays where it fits as well as they do.
    applied_fits: bool = False

    @property
    def called_for(self) -> bool:
        return self.explained - self.at_applied >= BETTER and not self.applied_fits


class LagEstimator:
    """Frames as read and labels as named, to the lag between them (see the module)."""

    def __init__(self, num_classes: int, window: float, history_s: float) -> None:
        self.num_classes, self.window, self.history_s = num_classes, window, history_s
        self.grid = np.round(np.arange(-MAX_LAG, MAX_LAG + STEP / 2, STEP), 6)
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
        self._span = (np.inf, -np.inf)  # the first and last time a label scored named
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
        # a label is scored once frames MAX_LAG past it are in, against frames as far before
        oldest = self._t[self._hi - 1] - self.history_s - 2 * MAX_LAG - self.window
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
        self._span = (min(self._span[0], ready[0][0]), max(self._span[1], ready[-1][0]))

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
        """A new verdict every ``EVERY`` labels scored, once ``MIN_LABELS`` are over
        ``MIN_SPAN`` seconds; None between them or while the labels explain the frames no
        better than independent labels."""
        if len(self._rows) < MIN_LABELS or self._scored_since < EVERY \
                or self._span[1] - self._span[0] < MIN_SPAN:
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
        fit = _smoothed(r2)
        top = float(np.max(fit))
        floor = top - max(TIE, PEAK_SHARE * top)
        peaks = _peaks(fit, floor)
        peak = min(peaks, key=lambda i: abs(self.grid[i]))
        lo = hi = peak
        while lo > 0 and fit[lo - 1] >= fit[peak] - TIE:
            lo -= 1
        while hi < len(fit) - 1 and fit[hi + 1] >= fit[peak] - TIE:
            hi += 1
        lag = round(float(np.round((self.grid[lo] + self.grid[hi]) / 2 / STEP) * STEP), 3)
        at = fit[int(np.argmin(np.abs(self.grid - applied)))]
        # Other peaks as good, or one run so wide (half the shifts tried) that the labels fit
        # nearly any lag: a line of one product, or of products in a fixed cycle.
        ambiguous = any(not lo <= i <= hi for i in peaks) or hi - lo >= len(fit) // 2
        self.last = LagVerdict(lag, float(fit[(lo + hi) // 2]),
                               0.0 if not np.isfinite(at) else float(at),
                               ambiguous=ambiguous, applied_fits=ambiguous and at >= floor)
        return self.last


def _smoothed(r2: np.ndarray) -> np.ndarray:
    """R^2 averaged over ``SMOOTH`` neighbouring shifts where they have one (-inf where none)."""
    known = np.isfinite(r2)
    kernel = np.ones(SMOOTH)
    total = np.convolve(np.where(known, r2, 0.0), kernel, mode="same")
    count = np.convolve(known.astype(float), kernel, mode="same")
    return np.where(known, total / np.maximum(count, 1), -np.inf)


def _peaks(fit: np.ndarray, floor: float) -> list[int]:
    """Shifts where the fit is at least ``floor`` and no lower than either neighbour."""
    left = np.concatenate([[-np.inf], fit[:-1]])
    right = np.concatenate([fit[1:], [-np.inf]])
    return np.flatnonzero((fit >= floor) & (fit >= left) & (fit >= right)).tolist()
