"""Super-node selection: GBP-CS and the baselines it is measured against.

GBP-CS (FedGS, "gradient-based binary permutation client selection") solves
``min_x (1/2F) ||A x - y||^2`` s.t. ``1'x = S``, ``x`` binary, where ``A``
holds the candidates' next-batch label histograms as columns and ``y`` the
label counts that would make the super node's distribution match ``P_real``
(SPEC §4).  Every selector shares one signature and is registered by name in
:data:`SELECTORS`; each returns the sorted indices it picked, never one in
``fixed``.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from edge_client.errors import SelectionError, ShapeError

__all__ = [
    "SELECTORS",
    "gbp_cs",
    "random_selection",
    "greedy_selection",
    "brute_force_selection",
    "annealing_selection",
    "divergence",
    "selection_problem",
    "blas_threads",
]

BRUTE_FORCE_LIMIT = 2_000_000  # combinations; beyond this brute force refuses


def selection_problem(hists: np.ndarray, target: np.ndarray, n_select: int,
                      fixed: Sequence[int] = ()) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Validate inputs; return ``(candidates, A, y)`` of the least-squares problem.

    ``A`` is (F, K') with the candidates' histograms as columns; ``y`` is the
    count vector the picked columns should sum to: ``P_real`` scaled to the
    expected super-node size, less what the fixed devices already bring.
    """
    hists = np.asarray(hists, dtype=np.float64)
    target = np.asarray(target, dtype=np.float64)
    if hists.ndim != 2:
        raise ShapeError(f"histograms must be (K, F), got shape {hists.shape}")
    if target.shape != (hists.shape[1],):
        raise ShapeError(f"target has shape {target.shape}, histograms have "
                         f"{hists.shape[1]} classes")
    if not (np.isfinite(hists).all() and (hists >= 0).all()):
        raise ShapeError("histograms must be finite, non-negative counts")
    if not (np.isfinite(target).all() and (target >= 0).all() and target.sum() > 0):
        raise ShapeError("target must be a non-negative distribution with positive mass")
    fixed_idx = np.unique(np.asarray(fixed, dtype=np.int64))
    if len(fixed_idx) != len(fixed) or ((fixed_idx < 0) | (fixed_idx >= len(hists))).any():
        raise SelectionError(f"fixed indices {list(fixed)} must be distinct and in range")
    candidates = np.setdiff1d(np.arange(len(hists)), fixed_idx)
    if not 0 <= n_select <= len(candidates):
        raise SelectionError(f"cannot pick {n_select} of {len(candidates)} candidates")
    A = hists[candidates].T
    b = hists[fixed_idx].sum(axis=0)
    mean_size = A.sum(axis=0).mean() if A.size else 0.0
    y = target / target.sum() * (b.sum() + n_select * mean_size) - b
    return candidates, A, y


def divergence(hists: np.ndarray, chosen: Sequence[int], target: np.ndarray) -> float:
    """L2 distance between the super node's label distribution and ``target``."""
    counts = np.asarray(hists, dtype=np.float64)[np.asarray(chosen, dtype=np.int64)].sum(axis=0)
    p = np.asarray(target, dtype=np.float64) / np.sum(target)
    total = counts.sum()
    return float(np.linalg.norm((counts / total if total else counts) - p))


def _trivial(candidates: np.ndarray, n_select: int) -> np.ndarray | None:
    if n_select == len(candidates):
        return candidates.copy()
    if n_select == 0:
        return np.empty(0, dtype=np.int64)
    return None


def gbp_cs(hists: np.ndarray, target: np.ndarray, n_select: int, *,
           fixed: Sequence[int] = (), max_iter: int = 100,
           rng: np.random.Generator | None = None) -> np.ndarray:
    """GBP-CS (Li et al., FedGS, 2022): pseudo-inverse start, then gradient-guided swaps.

    Each loop swaps the unselected candidate with the smallest gradient entry
    for the selected one with the largest; when that first-order pair fails to
    lower ``D``, the exact best swap is tried before stopping (cheap for the
    tens of candidates a factory has).  ``rng`` is unused: GBP-CS is
    deterministic.
    """
    candidates, A, y = selection_problem(hists, target, n_select, fixed)
    done = _trivial(candidates, n_select)
    if done is not None:
        return done
    x = np.zeros(A.shape[1], dtype=bool)
    xhat = np.linalg.pinv(A) @ y
    x[np.argsort(-xhat, kind="stable")[:n_select]] = True
    r = A[:, x].sum(axis=1) - y
    cost = r @ r
    for _ in range(max_iter):
        g = A.T @ r
        out, inn = np.flatnonzero(~x), np.flatnonzero(x)
        i, j = out[np.argmin(g[out])], inn[np.argmax(g[inn])]
        r_new = r + A[:, i] - A[:, j]
        if r_new @ r_new >= cost:
            # ||r + a_i - a_j||^2 for every (unselected i, selected j) pair at once.
            diff = A[:, out][:, :, None] - A[:, inn][:, None, :]
            costs = (cost + np.einsum("fij,fij->ij", diff, diff)
                     + 2 * np.einsum("f,fij->ij", r, diff))
            bi, bj = np.unravel_index(np.argmin(costs), costs.shape)
            if costs[bi, bj] >= cost - 1e-9:
                break
            i, j = out[bi], inn[bj]
            r_new = r + A[:, i] - A[:, j]
        x[i], x[j] = True, False
        r, cost = r_new, r_new @ r_new
    return np.sort(candidates[x])


def random_selection(hists: np.ndarray, target: np.ndarray, n_select: int, *,
                     fixed: Sequence[int] = (), rng: np.random.Generator | None = None,
                     **_: object) -> np.ndarray:
    """Uniformly random super node (FedAvg's client sampling)."""
    candidates, _, _ = selection_problem(hists, target, n_select, fixed)
    rng = rng if rng is not None else np.random.default_rng()
    return np.sort(rng.choice(candidates, size=n_select, replace=False))


def greedy_selection(hists: np.ndarray, target: np.ndarray, n_select: int, *,
                     fixed: Sequence[int] = (), **_: object) -> np.ndarray:
    """Add, one at a time, the candidate that most lowers ``||A x - y||``."""
    candidates, A, y = selection_problem(hists, target, n_select, fixed)
    done = _trivial(candidates, n_select)
    if done is not None:
        return done
    x = np.zeros(A.shape[1], dtype=bool)
    r = -y
    for _ in range(n_select):
        out = np.flatnonzero(~x)
        trial = r[:, None] + A[:, out]
        best = out[np.argmin(np.einsum("fk,fk->k", trial, trial))]
        x[best] = True
        r = r + A[:, best]
    return np.sort(candidates[x])


def brute_force_selection(hists: np.ndarray, target: np.ndarray, n_select: int, *,
                          fixed: Sequence[int] = (), **_: object) -> np.ndarray:
    """Exact minimiser of ``||A x - y||`` by enumeration (small instances only)."""
    candidates, A, y = selection_problem(hists, target, n_select, fixed)
    done = _trivial(candidates, n_select)
    if done is not None:
        return done
    k = A.shape[1]
    if math.comb(k, n_select) > BRUTE_FORCE_LIMIT:
        raise SelectionError(f"C({k}, {n_select}) combinations exceed the brute-force limit "
                             f"of {BRUTE_FORCE_LIMIT}")
    best_cost, best = np.inf, None
    combos = itertools.combinations(range(k), n_select)
    while (chunk := np.array(list(itertools.islice(combos, 50_000)), dtype=np.int64)).size:
        r = A.T[chunk].sum(axis=1) - y
        costs = np.einsum("cf,cf->c", r, r)
        i = int(np.argmin(costs))
        if costs[i] < best_cost:
            best_cost, best = costs[i], chunk[i]
    return np.sort(candidates[best])


def annealing_selection(hists: np.ndarray, target: np.ndarray, n_select: int, *,
                        fixed: Sequence[int] = (), rng: np.random.Generator | None = None,
                        steps: int = 2000, start_temp: float = 1.0, **_: object) -> np.ndarray:
    """Simulated annealing over swaps (Kirkpatrick et al., Science 1983), a stochastic baseline.

    From a random super node, propose swapping one picked and one unpicked candidate;
    accept a worse cost with probability ``exp(-increase / temperature)``, the temperature
    falling geometrically to 1/1000 of ``start_temp`` (relative to the initial cost).
    """
    candidates, A, y = selection_problem(hists, target, n_select, fixed)
    done = _trivial(candidates, n_select)
    if done is not None:
        return done
    rng = rng if rng is not None else np.random.default_rng()
    x = np.zeros(A.shape[1], dtype=bool)
    x[rng.choice(A.shape[1], n_select, replace=False)] = True
    r = A[:, x].sum(axis=1) - y
    cost = float(r @ r)
    best_x, best_cost = x.copy(), cost
    temp, cool = start_temp * max(cost, 1e-9), 1e-3 ** (1.0 / steps)
    for _ in range(steps):
        i, j = rng.choice(np.flatnonzero(~x)), rng.choice(np.flatnonzero(x))
        r_new = r + A[:, i] - A[:, j]
        new = float(r_new @ r_new)
        if new <= cost or rng.random() < np.exp(-(new - cost) / temp):
            x[i], x[j], r, cost = True, False, r_new, new
            if cost < best_cost:
                best_x, best_cost = x.copy(), cost
        temp *= cool
    return np.sort(candidates[best_x])


Selector = Callable[..., np.ndarray]

SELECTORS: dict[str, Selector] = {
    "gbp_cs": gbp_cs,
    "random": random_selection,
    "greedy": greedy_selection,
    "brute_force": brute_force_selection,
    "annealing": annealing_selection,
}


@contextlib.contextmanager
def blas_threads(n: int = 1) -> Iterator[None]:
    """At most ``n`` BLAS threads inside: GBP-CS's products and ``pinv`` are small problems,
    and OpenBLAS threads that spin beside other work cost more CPU than they save (at 100
    candidates beside two nice-19 jobs: 4.45 ms with 2 threads, 3.95 ms with 1; under
    contention of equal priority it was 94 ms against 1.4 ms).  A no-op without
    threadpoolctl (installed with scikit-learn, the ``data`` extra)."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        yield
        return
    with threadpool_limits(limits=n, user_api="blas"):
        yield
