"""The cloud role: ``P_real``, external synchronisation and the global model.

It waits for every station's label counts, broadcasts round 0 with
``P_real = normalise(sum_{m,k} N^{m,k} P^{m,k})``, then each round fuses the
stations' ``w^m`` (weighted by the samples they consumed, or equally as in the
FedGS reference code), applies the server optimiser and broadcasts the next
global model, marked ``final`` after ``R`` rounds (never, with ``rounds = 0``: a field
fleet learns until it is stopped).  Transport-free.

A station's sample count is a claim: over the run, a station cannot have trained on
more samples than its devices saw, so its cumulative count is clipped to its reported
seen total.  ``snapshot``/``restore`` let the service resume after a crash; when a
station's presence comes back, the cloud repeats the current global model to it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import numpy as np

from edge_client import messages as m
from edge_client.catalogue import Catalogue
from edge_client.errors import ShapeError
from edge_client.messages import ProductNames
from edge_client.role import RoleBase, RoleEvent
from edge_client.states import CloudState
from edge_client.topics import CLOUD_ID, cloud_topics

from .accuracy import device_accuracy_summary
from .central_dp import CentralDP
from .checkpoint import CloudCheckpoint, group, grouped
from .config import CloudConfig
from .fusion import Fold, fold_for
from .heads import HeadLedger, came_online, refused
from .server_optimizers import build_server_optimizer
from .trust import claimed_total

log = logging.getLogger(__name__)

__all__ = ["Cloud", "CloudState", "CloudEvent"]

MAX_DEVICE_ACCURACIES = m.MAX_MEMBERS  # per station: no roster is larger



_C = CloudState


class CloudEvent(RoleEvent):
    """What moves the cloud (its ``TRANSITIONS``)."""

    STATIONS_JOINED = "stations_joined"  # every station's counts: round 0 goes out
    ROUND_CLOSED = "round_closed"  # external synchronisation; the next round goes out
    LAST_ROUND_CLOSED = "last_round_closed"  # the final global model goes out


_E = CloudEvent


class Cloud(RoleBase[CloudState]):
    """The cloud aggregator; ``initial_weights`` is the round-0 global model."""

    INITIAL = _C.JOINING
    TRANSITIONS = {(_C.JOINING, _E.STATIONS_JOINED): _C.COLLECTING,
                   (_C.COLLECTING, _E.ROUND_CLOSED): _C.COLLECTING,
                   (_C.COLLECTING, _E.LAST_ROUND_CLOSED): _C.DONE}

    def __init__(self, config: CloudConfig, *, initial_weights: np.ndarray,
                 num_classes: int) -> None:
        super().__init__()
        self.config = config
        self.num_classes = num_classes
        self.weights = np.array(initial_weights, dtype=np.float32)
        self.optimizer = build_server_optimizer(config)
        self.state = self.INITIAL
        self.round = 0
        self.iteration = 0
        self.deadline = float("inf")
        self._counts: dict[str, np.ndarray] = {}
        self._accuracies: dict[str, dict[str, np.ndarray]] = {}  # per station, for summaries
        # This round's station updates, folded as they arrive; kept: each one's iteration.
        self._updates: dict[str, int] = {}
        self.dp = CentralDP(config, seed=0)  # the cloud has no seed of its own
        self._fold = self._new_fold()
        self._consumed: dict[str, int] = {}  # samples each station claimed over the run
        # Stations whose Last Will fired, and when: a round waits ``station_grace`` seconds
        # for one to come back (a finished station: none).
        self.offline: dict[str, float] = {}
        self.heads: HeadLedger | None = None  # where the head is solved in closed form
        # The fleet's products (its file's, and as it is rewritten: CloudService), told to
        # every station and device with each model (edge_client/catalogue.py).
        self.catalogue = Catalogue(num_classes)

    @property
    def id(self) -> str:
        return CLOUD_ID

    def subscriptions(self) -> list[str]:
        return cloud_topics(self.config.fleet)

    @property
    def p_real(self) -> np.ndarray:
        """Fleet-wide label distribution from the stations' reported counts."""
        # In floats: a station's counts are claims too, and their int64 sum could wrap.
        total = np.sum([c.astype(np.float64) for c in self._counts.values()], axis=0)
        if total.sum() == 0:
            return np.full(self.num_classes, 1.0 / self.num_classes)
        return total / total.sum()

    def start(self, now: float) -> list[m.Message]:
        """A cloud resumed from a checkpoint repeats its current global model."""
        if self.state == _C.JOINING:
            return []
        self.deadline = now + self.config.round_timeout
        return [self._global_model()]

    def snapshot(self) -> tuple[dict[str, np.ndarray], CloudCheckpoint]:
        """Arrays and scalars that :meth:`restore` needs to continue bit for bit."""
        arrays = {"weights": self.weights, **grouped("opt", self.optimizer.state()),
                  **grouped("counts", self._counts),
                  **(self.heads.arrays() if self.heads is not None else {})}
        meta = CloudCheckpoint(state=self.state, round=self.round, iteration=self.iteration,
                               consumed=dict(self._consumed), counters=dict(self.counters),
                               dp_bound=self.dp.adaptive_bound)
        return arrays, meta

    def restore(self, arrays: dict[str, np.ndarray], meta: CloudCheckpoint) -> None:
        """Continue from a :meth:`snapshot` taken when a round was broadcast."""
        if meta.role != m.Participant.CLOUD or arrays["weights"].shape != self.weights.shape:
            raise ShapeError("the checkpoint is not this cloud's (role or model size differ)")
        self.weights = np.array(arrays["weights"], dtype=np.float32)
        self.optimizer.load_state(group(arrays, "opt"))
        self._counts = {s: np.array(v) for s, v in group(arrays, "counts").items()
                        if s in self.config.stations}
        self.state, self.round, self.iteration = _C(meta.state), meta.round, meta.iteration
        self._consumed = {k: int(v) for k, v in meta.consumed.items()}
        self.dp.resume(meta.dp_bound)
        self.counters.update(meta.counters)
        if self.heads is not None:
            self.heads.restore(arrays)
        self._updates, self._fold = {}, self._new_fold()

    def tick(self, now: float) -> list[m.Message]:
        """Close the round at its deadline if a quorum of stations reported; round 0 goes
        out at the end of its wait for the head's statistics."""
        if self.state == _C.JOINING and now >= self.deadline:
            return self._joined(now)
        if self._quorate() and self._all_in(now):
            return self._close_round(now)  # a vanished station's grace ran out
        if self.state == _C.COLLECTING and now >= self.deadline:
            if len(self._updates) >= self.config.min_stations:
                return self._close_round(now)
            self.deadline = now + self.config.round_timeout
            self.counters["rounds_below_quorum"] += 1
        return []

    def wakeup(self) -> float | None:
        if self.state == _C.DONE:
            return None
        graces = [t + self.config.station_grace for s, t in self.offline.items()
                  if s not in self._updates] if self._quorate() else []
        soonest = min([self.deadline, *graces])
        return soonest if soonest < math.inf else None

    def _quorate(self) -> bool:
        return self.state == _C.COLLECTING and len(self._updates) >= self.config.min_stations

    def _all_in(self, now: float) -> bool:
        """Every station has sent this round's update or is gone: finished, or vanished
        ``station_grace`` seconds ago.  A restarted station (systemd's RestartSec, then its
        checkpoint) is back within it and its devices' round counts; closing at its Last
        Will lost every round it would have rejoined where rounds are short."""
        return all(s in self._updates or self.offline.get(s, math.inf)
                   + self.config.station_grace <= now for s in self.config.stations)

    def _joined(self, now: float) -> list[m.Message]:
        """Every station has reported its counts: round 0 goes out, its head solved from
        the statistics the stations forward of the frames their devices started with; those
        follow the counts, so the cloud waits ``head_join_wait`` seconds for them."""
        if self.heads is not None:  # (at the wait's end, the deadline is past: it goes out)
            self.deadline = min(self.deadline, now + self.config.head_join_wait)
            if now < self.deadline:
                return []
        if self.heads is not None:
            self.weights = self.heads.first(self.weights)
        return self._broadcast(self.next_state(_E.STATIONS_JOINED), now)

    def _handle(self, message: m.Message, now: float) -> list[m.Message]:
        if message.fleet != self.config.fleet:
            return self._reject("wrong_fleet", f"fleet {message.fleet!r}")
        if isinstance(message, m.Presence):
            return self._on_presence(message, now)
        if isinstance(message, m.Refusal):
            return []  # counted by the transport; the station repeats its upload on presence
        if not isinstance(message, (m.StationStats, m.StationUpdate, m.HeadStats)):
            return self._reject("unexpected_type", type(message).__name__)
        if message.sender not in self.config.stations:
            return self._reject("unknown_sender", f"station {message.sender!r}")
        if isinstance(message, m.HeadStats):
            return self._on_head(message)
        if message.seen_counts.size != self.num_classes:
            return self._reject("wrong_length", f"counts of width {message.seen_counts.size}")
        if isinstance(message, m.StationStats):
            self._counts[message.sender] = np.array(message.seen_counts)
            if self.state == _C.JOINING and len(self._counts) == len(self.config.stations):
                return self._joined(now)
            return []
        if self.state != _C.COLLECTING or message.round != self.round:
            return self._reject("stale_iteration", f"update for round {message.round}, "
                                f"cloud is at {self.round} ({self.state})")
        if message.weights.size != self.weights.size:
            return self._reject("wrong_length", f"{message.weights.size} weights")
        if message.sender in self._updates:
            self.counters["duplicates"] += 1
            return []
        self._counts[message.sender] = np.array(message.seen_counts)
        self._note_accuracies(message)
        accepted = self._plausible_count(message)
        equal = self.config.station_weighting == "equal"
        self._fold.add(accepted.weights, 1.0 if equal else accepted.num_samples,
                       key=accepted.sender)
        self._updates[message.sender] = accepted.iteration
        self.offline.pop(message.sender, None)
        return self._close_round(now) if self._all_in(now) else []

    def _on_head(self, msg: m.HeadStats) -> list[m.Message]:
        """A station's head statistics, checked against its counts and its devices' seen."""
        error = refused(self.heads, msg, self._counts.get(msg.sender))
        return self._reject(error.reason, str(error)) if error else []

    def _note_accuracies(self, msg: m.StationUpdate) -> None:
        """Keep the station's device accuracies for the summary: a metric, so values outside
        [0, 1] or more than a roster's worth are dropped and counted, never refused."""
        kept = {}
        for key in ("local", "prequential"):
            values = getattr(msg, f"{key}_accuracies")[:MAX_DEVICE_ACCURACIES]
            good = values[(values >= 0) & (values <= 1)]
            if len(good) < len(getattr(msg, f"{key}_accuracies")):
                self.counters[f"clipped.{key}_accuracies"] += 1
            kept[key] = good
        self._accuracies[msg.sender] = kept

    def accuracy_summary(self) -> dict[str, Any]:
        """Held-out and prequential accuracy over every station's devices."""
        return device_accuracy_summary(
            *([v for acc in self._accuracies.values() for v in acc[key]]
              for key in ("local", "prequential")))

    def _plausible_count(self, msg: m.StationUpdate) -> m.StationUpdate:
        """Clip a station's claimed samples to what its devices can have seen."""
        before = self._consumed.get(msg.sender, 0)
        room = max(0, claimed_total(msg.seen_counts) - before)
        if msg.num_samples > room:
            self.counters["clipped.station_samples"] += 1
            msg = dataclasses.replace(msg, num_samples=room)
        self._consumed[msg.sender] = before + msg.num_samples
        return msg

    def _on_presence(self, msg: m.Presence, now: float) -> list[m.Message]:
        if msg.role != m.Participant.STATION or msg.sender not in self.config.stations:
            return []
        if msg.online:
            self.offline.pop(msg.sender, None)
            came_online(self.heads)  # a restarted station holds no detector: it goes again
            if self.state == _C.JOINING or msg.sender in self._updates:
                return []
            # A (re)started station may have missed this round's model: repeat it.
            self.counters["rebroadcasts"] += 1
            return [self._global_model()]
        self.offline[msg.sender] = -math.inf if msg.final else now
        self.counters["stations_offline"] += 1
        if msg.final:
            log.info("cloud: station %s finished", msg.sender)
        else:
            log.warning("cloud: station %s went offline (its Last Will); rounds close without "
                        "it after %g s ([cloud] station_grace) unless it comes back",
                        msg.sender, self.config.station_grace)
        if self._quorate() and self._all_in(now):
            return self._close_round(now)
        return []

    def _new_fold(self) -> Fold:
        """With central DP a noised mean of the stations' clipped steps from the global
        model over every station; else the fusion rule's fold, which averages equally in a
        round in which no station consumed data."""
        if self.dp.enabled:
            return self.dp.fold(self.weights, len(self.config.stations))
        return fold_for(self.config.fusion, equal_if_unweighted=True)

    def privacy_summary(self) -> dict[str, Any]:
        """With central DP, the most any station's data has spent in the cloud's releases."""
        return {"epsilon_cloud": self.dp.privacy.worst()} if self.dp.enabled else {}

    def _close_round(self, now: float) -> list[m.Message]:
        # rounds = 0: a field fleet learns for as long as it runs (no round is the last).
        last = 0 < self.config.rounds <= self.round + 1
        new = self.next_state(_E.LAST_ROUND_CLOSED if last else _E.ROUND_CLOSED)
        # Each station a round closed without: at its deadline, or gone (its Last Will).
        if missed := len(self.config.stations) - len(self._updates):
            self.counters["stations_missed"] += missed
        if self._updates:
            self.weights = self.optimizer.step(self.weights,
                                               self.dp.release(self._fold, self.counters))
            self.iteration = max(self._updates.values())
        if self.heads is not None and self.heads.spec.resolve == "every":
            # The head is the latest solve, whether or not statistics came this round: SGD
            # rounds between two solves took a FedAvg fleet's head from 0.86 to 0.61.
            self.weights = self.heads.latest(self.weights)
        elif self.heads is not None:
            self.weights = self.heads.first(self.weights)
        if self.heads is not None and self._updates and not self.heads.total.n:
            self._no_head_stats()
        self._updates, self._fold = {}, self._new_fold()
        self.round += 1
        return self._broadcast(new, now)

    def _no_head_stats(self) -> None:
        """A round of updates and not one statistic: a device sends its statistics from its
        first labelled frame, before it trains on it, so after two such rounds a broker is
        dropping them (a station broker whose ACL lacks its devices' ``dev/<id>/head``, as
        Mosquitto grants the subscription and drops the messages without a word)."""
        self.counters["rounds_without_head_stats"] += 1
        if self.counters["rounds_without_head_stats"] == 2:
            log.error("cloud: %d rounds of updates and no head statistics from any station: "
                      "their brokers drop them; run safl provision again and reload the "
                      "station brokers' ACLs (docs/bodies.md)",
                      self.counters["rounds_without_head_stats"])

    def _broadcast(self, new: CloudState, now: float) -> list[m.Message]:
        """Round ``self.round`` begins (``new``: collecting, or done after the last)."""
        self.state = new
        self.deadline = now + self.config.round_timeout
        return [self._global_model()]

    def catalogue_summary(self) -> dict[str, Any]:
        """The fleet's products, for the cloud's summary (edge_client/catalogue.py)."""
        cat = self.catalogue
        return {"classes": cat.num_classes, "products": cat.names, "retired": cat.retired_names}

    def _global_model(self) -> m.GlobalModel:
        return m.GlobalModel(fleet=self.config.fleet, sender=CLOUD_ID, round=self.round,
                             iteration=self.iteration, weights=self.weights,
                             p_real=self.p_real, final=self.state == _C.DONE,
                             head_samples=self.heads.solved if self.heads else 0,
                             products=ProductNames(self.catalogue.names),
                             retired=ProductNames(self.catalogue.retired_names),
                             **(self.heads.novelty_out() if self.heads else {}))
