"""Central differential privacy where an aggregator fuses: a station over its factory's
devices, the cloud over its stations (``docs/privacy.md``).

With ``central_dp_noise > 0`` a fusion is one release: :class:`NoisedMean` clips each
contributor's step from the current model, adds Gaussian noise to the sum and divides by the
number asked; :class:`CentralDP` draws the noise, counts each contributor's releases on a
:class:`~edge_client.privacy.PrivacyLedger` and hands the ledger to whoever keeps it on disk
before the release leaves.  With ``central_dp_mechanism = "tree"`` a station's releases within
a round are instead the prefix sums of a binary tree of noised partial sums
(:class:`NoiseTree`, DP-FTRL's tree aggregation), and each member is charged for every tree
node its steps entered.
"""

from __future__ import annotations

import itertools
import math
import secrets
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from edge_client.config import check_range
from edge_client.errors import ConfigError, ShapeError
from edge_client.privacy import LedgerState, PrivacyLedger

from .checkpoint import CheckpointError
from .fusion import Fold, fold_weight, model_vector

__all__ = ["CentralPrivacy", "CentralDP", "NoisedMean", "NoiseTree", "MECHANISMS",
           "tree_sensitivity"]

MECHANISMS = ("independent", "tree")


@dataclass(frozen=True, kw_only=True)
class CentralPrivacy:
    """Central DP settings of an aggregator: each contribution's step clipped to
    ``central_dp_clip``, Gaussian noise of ``central_dp_noise`` x that bound on the sum,
    divided by the number asked (DP-FedAvg); it takes the place of the fusion rule.
    0: off.  The aggregator keeps its ledger in its state directory."""

    central_dp_clip: float = 0.0
    central_dp_noise: float = 0.0  # noise multiplier (Gaussian sd: central_dp_noise x the clip)
    # Adaptive clipping (Andrew et al. 2021): the bound moves each release so that about
    # this fraction of steps fits under it (0: the bound stays central_dp_clip, its start),
    # by the geometric rate central_dp_clip_lr, from a count of the steps that fit noised
    # with standard deviation central_dp_count_noise (0: a twentieth of the participants
    # asked, as the paper suggests).  The count is a release too, on the ledger.
    central_dp_quantile: float = 0.0
    central_dp_clip_lr: float = 0.2  # the adaptive clip's step size (geometric update)
    # noise multiplier on the count of contributions under the clip
    central_dp_count_noise: float = 0.0
    # How a station noises its internal syncs: each independently, or a round's as the
    # prefix sums of a binary tree of noised partial sums (NoiseTree).
    central_dp_mechanism: str = "independent"
    # Each device in at most this many of a round's internal syncs (0: no cap): the
    # selector picks under it, and it bounds what one device's data can enter.
    max_participations: int = 0
    privacy_delta: float = 1e-5  # the delta of the (epsilon, delta) the ledger reports
    # Seed the noise from the role's seed (reproducible simulations), not the OS's entropy.
    noise_seeded: bool = False

    def check_privacy(self, fusion: str) -> None:
        check_range("central_dp_clip", self.central_dp_clip, 0)
        check_range("central_dp_noise", self.central_dp_noise, 0)
        check_range("privacy_delta", self.privacy_delta, 0, 1, low_open=True)
        check_range("central_dp_quantile", self.central_dp_quantile, 0, 1)
        check_range("central_dp_clip_lr", self.central_dp_clip_lr, 0, low_open=True)
        check_range("central_dp_count_noise", self.central_dp_count_noise, 0)
        if self.central_dp_noise and not self.central_dp_clip:
            raise ConfigError("central_dp_clip", "central DP's noise is scaled to the clip "
                              "bound: set central_dp_clip > 0")
        if self.central_dp_mechanism not in MECHANISMS:
            raise ConfigError("central_dp_mechanism", f"must be one of {MECHANISMS}, got "
                              f"{self.central_dp_mechanism!r}")
        check_range("max_participations", self.max_participations, 0)
        if self.central_dp_noise and fusion != "fedavg":
            raise ConfigError("fusion", f"central DP replaces the fusion rule by a noised mean "
                              f"of clipped steps; {fusion!r} cannot be kept with it")


class NoisedMean(Fold):
    """Central differential privacy for one release (DP-FedAvg, McMahan et al. 2018): each
    update's step from ``start`` is clipped to L2 norm ``bound``, the steps are summed,
    Gaussian noise of ``noise x bound`` is added to the sum, and the sum is divided by
    ``size``, the number of participants asked (fixed before anyone answered, so neither
    the divisor nor the weights reveal who did).  One participant moves the sum by at most
    ``bound``: the sensitivity the noise is scaled to.  ``contributors`` are whose data the
    release used, for the privacy ledger."""

    def __init__(self, start: np.ndarray, *, bound: float, noise: float, size: int,
                 rng: np.random.Generator) -> None:
        self._start = model_vector(start, None)
        self._sum = np.zeros_like(self._start)
        self._bound, self._noise, self.size, self._rng = bound, noise, max(1, size), rng
        self._total = 0.0
        self.contributors: list[str] = []
        self.clipped = 0  # steps longer than the bound: the rest fit under it

    def add(self, model: np.ndarray, weight: float, key: str = "") -> None:
        step = model_vector(model, self._start.shape) - self._start
        norm = float(np.linalg.norm(step))
        if norm > self._bound:
            step *= np.float32(self._bound / norm)
            self.clipped += 1
        self._sum += step
        self._total += fold_weight(weight)
        self.contributors.append(key)

    def result(self) -> np.ndarray:
        self._check()
        noise = self._rng.standard_normal(self._sum.size, dtype=np.float32)
        noise *= np.float32(self._noise * self._bound)
        return self._start + (self._sum + noise) / np.float32(self.size)

    def _check(self) -> None:
        if not self.contributors:
            raise ShapeError("nothing to fuse: no models")

    def mean_step(self) -> np.ndarray:
        """The clipped steps' sum over the members asked, before any noise: what a
        :class:`NoiseTree` takes as a leaf."""
        self._check()
        return self._sum / np.float32(self.size)

    @property
    def start(self) -> np.ndarray:
        return self._start

    @property
    def scale(self) -> float:
        """How far one member can move :meth:`mean_step`: the bound over the members asked."""
        return self._bound / self.size

    def __len__(self) -> int:
        return len(self.contributors)

    @property
    def total(self) -> float:
        return self._total


def _left_nodes(leaf: int) -> Iterable[tuple[int, int]]:
    """The tree nodes that leaf ``leaf`` (1-based) completes and that some prefix uses, as
    (level, index): node ``(h, j)`` sums leaves ``j 2^h + 1 .. (j + 1) 2^h``, and a prefix
    ``1..t`` is the sum of the nodes ``(h, (t >> h) - 1)`` for each bit ``h`` set in ``t``,
    all of even index.  A right child is never used, so it is never released or charged."""
    h = 0
    while leaf % (1 << h) == 0:
        j = (leaf >> h) - 1
        if j % 2 == 0:
            yield h, j
        h += 1


def _prefix_nodes(leaf: int) -> list[tuple[int, int]]:
    return [(h, (leaf >> h) - 1) for h in range(leaf.bit_length()) if leaf >> h & 1]


def _charges(pattern: Iterable[int], leaves: int) -> int:
    """What a member seated at the leaves ``pattern`` (1-based) of a tree of ``leaves``
    leaves is charged: the sum over released nodes of the square of how many of its steps
    each holds (its sensitivity, squared, in units of one step)."""
    seats = set(pattern)
    return sum(sum(1 for i in range((j << h) + 1, ((j + 1) << h) + 1) if i in seats) ** 2
               for t in range(1, leaves + 1) for h, j in _left_nodes(t))


def tree_sensitivity(leaves: int, participations: int) -> int:
    """The most a member seated at ``participations`` of a round's ``leaves`` releases can be
    charged in one :class:`NoiseTree` (the worst seating; releases at the same noise
    multiplier that cost as much): what planning a run's noise for a budget must assume.
    Exact by enumeration up to 50,000 seatings, an upper bound beyond (each node holds at
    most ``min(participations, its width)`` of the member's steps)."""
    k = min(participations, leaves)
    if k <= 0:
        return 0
    if math.comb(leaves, k) <= 50_000:
        return max(_charges(p, leaves) for p in itertools.combinations(range(1, leaves + 1), k))
    return sum(min(k, 1 << h) ** 2 for t in range(1, leaves + 1) for h, _ in _left_nodes(t))


class NoiseTree:
    """A round's releases as a binary tree (tree aggregation: Dwork et al. 2010, Chan, Shi
    and Song 2011; in DP-FTRL, Kairouz et al. 2021, arXiv 2103.00039): the station's model
    after ``t`` internal syncs is the round's start plus the noised prefix sum of their mean
    clipped steps, built from at most ``log2 t`` noised nodes instead of ``t`` independent
    draws, so the noise in a model does not grow with the round.  Each node's noise is the
    multiplier times the largest step scale among its leaves, so one member moves a node by
    at most (its steps in the node) x that scale; :meth:`add` returns the new model and
    what each member is charged: for each node released, the square of its steps there."""

    def __init__(self, start: np.ndarray, noise: float, rng: np.random.Generator) -> None:
        self.start = start.copy()
        self._noise, self._rng = noise, rng
        self._steps: list[np.ndarray] = []
        self._scales: list[float] = []
        self._members: list[set[str]] = []
        self._nodes: dict[tuple[int, int], np.ndarray] = {}  # noised sums, released

    def __len__(self) -> int:
        return len(self._steps)

    def add(self, fold: NoisedMean) -> tuple[np.ndarray, Counter[str]]:
        self._steps.append(fold.mean_step())
        self._scales.append(fold.scale)
        self._members.append(set(fold.contributors))
        t = len(self._steps)
        charges: Counter[str] = Counter()
        for h, j in _left_nodes(t):
            lo, hi = j << h, t
            node = np.sum(self._steps[lo:hi], axis=0, dtype=np.float32)
            noise = self._rng.standard_normal(node.size, dtype=np.float32)
            node += noise * np.float32(self._noise * max(self._scales[lo:hi]))
            self._nodes[(h, j)] = node
            held = Counter(d for members in self._members[lo:hi] for d in members)
            charges.update({d: n * n for d, n in held.items()})
        prefix = np.sum([self._nodes[n] for n in _prefix_nodes(t)], axis=0, dtype=np.float32)
        return self.start + prefix, charges


class CentralDP:
    """An aggregator's central DP: its noise, its folds, its ledger of contributors."""

    def __init__(self, settings: CentralPrivacy, seed: int) -> None:
        self.settings = settings
        self.enabled = settings.central_dp_noise > 0
        # The noise comes from the OS's entropy unless a simulation seeds it.
        self.rng = np.random.default_rng([seed, 0x401CE] if settings.noise_seeded
                                         else secrets.randbits(128))
        self.privacy = PrivacyLedger(settings.central_dp_noise, settings.privacy_delta)
        self.on_release: Callable[[LedgerState], None] | None = None  # keeps the ledger
        self.bound = settings.central_dp_clip  # moves with adaptive clipping
        self.tree: NoiseTree | None = None  # this round's, with the tree mechanism

    @property
    def adaptive_bound(self) -> float | None:
        """The bound a checkpoint keeps: only adaptive clipping moves it."""
        return self.bound if self.settings.central_dp_quantile else None

    def resume(self, bound: float | None) -> None:
        """Continue adaptive clipping from a checkpoint's bound, not from its start (a fixed
        bound, or a checkpoint without one, keeps ``central_dp_clip``)."""
        if bound is None or not self.settings.central_dp_quantile:
            return
        if not (math.isfinite(bound) and bound > 0):
            raise CheckpointError(f"the checkpoint's clip bound {bound} cannot be one")
        self.bound = float(bound)

    def fold(self, start: np.ndarray, size: int) -> NoisedMean:
        return NoisedMean(start, bound=self.bound, noise=self.settings.central_dp_noise,
                          size=size, rng=self.rng)

    def _adapt(self, fold: NoisedMean) -> None:
        """Move the bound towards the target quantile of step norms, from a noised count of
        the steps that fit (each contributor moves the count by at most 1: a Gaussian
        release of multiplier ``count noise``, recorded for every contributor)."""
        s = self.settings
        sigma = s.central_dp_count_noise or fold.size / 20
        fit = len(fold) - fold.clipped + sigma * float(self.rng.standard_normal())
        self.bound *= float(np.exp(-s.central_dp_clip_lr * (fit / fold.size
                                                             - s.central_dp_quantile)))
        for contributor in fold.contributors:
            self.privacy.record(contributor, noise=sigma)

    def summary(self, epsilon_local: float) -> dict[str, float]:
        """A station's privacy figures: ``epsilon_local``, the largest epsilon a device
        reports its local differential privacy has spent (absent where none reports any: no
        noise stage), and with central DP the largest any device's data has spent in the
        station's noised syncs."""
        local = {"epsilon_local": epsilon_local} if epsilon_local > 0 else {}
        return {**local, "epsilon_central": self.privacy.worst()} if self.enabled else local

    def new_round(self) -> None:
        """A round begins (a global model arrived, or a restart from a round's start): the
        tree mechanism starts a new tree from the next fold's start."""
        self.tree = None

    def release(self, fold: Fold, counters: Counter[str]) -> np.ndarray:
        """The fusion of ``fold``; where it is a noised one, each contributor's data is on
        the ledger (and on disk) before the result is returned to leave the aggregator."""
        if not isinstance(fold, NoisedMean):
            return fold.result()
        if self.settings.central_dp_mechanism == "tree":
            if self.tree is None:
                self.tree = NoiseTree(fold.start, self.settings.central_dp_noise, self.rng)
            model, charges = self.tree.add(fold)
            for contributor, times in charges.items():
                self.privacy.record(contributor, times=times)
            counters["dp_tree_nodes"] += len(list(_left_nodes(len(self.tree))))
        else:
            model = fold.result()
            for contributor in fold.contributors:
                self.privacy.record(contributor)
        if self.settings.central_dp_quantile:
            self._adapt(fold)
        counters["dp_releases"] += 1
        counters["clipped.dp_step"] += fold.clipped
        if self.on_release is not None:
            self.on_release(self.privacy.state())
        return model
