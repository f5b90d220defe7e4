"""The base-station role: FedGS inside one factory, as a transport-free state machine.

Each iteration ``t`` it forms a super node of ``L`` devices (``rand_per_group``
at random, the rest by the configured selector, GBP-CS by default, against
``P_real``), publishes ``w^m`` and the selection, and on the replies sets
``w^m = sum_k (n_k / n) z_k`` (internal synchronisation).  Every ``T``
iterations it uploads ``w^m`` to the cloud and waits for the global model
(external synchronisation).  Replies past the deadline are dropped and counted.
"""

from __future__ import annotations

import logging

import numpy as np

from edge_client import messages as m
from edge_client.role import RoleBase
from edge_client.topics import station_topics

from .config import StationConfig
from .fusion import FUSION_RULES
from .selection import SELECTORS

__all__ = ["Station"]

log = logging.getLogger(__name__)


class Station(RoleBase):
    """Base station ``m`` (one factory).

    States: ``joining`` (waiting for every device's first stats), ``waiting``
    (for the global model), ``collecting`` (replies of a super node), ``done``.
    """

    def __init__(self, config: StationConfig, *, num_params: int, num_classes: int,
                 rng: np.random.Generator) -> None:
        super().__init__()
        self.config = config
        self.num_params = num_params
        self.num_classes = num_classes
        self.rng = rng
        self.state = "joining"
        self.stats: dict[str, m.DeviceStats] = {}
        self.offline: set[str] = set()
        self.weights: np.ndarray | None = None
        self.p_real: np.ndarray | None = None
        self.round = 0
        self.iteration = 0
        self.members: tuple[str, ...] = ()
        self.deadline = 0.0
        self._next_hello = 0.0
        self._replies: dict[str, m.DeviceUpdate | m.SkipNotice] = {}
        self._consumed = 0

    @property
    def id(self) -> str:
        return self.config.station_id

    @property
    def online_devices(self) -> int:
        """Roster devices that reported and whose Last Will has not fired since."""
        return sum(1 for d in self.stats if d not in self.offline)

    def subscriptions(self) -> list[str]:
        return station_topics(self.config.fleet, self.config.devices)

    def tick(self, now: float) -> list[m.Message]:
        """Close the iteration at its deadline; repeat the join until the cloud answers."""
        if self.state == "waiting" and self.weights is None and now >= self._next_hello:
            self._next_hello = now + self.config.hello_interval
            self.counters["hellos"] += 1
            return [self._station_stats()]
        if self.state == "collecting" and now >= self.deadline:
            missing = len(self.members) - len(self._replies)
            self.counters["replies_missed"] += missing
            log.info("station %s: iteration %d deadline passed, %d of %d replies missing",
                     self.id, self.iteration, missing, len(self.members))
            return self._close_iteration(now)
        return []

    def _handle(self, message: m.Message, now: float) -> list[m.Message]:
        cfg = self.config
        if message.fleet != cfg.fleet:
            return self._reject("wrong_fleet", f"fleet {message.fleet!r}")
        if isinstance(message, m.GlobalModel):
            return self._on_global(message, now)
        if isinstance(message, m.Presence):
            return self._on_presence(message, now)
        if not isinstance(message, (m.DeviceStats, m.DeviceUpdate, m.SkipNotice)):
            return self._reject("unexpected_type", type(message).__name__)
        if message.station != self.id:
            return []  # another factory's device on the shared tree
        if message.sender not in cfg.devices:
            return self._reject("unknown_sender", f"device {message.sender!r} is not on the roster")
        if isinstance(message, m.DeviceStats):
            return self._on_stats(message, now)
        return self._on_reply(message, now)

    def _on_stats(self, msg: m.DeviceStats, now: float) -> list[m.Message]:
        if {msg.seen_counts.size, msg.next_batch_counts.size} != {self.num_classes}:
            return self._reject("wrong_length", f"histograms of width {msg.seen_counts.size}, "
                                f"expected {self.num_classes}")
        joined = msg.sender not in self.stats or msg.sender in self.offline
        self.stats[msg.sender] = msg
        self.offline.discard(msg.sender)
        if self.state == "joining" and len(self.stats) >= self.config.min_devices:
            self.state = "waiting"
            self._next_hello = now + self.config.hello_interval
            return [self._station_stats()]
        if joined and self.weights is not None:
            # A late joiner gets the current model; it is selectable from now on.
            self.counters["late_joins"] += 1
            return [self._model_message()]
        return []

    def _on_presence(self, msg: m.Presence, now: float) -> list[m.Message]:
        if msg.role != "dev" or msg.sender not in self.config.devices:
            return []
        if msg.online:
            return []  # selectable again from its next stats report
        self.offline.add(msg.sender)
        self.counters["devices_offline"] += 1
        if self.state == "collecting" and msg.sender in self.members \
                and msg.sender not in self._replies:
            # Its Last Will fired: do not wait for it until the deadline.
            self.counters["replies_missed"] += 1
            if self._awaited() == 0:
                return self._close_iteration(now)
        return []

    def _awaited(self) -> int:
        return sum(1 for d in self.members if d not in self._replies and d not in self.offline)

    def _on_reply(self, msg: m.DeviceUpdate | m.SkipNotice, now: float) -> list[m.Message]:
        if self.state != "collecting" or msg.iteration != self.iteration:
            return self._reject("stale_iteration", f"reply for iteration {msg.iteration}, "
                                f"station is at {self.iteration} ({self.state})")
        if msg.sender not in self.members:
            return self._reject("not_selected", f"{msg.sender} is not in the super node")
        if msg.sender in self._replies:
            self.counters["duplicates"] += 1
            return []
        if isinstance(msg, m.DeviceUpdate) and msg.weights.size != self.num_params:
            return self._reject("wrong_length", f"{msg.weights.size} weights, expected "
                                f"{self.num_params}")
        if now > self.deadline:
            self.counters["late_replies"] += 1
            return []
        self._replies[msg.sender] = msg
        kind = "updates" if isinstance(msg, m.DeviceUpdate) else "skips"
        self.counters[f"received_{kind}"] += 1
        if self._awaited() == 0:
            return self._close_iteration(now)
        return []

    def _on_global(self, msg: m.GlobalModel, now: float) -> list[m.Message]:
        if msg.sender != "cloud":
            return self._reject("unknown_sender", f"global model from {msg.sender!r}")
        if msg.weights.size != self.num_params or msg.p_real.size != self.num_classes:
            return self._reject("wrong_length", "global model or P_real of the wrong size")
        if self.weights is not None and msg.round <= self.round:
            return self._reject("stale_iteration", f"global round {msg.round} already applied")
        self.weights = np.array(msg.weights)
        self.p_real = np.array(msg.p_real)
        self.round, self.iteration = msg.round, msg.iteration
        if msg.final:
            self.state = "done"
            return [self._model_message(final=True)]
        return self._begin_iteration(now)

    def _begin_iteration(self, now: float) -> list[m.Message]:
        cfg = self.config
        ready = [d for d in cfg.devices if d in self.stats and d not in self.offline
                 and self.stats[d].next_batch_counts.any()]
        size = min(cfg.super_node_size, len(ready))
        hists = np.array([self.stats[d].next_batch_counts for d in ready], dtype=np.float64)
        n_random = min(cfg.rand_per_group, size)
        fixed = list(self.rng.choice(len(ready), size=n_random, replace=False)) if n_random else []
        picked = SELECTORS[cfg.selector](hists.reshape(len(ready), self.num_classes), self.p_real,
                                         size - n_random, fixed=fixed, rng=self.rng,
                                         max_iter=cfg.gbp_max_iter) if ready else []
        self.members = tuple(sorted(ready[i] for i in [*fixed, *picked]))
        log.debug("station %s: iteration %d super node %s", self.id, self.iteration, self.members)
        self._replies = {}
        self.deadline = now + cfg.iteration_timeout
        self.state = "collecting"
        out: list[m.Message] = [self._model_message(),
                                m.Selection(fleet=cfg.fleet, sender=self.id, round=self.round,
                                            iteration=self.iteration, members=self.members,
                                            deadline=self.deadline)]
        if not self.members:
            self.counters["iterations_without_data"] += 1
            return out + self._close_iteration(now)
        return out

    def _close_iteration(self, now: float) -> list[m.Message]:
        cfg = self.config
        # Sorted by sender so the fused model does not depend on arrival order.
        updates = [r for _, r in sorted(self._replies.items()) if isinstance(r, m.DeviceUpdate)]
        if len(updates) >= cfg.min_quorum:
            self.weights = FUSION_RULES[cfg.fusion]([u.weights for u in updates],
                                                    [u.num_samples for u in updates])
            self._consumed += sum(u.num_samples for u in updates)
        else:
            self.counters["iterations_below_quorum"] += 1
        self.iteration += 1
        if self.iteration % cfg.sync_period:
            return self._begin_iteration(now)
        self.state = "waiting"
        update = m.StationUpdate(fleet=cfg.fleet, sender=self.id, round=self.round,
                                 iteration=self.iteration, weights=self.weights,
                                 num_samples=self._consumed, seen_counts=self._seen_counts())
        self._consumed = 0
        return [update]

    def _station_stats(self) -> m.StationStats:
        return m.StationStats(fleet=self.config.fleet, sender=self.id, round=0, iteration=0,
                              seen_counts=self._seen_counts())

    def _model_message(self, final: bool = False) -> m.StationModel:
        return m.StationModel(fleet=self.config.fleet, sender=self.id, round=self.round,
                              iteration=self.iteration, weights=self.weights, final=final)

    def _seen_counts(self) -> np.ndarray:
        return np.sum([s.seen_counts for s in self.stats.values()], axis=0)
