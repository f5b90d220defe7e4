"""What a station knows of its roster: each device's latest stats, checked as claims on
arrival, who is offline, and what the station derives from them (who is ready, the
factory's label counts, the devices' accuracies).

Histograms must have the fleet's width and the next batch must fit the batch size (else
the stats are refused); seen counts may grow only ``max_seen_rate x local_steps`` per
iteration and no device may claim more than ``seen_share`` of the roster's samples
(:func:`~aggregator.trust.bound_seen_counts`: clipped, and kept clipped); accuracies
outside [0, 1] and a negative epsilon are metrics no device can have measured, dropped
as not measured.  Every refusal and clip goes to the station's ``reject`` and ``clip``.
The label counts a station reports for ``P_real`` are capped so that no device outweighs
the rest (:func:`~aggregator.trust.majority_capped`).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from edge_client import messages as m

from .accuracy import device_accuracy_summary
from .checkpoint import group, grouped
from .config import StationConfig
from .drift import DriftWatch
from .trust import SeenTotals, bound_seen_counts, claimed_total, majority_capped

__all__ = ["Roster", "StatsCheck"]

# A device's claimed seen shape is checked against the batches its admitted updates were
# selected on (what the station saw it train) once it has this many; beyond this total
# variation between the two, the trained shape stands in for the claimed one in P_real.
SHAPE_MIN_UPDATES = 8
SHAPE_TOLERANCE = 0.25
JOIN_PATIENCE_S = 300.0  # a roster incomplete this long after start is a warning, not news


class StatsCheck:
    """The checks of one station's incoming stats."""

    def __init__(self, config: StationConfig, num_classes: int, *,
                 reject: Callable[[str, str], Any], clip: Callable[[str], None]) -> None:
        self.config, self.num_classes = config, num_classes
        self._reject, self._clip = reject, clip

    def check(self, msg: m.DeviceStats, totals: SeenTotals,
              window: tuple[int, int]) -> m.DeviceStats | None:
        """``msg`` as the station keeps it, or None where it is refused; ``totals``: the
        seen totals the roster accepted so far, ``window``: the sender's accepted total its
        seen counts grow from, and over how many iterations (:meth:`Roster.window`)."""
        if {msg.seen_counts.size, msg.next_batch_counts.size} != {self.num_classes}:
            self._reject("wrong_length", f"histograms of width {msg.seen_counts.size}, "
                         f"expected {self.num_classes}")
            return None
        if (batch := claimed_total(msg.next_batch_counts)) > self.config.batch_size:
            self._reject("bad_histogram", f"next batch of {batch} samples, the batch size is "
                         f"{self.config.batch_size}")
            return None
        msg = self._plausible_seen(msg, totals, window)
        # Only metrics, but metrics operators act on: an accuracy outside [0, 1] is dropped
        # (as not measured) and counted; the histograms still count.
        if msg.epsilon < 0:
            self._clip("epsilon")
            msg = dataclasses.replace(msg, epsilon=0.0)
        for name in ("local", "prequential", "shadow"):
            if not 0.0 <= getattr(msg, f"{name}_accuracy") <= 1.0:
                self._clip(f"{name}_accuracy")
                cleared: dict[str, Any] = {f"{name}_accuracy": 0.0, f"{name}_samples": 0}
                msg = dataclasses.replace(msg, **cleared)
        return msg

    def _plausible_seen(self, msg: m.DeviceStats, totals: SeenTotals,
                        window: tuple[int, int]) -> m.DeviceStats:
        """Seen counts bounded in growth and share (a claim of 10^15 samples must not decide
        ``P_real``); the clipped counts are what the station keeps and sums."""
        cfg = self.config
        # A device senses per local step, and a flat round holds many steps between reports.
        per_iteration = cfg.max_seen_rate * cfg.local_steps
        base, elapsed = window
        counts, clipped = bound_seen_counts(msg.seen_counts, base, per_iteration * elapsed,
                                            totals.median_without(msg.sender), cfg.seen_share,
                                            per_iteration)
        if not clipped:
            return msg
        self._clip("seen_counts")
        return dataclasses.replace(msg, seen_counts=counts)


class LateModels:
    """When the current model goes out again for devices that joined late or came back.
    A broker restart fires every Last Will and a thousand devices come back within
    seconds; one broadcast reaches them all, so it goes at most once an ``interval``
    however many come in it (one a device put 1,000 x 51 MB through a thousand-camera
    station's broker), and once more after it for those it came before."""

    def __init__(self, interval: float = 1.0) -> None:
        self.interval = interval
        self.due_at: float | None = None  # a broadcast owed to joiners since the last
        self._last = -math.inf

    def joined(self, now: float) -> bool:
        """A device joined: True where the model goes out now, else it is owed."""
        if now >= self._last + self.interval:
            self._last, self.due_at = now, None
            return True
        self.due_at = self._last + self.interval
        return False

    def due(self, now: float) -> bool:
        """Whether the owed broadcast goes out now."""
        if self.due_at is None or now < self.due_at:
            return False
        self._last, self.due_at = now, None
        return True


class Roster:
    """A station's devices as it knows them: their latest checked stats, who is offline."""

    def __init__(self, config: StationConfig, num_classes: int, counters: Counter[str], *,
                 reject: Callable[[str, str], Any], clip: Callable[[str], None]) -> None:
        self.config, self.num_classes, self.counters = config, num_classes, counters
        self.check = StatsCheck(config, num_classes, reject=reject, clip=clip)
        self.stats: dict[str, m.DeviceStats] = {}
        self.totals = SeenTotals()  # of the seen counts in ``stats``
        self._joining_since: float | None = None  # when the station first said it waits
        self.offline: set[str] = set()
        self.seen_at: dict[str, int] = {}  # iteration of each device's last accepted stats
        self._window: dict[str, tuple[int, int]] = {}  # what its last accepted grew from
        self.trained: dict[str, np.ndarray] = {}  # next batches its admitted updates had
        self.trained_updates: Counter[str] = Counter()
        self.drift = DriftWatch(counters, clip)
        self.late = LateModels()

    def checked(self, msg: m.DeviceStats, iteration: int) -> m.DeviceStats | None:
        """``msg`` as the station would keep it at ``iteration``, or None: refused."""
        return self.check.check(msg, self.totals, self.window(msg.sender, iteration))

    def window(self, device: str, iteration: int) -> tuple[int, int]:
        """The accepted seen total a report of ``device`` at ``iteration`` grows from, and
        the iterations of allowance it grows by.  A report in the iteration of the device's
        last accepted one shares that one's window: the allowance is per iteration, not per
        report, or a device sending a hundred reports an iteration would grow by a hundred
        allowances in it."""
        last = self.seen_at.get(device)
        if last is None or device not in self.stats:
            return 0, 1
        if iteration == last and device in self._window:
            return self._window[device]
        return claimed_total(self.stats[device].seen_counts), max(1, iteration - last)

    def accept(self, msg: m.DeviceStats, iteration: int) -> None:
        self._window[msg.sender] = window = self.window(msg.sender, iteration)
        cfg = self.config
        self.drift.take(msg.sender, msg.prequential_scored, msg.prequential_hits, window,
                        cfg.max_seen_rate * cfg.local_steps)
        self.stats[msg.sender] = msg
        self.totals.set(msg.sender, claimed_total(msg.seen_counts))
        self.seen_at[msg.sender] = iteration
        self.offline.discard(msg.sender)

    def arrays(self) -> dict[str, np.ndarray]:
        """The checkpoint's share in arrays: each device's seen counts, next-batch histogram
        and the batches the station saw it train (the rest is in :meth:`state`)."""
        return {**grouped("seen", {d: st.seen_counts for d, st in self.stats.items()}),
                **grouped("next", {d: st.next_batch_counts for d, st in self.stats.items()}),
                **grouped("trained", self.trained)}

    def state(self) -> dict[str, Any]:
        """The checkpoint's share in the document: when each device last reported, what its
        report grew from (a restart mid-iteration must not hand out a fresh allowance) and
        how many admitted updates its trained shape rests on, and what each had counted
        before it restarted (:class:`~aggregator.trust.SeenTotals`)."""
        return {"seen_at": dict(self.seen_at), "seen_carried": dict(self.totals.carried),
                "windows": {d: list(w) for d, w in self._window.items()},
                "trained_updates": dict(self.trained_updates), **self.drift.state()}

    def restore(self, arrays: Mapping[str, np.ndarray], seen_at: Mapping[str, int],
                windows: Mapping[str, list[int]], trained_updates: Mapping[str, int],
                drift_counts: Mapping[str, list[int]],
                drift_levels: Mapping[str, float], seen_carried: Mapping[str, int]) -> None:
        """Back to :meth:`arrays` and :meth:`state`, for the roster's devices only."""
        cfg = self.config
        self.totals.restore({d: c for d, c in seen_carried.items() if d in cfg.devices})
        self.drift.restore({d: c for d, c in drift_counts.items() if d in cfg.devices},
                           {d: v for d, v in drift_levels.items() if d in cfg.devices})
        seen, nxt = group(arrays, "seen"), group(arrays, "next")
        for d in cfg.devices:
            if d in seen:
                self.stats[d] = m.DeviceStats(fleet=cfg.fleet, sender=d, round=0, iteration=0,
                                              station=cfg.station_id, seen_counts=seen[d],
                                              next_batch_counts=nxt[d])
                self.totals.set(d, claimed_total(seen[d]))
        self.seen_at = {d: int(i) for d, i in seen_at.items() if d in cfg.devices}
        self._window = {d: (int(w[0]), int(w[1])) for d, w in windows.items()
                        if d in cfg.devices}
        self.trained = {d: np.array(v, dtype=np.int64)
                        for d, v in group(arrays, "trained").items() if d in cfg.devices}
        self.trained_updates = Counter({d: int(n) for d, n in trained_updates.items()
                                        if d in self.trained})

    def ready(self) -> list[str]:
        """Devices online whose next batch is ready, in roster order."""
        return list(self._ready())

    def _ready(self) -> Iterator[str]:
        return (d for d in self.config.devices if d in self.stats and d not in self.offline
                and self.stats[d].next_batch_counts.any())

    def enough_ready(self, quorum: int) -> bool:
        """Whether ``quorum`` devices are ready: a gathering station asks on every report,
        and the first ``quorum`` answer it (the whole roster cost 2 ms at 1,000 devices)."""
        return next(itertools.islice(self._ready(), quorum - 1, None), None) is not None

    def went_offline(self, device: str) -> None:
        """``device``'s Last Will fired."""
        self.offline.add(device)
        self.counters["devices_offline"] += 1

    def back_online(self, device: str) -> bool:
        """``device`` is online again; True where it was offline."""
        if device not in self.offline:
            return False
        self.offline.discard(device)
        self.counters["devices_back_online"] += 1
        return True

    def joining(self, now: float) -> tuple[int, str]:
        """How loud to say it, and who a joining station has heard from and waits for: a
        warning, with where to look, once it has waited ``JOIN_PATIENCE_S`` (a broker that
        refuses devices past its file descriptors keeps a station joining for good)."""
        if self._joining_since is None:
            self._joining_since = now
        missing = self.missing
        text = (f"{len(self.stats)} of {self.config.min_devices} devices reported, waiting "
                f"for {', '.join(missing[:20])}"
                + (f" and {len(missing) - 20} more" if len(missing) > 20 else ""))
        if now - self._joining_since < JOIN_PATIENCE_S:
            return logging.INFO, text
        return logging.WARNING, (f"{text}, for {now - self._joining_since:.0f} s: a missing "
                                 "device's log says why it cannot report; past about 1,000 "
                                 "devices a broker under the usual 1,024 file descriptors "
                                 "refuses the rest (docs/deploy.md)")

    @property
    def online(self) -> int:
        """Roster devices that reported and whose Last Will has not fired since."""
        return sum(1 for d in self.stats if d not in self.offline)

    @property
    def missing(self) -> list[str]:
        """Roster devices the station has not heard from (or whose Last Will fired)."""
        return [d for d in self.config.devices if d not in self.stats or d in self.offline]

    def local_accuracies(self) -> list[float]:
        """The latest device-local accuracy each device reported (those that measured)."""
        return [s.local_accuracy for s in self.stats.values() if s.local_samples]

    def prequential_accuracies(self) -> list[float]:
        """The latest prequential accuracy each device reported (those that predict)."""
        return [s.prequential_accuracy for s in self.stats.values() if s.prequential_samples]

    def accuracy_summary(self) -> dict[str, float]:
        """Held-out and prequential accuracy over the devices, mean and worst 10%."""
        return device_accuracy_summary(self.local_accuracies(), self.prequential_accuracies())

    def epsilon_local(self) -> float:
        """The largest epsilon a device reports its local differential privacy has spent."""
        return max((s.epsilon for s in self.stats.values()), default=0.0)

    def trained_on(self, device: str) -> None:
        """An update of ``device`` was admitted: the batch it reported it would train on
        joins what the station saw it train."""
        if device in self.stats:
            batch = self.stats[device].next_batch_counts
            self.trained[device] = self.trained.get(device, 0) + batch
            self.trained_updates[device] += 1

    def _shaped(self, device: str, counts: np.ndarray) -> np.ndarray:
        """``counts`` as ``P_real`` takes them: the claimed total, in the shape the station
        saw the device train where the claimed shape is further than SHAPE_TOLERANCE from
        it (a device cannot make up the label mix it adds to its factory's)."""
        trained = self.trained.get(device)
        total = claimed_total(counts)
        if trained is None or self.trained_updates[device] < SHAPE_MIN_UPDATES or not total \
                or not trained.sum():
            return counts
        shape = trained / trained.sum()
        if 0.5 * float(np.abs(counts / total - shape).sum()) <= SHAPE_TOLERANCE:
            return counts
        self.counters["seen_shape_replaced"] += 1
        return np.floor(total * shape).astype(np.int64)

    def seen_counts(self, at_least: int) -> np.ndarray:
        """The factory's label counts for ``P_real``: no device outweighs the rest, and never
        fewer than ``at_least``, the samples its updates have reported (the cloud checks
        those against it)."""
        if not self.stats:
            return np.zeros(self.num_classes, dtype=np.int64)
        total, capped = majority_capped([self._shaped(d, s.seen_counts)
                                         for d, s in self.stats.items()], at_least=at_least)
        if capped:
            self.counters["seen_majority_capped"] += capped
        return total
