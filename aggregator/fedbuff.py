"""FedBuff at the base station: buffered asynchronous aggregation (``mode = "buffered"``).

Nguyen et al. (AISTATS 2022): the server keeps up to ``C`` clients training at once, each
from the latest model it has; every ``K`` updates that arrive are folded into the model,
each step weighted by its staleness ``s`` (server versions since the model it started from,
``1/sqrt(1+s)`` by default), and training never waits for the slowest client.  Here ``C``
is the super node size, ``K`` is ``buffer_size``, and a station *iteration* is one buffer
fold: every ``sync_period`` of them the station uploads to the cloud as a synchronous one
does, so the cloud, the devices and SAFL's annealed merge and upload gate are unchanged.

An update is a step from the model it was trained on (kept for ``max_staleness``
iterations): the step is checked, clipped and decoded against that model exactly as a
synchronous station checks one against ``w^m`` (``UpdateAdmission.admit``), then folded by the
station's fusion rule (or central DP's noised mean of clipped steps) with weight
``samples x staleness_weight(s)``.  The fold's mean step, scaled by the buffer's mean
staleness weight (a stale buffer moves the model less), is added to ``w^m``.  Updates
that arrive while the station waits for the cloud are kept in the buffer and applied to
the global model that comes back.  Each device is asked once per iteration; a device that
has not answered within ``iteration_timeout`` frees its place, and its answer is still
folded if it is fresh enough.  A device whose Last Will fires frees its place at once.

What a restart loses: the devices in flight and the buffer (the checkpoint is taken at
round boundaries, as a synchronous station's is); their answers after it are refused as
not asked.
"""

from __future__ import annotations

import math

import numpy as np

from edge_client import messages as m

from .config import StationConfig
from .fusion import Fold, fold_for
from .station import Station, StationEvent, StationState

__all__ = ["BufferedStation", "station_role", "staleness_weight"]

_S, _E = StationState, StationEvent


def staleness_weight(rule: str, staleness: int) -> float:
    """How much a step ``staleness`` iterations old counts (``StationConfig.staleness_weight``)."""
    return 1.0 / math.sqrt(1.0 + staleness) if rule == "sqrt" else 1.0


def station_role(config: StationConfig, *, num_params: int, num_classes: int,
                 rng: np.random.Generator) -> Station:
    """The station its ``mode`` asks for."""
    kind = BufferedStation if config.mode == "buffered" else Station
    return kind(config, num_params=num_params, num_classes=num_classes, rng=rng)


class BufferedStation(Station):
    """A base station in buffered mode: the states of :class:`Station`, where ``collecting``
    means devices are training and the buffer filling, and an iteration is one fold."""

    def __init__(self, config: StationConfig, *, num_params: int, num_classes: int,
                 rng: np.random.Generator) -> None:
        super().__init__(config, num_params=num_params, num_classes=num_classes, rng=rng)
        self._in_flight: dict[str, tuple[int, float]] = {}  # asked: (iteration, when)
        self._expired: dict[str, int] = {}  # freed at the timeout: the iteration asked
        self._answered: set[str] = set()  # answered this iteration: asked again next one
        self._bases: dict[int, np.ndarray] = {}  # the model each recent iteration published
        self._buffered_samples = 0

    # -- the buffer's model versions ------------------------------------------------------

    def _begin_iteration(self, now: float, ready: list[str] | None = None) -> list[m.Message]:
        """A new model version (a fold, or the cloud's model): publish it, fold what waited
        for it, and ask idle devices up to the concurrency."""
        cfg = self.config
        self._bases[self.iteration] = self._model()
        for old in [i for i in self._bases if i < self.iteration - cfg.max_staleness]:
            del self._bases[old]
        self._answered = set()
        if not len(self.sync.fold):  # a fresh buffer: with central DP, a noised one
            self.sync.fold = self._new_fold(cfg.buffer_size)
        if len(self.sync.fold) >= cfg.buffer_size:  # filled while the station waited for the cloud
            self.state = self.next_state(_E.SUPER_NODE_SELECTED)
            return [self._model_message(), *self._close_iteration(now)]
        return self._ask(now, ready, publish=True)

    def _ask(self, now: float, ready: list[str] | None = None, *, publish: bool = False
             ) -> list[m.Message]:
        """Fill the places devices freed with idle ready ones, by the selector."""
        cfg = self.config
        out: list[m.Message] = [self._model_message()] if publish else []
        if self.state in (_S.WAITING, _S.DONE) and not publish:
            return out  # the cloud's model comes first: nobody trains on the uploaded one
        ready = self.roster.ready() if ready is None else ready
        idle = [d for d in ready if d not in self._in_flight and d not in self._answered
                and not self._owes(d)]
        want = cfg.super_node_size - len(self._in_flight)
        picked = self._pick(idle, want) if want > 0 and idle else ()
        if not picked and not self._in_flight:
            if len(self.sync.fold) >= cfg.min_quorum:  # nobody left to ask: fold what came
                return out + self._close_iteration(now)
            gathering = self._gather(now, len(ready))
            return out + ([] if publish else gathering)
        for d in picked:
            self._in_flight[d] = (self.iteration, now)
        self.sync.members = tuple(sorted(self._in_flight))
        self.state = self.next_state(_E.SUPER_NODE_SELECTED)
        self.deadline = min(t for _, t in self._in_flight.values()) + cfg.iteration_timeout
        if picked:
            self.seating.share.record(picked)
            out.append(m.Selection(fleet=cfg.fleet, sender=self.id, round=self.round,
                                   iteration=self.iteration, members=picked,
                                   deadline=now + cfg.iteration_timeout))
        return out

    def _owes(self, device: str) -> bool:
        """Past its timeout, and its answer could still be folded: it is busy with it."""
        asked = self._expired.get(device)
        return asked is not None and self.iteration - asked <= self.config.max_staleness

    def _close_iteration(self, now: float) -> list[m.Message]:
        """Fold the buffer into ``w^m``: one iteration; the upload every ``sync_period``."""
        cfg = self.config
        fold, self.sync.fold = self.sync.fold, self._new_fold(cfg.buffer_size)
        samples, self._buffered_samples = self._buffered_samples, 0
        if len(fold) >= max(1, cfg.min_quorum):
            # The mean step, scaled by the buffer's mean staleness weight per sample.
            scale = np.float32(fold.total / samples) if samples else np.float32(1.0)
            step = self.dp.release(fold, self.counters)
            self.weights = (self._model() + scale * step).astype(np.float32)
            self.external.fused(samples)
            self.counters["buffer_folds"] += 1
        else:
            self.counters["iterations_below_quorum"] += 1
        self.iteration += 1
        if self.iteration % cfg.sync_period == 0:
            return self._external_sync(self.next_state(_E.SYNC_DUE))
        return self._begin_iteration(now)

    def _new_fold(self, size: int) -> Fold:
        """The fusion rule's fold of steps (central DP: a noised mean of clipped steps)."""
        if not self.dp.enabled or self.weights is None:
            return fold_for(self.config.fusion)
        return self.dp.fold(np.zeros_like(self.weights), self.config.buffer_size)

    # -- answers ----------------------------------------------------------------------

    def _on_reply(self, msg: m.DeviceUpdate | m.SkipNotice, now: float) -> list[m.Message]:
        cfg = self.config
        if self.state in (_S.JOINING, _S.DONE):
            return self._reject("stale_iteration", f"reply for iteration {msg.iteration}, "
                                f"station is {self.state}")
        asked = self._in_flight.get(msg.sender)
        if asked is not None and asked[0] == msg.iteration:
            del self._in_flight[msg.sender]
            self.stragglers.answered(msg.sender, now - asked[1], True)
        elif self._expired.get(msg.sender) == msg.iteration:
            del self._expired[msg.sender]  # past its timeout, and still welcome if fresh
            self.counters["late_replies"] += 1
        else:
            return self._reject("not_selected", f"{msg.sender} was not asked for iteration "
                                f"{msg.iteration}")
        self.sync.members = tuple(sorted(self._in_flight))
        if msg.iteration == self.iteration:
            self._answered.add(msg.sender)
        staleness = self.iteration - msg.iteration
        base = self._bases.get(msg.iteration)
        if staleness > cfg.max_staleness or base is None:
            self.counters["stale_updates_dropped"] += 1
            return self._ask(now)
        if isinstance(msg, m.SkipNotice):
            self.counters["received_skips"] += 1
            return self._ask(now)
        z = self.admission.admit(msg, base)
        if z is None:
            return self._refused_reply(msg.sender, now)
        weight = msg.num_samples * staleness_weight(cfg.staleness_weight, staleness)
        self.sync.fold.add(z - base, weight, key=f"{msg.sender}@{msg.iteration}")
        self._buffered_samples += msg.num_samples
        self.roster.trained_on(msg.sender)
        self.counters["received_updates"] += 1
        if staleness:
            self.counters["stale_updates"] += 1
        if self.state == _S.COLLECTING and len(self.sync.fold) >= cfg.buffer_size:
            return self._close_iteration(now)
        return self._ask(now)

    def _on_stats(self, msg: m.DeviceStats, now: float) -> list[m.Message]:
        """A device that becomes ready fills a free place at once."""
        out = super()._on_stats(msg, now)
        if self.state == _S.COLLECTING and len(self._in_flight) < self.config.super_node_size:
            out += self._ask(now)
        return out

    def _refused_reply(self, device: str, now: float) -> list[m.Message]:
        """A refused update, or a refused frame: its place is free, it sits out a while."""
        self.counters["refused_updates"] += 1
        self.seating.refused(device, self.iteration)
        if self._in_flight.pop(device, None) is not None:
            self.sync.members = tuple(sorted(self._in_flight))
        return self._ask(now)

    def _on_refusal(self, msg: m.Refusal, now: float) -> list[m.Message]:
        if msg.role != m.Participant.DEVICE or msg.leaf != "update" \
                or msg.sender not in self._in_flight:
            return []
        return self._refused_reply(msg.sender, now)

    def _member_offline(self, device: str, now: float) -> list[m.Message]:
        if self._in_flight.pop(device, None) is None:
            return []
        self.counters["replies_missed"] += 1
        self.sync.members = tuple(sorted(self._in_flight))
        return self._ask(now)

    # -- time ---------------------------------------------------------------------------

    def tick(self, now: float) -> list[m.Message]:
        """Free the places of devices past their timeout (their answers still count if they
        come fresh enough), and ask others."""
        if self.state != _S.COLLECTING:
            return super().tick(now)
        timeout = self.config.iteration_timeout
        expired = [d for d, (_, t) in self._in_flight.items() if now >= t + timeout]
        if not expired:
            return []
        for d in expired:
            self._expired[d] = self._in_flight.pop(d)[0]
        self.counters["replies_missed"] += len(expired)
        self.sync.members = tuple(sorted(self._in_flight))
        return self._ask(now)

    def wakeup(self) -> float | None:
        if self.state == _S.COLLECTING:
            return self.deadline if self._in_flight else None
        return super().wakeup()
