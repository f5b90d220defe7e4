"""What one compromised device sends: the attacks the trust checks are measured against.

Each attack rewrites a device's outgoing messages (``tamper``); ``replay`` sends the
device's first update again as every later reply.  Of the lies about seen counts,
``seen`` puts 10^15 samples in one class once, ``uniform_seen`` claims every class at the
largest count the wire carries in every stats message, and ``seen_at_bound`` is the
attacker who has read the station's code: every class grows, evenly, by exactly the
growth a station accepts (``max_seen_rate x local_steps`` per iteration since its last
report, however many reports it sends in one), so no clip ever catches it;
``seen_shape_at_bound`` grows as fast, in the shape furthest towards even that the station
takes from it: just inside ``SHAPE_TOLERANCE`` of the batches it reported (what the station
sees it train).  Of the lies about a closed-form head's statistics (``HeadStats``),
``stats_scale`` multiplies every sum by ``STATS_SCALE`` (a consistent claim of that many
times the samples), ``stats_flip`` shifts every label by one class (sums as consistent as
honest ones), and ``stats_random`` sends, for as many samples, rows drawn at random at the
clip's norm with random labels: everything within the station's bounds.  ``accuracy_fall``
reports prequential counts (``FALL_SCORES`` a report) 95% right for ``FALL_AT`` reports and
40% right after: a camera that drifts as its station's drift watch sees it, a lie that
can only get the liar named.  ``nan`` cannot be a
message at all (messages refuse non-finite weights), so it becomes a forged frame,
checksum and all, that the receiver's :class:`~edge_client.admission.Admission`
must refuse.  The simulator and the hostile device process of the MQTT tests use
these same functions.  Used by ``safl experiment`` (``attack``, ``attackers``) and
``tests/hostile_device.py``; never by a production role.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from edge_client import messages as m
from edge_client.admission import Admission
from edge_client.codec import encode, reseal
from edge_client.head_stats import HeadSums
from edge_client.runner import RoleRunner
from edge_client.topics import topic_for
from edge_client.transport import LocalBus

__all__ = ["ATTACKS", "tamper", "forge_nan", "install"]

ATTACKS = ("none", "scale", "inflate", "nan", "seen", "balanced", "replay", "uniform_seen",
           "seen_at_bound", "seen_shape_at_bound", "stats_scale", "stats_flip", "stats_random",
           "accuracy_fall")
SCALE = 1e6  # "an update scaled by 1e6"
INFLATED = 10**12  # "an update claiming 10^12 samples"
SEEN = 10**15  # "one report of 10^15 seen samples"
WIRE_MAX = int(np.iinfo(np.int64).max)  # the largest count a frame carries
STATS_SCALE = 1000.0  # "statistics of 1,000 times the samples"
FALL_SCORES, FALL_AT = 25, 15  # accuracy_fall: scores a report, reports before the fall


def spread(total: int, width: int) -> np.ndarray:
    """``total`` samples over ``width`` classes, as evenly as counts go."""
    counts = np.full(width, total // width, dtype=np.int64)
    counts[: total % width] += 1
    return counts


def forge_nan(frame: bytes, n_weights: int) -> bytes:
    """``frame`` with its first weight set to NaN and the checksum recomputed."""
    data = bytearray(frame)
    start = len(data) - n_weights * 4
    data[start:start + 4] = np.array([np.nan], np.float32).tobytes()
    return reseal(data)


def tamper(message: m.Message, attack: str,
           memory: dict[str, Any] | None = None) -> m.Message | bytes:
    """What the compromised device sends instead of ``message``; ``memory`` is what the
    device keeps between its messages: a replaying one its first update, one lying at the
    bound the growth a station accepts per iteration (``growth``, set by whoever installs
    it) and its last claim."""
    if isinstance(message, m.DeviceUpdate):
        if attack == "replay":
            if memory is None:  # without it the "attack" would silently be an honest device
                raise ValueError("the replay attack needs a memory to keep its first update")
            # Its first update again, as this iteration's reply: new id, valid fields.
            first = memory.setdefault("first", message.weights)
            return dataclasses.replace(message, weights=first)
        if attack == "scale":
            return dataclasses.replace(message, weights=message.weights * np.float32(SCALE))
        if attack == "inflate":
            return dataclasses.replace(message, num_samples=INFLATED)
        if attack == "nan":
            return forge_nan(encode(message), message.weights.size)
    if isinstance(message, m.DeviceStats):
        if attack == "seen":
            counts = np.zeros_like(message.seen_counts)
            counts[0] = SEEN
            return dataclasses.replace(message, seen_counts=counts)
        if attack == "balanced":
            # The histogram GBP-CS likes best: the batch spread evenly over the classes.
            total = max(1, int(message.next_batch_counts.sum()))
            return dataclasses.replace(message, next_batch_counts=spread(
                total, message.next_batch_counts.size))
        if attack == "uniform_seen":
            return dataclasses.replace(message, seen_counts=np.full_like(
                message.seen_counts, WIRE_MAX))
        if attack == "seen_at_bound":
            return dataclasses.replace(message, seen_counts=_at_bound(message, memory))
        if attack == "seen_shape_at_bound":
            return dataclasses.replace(message, seen_counts=_shape_at_bound(message, memory))
        if attack == "accuracy_fall":
            scored, hits = _falling(memory)
            return dataclasses.replace(message, prequential_scored=scored,
                                       prequential_hits=hits)
    if isinstance(message, m.HeadStats) and attack.startswith("stats_"):
        return _head_stats(message, attack, memory)
    return message


def _falling(memory: dict[str, Any] | None) -> tuple[int, int]:
    """``accuracy_fall``'s scores and hits since it started, at its next report."""
    if memory is None:
        raise ValueError("the accuracy_fall attack counts its reports in a memory")
    k = memory["reports"] = memory.get("reports", 0) + 1
    before, after = min(k, FALL_AT), max(0, k - FALL_AT)
    return FALL_SCORES * k, before * FALL_SCORES * 95 // 100 + after * FALL_SCORES * 2 // 5


def _head_stats(message: m.HeadStats, attack: str, memory: dict[str, Any] | None
                ) -> m.HeadStats:
    """A device's head statistics, lied about (``stats_*``)."""
    gram, cross, counts = message.gram, message.cross, message.counts
    classes = counts.size
    if attack == "stats_scale":
        return dataclasses.replace(message, gram=gram * np.float32(STATS_SCALE),
                                   cross=cross * np.float32(STATS_SCALE),
                                   counts=counts * int(STATS_SCALE))
    if attack == "stats_flip":
        return dataclasses.replace(message, cross=np.roll(cross.reshape(-1, classes), 1,
                                                          axis=1).ravel(),
                                   counts=np.roll(counts, 1))
    if memory is None or "clip" not in memory:
        raise ValueError("the stats_random attack needs the body's clip")
    rng = memory.setdefault("rng", np.random.default_rng(0))
    n, width = int(counts.sum()), cross.size // classes
    rows = rng.standard_normal((n, width - 1))
    rows *= 0.999 * memory["clip"] / np.linalg.norm(rows, axis=1, keepdims=True)
    sums = HeadSums.zeros(width - 1, classes, kind="ridge" if gram.size else "ncm")
    sums.add_rows(np.hstack([rows, np.ones((n, 1))]), rng.integers(0, classes, n))
    tri, flat, got = sums.packed()
    return dataclasses.replace(message, gram=tri, cross=flat, counts=got)


def _at_bound(message: m.DeviceStats, memory: dict[str, Any] | None) -> np.ndarray:
    """Seen counts grown, in every class, by exactly what the station accepts since the
    attacker's last claim: ``growth`` for its first claim and per station iteration since,
    nothing more for another claim in the same iteration (the station's window)."""
    if memory is None or "growth" not in memory:
        raise ValueError("the seen_at_bound attack needs the growth a station accepts")
    total, last = memory.get("claim", (0, None))
    total += memory["growth"] * (1 if last is None else max(0, message.iteration - last))
    memory["claim"] = (total, message.iteration)
    return spread(total, message.seen_counts.size)


def _shape_at_bound(message: m.DeviceStats, memory: dict[str, Any] | None) -> np.ndarray:
    """:func:`_at_bound`'s total in the shape of the batches the device reported, moved
    towards even up to 0.95 of the station's shape tolerance (``tolerance``)."""
    counts = _at_bound(message, memory)
    assert memory is not None  # _at_bound refused without it
    batches = memory["batches"] = memory.get("batches", 0) + message.next_batch_counts
    if not batches.sum():
        return counts
    own = batches / batches.sum()
    even = np.full(own.size, 1.0 / own.size)
    apart = 0.5 * float(np.abs(even - own).sum())
    step = 1.0 if apart == 0 else min(1.0, 0.95 * memory["tolerance"] / apart)
    total = int(counts.sum())
    return np.floor(total * (own + step * (even - own))).astype(np.int64)


def install(runner: RoleRunner, attack: str, admission: Admission, bus: LocalBus, *,
            growth: int, tolerance: float, clip: float = 0.0) -> None:
    """Make a simulated device hostile: its runner sends ``tamper``'s output instead.

    A forged frame goes through ``admission`` (what the station's transport does) and
    whatever that yields, a refusal, is delivered in its place.  ``growth``: the seen
    samples its station accepts per iteration (``max_seen_rate x local_steps``),
    ``tolerance`` the shape tolerance it checks seen counts with, ``clip`` the body's
    row clip (for ``stats_random``).
    """
    honest = runner.publish
    memory: dict[str, Any] = {"growth": growth, "tolerance": tolerance, "clip": clip}

    def publish(out: list[m.Message]) -> None:
        for message in out:
            sent = tamper(message, attack, memory)
            if isinstance(sent, bytes):
                got = admission.admit(topic_for(message), sent, 0.0)
                if got is not None:
                    bus.publish(topic_for(got), got)
            else:
                honest([sent])
    runner.publish = publish  # type: ignore[method-assign]  # the compromised device's voice
