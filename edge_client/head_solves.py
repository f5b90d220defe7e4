"""The solves of a closed-form head from summed statistics (``head_stats.py``): ridge
(Fed3R), linear discriminant analysis with equal priors, and class means (FedNCM); the
ridge penalty chosen by generalised cross-validation from the statistics alone; a solved
head as the linear head's flat vector.

Every solve takes the same sums (``G``, ``B``, the counts) and centres them by their own mean
(an unpenalised bias, exactly).  Pure numpy: a device with a body imports it.
"""

from __future__ import annotations

import math
from typing import Protocol

import numpy as np

__all__ = ["solve_ridge", "solve_lda", "solve_ncm", "gcv_lambda", "head_vector", "NCM_SCALE",
           "UNSEEN_BIAS", "GCV_FLOOR"]

# A cosine classifier's scores lie in [-1, 1]; softmax over them is nearly flat, so the head
# fine-tuned from it starts this sharp (a temperature of 0.1, as FedNCM's cosine head uses).
NCM_SCALE = 10.0
# An LDA head's score for a class with no labelled frame yet: below any seen class's (their
# scores are log-likelihoods, tens at most on a body's clipped rows), finite for float32.
UNSEEN_BIAS = -1.0e4
_LAMBDAS = np.logspace(-5, 1, 31)  # relative to the mean eigenvalue of the centred Gram
# GCV's penalty is never below this x features / samples of the mean eigenvalue (gcv_lambda).
GCV_FLOOR = 0.1


class HeadSums(Protocol):
    """What a solve reads of ``head_sums.HeadSums``."""

    gram: np.ndarray
    cross: np.ndarray
    counts: np.ndarray

    @property
    def n(self) -> int: ...

    @property
    def has_gram(self) -> bool: ...


def _centred(s: HeadSums) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The Gram and cross term centred by the sums' own mean (an unpenalised bias), that
    mean, and the class frequencies."""
    d, n = s.cross.shape[0] - 1, max(s.n, 1)
    mean = s.gram[d, :d] / n if s.has_gram else s.cross[:d].sum(axis=1) / n
    freq = s.counts / n
    cross = s.cross[:d] - np.outer(mean, s.counts)
    gram = s.gram[:d, :d] - n * np.outer(mean, mean) if s.has_gram else np.zeros((0, 0))
    return gram, cross, mean, freq


def gcv_lambda(eig: np.ndarray, q2: np.ndarray, n: int, yy: float) -> float:
    """The ridge penalty minimising generalised cross-validation, from the centred Gram's
    eigenvalues ``eig``, the squared norms ``q2`` of the cross term's rows in its eigenbasis,
    the sample count and ``tr(Y^T Y)`` of the centred one-hot targets: all statistics.

    The residual is split into the part no penalty changes (outside the embeddings' span)
    and the penalty's part, each a sum of positives, so it stays exact where the rows are
    fewer than the features; the bias counts as a degree of freedom, without which GCV
    degenerates to no penalty there (both its terms go to zero).

    GCV takes the rows to be independent; a line's labelled frames are not (an item is in
    view for many frames, a product shows a few exemplars).  On a live line's frames it went
    to its grid's bottom (1e-5 of the mean eigenvalue), the LDA head's weights to 17,000 at
    1,248 samples of 1,280 features, and the cloud's accuracy on its photos from 1.000 to
    0.006 (docs/bodies.md).  The best penalty falls as features / samples (Dobriban and
    Wager, Ann. Statist. 2018), and on independent frames GCV chooses about 0.4 of that
    times the mean eigenvalue (1.6 at 300 samples, 0.01 at 50,000); so the penalty is never
    below ``GCV_FLOOR`` (0.1) of it, which binds only where the rows repeat themselves."""
    live = eig > max(float(eig.max(initial=0.0)), 1e-30) * 1e-10
    e, q = eig[live], q2[live]
    outside = max(yy - float((q / e).sum()), 0.0)
    scale = max(float(eig.sum()) / max(len(eig), 1), 1e-12)
    best, best_score = float(_LAMBDAS[-1] * scale), math.inf
    for rel in _LAMBDAS:
        lam = float(rel * scale)
        rss = outside + float((q * lam * lam / (e * (e + lam) ** 2)).sum())
        free = n - 1 - float((e / (e + lam)).sum())
        if free <= 0:
            continue
        score = n * rss / (free * free)
        if score < best_score:
            best, best_score = lam, score
    return max(best, GCV_FLOOR * len(eig) / max(n, 1) * scale)


def solve_ridge(s: HeadSums, lam: float | None = None
                ) -> tuple[np.ndarray, np.ndarray, float]:
    """The ridge head ``(W (classes, d), b (classes,), lambda)`` on the sums' rows, its
    bias unpenalised; ``lam`` None: chosen by :func:`gcv_lambda`."""
    eig, vecs, q, lam, (_, mean, freq) = _eigenbasis(s, lam, "a ridge")
    w = vecs @ (q / (np.maximum(eig, 0.0) + lam)[:, None])  # (d, classes)
    bias = freq - mean @ w
    return w.T, bias, lam


def _eigenbasis(s: HeadSums, lam: float | None, kind: str
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, float,
                           tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """What the ridge and LDA solves share: the centred Gram's eigenvalues and vectors, the
    centred cross term in that basis, lambda (``lam``, else by GCV), and the centred cross
    term, the sums' mean and the class frequencies."""
    if not s.has_gram:
        raise ValueError(f"{kind} head needs the Gram: these sums are class means only")
    gram, cross, mean, freq = _centred(s)
    eig, vecs = np.linalg.eigh(gram)
    q = vecs.T @ cross
    if lam is None:
        yy = float(s.n - (s.counts.astype(np.float64) ** 2).sum() / max(s.n, 1))
        lam = gcv_lambda(eig, (q ** 2).sum(axis=1), s.n, yy)
    return eig, vecs, q, lam, (cross, mean, freq)


def solve_lda(s: HeadSums, lam: float | None = None
              ) -> tuple[np.ndarray, np.ndarray, float]:
    """Linear discriminant analysis with equal class priors on the sums' rows: ``(W
    (classes, d), b (classes,), lambda)``, each seen class scored by ``x^T S^-1 m_c -
    m_c^T S^-1 m_c / 2`` with ``m_c`` its mean (``B / n``) and ``S`` the within-class
    covariance (``G`` less the between-class part, over ``N - classes``) plus ``lambda``,
    chosen by :func:`gcv_lambda` as the ridge solve chooses it (``lam`` None).

    Ridge on one-hot targets weighs each class by its frames, so a product with a few
    labelled frames among thousands scores low everywhere (0.46 on its own frames after
    100 of them, against 0.78 here: docs/bodies.md); with equal priors a class counts as
    much as its mean is certain.  The scores, log-likelihoods under shared-covariance
    Gaussians, are divided by the mean margin of a class's frames over the other classes
    (from the class means: the scores are linear), so that, as with ridge's one-hot targets,
    a class's frames score about one above the rest: a softmax over log-likelihoods
    saturates, and the devices' SGD steps on the solved head, zero on most batches and not
    on a few, looked like replays and outliers to the station's guards.

    The within-class part is the total scatter less a rank-``classes`` term, so one
    eigendecomposition (the one GCV needs) serves both: by Woodbury,
    ``(T + lambda I - M D^-1 M^T)^-1 M D^-1 = K (D - M^T K)^-1`` with ``K = (T + lambda
    I)^-1 M``, ``M`` the centred class sums and ``D`` the counts."""
    eig, vecs, q, lam, (cross, mean, _) = _eigenbasis(s, lam, "an LDA")
    seen = s.counts > 0
    w = np.zeros_like(cross)  # (d, classes)
    bias = np.full(s.counts.shape, UNSEEN_BIAS)
    if seen.any():
        qs = q[:, seen]
        k = qs / (np.maximum(eig, 0.0) + lam)[:, None]
        counts = s.counts[seen].astype(np.float64)
        inner = np.diag(counts) - qs.T @ k  # positive definite for lambda > 0
        ws = vecs @ np.linalg.solve(inner.T, k.T).T
        means = cross[:, seen] / counts
        centred_bias = -0.5 * (means * ws).sum(axis=0)
        at_means = means.T @ ws + centred_bias  # (seen, seen): class c's mean frame's scores
        others = max(int(seen.sum()) - 1, 1)
        margins = np.diag(at_means) - (at_means.sum(axis=1) - np.diag(at_means)) / others
        margin = float(counts @ margins / counts.sum())
        scale = 1.0 / margin if margin > 0 else 1.0
        w[:, seen] = ws * scale
        bias[seen] = (centred_bias - mean @ ws) * scale
    return w.T, bias, lam


def solve_ncm(s: HeadSums) -> tuple[np.ndarray, np.ndarray]:
    """The nearest-class-mean head: each seen class's mean (centred by the sums' mean),
    normalised; a class never seen scores lowest."""
    _, cross, mean, _ = _centred(s)
    seen = s.counts > 0
    means = np.zeros_like(cross)
    means[:, seen] = cross[:, seen] / s.counts[seen]
    norms = np.linalg.norm(means, axis=0)
    w = np.where(norms > 0, means / np.maximum(norms, 1e-12), 0.0).T * NCM_SCALE
    bias = -(w @ mean)
    bias[~seen] = -NCM_SCALE * 2  # below any seen class's cosine
    return w, bias


def head_vector(w: np.ndarray, bias: np.ndarray, centre: np.ndarray) -> np.ndarray:
    """A solved head as the linear head's flat float32 vector (``fc.weight`` then
    ``fc.bias``), acting on raw embeddings: the body's centring folded into the bias."""
    return np.concatenate([w.astype(np.float32).ravel(),
                           (bias - w @ centre).astype(np.float32)])


