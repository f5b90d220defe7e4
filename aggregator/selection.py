"""Super-node selection: GBP-CS and the baselines it is measured against.

GBP-CS (FedGS, "gradient-based binary permutation client selection") solves
``min_x (1/2F) ||A x - y||^2`` s.t. ``1'x = S``, ``x`` binary, where ``A``
holds the candidates' next-batch label histograms as columns and ``y`` the
label counts that would make the super node's distribution match ``P_real``
(SPEC §4).  Each selector function takes what it uses and nothing else (a stochastic one
requires its generator; none falls back to an unseeded one), and is registered by name in
:data:`SELECTORS` with what binds it to the station's settings; :func:`build_selector`
returns a :class:`Selector`, the one signature the station calls.  Each returns the sorted
indices it picked, never one in ``fixed``.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from edge_client.errors import SelectionError, ShapeError

__all__ = [
    "SELECTORS",
    "Selector",
    "SelectorSettings",
    "build_selector",
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
    free = np.ones(len(hists), dtype=bool)  # a mask, not setdiff1d: 3 us against 41
    free[fixed_idx] = False
    candidates = np.flatnonzero(free)
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


def _greedy_fill(At: np.ndarray, y: np.ndarray, n_select: int,
                 norms: np.ndarray) -> np.ndarray:
    """Add, one at a time, the candidate that most lowers ``||A x - y||^2``: adding ``a_k``
    changes it by ``||a_k||^2 + 2 g_k`` with ``g = A'r``, and ``g`` moves by one Gram column."""
    x = np.zeros(len(At), dtype=bool)
    g = At @ -y
    for _ in range(n_select):
        gain = norms + 2.0 * g
        gain[x] = np.inf
        k = int(np.argmin(gain))
        x[k] = True
        g += At @ At[k]
    return x


def gbp_cs(hists: np.ndarray, target: np.ndarray, n_select: int, *,
           fixed: Sequence[int] = (), max_iter: int = 100) -> np.ndarray:
    """GBP-CS (Li et al., FedGS, 2022): a relaxed start, then gradient-guided swaps.

    Swaps run from two starts, the paper's pseudo-inverse rounding and a greedy fill, and the
    closer result wins, so it is never worse than greedy.  Each swap is the exact best one:
    swapping in ``i`` for ``j`` changes the cost by ``||a_i||^2 + ||a_j||^2 + 2(g_i - g_j)
    - 2 a_i'a_j``, the gradient ``g = A'r`` plus the curvature the paper's first-order pair
    leaves out, for every pair at once from the selected columns' Gram products; a swap then
    updates ``g`` and those products by one Gram column (rank one), so a pass costs
    ``O(K' S)`` plus one ``O(K' F)`` product, not ``O(K' S F)``.  Stops when no swap lowers
    the cost, or after ``max_iter`` swaps.  Deterministic: it draws nothing.
    """
    candidates, A, y = selection_problem(hists, target, n_select, fixed)
    done = _trivial(candidates, n_select)
    if done is not None:
        return done
    At = np.ascontiguousarray(A.T)  # (K', F): one candidate's histogram per row
    norms = np.einsum("kf,kf->k", At, At)
    # pinv(A) y, through A' (A A')^+ y when K' > F: an F x F pseudo-inverse, not F x K'.
    xhat = (np.linalg.pinv(A) @ y if len(At) <= len(y)
            else At @ (np.linalg.pinv(A @ At) @ y))
    relaxed = np.zeros(len(At), dtype=bool)
    relaxed[np.argsort(-xhat, kind="stable")[:n_select]] = True
    searched = [_best_swaps(At, y, norms, start, max_iter)
                for start in (relaxed, _greedy_fill(At, y, n_select, norms))]
    x, _ = min(searched, key=lambda found: found[1])  # a tie keeps the paper's start
    return np.sort(candidates[x])


def _best_swaps(At: np.ndarray, y: np.ndarray, norms: np.ndarray, x: np.ndarray,
                max_iter: int) -> tuple[np.ndarray, float]:
    """Swap the exact best pair until none lowers ``||A x - y||^2``; ``(x, cost)``."""
    x = x.copy()
    r = At[x].sum(axis=0) - y
    cost = float(r @ r)
    inn = np.flatnonzero(x)
    g = At @ r
    gram = At @ At[inn].T  # (K', S): a_k' a_j for every candidate k and selected j
    for _ in range(max_iter):
        delta = ((norms + 2.0 * g)[:, None] + (norms[inn] - 2.0 * g[inn])[None, :]
                 - 2.0 * gram)
        delta[x] = np.inf
        i, c = np.unravel_index(int(np.argmin(delta)), delta.shape)
        if delta[i, c] >= -1e-9 * (1.0 + cost):
            break
        column = At @ At[i]
        g += column - gram[:, c]
        gram[:, c] = column
        x[i], x[inn[c]] = True, False
        inn[c] = i
        cost += float(delta[i, c])
    return x, cost


def random_selection(hists: np.ndarray, target: np.ndarray, n_select: int, *,
                     rng: np.random.Generator, fixed: Sequence[int] = ()) -> np.ndarray:
    """Uniformly random super node (FedAvg's client sampling)."""
    candidates, _, _ = selection_problem(hists, target, n_select, fixed)
    return np.sort(rng.choice(candidates, size=n_select, replace=False))


def greedy_selection(hists: np.ndarray, target: np.ndarray, n_select: int, *,
                     fixed: Sequence[int] = ()) -> np.ndarray:
    """Add, one at a time, the candidate that most lowers ``||A x - y||``."""
    candidates, A, y = selection_problem(hists, target, n_select, fixed)
    done = _trivial(candidates, n_select)
    if done is not None:
        return done
    At = np.ascontiguousarray(A.T)
    return np.sort(candidates[_greedy_fill(At, y, n_select, np.einsum("kf,kf->k", At, At))])


def brute_force_selection(hists: np.ndarray, target: np.ndarray, n_select: int, *,
                          fixed: Sequence[int] = ()) -> np.ndarray:
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
                        rng: np.random.Generator, fixed: Sequence[int] = (),
                        steps: int = 2000, start_temp: float = 1.0) -> np.ndarray:
    """Simulated annealing over swaps (Kirkpatrick et al., Science 1983), a stochastic baseline.

    From a random super node, propose swapping one picked and one unpicked candidate;
    accept a worse cost with probability ``exp(-increase / temperature)``, the temperature
    falling geometrically to 1/1000 of ``start_temp`` (relative to the initial cost).
    """
    candidates, A, y = selection_problem(hists, target, n_select, fixed)
    done = _trivial(candidates, n_select)
    if done is not None:
        return done
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


class Selector(Protocol):
    """What the station calls: pick ``n_select`` of the devices whose next-batch histograms
    are the rows of ``hists`` (``fixed`` ones already in), against ``target`` (``P_real``)."""

    def __call__(self, hists: np.ndarray, target: np.ndarray, n_select: int, *,
                 fixed: Sequence[int] = ()) -> np.ndarray: ...


@dataclass(frozen=True)
class SelectorSettings:
    """What a station gives its selector: its own generator (the stochastic selectors draw
    from it, so a run repeats) and GBP-CS's swap budget (``[station] gbp_max_iter``)."""

    rng: np.random.Generator
    max_iter: int = 100


# Each entry binds its selector to the settings it uses, and only those.
SELECTORS: dict[str, Callable[[SelectorSettings], Selector]] = {
    "gbp_cs": lambda s: functools.partial(gbp_cs, max_iter=s.max_iter),
    "random": lambda s: functools.partial(random_selection, rng=s.rng),
    "greedy": lambda s: greedy_selection,
    "brute_force": lambda s: brute_force_selection,
    "annealing": lambda s: functools.partial(annealing_selection, rng=s.rng),
}


def build_selector(name: str, settings: SelectorSettings) -> Selector:
    """The registered selector ``name`` bound to ``settings``."""
    if name not in SELECTORS:
        raise SelectionError(f"unknown selector {name!r}; known: {sorted(SELECTORS)}")
    return SELECTORS[name](settings)


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
