"""The closed-form head's sums at a station and at the cloud (``edge_client/head_stats.py``):
each participant's statistics checked as a claim, summed, owed upstream, solved, and kept
in the role's checkpoint.

A station adds its devices' increments and owes the cloud the sum of what it admitted since
its last upload; the cloud adds its stations'.  A participant's statistics are a claim: their
bias entries must equal their counts, their rows lie within the body's clip, and the counts
a participant has claimed in all count for no more than the samples it has reported seeing
(which the trust layer already bounds: ``aggregator/roster.py``).  Refused statistics are
counted under ``rejected.<reason>`` and change nothing.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np

from edge_client import messages as m
from edge_client.errors import MessageError
from edge_client.head_sends import Counted, SendLog, draw
from edge_client.head_stats import GRAM_KINDS, HeadSpec
from edge_client.novelty import BINS, Detector, solve_detector, threshold_of
from edge_client.topics import CLOUD_ID

from .checkpoint import group, grouped
from .kept_sums import KeptSums

__all__ = ["HeadLedger", "attach_heads", "came_online", "fused_head", "refused", "sent_again"]

log = logging.getLogger(__name__)


class HeadLedger:
    """One aggregator's sums: ``total`` (everything admitted; at a station, what it has
    not yet sent upstream is its fresh part, :mod:`kept_sums`; the cloud has no level above
    and folds each at once), what each participant has claimed, and the last solve's size."""

    def __init__(self, spec: HeadSpec, counters: Counter[str], fleet: str, *,
                 upstream: bool) -> None:
        self.spec, self.counters, self.fleet = spec, counters, fleet
        self.total = KeptSums(spec.features, spec.classes, gram=spec.kind in GRAM_KINDS)
        self.sends_up = upstream
        self.claimed: dict[str, float] = {}  # samples each participant's sums count, weighted
        self.seen_then: dict[str, float] = {}  # its seen total at its last admitted claim
        # Each participant's sends counted once, whoever restarts (head_sends.py); and, at a
        # station, its own sends upstream, stamped and kept for a cloud that resumed.
        self.counted = Counted()
        self.sends = SendLog()
        self.started = draw()  # this process's (never checkpointed)
        self.solved = 0  # samples the last solve was made from
        self.head: np.ndarray | None = None  # the last solve
        self.newcomer = False  # the last statistics admitted were their sender's first
        # A station's round began from a solved head that the next round's solve replaces
        # (resolve = "every"): its internal syncs keep it (:meth:`fused`).
        self.round_head: np.ndarray | None = None
        # The unknown-part detector (edge_client/novelty.py): the cloud solves it as the
        # sums double and sets its threshold from the devices' scores of labelled frames
        # (``scored``, by the detector of ``detector_of`` samples: at a station, those it
        # owes the cloud); a station relays both to its devices.  Packed; sent where it
        # changed, and again once a device comes online (``resend``).
        self.detector: np.ndarray | None = None
        self.threshold = 0.0  # the score past which a frame is unknown (0: none yet)
        self.scored = np.zeros(BINS)
        self.resend = False

    @property
    def detector_of(self) -> int:
        """The samples the detector in use was solved from, by its packed count (float32), as
        the devices name it (0: none)."""
        return int(self.detector[1]) if self.detector is not None else 0

    def admit(self, msg: m.HeadStats, seen: np.ndarray | None) -> None:
        """Add ``msg``'s sums, checked (:class:`MessageError`, nothing added, where they
        contradict their counts).  ``seen``: the sender's label counts as the trust layer
        keeps them; statistics of more samples in all than that are weighted down to it
        (``clipped.head_stats``), as a claim at its bound is.  Sent again after a restart
        and counted already: dropped (``head_stats.duplicate``)."""
        if self.counted.already(msg):
            self.counters["head_stats.duplicate"] += 1
            return
        sums = self.spec.claim(msg)
        scored = self._scored(msg, sums.n)
        so_far = self.claimed.get(msg.sender, 0.0)
        seen_now = float(seen.sum()) if seen is not None else 0.0
        if self.sends_up and seen_now < self.seen_then.get(msg.sender, 0.0):
            # A device restarted without its counts: they begin again, and so do its sums,
            # so its claims are bounded anew by what it has seen since (an honest camera's
            # statistics were clipped 175 times on a line after restarts).  What it claimed
            # before stays counted.  A liar claims no faster than its counts may climb
            # back, at the rate the roster allows.  Not at the cloud: a station resumes from
            # a checkpoint and may send again what it sent, which the bound must still catch.
            so_far = 0.0
            self.counters["head_stats.rebased"] += 1
        room = seen_now - so_far if seen is not None else 0.0
        weight = min(1.0, max(room, 0.0) / max(sums.n, 1))
        if weight < 1.0:
            self.counters["clipped.head_stats"] += 1
        self.total.add(sums, weight)
        if not self.sends_up:
            self.total.fold()  # float64 at once: the cloud's sums grow for as long as it runs
        self.newcomer = msg.sender not in self.claimed
        self.claimed[msg.sender] = so_far + weight * sums.n
        self.seen_then[msg.sender] = seen_now
        self.counted.note(msg)
        self.counters["head_stats"] += 1
        if scored is not None:
            self.scored += weight * scored
            if not self.sends_up and self.spec.unknown_share > 0:
                threshold = threshold_of(self.scored, self.spec.unknown_share)
                self.threshold = threshold if np.isfinite(threshold) else self.threshold

    def _scored(self, msg: m.HeadStats, frames: int) -> np.ndarray | None:
        """The histogram of scores ``msg`` carries, checked as a claim: each is one of its
        ``frames`` (a :class:`MessageError` otherwise); None where it has none, or they are
        of another detector than the one in use (``novelty.stale``: they calibrate nothing
        of it)."""
        if not msg.novelty.size:
            return None
        if msg.novelty.size != BINS:
            raise MessageError("wrong_length", f"{msg.novelty.size} bins of unknown-part "
                               f"scores, not {BINS}")
        if msg.novelty_of == 0:  # a device scores with a detector it was sent, by its name
            raise MessageError("novelty_claim", "unknown-part scores of no detector")
        if int(msg.novelty.sum()) > frames:
            raise MessageError("novelty_claim", f"{int(msg.novelty.sum())} frames scored, "
                               f"of {frames} in the statistics")
        if msg.novelty_of != self.detector_of:
            self.counters["novelty.stale"] += 1
            return None
        return msg.novelty.astype(np.float64)
    def upstream(self, seen: Callable[[], m.StationStats], round_: int, iteration: int, *,
                 early: bool = False, roster: int = 0) -> list[m.Message]:
        """What was admitted since the last send, for the level above (none where nothing),
        after ``seen()``, the sender's seen counts that bound it there (made only where
        something goes, as this runs on every device's statistics): sent before the upload
        that closes the round, so that round's solve has them, and the upload's own counts
        would come too late to bound them.  ``early``: between uploads, where what is
        pending is at least everything sent before it (doubling, so that a young fleet's
        first frames reach round 0's solve, and the sends stay few), and at once where the
        last of a ``roster`` of participants sent its first statistics, so that the solve
        before round 0 has every device's (under label skew one left out can hold a class)."""
        whole = self.newcomer and len(self.claimed) == roster
        pending = self.total.fresh_n
        if not self.sends_up or pending == 0 or (
                early and not whole and pending < self.total.n - pending):
            return []
        gram, cross, counts = self.total.take_fresh()
        self.counters["head_stats_forwarded"] += 1
        counts_first = seen()
        scored = np.floor(self.scored).astype(np.int64)  # a weighted-down claim, rounded down
        self.scored[:] = 0
        return [counts_first, self.sends.stamp(m.HeadStats(
            fleet=self.fleet, sender=counts_first.sender, round=round_, iteration=iteration,
            station=counts_first.sender, gram=gram, cross=cross, counts=counts,
            novelty=scored if scored.any() else scored[:0],
            novelty_of=self.detector_of if scored.any() else 0))]

    def solve(self, *, again: bool) -> np.ndarray | None:
        """The head from every admitted statistic, where there are any and a solve is due:
        the first one, or each time with ``again``.  None otherwise."""
        if self.total.n == 0 or (self.solved and not again) or self.total.n == self.solved:
            return None
        self.solved = self.total.n
        self.counters["head_solves"] += 1
        self.head = self.spec.solve(self.total.whole())
        log.info("fleet %s: its %s head solved from the statistics of %d samples", self.fleet,
                 self.spec.kind, self.solved)
        if not self.sends_up and self.spec.kind in GRAM_KINDS and self.spec.unknown_share > 0 \
                and self.total.n >= max(2 * self.detector_of, self.spec.features):
            self._detect()
        return self.head

    def _detect(self) -> None:
        """The cloud's detector from everything admitted: the first once the sums hold as
        many frames as the body has features (AUROC 0.87 there in the lab; a camera line's
        first few hundred frames of a few items score every new frame thousands of times
        farther than a known one), then again as they double (3.3 MB to every device each
        time: ten detectors to 650,000 frames at 1,280 features), its threshold kept until
        the new one's scores calibrate it."""
        detector = solve_detector(self.total.whole())
        self.detector = detector.packed()
        self.scored[:] = 0
        self.resend = True
        self.counters["novelty.detectors"] += 1
        log.info("fleet %s: its unknown-part detector solved from %d samples (%.0f degrees "
                 "of freedom)", self.fleet, detector.samples, detector.df)

    def relay(self, msg: m.GlobalModel) -> None:
        """A station's: the detector and threshold the cloud sent, for its devices; a
        detector that is not one for this head is refused and counted (the one held stays)."""
        self.threshold = msg.novelty_threshold
        if not msg.novelty.size:
            return
        try:
            detector = Detector.unpacked(msg.novelty, self.spec.features, self.spec.classes)
        except MessageError as exc:
            self.counters[f"rejected.novelty.{exc.reason}"] += 1
            log.warning("station: refused the cloud's unknown-part detector: %s", exc)
            return
        if detector.samples != self.detector_of:
            self.scored[:] = 0  # scores of the detector before it go nowhere now
        self.detector, self.resend = np.array(msg.novelty), True

    def novelty_out(self) -> dict[str, Any]:
        """The detector (where it is due), threshold and, at a station, its process's draw
        (``StationModel.started``), as a model message's fields."""
        out: dict[str, Any] = {"novelty_threshold": self.threshold,
                               **({"started": self.started} if self.sends_up else {})}
        if self.resend and self.detector is not None:
            out["novelty"], self.resend = self.detector, False
        return out

    def latest(self, otherwise: np.ndarray) -> np.ndarray:
        """The head from everything admitted so far (solved again where more came), else
        ``otherwise``."""
        self.solve(again=True)
        return otherwise if self.head is None else self.into(otherwise)

    def first(self, weights: np.ndarray) -> np.ndarray:
        """``weights`` with the head where the first solve is due now, else as they are
        (``resolve = "once"``: later rounds keep what the fleet made of it)."""
        return weights if self.solve(again=False) is None else self.into(weights)

    def into(self, weights: np.ndarray) -> np.ndarray:
        """``weights`` with the last solve as their head: the head's tensors come last in
        the flat layout, so for a head on a frozen body this is the whole model, and where
        the body's last blocks train their weights stay as they were before it."""
        assert self.head is not None and self.head.size <= weights.size
        out = weights.copy()
        out[weights.size - self.head.size:] = self.head
        return out

    def round_began(self, msg: m.GlobalModel) -> np.ndarray:
        """What a station's round starts from: the cloud's model ``msg``, or where the cloud
        solved no head yet (its ``head_samples``), this factory's head where there is one;
        the detector and threshold it carries are kept for the devices (:meth:`relay`)."""
        self.sends.heard(msg.round, msg.iteration)  # what the cloud surely holds, let go
        weights = np.array(msg.weights)
        if not msg.head_samples:
            weights = self.latest(weights)
        self.relay(msg)
        solved = msg.head_samples or self.head is not None
        self.round_head = weights.copy() if solved and self.spec.resolve == "every" else None
        return weights

    def fused(self, weights: np.ndarray) -> np.ndarray:
        """An internal sync's fused model, or the round's solved head where the next
        round's solve replaces whatever the steps make of it (resolve = "every"): fused
        in, the members' SGD steps moved the models the lines score between solves off the
        best head the statistics give (a camera line's candidates scored 0.26-0.59 against
        the solve's 0.59-0.65, and were refused; docs/bodies.md)."""
        if self.round_head is None:
            return weights
        self.counters["head_kept"] += 1
        return self.round_head.copy()

    def arrays(self) -> dict[str, np.ndarray]:
        out = {}
        out.update(grouped("head_kept", self.total.arrays()))
        out.update(grouped("head_claimed", {k: np.array([v]) for k, v in self.claimed.items()}))
        out.update(grouped("head_seen", {k: np.array([v]) for k, v in self.seen_then.items()}))
        out.update(grouped("head_through", {k: np.array(v, np.int64)
                                            for k, v in self.counted.through.items()}))
        out["head_sent"] = np.array([self.sends.epoch, self.sends.upto], np.int64)
        out["head_solved"] = np.array([self.solved], np.int64)
        if self.round_head is not None:
            out["head_round"] = self.round_head
        if self.detector is not None:
            out["head_detector"] = self.detector
        out["head_scored"] = self.scored
        out["head_threshold"] = np.array([self.threshold])
        return out

    def restore(self, arrays: dict[str, np.ndarray]) -> None:
        """From :meth:`arrays`; a checkpoint without them (written before heads were
        solved) leaves the sums empty."""
        if "head_solved" not in arrays:
            return
        kept = group(arrays, "head_kept") or {f"{part}_{k}": v for part in ("total", "pending")
                                               for k, v in group(arrays, f"head_{part}").items()}
        self.total.restore(kept)
        self.claimed = {k: float(v[0]) for k, v in group(arrays, "head_claimed").items()}
        self.seen_then = {k: float(v[0]) for k, v in group(arrays, "head_seen").items()}
        self.counted.through = {k: (int(v[0]), int(v[1]))
                                for k, v in group(arrays, "head_through").items()}
        if "head_sent" in arrays:  # the same epoch: its count goes on where the cloud has it
            self.sends = SendLog(*(int(v) for v in arrays["head_sent"]))
        self.solved = int(arrays["head_solved"][0])
        self.round_head = np.array(arrays["head_round"]) if "head_round" in arrays else None
        if "head_detector" in arrays:  # sent again: a device may have restarted meanwhile
            self.detector, self.resend = np.array(arrays["head_detector"]), True
        if "head_scored" in arrays:
            self.scored = np.array(arrays["head_scored"], np.float64)
            self.threshold = float(arrays["head_threshold"][0])


def attach_heads(role: Any, spec: HeadSpec | None) -> None:
    """Give a station or the cloud its ledger, where the federation solves its head."""
    if spec is not None:
        role.heads = HeadLedger(spec, role.counters, role.config.fleet,
                                upstream=role.id != CLOUD_ID)


def came_online(heads: HeadLedger | None) -> None:
    """A device came online: it may have restarted, so the detector goes again."""
    if heads is not None:
        heads.resend = heads.detector is not None


def sent_again(heads: HeadLedger | None, presence: m.Presence) -> list[m.Message]:
    """The cloud (re)appeared: a station's statistics of the last rounds again, since it
    may have resumed from a checkpoint without them (it counts each once)."""
    return list(heads.sends.kept) if heads is not None and presence.online else []


def fused_head(heads: HeadLedger | None, weights: np.ndarray) -> np.ndarray:
    """:meth:`HeadLedger.fused`, where the federation solves its head."""
    return weights if heads is None else heads.fused(weights)


def refused(heads: HeadLedger | None, msg: m.HeadStats, seen: np.ndarray | None
            ) -> MessageError | None:
    """:meth:`HeadLedger.admit`, its refusal returned for the role to count instead of
    raised; statistics sent to a role that solves no head are refused too."""
    if heads is None:
        return MessageError("unexpected_type", "head statistics, and this federation's head "
                            "is not solved in closed form ([model] head_init)")
    try:
        heads.admit(msg, seen)
    except MessageError as exc:
        return exc
    return None
