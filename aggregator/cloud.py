"""The cloud role: ``P_real``, external synchronisation and the global model.

It waits for every station's label counts, broadcasts round 0 with
``P_real = normalise(sum_{m,k} N^{m,k} P^{m,k})``, then each round fuses the
stations' ``w^m`` (weighted by the samples they consumed, or equally as in the
FedGS reference code), applies the server optimiser and broadcasts the next
global model, marked ``final`` after ``R`` rounds.  Transport-free.
"""

from __future__ import annotations

import numpy as np

from edge_client import messages as m
from edge_client.role import RoleBase
from edge_client.topics import cloud_topics

from .config import CloudConfig
from .fusion import build_server_optimizer, fedavg

__all__ = ["Cloud", "CLOUD_ID"]

CLOUD_ID = "cloud"


class Cloud(RoleBase):
    """The cloud aggregator; ``initial_weights`` is the round-0 global model."""

    def __init__(self, config: CloudConfig, *, initial_weights: np.ndarray,
                 num_classes: int) -> None:
        super().__init__()
        self.config = config
        self.num_classes = num_classes
        self.weights = np.array(initial_weights, dtype=np.float32)
        self.optimizer = build_server_optimizer(
            config.server_optimizer, lr=config.server_lr, beta1=config.beta1,
            beta2=config.beta2, tau=config.tau)
        self.state = "joining"
        self.round = 0
        self.iteration = 0
        self.deadline = float("inf")
        self._counts: dict[str, np.ndarray] = {}
        self._updates: dict[str, m.StationUpdate] = {}
        self.offline: set[str] = set()

    @property
    def id(self) -> str:
        return CLOUD_ID

    def subscriptions(self) -> list[str]:
        return cloud_topics(self.config.fleet)

    @property
    def p_real(self) -> np.ndarray:
        """Fleet-wide label distribution from the stations' reported counts."""
        total = np.sum(list(self._counts.values()), axis=0).astype(np.float64)
        if total.sum() == 0:
            return np.full(self.num_classes, 1.0 / self.num_classes)
        return total / total.sum()

    def tick(self, now: float) -> list[m.Message]:
        """Close the round at its deadline if a quorum of stations reported."""
        if self.state == "collecting" and now >= self.deadline:
            if len(self._updates) >= self.config.min_stations:
                self.counters["stations_missed"] += len(self.config.stations) - len(self._updates)
                return self._close_round(now)
            self.deadline = now + self.config.round_timeout
            self.counters["rounds_below_quorum"] += 1
        return []

    def _handle(self, message: m.Message, now: float) -> list[m.Message]:
        if message.fleet != self.config.fleet:
            return self._reject("wrong_fleet", f"fleet {message.fleet!r}")
        if isinstance(message, m.Presence):
            return self._on_presence(message, now)
        if not isinstance(message, (m.StationStats, m.StationUpdate)):
            return self._reject("unexpected_type", type(message).__name__)
        if message.sender not in self.config.stations:
            return self._reject("unknown_sender", f"station {message.sender!r}")
        if message.seen_counts.size != self.num_classes:
            return self._reject("wrong_length", f"counts of width {message.seen_counts.size}")
        if isinstance(message, m.StationStats):
            self._counts[message.sender] = np.array(message.seen_counts)
            if self.state == "joining" and len(self._counts) == len(self.config.stations):
                return self._broadcast(now)
            return []
        if self.state != "collecting" or message.round != self.round:
            return self._reject("stale_iteration", f"update for round {message.round}, "
                                f"cloud is at {self.round} ({self.state})")
        if message.weights.size != self.weights.size:
            return self._reject("wrong_length", f"{message.weights.size} weights")
        if message.sender in self._updates:
            self.counters["duplicates"] += 1
            return []
        self._updates[message.sender] = message
        self._counts[message.sender] = np.array(message.seen_counts)
        self.offline.discard(message.sender)
        if all(s in self._updates or s in self.offline for s in self.config.stations):
            return self._close_round(now)
        return []

    def _on_presence(self, msg: m.Presence, now: float) -> list[m.Message]:
        if msg.role != "station" or msg.sender not in self.config.stations or msg.online:
            return []
        self.offline.add(msg.sender)
        self.counters["stations_offline"] += 1
        waiting = [s for s in self.config.stations
                   if s not in self._updates and s not in self.offline]
        if self.state == "collecting" and not waiting \
                and len(self._updates) >= self.config.min_stations:
            return self._close_round(now)
        return []

    def _close_round(self, now: float) -> list[m.Message]:
        ups = [u for _, u in sorted(self._updates.items())]  # fusion independent of arrival
        if ups:
            # A round in which no station consumed data still averages, equally.
            equal = self.config.station_weighting == "equal" or not any(u.num_samples for u in ups)
            fused = fedavg([u.weights for u in ups],
                           [1.0 if equal else u.num_samples for u in ups])
            self.weights = self.optimizer.step(self.weights, fused)
            self.iteration = max(u.iteration for u in ups)
        self._updates = {}
        self.round += 1
        return self._broadcast(now)

    def _broadcast(self, now: float) -> list[m.Message]:
        final = self.round >= self.config.rounds
        self.state = "done" if final else "collecting"
        self.deadline = now + self.config.round_timeout
        return [m.GlobalModel(fleet=self.config.fleet, sender=CLOUD_ID, round=self.round,
                              iteration=self.iteration, weights=self.weights,
                              p_real=self.p_real, final=final)]
