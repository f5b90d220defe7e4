"""Bounded trust in what participants report: every field is a claim to check.

A station cannot verify a device's data, but it can bound what one device can do:
its update may move the model only about as far as honest updates do (:class:`NormGuard`
clips it onto that bound) and may not repeat one of its recent updates
(:class:`ReplayGuard`), its claimed history may grow only at a plausible rate and
to a bounded share of the roster (:func:`bound_seen_counts`), it never weighs more
than the rest of its factory together in the label counts that feed ``P_real``
(:func:`majority_capped`), and it may sit in at most a bounded share of recent
super nodes, below all of them whenever there is a choice, and sits out a few after
a refused reply (:class:`ShareCap`, :func:`fair_seat_share`, :func:`seat_candidates`).
:class:`ClaimTally` keeps, per roster device, how many of its claims were refused or
clipped, so an operator can see which device is the trouble.  Pure numpy, no I/O; the
station role applies them (``docs/reliability.md``).
"""

from __future__ import annotations

import bisect
import math
from collections import Counter, deque
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

__all__ = ["NormGuard", "Bounded", "ReplayGuard", "SeenTotals", "bound_seen_counts",
           "claimed_total", "majority_capped", "ShareCap", "fair_seat_share", "seat_candidates",
           "ClaimTally"]


class NormGuard:
    """Bounds ``||z - w||``, an update's distance from the model it started from.

    With ``bound > 0`` that fixed bound applies.  Otherwise, once ``warmup`` updates
    were accepted, the bound is ``factor`` times the median of the last ``window``
    accepted distances (honest updates shrink as training converges, and the median
    follows them; one device cannot move it); before that it is ``initial``, which the
    station derives from the devices' learning rate and steps.  ``factor = 0`` with
    ``bound = 0`` turns the guard off.

    An update beyond the bound but within ``hard_factor`` times it is clipped onto the
    bound (norm bounding, Sun et al. 2019): it keeps its direction, so an honest device's
    unusually long step still counts, and it moves the model no farther than an accepted
    one.  Only an update beyond the hard bound, which no honest step reaches, is refused.
    ``hard_factor = 1`` refuses whatever passes the bound.
    """

    def __init__(self, *, bound: float, factor: float, initial: float, window: int = 64,
                 warmup: int = 8, hard_factor: float = 10.0) -> None:
        self.fixed, self.factor, self.initial, self.warmup = bound, factor, initial, warmup
        self.hard_factor = hard_factor
        self.history: deque[float] = deque(maxlen=window)
        # The history kept sorted as well, for its median: a station asks the limit of every
        # reply, and np.median of 64 floats twice a reply cost a FedGS simulation 5% of its
        # time.
        self._sorted: list[float] = []

    @property
    def enabled(self) -> bool:
        return self.fixed > 0 or self.factor > 0

    @property
    def limit(self) -> float:
        """The distance beyond which an update is clipped now."""
        if self.fixed > 0:
            return self.fixed
        if not self.enabled:
            return float("inf")
        if len(self.history) < self.warmup:
            return self.initial
        n, ranked = len(self._sorted), self._sorted
        median = ranked[n // 2] if n % 2 else (ranked[n // 2 - 1] + ranked[n // 2]) / 2
        return self.factor * median

    def check(self, update: np.ndarray, start: np.ndarray) -> Bounded:
        """What of ``update`` may be fused; an accepted distance (clipped: the bound) joins
        the history, so an attacker at the bound cannot walk the median up faster than an
        honest device can."""
        # In float32: the same distance to its 7th digit over 10^5 weights, in 21 us against
        # 408 for a float64 copy of the step (a simulated station checks every reply).
        step = np.subtract(update, start, dtype=np.float32)
        distance = math.sqrt(float(np.dot(step, step)))
        limit = self.limit
        if distance <= limit:
            self._remember(distance)
            return Bounded(update, distance, clipped=False)
        if distance > self.hard_factor * limit:
            return Bounded(None, distance, clipped=False)
        self._remember(limit)
        return Bounded((start + step * np.float32(limit / distance)).astype(np.float32),
                       distance, clipped=True)

    def _remember(self, distance: float) -> None:
        if len(self.history) == self.history.maxlen:
            del self._sorted[bisect.bisect_left(self._sorted, self.history[0])]
        self.history.append(distance)
        bisect.insort(self._sorted, distance)

    def state(self) -> list[float]:
        return list(self.history)

    def restore(self, history: list[float]) -> None:
        for h in history:
            self._remember(float(h))


class Bounded(NamedTuple):
    """The norm guard's verdict: the update to fuse (None: refused), its distance from the
    model it started from, and whether it was clipped onto the bound."""

    update: np.ndarray | None
    distance: float
    clipped: bool


def claimed_total(counts: np.ndarray) -> int:
    """The exact sum of a claimed histogram.  Each count fits the wire's int64, their sum
    need not: numpy's would wrap round to a negative total (ten classes at 2^62 sum to
    -2^63), which every bound below would then wave through."""
    return sum(counts.tolist())


class SeenTotals:
    """Each device's accepted seen total in all, kept sorted: the median of the others' bounds
    every new claim, and a station is asked it on every report (a thousand waiting
    devices' hellos, 500 a second).  Summing every device's histogram on each report made
    a report cost 250 us at 1,000 devices and 950 us at 4,000: past a core's worth of
    hellos.

    A device restarted without its state counts anew from zero.  What it had counted
    before is ``carried`` into its total in all: else its restart drags down the median
    the rest of its roster is bounded by (on a line of two cameras, each report of the one
    that kept running was clipped against the restarted one's few frames).  A device that
    feigns restarts carries no more than its claims could grow by anyway."""

    def __init__(self) -> None:
        self.of: dict[str, int] = {}  # in all: carried and current
        self.carried: dict[str, int] = {}
        self._sorted: list[int] = []

    def set(self, device: str, total: int) -> None:
        if device in self.of:
            carried = self.carried.get(device, 0)
            if total < (before := self.of[device] - carried):  # it counts anew
                self.carried[device] = carried + before
            del self._sorted[bisect.bisect_left(self._sorted, self.of[device])]
        self.of[device] = self.carried.get(device, 0) + total
        bisect.insort(self._sorted, self.of[device])

    def restore(self, carried: Mapping[str, int]) -> None:
        """What each device carried, kept by a checkpoint (before :meth:`set`)."""
        self.carried = {d: int(c) for d, c in carried.items()}

    def median_without(self, device: str) -> float | None:
        """The median total of every device but ``device`` (None: no other)."""
        values = self._sorted
        skip = bisect.bisect_left(values, self.of[device]) if device in self.of else len(values)
        n = len(values) - (skip < len(values))
        if n == 0:
            return None

        def at(k: int) -> int:
            return values[k if k < skip else k + 1]
        return float(at(n // 2)) if n % 2 else (at(n // 2 - 1) + at(n // 2)) / 2


def bound_seen_counts(counts: np.ndarray, previous_total: int, allowance: int,
                      roster_median: float | None, share: float, floor: int
                      ) -> tuple[np.ndarray, bool]:
    """A device's claimed seen-label counts, scaled down to what is plausible.

    The total may grow by at most ``allowance`` since the last accepted report, and may be
    at most ``share`` times ``roster_median``, the median total of the other devices (None:
    none reported), or ``floor`` while the fleet is young.  Returns the counts to use and
    whether they were clipped.  (On a roster of two or three that still lets one device
    hold most of the factory's counts: the estimate it feeds is bounded apart, by
    :func:`majority_capped`.)
    """
    total = claimed_total(counts)
    cap = previous_total + allowance
    if roster_median is not None:
        cap = min(cap, max(int(share * roster_median), floor))
    if total <= cap:
        return counts, False
    scaled = np.floor(counts.astype(np.float64) * (cap / total)).astype(np.int64)
    return scaled, True


def majority_capped(counts: list[np.ndarray], at_least: int = 0) -> tuple[np.ndarray, int]:
    """The factory's label counts with no device weighing more than all the others together.

    Where one device's total exceeds the sum of the other devices' totals (only one can, and
    only once the others have seen something), its histogram is scaled down to the others'
    total before the sum.  Whatever one device claims, it then makes at most half of its
    factory's counts, on a roster of two as of two hundred.  A capped sum is raised, in the
    same shape, to ``at_least`` if that is more (never above what was claimed): the cloud
    checks the samples a station consumed against its counts, and an honest station must
    not fail that check because its largest device was capped.  Returns the counts and how
    many devices were capped (0 or 1).
    """
    totals = [claimed_total(c) for c in counts]  # exact: an int64 array would overflow
    summed = np.asarray(np.sum(counts, axis=0, dtype=np.int64))
    whole = sum(totals)
    for k, total in enumerate(totals):
        others = whole - total
        if len(counts) > 1 and 0 < others < total:
            shaped = summed - counts[k] + counts[k].astype(np.float64) * (others / total)
            target = max(2 * others, min(at_least, whole))
            out = np.floor(shaped * (target / shaped.sum())).astype(np.int64)
            out[int(np.argmax(out))] += target - int(out.sum())  # what flooring lost
            return out, 1
    return summed, 0


def fair_seat_share(super_node_size: int, roster: int) -> float:
    """The default seat cap: 1.5 times a device's fair share ``L / roster`` of super nodes,
    but never more than halfway from that share to every super node, so that it stays
    below 1 whenever the station has a choice (``L < roster``; 1.5 L / roster alone is no
    cap at all once L is two thirds of the roster, two of three devices say)."""
    fair = min(1.0, super_node_size / roster)
    return min(1.5 * fair, (1.0 + fair) / 2)


def seat_candidates(ready: list[str], share: ShareCap, sitting_out: dict[str, int],
                    iteration: int, want: int) -> tuple[list[str], int]:
    """The devices this iteration's super node may be drawn from, and how many the seat cap
    left out.

    Left out: devices at their seat cap, and devices sitting out a refused reply until the
    iteration ``sitting_out`` gives (a seat given to a device whose replies are refused is a
    seat lost).  When fewer than ``want`` remain, the left-out ones fill the seats nobody
    else can: fewest recent seats first, those sitting out last.
    """
    resting = {d for d in ready if sitting_out.get(d, -1) >= iteration}
    capped = {d for d in ready if not share.eligible(d)}
    keep = [d for d in ready if d not in resting and d not in capped]
    if len(keep) < want:
        rest = sorted((d for d in ready if d not in keep),
                      key=lambda d: (d in resting, share.seats(d)))
        keep += rest[:want - len(keep)]
    return keep, len(capped)


class ShareCap:
    """Caps the share of the last ``window`` super nodes a device may sit in.

    GBP-CS favours the histograms that balance the super node, so a device that lies
    about its next batch could otherwise buy a seat in every one.
    """

    def __init__(self, window: int, max_share: float) -> None:
        self.window, self.max_share = window, max_share
        self.recent: deque[tuple[str, ...]] = deque(maxlen=window)
        # Seats in ``recent`` per device, kept as it moves: every ready device is asked at
        # every selection, and counting through the window each time cost a thousand-device
        # station 4 ms an iteration.
        self._seats: Counter[str] = Counter()

    def seats(self, device: str) -> int:
        """How many of the recent super nodes the device sat in."""
        return self._seats[device]

    def eligible(self, device: str) -> bool:
        return self.max_share >= 1.0 or self.seats(device) < self.max_share * self.window

    def record(self, members: tuple[str, ...]) -> None:
        if not self.window:
            return
        if len(self.recent) == self.window:
            self._seats.subtract(set(self.recent[0]))
        self.recent.append(members)
        self._seats.update(set(members))
        self._seats += Counter()  # drops those at zero: the roster, not every id ever seen

    def state(self) -> list[list[str]]:
        return [list(ms) for ms in self.recent]

    def restore(self, recent: list[list[str]]) -> None:
        for members in recent:
            self.record(tuple(members))


class ReplayGuard:
    """Refuses an update that repeats one of the device's ``depth`` recent updates.

    An honest reply starts from this iteration's model and takes a fresh one-shot batch, so
    it lies about as far from each of the device's earlier updates as from the model it
    started from.  A replay (an earlier update sent again, with a new message id and valid
    fields) lies at almost no distance from the one it repeats.  Refused: an update ``z``
    whose distance to a recent update is under ``tolerance`` times ``||z - w^m||``.

    Updates are compared through count sketches (each weight added, with a random sign, to
    one of ``width`` buckets): distances between sketches estimate distances between
    vectors, and a device costs ``depth x width`` float32s, not ``depth`` models.  What it
    does not catch: a replay with noise added on purpose, which is then an ordinary stale
    update for the distance guard and the fusion rule to bound.
    """

    def __init__(self, num_params: int, *, seed: int, width: int = 256, depth: int = 4,
                 tolerance: float = 1e-3) -> None:
        self.width, self.tolerance = width, tolerance
        if self.enabled:  # 4 bytes a parameter, for nothing when the test is off
            rng = np.random.default_rng([seed, 0x5AF1])  # not the station's selection stream
            # Weight i goes to bucket i mod width: with the random signs the sketch's squared
            # norm is still an unbiased estimate of the vector's, and summing the rows of a
            # (n / width, width) view takes 29 us at 10^5 weights against 155 us for a
            # bincount into random buckets (every reply is sketched).
            self._padded = np.zeros(-(-num_params // width) * width, np.float32)
            self.sign = rng.choice(np.array([-1.0, 1.0], np.float32), num_params)
        self.recent: dict[str, deque[np.ndarray]] = {}
        self.depth = depth
        self._start: tuple[np.ndarray | None, np.ndarray | None] = (None, None)

    @property
    def enabled(self) -> bool:
        return self.tolerance > 0

    def sketch(self, vector: np.ndarray) -> np.ndarray:
        """``width`` floats (1 KB a sketch kept: what a device costs the station here)."""
        np.multiply(vector, self.sign, out=self._padded[:len(self.sign)])
        return self._padded.reshape(-1, self.width).sum(axis=0)

    def check(self, device: str, update: np.ndarray, start: np.ndarray) -> tuple[bool, float]:
        """``(accepted, ratio)``: the distance to the nearest recent update over the distance
        from ``start``; an accepted update joins the device's recent ones."""
        if not self.enabled:
            return True, float("inf")
        z = self.sketch(update)
        if self._start[0] is not start:  # every member of a super node starts from one w^m
            self._start = (start, self.sketch(start))
        step = _length(z - self._start[1])
        if step == 0:
            # The model it was sent, unchanged: a device whose every sample its head already
            # scores with certainty (a solved LDA head's softmax on a device's own classes)
            # takes a zero step, twice alike; it repeats nothing, and fusing it moves nothing.
            return True, float("inf")
        recent = self.recent.setdefault(device, deque(maxlen=self.depth))
        nearest = min((_length(z - r) for r in recent), default=float("inf"))
        ratio = nearest / step if step > 0 else (0.0 if nearest == 0 else float("inf"))
        if ratio < self.tolerance:
            return False, ratio
        recent.append(z)
        return True, ratio

    def state(self) -> dict[str, np.ndarray]:
        return {d: np.array(r) for d, r in self.recent.items() if r}

    def restore(self, recent: dict[str, np.ndarray]) -> None:
        for d, rows in recent.items():
            self.recent[d] = deque((np.array(r) for r in rows), maxlen=self.depth)


def _length(sketch: np.ndarray) -> float:
    """A sketch's Euclidean length: a dot product, a third of np.linalg.norm's time on
    ``width`` floats (five of them for every reply)."""
    return math.sqrt(float(np.dot(sketch, sketch)))


class ClaimTally:
    """Per roster device, its claims refused and clipped (senders off the roster are only
    counted in the station's totals: an unknown id must not grow the station's memory)."""

    def __init__(self, roster: tuple[str, ...] | list[str]) -> None:
        self.roster = frozenset(roster)
        self.refused: Counter[str] = Counter()
        self.clipped: Counter[str] = Counter()

    def count(self, tally: Counter[str], device: str) -> None:
        if device in self.roster:
            tally[device] += 1

    def state(self) -> dict[str, dict[str, int]]:
        return {"refused": dict(self.refused), "clipped": dict(self.clipped)}

    def restore(self, state: dict[str, dict[str, int]]) -> None:
        for name, tally in (("refused", self.refused), ("clipped", self.clipped)):
            tally.update({d: int(n) for d, n in state.get(name, {}).items() if d in self.roster})
