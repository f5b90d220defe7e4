"""The summed statistics of a closed-form head (``head_stats.py``): the rows they sum, the
sums themselves, their wire forms (the Gram's triangle, or a factor of it where it holds
fewer rows than half its side) and the checks that hold a participant's claim to its counts.

Pure numpy: a device with a body imports it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import MessageError

__all__ = ["GRAM_KINDS", "HeadSums", "augment", "check_claim", "factored", "factor_rows",
           "triangle_size"]

GRAM_KINDS = ("lda", "ridge")  # the solves whose statistics carry the Gram


def triangle_size(n: int) -> int:
    """Entries of an ``n x n`` symmetric matrix's upper triangle, the diagonal included."""
    return n * (n + 1) // 2


def augment(x: np.ndarray, centre: np.ndarray, clip: float) -> np.ndarray:
    """Embeddings centred by the body's constant, rows clipped to norm ``clip``, and a bias
    column of ones: the rows the statistics are sums over."""
    z = np.asarray(x, np.float32).reshape(len(x), -1) - centre
    norms = np.sqrt(np.einsum("ij,ij->i", z, z))
    over = norms > clip
    if over.any():
        z[over] *= (clip / norms[over])[:, None]
    return np.hstack([z, np.ones((len(z), 1), np.float32)])


@dataclass
class HeadSums:
    """Summed statistics of a linear head on ``d`` features and ``classes`` classes:
    ``gram`` (``(d+1, d+1)``, empty for ``ncm``), ``cross`` (``(d+1, classes)``) and
    ``counts``; the last row and column of ``gram`` and the last row of ``cross`` are the
    bias column's."""

    gram: np.ndarray
    cross: np.ndarray
    counts: np.ndarray

    @classmethod
    def zeros(cls, d: int, classes: int, *, kind: str = "ridge",
              dtype: type = np.float64) -> HeadSums:
        gram: np.ndarray = np.zeros((d + 1, d + 1) if kind in GRAM_KINDS else (0, 0), dtype)
        return cls(gram, np.zeros((d + 1, classes), dtype), np.zeros(classes, dtype))

    @property
    def n(self) -> int:
        return int(round(float(self.counts.sum())))

    @property
    def has_gram(self) -> bool:
        return self.gram.size > 0

    def add_rows(self, a: np.ndarray, y: np.ndarray) -> None:
        """Add augmented rows ``a`` (:func:`augment`) with labels ``y``: one pass each."""
        y = np.asarray(y, np.int64)
        a = a.astype(self.cross.dtype, copy=False)  # products in the sums' precision
        if self.has_gram:
            self.gram += a.T @ a  # BLAS: one rank-k update for the batch
        onehot = np.zeros((len(y), self.counts.size), a.dtype)
        onehot[np.arange(len(y)), y] = 1
        self.cross += a.T @ onehot
        self.counts += np.bincount(y, minlength=self.counts.size).astype(self.counts.dtype)

    def add(self, other: HeadSums, weight: float = 1.0) -> None:
        """Add another participant's sums (``weight`` < 1: its share capped)."""
        if self.has_gram and other.has_gram:  # in place: a Gram is 13 MB in float64
            self.gram += other.gram if weight == 1.0 else weight * other.gram
        self.cross += weight * other.cross
        self.counts += weight * other.counts  # fractional where weighted: bias row and counts agree

    def taken(self) -> HeadSums:
        """These sums, and zero in their place: the increment since the last send.  The
        arrays themselves go (fresh zeros take their place, untouched pages until the next
        rows come): a copy would hold a second Gram (6.6 MB) at a board's peak."""
        out = HeadSums(self.gram, self.cross, self.counts)
        # np.zeros, not zeros_like: it maps zero pages, where zeros_like writes them all.
        self.gram, self.cross, self.counts = (np.zeros(a.shape, a.dtype) for a in (
            out.gram, out.cross, out.counts))
        return out

    def packed(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """float32 for the wire: the Gram's upper triangle row by row, the cross term
        flat, the counts."""
        g = self.gram
        tri = np.concatenate([g[i, i:] for i in range(len(g))]).astype(
            np.float32, copy=False) if self.has_gram else np.zeros(0, np.float32)
        return (tri, self.cross.astype(np.float32, copy=False).ravel(),
                np.rint(self.counts).astype(np.int64))

    @classmethod
    def unpacked(cls, d: int, classes: int, tri: np.ndarray, cross: np.ndarray,
                 counts: np.ndarray, dtype: type = np.float64) -> HeadSums:
        """From the wire's arrays (float64 from here on, or ``dtype``); :class:`MessageError`
        where their sizes do not fit a head on ``d`` features and ``classes`` classes."""
        n = d + 1
        if cross.size != n * classes or counts.size != classes \
                or tri.size not in (0, triangle_size(n)):
            raise MessageError("wrong_length", f"head statistics of {tri.size}, {cross.size} "
                               f"and {counts.size} values; a head on {d} features and "
                               f"{classes} classes has {triangle_size(n)}, {n * classes} and "
                               f"{classes}")
        gram: np.ndarray = np.zeros((n, n) if tri.size else (0, 0), dtype)
        start = 0
        for i in range(n if tri.size else 0):
            row = tri[start:start + n - i]
            gram[i, i:] = row
            gram[i:, i] = row
            start += n - i
        return cls(gram, cross.astype(dtype).reshape(n, classes),
                   np.asarray(counts, dtype).copy())


def factored(d: int, classes: int, factor: np.ndarray, labels: np.ndarray,
             counts: np.ndarray) -> HeadSums:
    """The sums a factor carries (:meth:`HeadStatsPath._factored`): ``G = F^T F`` and the
    cross term ``F^T L``, float64; :class:`MessageError` where the sizes do not fit a head
    on ``d`` features and ``classes`` classes, or there are more rows than pay."""
    n = d + 1
    k = factor.size // n
    if factor.size != k * n or labels.size != k * classes or counts.size != classes \
            or not 0 < k <= factor_rows(d):
        raise MessageError("wrong_length", f"a head factor of {factor.size} and {labels.size} "
                           f"values and {counts.size} counts; a head on {d} features and "
                           f"{classes} classes takes k x {n} and k x {classes} for k from 1 "
                           f"to {factor_rows(d)}, and {classes}")
    f = factor.reshape(k, n)  # products in float32, as the device's own sums are made
    return HeadSums((f.T @ f).astype(np.float64), (f.T @ labels.reshape(k, classes)).astype(
        np.float64), np.asarray(counts, np.float64).copy())


# The most rows a factor carries (a device with that many sends at its next station model):
# each row costs a station as much float32 work as its bytes cost the wire, so that past about
# a hundred the triangle is the cheaper to admit (bench/head_stats.py), and a board's QR of
# them stays small (128 x 1,281: 6 ms on one x86 core).
FACTOR_ROWS = 128


def factor_rows(d: int) -> int:
    """The most rows a factor of a Gram on ``d`` features carries: :data:`FACTOR_ROWS`, and
    never past half its side, where the triangle is fewer bytes."""
    return min(FACTOR_ROWS, (d + 1) // 2)


def check_claim(s: HeadSums, clip: float, *, tolerance: float = 1e-3) -> None:
    """A participant's statistics checked against what their counts imply: the bias
    entries equal the counts, every row's norm within ``clip`` (the trace, the bias row and
    each class's sum), nothing negative on the diagonal.  :class:`MessageError` otherwise."""
    n, d = s.n, s.cross.shape[0] - 1
    slack = tolerance * max(n, 1)
    if np.abs(s.cross[d] - s.counts).max(initial=0.0) > slack:
        raise MessageError("stats_inconsistent", "the bias row of the cross term is not the "
                           "class counts")
    per_class = np.sqrt((s.cross[:d] ** 2).sum(axis=0))
    if (per_class > s.counts * clip * (1 + tolerance) + slack).any():
        raise MessageError("stats_out_of_bounds", "a class's summed embeddings exceed its "
                           "count times the clip")
    if not s.has_gram:
        return
    g = s.gram
    diag = np.diagonal(g)
    if abs(g[d, d] - n) > slack or (diag < -slack).any():
        raise MessageError("stats_inconsistent", f"the Gram's corner is {g[d, d]:.0f}, the "
                           f"counts sum to {n}")
    if np.abs(g[d, :d] - s.cross[:d].sum(axis=1)).max(initial=0.0) > slack * clip + 1e-3:
        raise MessageError("stats_inconsistent", "the Gram's bias row is not the sum of the "
                           "classes' embeddings")
    if diag[:d].sum() > n * clip * clip * (1 + tolerance) + slack:
        raise MessageError("stats_out_of_bounds", f"the Gram's trace {diag[:d].sum():.1f} "
                           f"exceeds {n} rows of norm {clip}")
