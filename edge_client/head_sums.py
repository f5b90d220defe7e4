"""The summed statistics of a closed-form head (``head_stats.py``): the rows they sum, the
sums themselves, their wire forms (the Gram's triangle, or a factor of it where it holds
fewer rows than half its side) and the checks that hold a participant's claim to its counts.

Pure numpy: a device with a body imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from .errors import MessageError

__all__ = ["GRAM_KINDS", "Claim", "HeadSums", "augment", "check_claim", "check_parts", "claim_of",
           "factor_rows", "one_hot", "pack_triangle", "triangle_index", "triangle_size",
           "unpack_triangle"]

GRAM_KINDS = ("lda", "ridge")  # the solves whose statistics carry the Gram


def triangle_size(n: int) -> int:
    """Entries of an ``n x n`` symmetric matrix's upper triangle, the diagonal included."""
    return n * (n + 1) // 2


@lru_cache(maxsize=4)
def triangle_index(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Where the packed upper triangle of an ``n x n`` matrix (row by row, the diagonal
    included) lives: its entries' flat positions in the matrix, and the triangle's positions
    of the diagonal and of the last column (a head's bias column)."""
    rows, cols = np.triu_indices(n)
    starts = np.arange(n) * n - np.arange(n) * (np.arange(n) - 1) // 2
    return rows * n + cols, starts, starts + (n - 1 - np.arange(n))


def unpack_triangle(tri: np.ndarray, n: int, dtype: type = np.float64) -> np.ndarray:
    """The symmetric ``n x n`` matrix whose packed upper triangle is ``tri``: row by row
    (3.9 ms on 1,281, where a scatter of the whole triangle took 7.9)."""
    g: np.ndarray = np.zeros((n, n), dtype)
    start = 0
    for i in range(n):
        row = tri[start:start + n - i]
        g[i, i:] = row
        g[i:, i] = row
        start += n - i
    return g


def pack_triangle(g: np.ndarray) -> np.ndarray:
    """The square ``g``'s upper triangle, row by row, the diagonal included: the wire's
    layout (:func:`unpack_triangle` undoes it)."""
    flat, _, _ = triangle_index(len(g))
    return np.ascontiguousarray(g).ravel()[flat]


def one_hot(y: np.ndarray, classes: int, dtype: Any = np.float64) -> np.ndarray:
    """Labels ``y`` as rows of ``classes`` columns, a one in each."""
    out: np.ndarray = np.zeros((len(y), classes), dtype)
    out[np.arange(len(y)), y] = 1
    return out


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
        self.cross += a.T @ one_hot(y, self.counts.size, a.dtype)
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
        tri = pack_triangle(self.gram).astype(np.float32, copy=False) if self.has_gram \
            else np.zeros(0, np.float32)
        return (tri, self.cross.astype(np.float32, copy=False).ravel(),
                np.rint(self.counts).astype(np.int64))

    @classmethod
    def unpacked(cls, d: int, classes: int, tri: np.ndarray, cross: np.ndarray,
                 counts: np.ndarray, dtype: type = np.float64) -> HeadSums:
        """From the wire's arrays (float64 from here on, or ``dtype``); :class:`MessageError`
        where their sizes do not fit a head on ``d`` features and ``classes`` classes."""
        n = d + 1
        _check_sizes(d, classes, tri, cross, counts)
        gram = unpack_triangle(tri, n, dtype) if tri.size else np.zeros((0, 0), dtype)
        return cls(gram, cross.astype(dtype).reshape(n, classes),
                   np.asarray(counts, dtype).copy())


@dataclass
class Claim:
    """A participant's statistics as they came, checked (:func:`claim_of`): the Gram as its
    packed upper triangle (``tri``, float32), as a factor's rows (``factor``, ``k x (d+1)``
    float32, ``G = F^T F``), or neither (``ncm``); the cross term and counts float64.  An
    aggregator adds them in these forms (``aggregator/kept_sums.py``); :meth:`sums` makes
    the whole matrices."""

    cross: np.ndarray
    counts: np.ndarray
    tri: np.ndarray | None = None
    factor: np.ndarray | None = None

    @property
    def n(self) -> int:
        return int(round(float(self.counts.sum())))

    def sums(self) -> HeadSums:
        """The float64 sums, the Gram whole."""
        n = len(self.cross)
        if self.factor is not None:  # products in float32, as the device's own are made
            gram = (self.factor.T @ self.factor).astype(np.float64)
        elif self.tri is not None:
            gram = unpack_triangle(self.tri, n)
        else:
            gram = np.zeros((0, 0))
        return HeadSums(gram, self.cross.copy(), self.counts.copy())


def _check_sizes(d: int, classes: int, tri: np.ndarray, cross: np.ndarray,
                 counts: np.ndarray) -> None:
    """:class:`MessageError` where a triangle, cross term and counts do not fit a head on
    ``d`` features and ``classes`` classes."""
    n = d + 1
    if cross.size != n * classes or counts.size != classes \
            or tri.size not in (0, triangle_size(n)):
        raise MessageError("wrong_length", f"head statistics of {tri.size}, {cross.size} "
                           f"and {counts.size} values; a head on {d} features and "
                           f"{classes} classes has {triangle_size(n)}, {n * classes} and "
                           f"{classes}")


def claim_of(d: int, classes: int, clip: float, *, tri: np.ndarray, cross: np.ndarray,
             counts: np.ndarray, factor: np.ndarray, labels: np.ndarray) -> Claim:
    """A message's statistics for a head on ``d`` features and ``classes`` classes, their
    sizes and sums checked against their counts (:func:`check_parts`) without making the
    whole Gram: :class:`MessageError` where they do not fit or contradict them."""
    n = d + 1
    counts64 = np.asarray(counts, np.float64).copy()
    if factor.size:
        k = factor.size // n
        if factor.size != k * n or labels.size != k * classes or counts.size != classes \
                or not 0 < k <= factor_rows(d):
            raise MessageError("wrong_length", f"a head factor of {factor.size} and "
                               f"{labels.size} values and {counts.size} counts; a head on {d} "
                               f"features and {classes} classes takes k x {n} and k x "
                               f"{classes} for k from 1 to {factor_rows(d)}, and {classes}")
        f = factor.reshape(k, n)
        claim = Claim((f.T @ labels.reshape(k, classes)).astype(np.float64), counts64,
                      factor=f)
        last = (f.T @ f[:, d]).astype(np.float64)  # the Gram's bias column
        check_parts(claim.cross, counts64, clip, np.einsum("ij,ij->j", f, f, dtype=np.float64),
                    last)
        return claim
    _check_sizes(d, classes, tri, cross, counts)
    claim = Claim(cross.astype(np.float64).reshape(n, classes), counts64,
                  tri=tri if tri.size else None)
    if tri.size:
        _, diagonal, last = triangle_index(n)
        check_parts(claim.cross, counts64, clip, tri[diagonal].astype(np.float64),
                    tri[last].astype(np.float64))
    else:
        check_parts(claim.cross, counts64, clip)
    return claim


# The most rows a factor may carry, as a station accepts it (a version before SEND_ROWS put
# up to this many in one).
FACTOR_ROWS = 128
# The most a device puts in one (and, holding that many, it sends at its next station model):
# a station multiplies a factor's rows into its sums at 0.02 ms a row on one x86 core and adds
# a triangle in 1.3 ms (aggregator/kept_sums.py, bench/head_stats.py), so past about 64 rows
# the triangle is the cheaper to admit; at 64 a factor is still a tenth of its bytes.
SEND_ROWS = 64


def factor_rows(d: int, *, sending: bool = False) -> int:
    """The most rows a factor of a Gram on ``d`` features carries (``sending``: that a
    device puts in one): :data:`FACTOR_ROWS` (:data:`SEND_ROWS`), and never past half its
    side, where the triangle is fewer bytes."""
    return min(SEND_ROWS if sending else FACTOR_ROWS, (d + 1) // 2)


def check_claim(s: HeadSums, clip: float, *, tolerance: float = 1e-3) -> None:
    """Whole sums checked as :func:`check_parts` checks a claim's."""
    gram = s.has_gram
    check_parts(s.cross, s.counts, clip, np.diagonal(s.gram) if gram else None,
                s.gram[-1] if gram else None, tolerance=tolerance)


def check_parts(cross: np.ndarray, counts: np.ndarray, clip: float,
                diagonal: np.ndarray | None = None, last: np.ndarray | None = None, *,
                tolerance: float = 1e-3) -> None:
    """A participant's statistics checked against what their counts imply, from the cross
    term, the counts and (with a Gram) its ``diagonal`` and ``last`` column, the bias
    column: the bias entries equal the counts, every row's norm within ``clip`` (the trace,
    the bias row and each class's sum), nothing negative on the diagonal.
    :class:`MessageError` otherwise."""
    n, d = int(round(float(counts.sum()))), cross.shape[0] - 1
    slack = tolerance * max(n, 1)
    if np.abs(cross[d] - counts).max(initial=0.0) > slack:
        raise MessageError("stats_inconsistent", "the bias row of the cross term is not the "
                           "class counts")
    per_class = np.sqrt((cross[:d] ** 2).sum(axis=0))
    if (per_class > counts * clip * (1 + tolerance) + slack).any():
        raise MessageError("stats_out_of_bounds", "a class's summed embeddings exceed its "
                           "count times the clip")
    if diagonal is None or last is None:
        return
    if abs(last[d] - n) > slack or (diagonal < -slack).any():
        raise MessageError("stats_inconsistent", f"the Gram's corner is {last[d]:.0f}, the "
                           f"counts sum to {n}")
    if np.abs(last[:d] - cross[:d].sum(axis=1)).max(initial=0.0) > slack * clip + 1e-3:
        raise MessageError("stats_inconsistent", "the Gram's bias row is not the sum of the "
                           "classes' embeddings")
    if diagonal[:d].sum() > n * clip * clip * (1 + tolerance) + slack:
        raise MessageError("stats_out_of_bounds", f"the Gram's trace {diagonal[:d].sum():.1f} "
                           f"exceeds {n} rows of norm {clip}")
