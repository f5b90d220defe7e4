"""Unknown parts: how far a frame lies from every product the fleet has labelled, from the
summed statistics of the closed-form head (``head_stats.py``), and the threshold past which
a prediction is flagged ``unknown``.

The score is the smallest Mahalanobis distance from a frame's embedding to the seen
classes' means under their shared within-class covariance (Lee et al., NeurIPS 2018, "A
Simple Unified Framework for Detecting Out-of-Distribution Samples and Adversarial
Attacks", on a frozen body's features), all of it from the sums the fleet adds already:
the class means are ``B / n``, the covariance is ``G`` less its between-class part, and its
penalty is the one GCV chooses for the head.  The distance is divided by the covariance's
effective degrees of freedom, so that a known frame scores about one whatever the body's
width, once the fleet has labelled many more frames than it has features (far more before:
the threshold, read from the same scores, scales with them).  The full precision is
needed: the 256 or 384 directions of least variance, the rest taken as one, score unknown
parts at AUROC 0.77-0.78 against the full matrix's 0.89 (docs/results.md), so a detector
travels as 3.3 MB at 1,280 features and is solved again only as the sums double
(``aggregator/heads.py``).

The threshold is a quantile of known frames' scores, and those must be scored before they
join the sums (a frame inside the sums lies closer to its mean: the in-sample 95th
percentile is 0.65-0.91 of the held-out one).  So each device scores every labelled frame
it adds, with the detector it holds, into a fixed histogram (:func:`binned`) that travels
with its statistics; the cloud sums the histograms of frames scored by the detector in use
and sets the threshold at the share of known frames to flag (``[model] unknown_share``),
one threshold for the fleet, the way federated conformal prediction calibrates a quantile
from its clients' scores (Lu et al., ICML 2023, "Federated Conformal Predictors for
Distributed Uncertainty Quantification"; here from a histogram, as the sums are).

Pure numpy: a device with a body imports it.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from . import messages as m
from .errors import MessageError
from .head_solves import HeadSums, _centred, _eigenbasis

__all__ = ["Detector", "DeviceNovelty", "solve_detector", "binned", "threshold_of", "BINS",
           "MIN_CALIBRATION"]

log = logging.getLogger(__name__)

# The histogram of scores: 16 bins an octave (the threshold is read to 4%) from 1/64 to 2^24
# times the degrees of freedom, and one bin each side for what falls outside.  A known frame
# scores about 1 once the sums hold many more frames than the body has features; far more
# before (a camera line's first detectors, from a few hundred frames of a few items:
# 1,400-12,000, each new frame off the few directions seen), and its threshold with them.
_PER_OCTAVE, _LOW, _OCTAVES = 16, -6, 30
EDGES = 2.0 ** (_LOW + np.arange(_PER_OCTAVE * _OCTAVES + 1) / _PER_OCTAVE)
BINS = len(EDGES) + 1
# Known frames scored by a detector before its threshold is read from them (the 95th
# percentile of 200 is within about 1.5 points of share).
MIN_CALIBRATION = 200


@dataclass(frozen=True)
class Detector:
    """A solved detector: the sums' ``mean``, the seen classes' ``means`` about it (``(seen,
    d)``), which classes they are, the within-class ``precision`` (``(d, d)``), its
    degrees of freedom ``df``, and the ``samples`` it was solved from (its name on the wire:
    the histograms a device scored with it say so)."""

    mean: np.ndarray
    means: np.ndarray
    seen: np.ndarray
    precision: np.ndarray
    df: float
    samples: int
    _pm: np.ndarray = field(init=False, repr=False, compare=False)
    _at_means: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Per detector, not per frame: P m_c and m_c^T P m_c (a class's C x d x d, ten times
        # a frame's cost where a camera predicts one frame at a time).
        pm = self.means @ self.precision
        object.__setattr__(self, "_pm", pm)
        object.__setattr__(self, "_at_means", np.einsum("ij,ij->i", pm, self.means))

    def scores(self, rows: np.ndarray) -> np.ndarray:
        """Each row's (an embedding centred by the body and clipped, as ``augment`` makes it,
        with or without its bias column) smallest distance to a seen class's mean, over
        ``df``: about one for a known frame where the sums hold many."""
        d = self.mean.size
        x = np.asarray(rows, np.float32)[:, :d] - self.mean
        own = np.einsum("ij,ij->i", x @ self.precision, x)
        dist = own[:, None] - 2.0 * (x @ self._pm.T) + self._at_means[None, :]
        return np.maximum(dist.min(axis=1), 0.0) / self.df

    def packed(self) -> np.ndarray:
        """As one float32 vector: ``df``, ``samples``, the features and classes, the seen
        mask, the mean, the means of every class (zeros where unseen) and the precision's
        upper triangle."""
        d, classes = self.mean.size, self.seen.size
        means = np.zeros((classes, d), np.float32)
        means[self.seen] = self.means
        tri = self.precision[np.triu_indices(d)]
        return np.concatenate([np.array([self.df, self.samples, d, classes], np.float32),
                               self.seen.astype(np.float32), self.mean, means.ravel(),
                               tri]).astype(np.float32)

    @classmethod
    def unpacked(cls, vector: np.ndarray, features: int, classes: int) -> Detector:
        """From :meth:`packed`, checked: a :class:`MessageError` where it is not a detector
        for ``features`` and ``classes`` or holds a non-finite number."""
        d, c = features, classes
        size = 4 + c + d + c * d + d * (d + 1) // 2
        v = np.asarray(vector, np.float32)
        if v.size != size or int(v[2]) != d or int(v[3]) != c:
            raise MessageError("wrong_length", f"a detector of {v.size} numbers, not one "
                               f"for {d} features and {c} classes ({size})")
        if not np.isfinite(v).all() or not v[0] > 0:
            raise MessageError("not_finite", "a detector with a non-finite number or no "
                               "degrees of freedom")
        seen = v[4:4 + c] > 0.5
        at = 4 + c
        mean = v[at:at + d].copy()
        means = v[at + d:at + d + c * d].reshape(c, d)[seen].copy()
        precision = np.zeros((d, d), np.float32)
        tri = v[at + d + c * d:]
        start = 0
        for i in range(d):  # row by row: index arrays of the triangle are 13 MB on a board
            precision[i, i:] = tri[start:start + d - i]
            start += d - i
        precision += np.triu(precision, 1).T
        return cls(mean, means, seen, precision, float(v[0]), int(v[1]))


def solve_detector(s: HeadSums, lam: float | None = None) -> Detector:
    """The detector these sums give: the within-class covariance (the total scatter less its
    between-class part, over ``N - classes``) with the head's GCV penalty, inverted."""
    _, _, _, lam, _ = _eigenbasis(s, lam, "an unknown-part detector")
    gram, cross, mean, _ = _centred(s)
    seen = s.counts > 0
    counts = s.counts[seen].astype(np.float64)
    free = max(s.n - int(seen.sum()), 1)
    sums = cross[:, seen]
    within = (gram - (sums / counts) @ sums.T) / free
    eig, vecs = np.linalg.eigh((within + within.T) / 2)
    eig = np.maximum(eig, 0.0)
    ridge = lam / free
    precision = (vecs / (eig + ridge)) @ vecs.T
    return Detector(mean.astype(np.float32), (sums / counts).T.astype(np.float32), seen,
                    precision.astype(np.float32), float((eig / (eig + ridge)).sum()), s.n)


def binned(scores: np.ndarray) -> np.ndarray:
    """Scores as counts in the fleet's fixed bins (``BINS``, int64)."""
    return np.bincount(np.searchsorted(EDGES, scores, side="right"),
                       minlength=BINS).astype(np.int64)


def threshold_of(counts: np.ndarray, share: float) -> float:
    """The score above which ``share`` of the frames counted lie (read within the bin it
    falls in, on a log scale); ``inf`` where fewer than :data:`MIN_CALIBRATION` were counted
    or ``share`` is 0 (flag nothing)."""
    counts = np.asarray(counts, np.float64)
    total = float(counts.sum())
    if share <= 0 or total < MIN_CALIBRATION:
        return math.inf
    want = (1.0 - share) * total
    cum = np.cumsum(counts)
    i = int(np.searchsorted(cum, want, side="left"))
    if i == 0:
        return float(EDGES[0])
    if i >= len(EDGES):
        return float(EDGES[-1])
    before = cum[i - 1]
    part = (want - before) / counts[i] if counts[i] else 1.0
    return float(EDGES[i - 1] * (EDGES[i] / EDGES[i - 1]) ** part)


class DeviceNovelty:
    """A device's side: the detector and threshold its station last sent, the scores of the
    labelled frames it adds to its statistics (binned, sent with them), and each
    prediction's score and flag."""

    def __init__(self, features: int, classes: int, counters: Counter[str], name: str) -> None:
        self.features, self.classes, self.counters, self.name = features, classes, counters, name
        self.detector: Detector | None = None
        self.threshold = math.inf  # none calibrated yet: nothing is flagged
        self.scored = np.zeros(BINS, np.int64)  # since the last send, by ``detector``

    def receive(self, model: m.StationModel) -> None:
        """The detector a model carries (a bad one refused and counted, the one held kept)
        and the fleet's threshold."""
        if model.novelty.size:
            try:
                detector = Detector.unpacked(model.novelty, self.features, self.classes)
            except MessageError as exc:
                self.counters[f"rejected.novelty.{exc.reason}"] += 1
                log.warning("device %s: refused the unknown-part detector of round %d: %s",
                            self.name, model.round, exc)
            else:
                if self.detector is None or detector.samples != self.detector.samples:
                    self.scored[:] = 0  # another detector's scores calibrate nothing of this one
                self.detector = detector
                self.counters["novelty.detectors"] += 1
        self.threshold = model.novelty_threshold or math.inf

    def calibrate(self, rows: np.ndarray) -> None:
        """Labelled frames' rows, scored before they join the sums."""
        if self.detector is not None and len(rows):
            self.scored += binned(self.detector.scores(rows))

    def taken(self) -> tuple[np.ndarray, int]:
        """The scores since the last send and the detector they are of, as a
        :class:`~messages.HeadStats` carries them (none: empty, 0)."""
        if self.detector is None or not self.scored.any():
            return np.zeros(0, np.int64), 0
        out = self.scored.copy()
        self.scored[:] = 0
        return out, self.detector.samples

    def judge(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray | None] | None:
        """Each row's score and whether it is unknown (None while no threshold is
        calibrated); None where no detector came yet."""
        if self.detector is None:
            return None
        scores = self.detector.scores(rows)
        if not math.isfinite(self.threshold):
            return scores, None
        unknown = scores > self.threshold
        self.counters["predictions.unknown"] += int(unknown.sum())
        return scores, unknown
