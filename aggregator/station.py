"""The base-station role: FedGS inside one factory, as a transport-free state machine.

Each iteration ``t`` it forms a super node of ``L`` devices (``seating.py``: guarded seats,
``rand_per_group`` at random, the rest by the selector, GBP-CS by default, against
``P_real``), publishes ``w^m`` and the selection, and on the replies sets
``w^m = sum_k (n_k / n) z_k`` (``internal_sync.py``).  Every ``T`` iterations it uploads
``w^m`` to the cloud and waits for the global model (``external_sync.py``).  Replies past
the deadline are dropped and counted (``stragglers.py``).  Every report is a claim:
updates are admitted by ``admission.py``, stats by ``roster.py``; a refused reply counts
as its member's answer, and the member sits out a few super nodes.  This core keeps the
state, the transition table and when each part is asked; ``station_resume.py`` its
checkpoint.
"""

from __future__ import annotations

import logging

import numpy as np

from edge_client import messages as m
from edge_client.role import RoleBase, RoleEvent
from edge_client.states import StationState
from edge_client.topics import CLOUD_ID, station_topics

from .admission import UpdateAdmission
from .central_dp import CentralDP
from .config import StationConfig
from .external_sync import ExternalSync
from .fusion import Fold, fold_for
from .heads import HeadLedger, came_online, fused_head, refused, sent_again
from .internal_sync import InternalSync
from .roster import Roster
from .seating import Seating
from .station_resume import StationResume
from .stragglers import StragglerWatch
from .trust import ClaimTally

__all__ = ["StationState", "StationEvent", "Station"]

log = logging.getLogger(__name__)


_S = StationState


class StationEvent(RoleEvent):
    """What moves a station (its ``TRANSITIONS``)."""

    DEVICES_REPORTED = "devices_reported"  # the roster's stats are in: tell the cloud
    SUPER_NODE_SELECTED = "super_node_selected"  # an iteration begins with a super node
    TOO_FEW_READY = "too_few_ready"  # an iteration begins with fewer ready than the quorum
    SYNC_DUE = "sync_due"  # T iterations done: upload w^m, wait for the global model
    FINAL_MODEL = "final_model"  # the cloud's last global model
    RESTARTED = "restarted"  # resumed from a checkpoint taken mid-round


_E = StationEvent


class Station(StationResume, RoleBase[StationState]):
    """Base station ``m`` (one factory), in one of the :class:`StationState` states."""

    INITIAL = _S.JOINING
    # A global model may arrive in any state but ``done`` (the cloud repeats it to a
    # station that comes back) and begins an iteration; an iteration ends into the next
    # one, or into the upload at the end of the synchronisation period.
    TRANSITIONS = {
        (_S.JOINING, _E.DEVICES_REPORTED): _S.WAITING,
        **{(state, event): new
           for state in (_S.JOINING, _S.WAITING, _S.COLLECTING, _S.GATHERING)
           for event, new in ((_E.SUPER_NODE_SELECTED, _S.COLLECTING),
                              (_E.TOO_FEW_READY, _S.GATHERING), (_E.FINAL_MODEL, _S.DONE))},
        **{(state, event): new
           for state in (_S.COLLECTING, _S.GATHERING)
           for event, new in ((_E.SYNC_DUE, _S.WAITING), (_E.RESTARTED, _S.RESUMING))},
        (_S.RESUMING, _E.SUPER_NODE_SELECTED): _S.COLLECTING,
        (_S.RESUMING, _E.TOO_FEW_READY): _S.GATHERING,
    }

    def __init__(self, config: StationConfig, *, num_params: int, num_classes: int,
                 rng: np.random.Generator) -> None:
        super().__init__()
        self.config, self.num_params, self.num_classes, self.rng = (config, num_params,
                                                                    num_classes, rng)
        self.seating = Seating(config, num_classes, rng, self.counters)
        self.state, self.round, self.iteration, self.deadline = self.INITIAL, 0, 0, 0.0
        self.weights: np.ndarray | None = None  # w^m
        self.p_real: np.ndarray | None = None
        self.sync = InternalSync(config, self.counters)
        self.admission = UpdateAdmission(config, num_params, reject=self._reject,
                                         clip=self._clip)
        self.roster = Roster(config, num_classes, self.counters, reject=self._reject,
                             clip=self._clip)
        self.stats, self.offline = self.roster.stats, self.roster.offline
        self.external = ExternalSync(config, self.roster, self.counters)
        self.dp, self.tally = CentralDP(config, config.seed), ClaimTally(config.devices)
        self.stragglers = StragglerWatch.for_station(config)
        self.heads: HeadLedger | None = None  # where the head is solved in closed form

    @property
    def id(self) -> str:
        return self.config.station_id

    @property
    def members(self) -> tuple[str, ...]:  # the current super node (internal_sync.py)
        return self.sync.members

    def _reject(self, reason: str, detail: str) -> list[m.Message]:
        self.tally.count(self.tally.refused, self._sender)
        return super()._reject(reason, detail)

    def _clip(self, kind: str) -> None:
        """A claim of the device whose message is being handled was trimmed and still used."""
        self.counters[f"clipped.{kind}"] += 1
        self.tally.count(self.tally.clipped, self._sender)

    def subscriptions(self) -> list[str]:
        return station_topics(self.config.fleet, self.config.devices)

    def start(self, now: float) -> list[m.Message]:
        """A station resumed from a checkpoint repeats its upload or begins the iteration."""
        if self.state == _S.WAITING and self.weights is not None:
            return self.external.reannounce()
        if self.state in (_S.COLLECTING, _S.GATHERING):
            return self._resume(now)
        return []

    def _resume(self, now: float) -> list[m.Message]:
        """Restarted mid-round: begin the iteration it was in anew (its replies are lost)."""
        # The whole way (through ``resuming`` into the iteration) is checked before a change.
        ready = self.roster.ready()
        self.next_state(_E.RESTARTED, self._iteration_event(ready))
        self.state = self.next_state(_E.RESTARTED)
        return self._begin_iteration(now, ready)

    def privacy_summary(self) -> dict[str, float]:
        """Local and central epsilon spent (central_dp.py)."""
        return self.dp.summary(self.roster.epsilon_local())

    def tick(self, now: float) -> list[m.Message]:
        """Close the iteration at its deadline; repeat the join until the cloud answers;
        the model once more for devices that joined since the last (``Roster.late``)."""
        late = self.roster.late.due(now) and self.weights is not None
        out: list[m.Message] = [self._model_message()] if late else []
        if self.state == _S.JOINING and self._limiter.allow(self.id, "joining"):
            level, waiting = self.roster.joining(now)  # a warning once it waits for minutes
            log.log(level, "station %s joining: %s", self.id, waiting)
        if self.state == _S.WAITING and self.weights is None:
            return out + self.external.hello(now)
        if self.state == _S.GATHERING and now >= self.deadline:
            self.counters["iterations_without_data"] += 1
            log.warning("station %s: iteration %d closes untrained, %d devices online < quorum "
                        "%d", self.id, self.iteration, self.roster.online, self.config.min_quorum)
            return out + self._close_iteration(now)
        if self.state == _S.COLLECTING and now >= self.deadline:
            absent = self.sync.missing()
            self.counters["replies_missed"] += absent
            if benched := self.stragglers.closed(self.sync.unanswered(self.offline),
                                                 self.iteration):
                self.counters["stragglers_benched"] += benched
            log.info("station %s: iteration %d deadline passed, %d of %d replies missing",
                     self.id, self.iteration, absent, len(self.members))
            return out + self._close_iteration(now)
        return out

    def wakeup(self) -> float | None:
        due = self.deadline if self.state in (_S.COLLECTING, _S.GATHERING) else \
            self.external.next_hello if self.state == _S.WAITING and self.weights is None else None
        late = self.roster.late.due_at  # whichever comes first
        return due if late is None else late if due is None else min(due, late)

    def _handle(self, message: m.Message, now: float) -> list[m.Message]:
        if message.fleet != self.config.fleet:
            return self._reject("wrong_fleet", f"fleet {message.fleet!r}")
        if isinstance(message, m.GlobalModel):
            return self._on_global(message, now)
        if isinstance(message, m.Presence):
            return self._on_presence(message, now)
        if isinstance(message, m.Refusal):
            return self._on_refusal(message, now)
        if not isinstance(message, (m.DeviceStats, m.DeviceUpdate, m.SkipNotice, m.HeadStats)):
            return self._reject("unexpected_type", type(message).__name__)
        if message.station != self.id:
            return []  # another factory's device on the shared tree
        if message.sender not in self.config.devices:
            return self._reject("unknown_sender", f"device {message.sender!r} is not on the roster")
        if isinstance(message, m.DeviceStats):
            return self._on_stats(message, now)
        if isinstance(message, m.HeadStats):
            return self._on_head(message)
        return self._on_reply(message, now)

    def _on_head(self, msg: m.HeadStats) -> list[m.Message]:
        """A device's head statistics, checked as a claim; passed on where they double."""
        seen = self.stats[msg.sender].seen_counts if msg.sender in self.stats else None
        if (error := refused(self.heads, msg, seen)) or self.heads is None:
            return self._reject(error.reason, str(error)) if error else []
        return self.heads.upstream(self.external.stats, self.round, self.iteration, early=True,
                                   roster=len(self.config.devices))

    def _on_refusal(self, msg: m.Refusal, now: float) -> list[m.Message]:
        """The transport refused a member's frame: its answer for this iteration."""
        if msg.role != m.Participant.DEVICE or msg.leaf != "update" \
                or self.state != _S.COLLECTING or msg.sender not in self.members \
                or self.sync.answered(msg.sender):
            return []
        return self._refused_reply(msg.sender, now)

    def _refused_reply(self, device: str, now: float) -> list[m.Message]:
        self.sync.refused(device)
        self.seating.refused(device, self.iteration)
        return self._close_if_answered(now)

    def _on_stats(self, msg: m.DeviceStats, now: float) -> list[m.Message]:
        if (checked := self.roster.checked(msg, self.iteration)) is None:
            return []
        msg = checked
        joined = msg.sender not in self.stats or msg.sender in self.offline
        reported = len(self.stats) + (msg.sender not in self.stats)
        if self.state == _S.JOINING and reported >= self.config.min_devices:
            return self._devices_reported(msg, now)
        self.roster.accept(msg, self.iteration)
        out: list[m.Message] = []
        if joined and self.weights is not None:
            # A late joiner gets the current model (once a second: Roster.late), and a seat.
            self.counters["late_joins"] += 1
            out += [self._model_message()] if self.roster.late.joined(now) else []
        return out + self._end_gathering(now)

    def _devices_reported(self, msg: m.DeviceStats, now: float) -> list[m.Message]:
        """The stats that complete the roster (``min_devices``): tell the cloud our counts."""
        self.state = self.next_state(_E.DEVICES_REPORTED)
        self.roster.accept(msg, self.iteration)
        self.external.next_hello = now + self.config.hello_interval
        return [self.external.stats()]

    def _on_presence(self, msg: m.Presence, now: float) -> list[m.Message]:
        if msg.role == m.Participant.CLOUD:  # counts, an unanswered upload, sums; or gone
            return [*self.external.cloud_presence(msg, self.id, self.state == _S.JOINING),
                    *sent_again(self.heads, msg)]
        if msg.role != m.Participant.DEVICE or msg.sender not in self.config.devices:
            return []
        if msg.online:  # after a Last Will (a broker restart fires them all): selectable again
            came_online(self.heads)
            return self._end_gathering(now) if self.roster.back_online(msg.sender) else []
        self.roster.went_offline(msg.sender)
        return self._member_offline(msg.sender, now)

    def _member_offline(self, device: str, now: float) -> list[m.Message]:
        if self.state == _S.COLLECTING and device in self.members \
                and not self.sync.answered(device):
            # Its Last Will fired: do not wait for it until the deadline.
            self.counters["replies_missed"] += 1
            return self._close_if_answered(now)
        return []

    def _close_if_answered(self, now: float) -> list[m.Message]:
        """Every member answered, or its Last Will fired: the iteration closes now."""
        return [] if self.sync.unanswered(self.offline) else self._close_iteration(now)

    def _on_reply(self, msg: m.DeviceUpdate | m.SkipNotice, now: float) -> list[m.Message]:
        if self.stragglers.late(msg.sender, msg.iteration, now):
            self.counters["late_replies"] += 1
            return []
        if self.state != _S.COLLECTING or msg.iteration != self.iteration:
            return self._reject("stale_iteration", f"reply for iteration {msg.iteration}, "
                                f"station is at {self.iteration} ({self.state})")
        if msg.sender not in self.members:
            return self._reject("not_selected", f"{msg.sender} is not in the super node")
        if self.sync.answered(msg.sender):
            self.counters["duplicates"] += 1
            return []
        deadline = self.stragglers.reply(msg.sender, now, self.deadline, len(self.members))
        if deadline is None:
            self.counters["late_replies"] += 1
            return []
        self.deadline = deadline
        if isinstance(msg, m.DeviceUpdate):
            fused = self.admission.admit(msg, self._model())
            if fused is None:
                return self._refused_reply(msg.sender, now)
            self.sync.update(msg.sender, fused, msg.num_samples)
            self.roster.trained_on(msg.sender)  # what it trained joins the roster's view
        else:
            self.sync.skip(msg.sender)
        return self._close_if_answered(now)

    def _on_global(self, msg: m.GlobalModel, now: float) -> list[m.Message]:
        if msg.sender != CLOUD_ID:
            return self._reject("unknown_sender", f"global model from {msg.sender!r}")
        if msg.weights.size != self.num_params or msg.p_real.size != self.num_classes:
            return self._reject("wrong_length", "global model or P_real of the wrong size")
        if self.weights is not None and msg.round <= self.round:
            if msg.round == self.round:
                self.counters["duplicates"] += 1  # repeated after a restart: applied already
                return []
            return self._reject("stale_iteration", f"global round {msg.round} already applied")
        # Refused in ``done``, by the table: the federation has ended.
        ready = self.roster.ready()  # the global model changes who is ready no more than the rest
        new = self.next_state(_E.FINAL_MODEL if msg.final else self._iteration_event(ready))
        self.external.answered(msg)
        self.p_real = np.array(msg.p_real)  # and w^m, or where the cloud solved no head, ours
        self.weights = np.array(msg.weights) if self.heads is None else self.heads.round_began(msg)
        self.round, self.iteration = msg.round, msg.iteration
        self.seating.new_round()
        self.dp.new_round()
        if msg.final:
            self.state = new
            return [self._model_message(final=True)]
        return self._begin_iteration(now, ready)

    def _end_gathering(self, now: float) -> list[m.Message]:
        """A gathering station begins its iteration as soon as a quorum is ready."""
        if self.state == _S.GATHERING and self.roster.enough_ready(self.config.min_quorum):
            return self._begin_iteration(now)
        return []

    def _iteration_event(self, ready: list[str]) -> StationEvent:
        """What beginning an iteration with ``ready`` devices is: a super node, or too few."""
        return _E.SUPER_NODE_SELECTED if len(ready) >= self.config.min_quorum else _E.TOO_FEW_READY

    def _begin_iteration(self, now: float, ready: list[str] | None = None) -> list[m.Message]:
        """Select the next super node, or gather; ``ready`` where the caller just listed it."""
        cfg = self.config
        ready = self.roster.ready() if ready is None else ready
        new = self.next_state(self._iteration_event(ready))
        if new == _S.GATHERING:
            self.sync.begin((), self._new_fold(0))
            return self._gather(now, len(ready))
        members = self._pick(ready, cfg.super_node_size)
        self.sync.begin(members, self._new_fold(len(members)))  # with its fold
        self.seating.seated(self.members)
        log.debug("station %s: iteration %d super node %s", self.id, self.iteration, self.members)
        self.deadline = self.stragglers.begin(now)
        self.state = new
        out: list[m.Message] = [self._model_message(),
                                m.Selection(fleet=cfg.fleet, sender=self.id, round=self.round,
                                            iteration=self.iteration, members=self.members,
                                            deadline=self.deadline)]
        if not self.members:
            self.counters["iterations_without_data"] += 1
            return out + self._close_iteration(now)
        return out

    def _gather(self, now: float, ready: int) -> list[m.Message]:
        """Wait for devices' data, each iteration up to its timeout, rather than close it
        untrained (only that is worth a warning, in :meth:`tick`); the model goes out once,
        as gathering begins (it wakes paced devices)."""
        cfg = self.config
        newly = self.state != _S.GATHERING
        if newly:
            log.debug("station %s: %d ready < quorum %d: gathering", self.id, ready, cfg.min_quorum)
        self.state = self.next_state(_E.TOO_FEW_READY)
        self.deadline = now + cfg.iteration_timeout
        return [self._model_message()] if newly else []

    def _pick(self, ready: list[str], want: int) -> tuple[str, ...]:
        """Up to ``want`` of the ``ready`` devices for a super node (seating.py)."""
        return self.seating.pick(ready, want, stats=self.stats, target=self._target,
                                 benched=self.stragglers.benched, iteration=self.iteration)

    def _new_fold(self, size: int) -> Fold:
        """The fusion rule's fold, or with central DP a noised mean of clipped steps from
        ``w^m`` over the ``size`` members asked."""
        if not self.dp.enabled or self.weights is None:
            return fold_for(self.config.fusion)
        return self.dp.fold(self.weights, size)

    def _close_iteration(self, now: float) -> list[m.Message]:
        cfg = self.config
        sync_due = (self.iteration + 1) % cfg.sync_period == 0
        ready = None if sync_due else self.roster.ready()  # closing an iteration changes no stats
        new = self.next_state(_E.SYNC_DUE if ready is None else self._iteration_event(ready))
        fold = self.sync.take()
        if len(fold) >= cfg.min_quorum:
            self.weights = fused_head(self.heads, self.dp.release(fold, self.counters))
            self.external.fused(int(fold.total))
        else:
            self.counters["iterations_below_quorum"] += 1
        self.iteration += 1
        if ready is not None:
            return self._begin_iteration(now, ready)
        return self._external_sync(new)

    def _external_sync(self, new: StationState) -> list[m.Message]:
        """The synchronisation period is over: upload ``w^m`` and wait for the cloud."""
        self.state = new
        up = self.heads.upstream(self.external.stats, self.round, self.iteration) if self.heads \
            else []
        return [*up, self.external.upload(self._model(), self.round, self.iteration)]

    def _model_message(self, final: bool = False) -> m.StationModel:
        return m.StationModel(fleet=self.config.fleet, sender=self.id, round=self.round,
                              iteration=self.iteration, weights=self._model(), final=final,
                              **self.external.relayed,
                              **(self.heads.novelty_out() if self.heads else {}))
