"""The device role: a transport-free state machine running SAFL on a stream.

On a selection that names it, the device takes the station model ``zbar_t``,
applies the annealed merge against its last local model, trains on fresh
one-shot batches from its :class:`StreamBuffer`, and either uploads ``z_t`` or
sends a skip notice, as the upload gate decides (SPEC §3).  It never does I/O:
``handle(message, now)`` returns the messages to publish.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from . import messages as m
from .buffer import StreamBuffer
from .catalogue import Catalogue, DeviceProducts
from .config import DeviceConfig, InferenceConfig
from .documents import DeviceSummary
from .head_stats import HeadStatsPath
from .line import Line
from .local_steps import LocalModel, LocalSteps
from .pipeline import UpdatePipeline
from .role import RoleBase, RoleEvent
from .silence import Silence, explain
from .states import DeviceState
from .topics import device_topics
from .trainers import Trainer
from .upload import UploadPath

__all__ = ["Device", "DeviceEvent", "LocalSteps"]

log = logging.getLogger(__name__)


class DeviceEvent(RoleEvent):
    """What moves a device (its ``TRANSITIONS``)."""

    MODEL = "model"  # the station's model of an iteration
    FINAL_MODEL = "final_model"  # the federation's last one
    SELECTED = "selected"  # in the super node of its model's iteration: train and reply
    SELECTED_AHEAD = "selected_ahead"  # in a super node whose model has not come: wait
    STATION_BACK = "station_back"  # the station (re)appeared: it gets our stats


_E = DeviceEvent
_D = DeviceState


class Device(RoleBase[DeviceState]):
    """One edge device: ``waiting`` for its station's first model, ``ready`` with one, and
    ``done`` after the final model (:class:`DeviceState`, moved by :class:`DeviceEvent`).

    ``trainer`` holds the model (its flat size is the federation's); ``num_classes`` is
    the label histograms' width ``F``, ``sample_shape`` one sample's; ``rng`` draws the merge
    masks and the upload gate.  ``inference`` serves the deployable model on the stream
    (:class:`Line`) and scores it prequentially; None (the simulator's default) keeps no
    deployable model.  ``head`` (:class:`~edge_client.head_stats.HeadStatsPath`), where the
    federation solves its head in closed form, sums each labelled sample's statistics.
    """

    INITIAL = _D.WAITING
    # A selection waits for its model, but is trained on only with it.  A device that is
    # done (and kept running, ``--keep-running``) follows its station only once the station
    # comes back, into whatever federation it then runs.
    TRANSITIONS = {
        (_D.WAITING, _E.MODEL): _D.READY,
        (_D.WAITING, _E.FINAL_MODEL): _D.DONE,
        (_D.WAITING, _E.SELECTED_AHEAD): _D.WAITING,
        (_D.WAITING, _E.STATION_BACK): _D.WAITING,
        (_D.READY, _E.MODEL): _D.READY,
        (_D.READY, _E.FINAL_MODEL): _D.DONE,
        (_D.READY, _E.SELECTED): _D.READY,
        (_D.READY, _E.SELECTED_AHEAD): _D.READY,
        (_D.READY, _E.STATION_BACK): _D.READY,
        (_D.DONE, _E.STATION_BACK): _D.READY,
    }

    def __init__(self, config: DeviceConfig, trainer: Trainer, *, num_classes: int,
                 sample_shape: tuple[int, ...], rng: np.random.Generator,
                 inference: InferenceConfig | None = None) -> None:
        super().__init__()
        self.config, self.inference, self.trainer, self.rng = config, inference, trainer, rng
        self.trainer.lr = config.lr
        self.buffer = StreamBuffer(config.buffer_capacity, num_classes, sample_shape,
                                   holdout_every=config.holdout_every,
                                   holdout_capacity=config.holdout_capacity)
        self.line = Line(inference, trainer, num_classes=num_classes, sample_shape=sample_shape,
                         counters=self.counters, name=config.device_id,
                         holdout=self.buffer.holdout)
        self.state = self.INITIAL
        self.last_train_s = self._next_hello = 0.0
        self.silence = Silence(config.unanswered_warning)  # hellos nobody answered
        self._model: m.StationModel | None = None
        self._accept_any_iteration = False  # set when the station's presence comes back
        self._station_online = False  # its presence, as last heard
        self._awaiting: m.Selection | None = None  # a selection that came before its model
        self._reported_next: np.ndarray | None = None
        self.local = LocalModel(config, trainer, self.buffer, rng, self.counters)
        self.upload = UploadPath(config, trainer, self.buffer, rng, self.counters)
        self.head: HeadStatsPath | None = None
        self.products = DeviceProducts(Catalogue(num_classes), line=self.line,
                                       ingest=self.ingest, counters=self.counters)

    @property
    def id(self) -> str:
        return self.config.device_id

    @property
    def finished(self) -> bool:
        """The station sent the final model."""
        return self.state == DeviceState.DONE

    def metrics(self) -> dict[str, float]:
        """Gauges beside ``counters``: model position, training step time, buffer state."""
        model = self._model
        return {"round": model.round if model else 0, "iteration": model.iteration if model else 0,
                "train_step_seconds": self.last_train_s / self.config.local_steps,
                "buffer.overwritten_unread": self.buffer.overwritten_unread,
                "buffer.unread": self.buffer.unread, "buffer.seen": self.buffer.samples_seen,
                "local_accuracy": self.local.accuracy[0], **self.line.gauges()}

    def subscriptions(self) -> list[str]:
        return device_topics(self.config.fleet, self.config.station)

    def start(self, now: float) -> list[m.Message]:
        self._next_hello = now + self.config.hello_interval
        return [self._stats(0, 0),
                *(self.head.first(self._station_online) if self.head else [])]

    def tick(self, now: float) -> list[m.Message]:
        """Measure what the last selection left; until a station model comes, say hello."""
        self.local.catch_up()
        if self.state != _D.WAITING:
            self.silence.heard()
            return []
        if now < self._next_hello:
            return []
        self._next_hello = now + self.config.hello_interval
        self.counters["hellos"] += 1
        if (silent := self.silence.hello(now)) is not None:
            self.counters["hellos_unanswered"] += 1
            log.warning("%s", explain(self.id, self.config.station, silent,
                                      self._station_online))
        return [self._stats(0, 0)]

    def wakeup(self) -> float | None:
        return self._next_hello if self.state == _D.WAITING else None

    def sense(self, x: np.ndarray, y: np.ndarray) -> None:
        """Buffer samples and add their statistics, without a word (a replay's first frames)."""
        held = self.buffer.push(x, y)
        if self.head is not None:  # once, as they arrive; held-out ones not: they judge it
            self.head.take(x[~held], y[~held])

    def ingest(self, x: np.ndarray, y: np.ndarray, now: float,
               predicted: np.ndarray | None = None) -> list[m.Message]:
        """Take newly sensed, labelled samples; report stats when the next batch changed.
        With prequential scoring on, each sample's prediction made on arrival (``predicted``,
        ``NOT_PREDICTED`` where none was made) is scored before it can be trained on; without
        ``predicted`` the device predicts one sample in ``[inference] every`` itself."""
        if self.line.prequential is not None and predicted is None:
            predicted = self.line.predict_every(x, self.buffer.samples_seen)
        self.sense(x, y)  # validates shapes and labels before anything is scored
        self.line.take(x, y, predicted)
        nxt = self._next_counts()
        if self._reported_next is not None and np.array_equal(nxt, self._reported_next):
            return []
        model = self._model
        return [self._stats(model.round if model else 0, model.iteration if model else 0)]

    def _handle(self, message: m.Message, now: float) -> list[m.Message]:
        if message.fleet != self.config.fleet:
            return self._reject("wrong_fleet", f"fleet {message.fleet!r}")
        if message.sender != self.config.station:
            return self._reject("unknown_sender", f"{message.sender!r} is not my station")
        if isinstance(message, m.Presence):
            return self._on_station_presence(message, now)
        if isinstance(message, m.StationModel):
            owed = self.head.due(message) if self.head else []
            # statistics after the seen counts that bound them at the station
            return self._on_model(message) + self.products.follow(message, now) + (
                [self._stats(message.round, message.iteration), *owed] if owed else [])
        if isinstance(message, m.Selection):
            return self._on_selection(message)
        return self._reject("unexpected_type", type(message).__name__)

    def _on_model(self, message: m.StationModel) -> list[m.Message]:
        """Keep the station's model (``zbar_t``), and answer a selection parked for it."""
        if message.weights.size != self.trainer.num_params:
            return self._reject("wrong_length", f"{message.weights.size} weights, model has "
                                f"{self.trainer.num_params}")
        if self._model is not None and message.iteration < self._model.iteration \
                and not self._accept_any_iteration:
            return self._reject("stale_iteration", f"model of iteration {message.iteration}")
        parked = self._awaiting
        completes = parked is not None and parked.iteration == message.iteration
        if message.final:
            new = self.next_state(_E.FINAL_MODEL)
        else:
            new = self.next_state(_E.MODEL, *([_E.SELECTED] if completes else []))
        if self._accept_any_iteration and self._model is not None \
                and message.iteration < self._model.iteration:
            self.counters["station_rewinds"] += 1  # it resumed from an older checkpoint
        self._accept_any_iteration = False
        if self._model is None or message.round != self._model.round:
            log.info("device %s: round %d (iteration %d), %d uploads and %d skips so far",
                     self.id, message.round, message.iteration, self.counters["uploads"],
                     self.counters["skipped.gate"])
        self._model = message
        self.state = new
        # Every broadcast is a candidate, so that a device its station leaves out keeps up;
        # a selected one offers its merged model too, in begin_steps.  The one pending from
        # the last iteration is judged first, where no labelled samples came between.
        self.line.promote()
        self.line.offer(message, message.weights)
        if parked is None or message.iteration < parked.iteration:
            return []
        if not completes or message.final:
            self._drop_awaiting(f"the model of {message.iteration} came instead")
            return []
        self._awaiting = None
        return self._train_and_reply(message)

    def _on_selection(self, message: m.Selection) -> list[m.Message]:
        """Train now if this iteration's model is here; else wait for it.
        MQTT orders messages per topic only: a broker under load may deliver the selection
        before the model the station published first (seen with Mosquitto on 2 busy cores,
        where a whole super node then missed its deadline).  A selection ahead of its model
        is parked until that model arrives; one behind the model is stale."""
        if self.id not in message.members:
            return []
        if self._model is not None and self._model.iteration == message.iteration:
            self.state = self.next_state(_E.SELECTED)
            return self._train_and_reply(self._model)
        if self._model is not None and message.iteration < self._model.iteration:
            return self._reject("no_model", f"selected for {message.iteration}, the model "
                                f"is of iteration {self._model.iteration}")
        self.state = self.next_state(_E.SELECTED_AHEAD)
        if self._awaiting is not None:
            self._drop_awaiting(f"superseded by the selection for {message.iteration}")
        self._awaiting = message
        self.counters["selection.before_model"] += 1
        return []

    def _drop_awaiting(self, why: str) -> None:
        if self._awaiting is not None:
            self._reject("no_model", f"selected for {self._awaiting.iteration}, its model "
                         f"never came ({why})")
        self._awaiting = None

    def _next_counts(self) -> np.ndarray:
        """The next batch's histogram as the station sees it: empty below ``min_batch``."""
        nxt = self.buffer.next_batch_counts(self.config.batch_size)
        return nxt if nxt.sum() >= self.config.min_batch else np.zeros_like(nxt)

    def _on_station_presence(self, msg: m.Presence, now: float) -> list[m.Message]:
        """The station (re)appeared: it may have restarted from an older checkpoint, so the
        next model it sends is accepted whatever its iteration, and it gets our stats."""
        if msg.role != m.Participant.STATION:
            return []
        seen_online, self._station_online = self._station_online, msg.online
        if not msg.online and msg.final and self._model is not None and self.state != _D.DONE:
            # It ended while this device was away (its final model went to a lost session).
            self.counters["final_missed"] += 1
            log.info("device %s: station %s finished while this device was away; it keeps "
                     "its model of round %d", self.id, msg.sender, self._model.round)
            self.state = self.next_state(_E.FINAL_MODEL)
            return []
        if not msg.online:  # a Last Will, or (never seen online) the broker's retained history
            self.counters["station_offline"] += bool(seen_online)
            log.log(logging.WARNING if seen_online else logging.INFO, "device %s: station %s "
                    + ("went offline (its Last Will)" if seen_online else "is not online (its "
                       "retained presence)") + "; waiting for it", self.id, msg.sender)
            return []
        self.state = self.next_state(_E.STATION_BACK)
        self._accept_any_iteration = self._model is not None
        if self._awaiting is not None:  # a restarted station selects anew
            self._drop_awaiting("the station restarted")
        model = self._model  # (statistics after the seen counts that bound them)
        return [self._stats(model.round if model else 0, model.iteration if model else 0),
                *(self.head.first(True) if self.head else [])]

    def _train_and_reply(self, model: m.StationModel) -> list[m.Message]:
        return self.end_steps(steps := self.begin_steps(model), self.take_steps(steps))

    def selected_steps(self, selection: m.Selection) -> LocalSteps | None:
        """The local steps this selection starts now, for a simulator that runs a super
        node's members in one batched call (then :meth:`end_steps` with the result); None
        where :meth:`handle` must take the selection instead (not a member, its model not
        here yet, a proximal term that needs each step's weights, a head solved in closed
        form)."""
        model = self._model
        if selection.fleet != self.config.fleet or selection.sender != self.config.station \
                or self.id not in selection.members or self.config.prox_mu \
                or self.local.spares_sgd \
                or model is None or model.iteration != selection.iteration:
            return None
        self.state = self.next_state(_E.SELECTED)
        return self.begin_steps(model)

    def begin_steps(self, model: m.StationModel) -> LocalSteps:
        """Everything before the local steps: the learning rate, the annealed merge (the
        trainer then holds the start), the deployed model, the local accuracy's schedule,
        and the batches, drawn from the buffer."""
        cfg, t = self.config, model.iteration
        lr = cfg.lr * cfg.lr_decay if cfg.lr_decay_at and t >= cfg.lr_decay_at else cfg.lr
        if self.trainer.lr != lr:  # ONNX Runtime's optimizer is told only of a change
            self.trainer.lr = lr
        # model.weights is read-only; the merge, the trainer and the gate only read it
        start = self.local.start(model.weights, t)
        self.trainer.set_flat(start)
        self.line.offer(model, start, merged=True)
        self.local.catch_up()
        self.local.schedule(start, t)
        return LocalSteps(model, start, self.local.batches(), lr, time.perf_counter())

    def take_steps(self, steps: LocalSteps) -> np.ndarray:
        """SGD from the start the trainer holds; the trained vector (the trainer holds it)."""
        return self.local.take(steps)

    def end_steps(self, steps: LocalSteps, z: np.ndarray) -> list[m.Message]:
        """The reply to trained ``z`` (which the trainer must hold): the gate, the update or
        a skip, after the stats."""
        cfg, model, t = self.config, steps.model, steps.model.iteration
        zbar = model.weights
        consumed = sum(len(y) for _, y in steps.batches)

        def skip(gap: float) -> m.SkipNotice:
            return m.SkipNotice(fleet=cfg.fleet, sender=self.id, round=model.round,
                                iteration=t, station=cfg.station, gap=gap)

        if consumed == 0 or self.local.spares_sgd:  # nothing to train, or no use for it
            self.counters["skipped.head_solved" if consumed else "skipped.no_data"] += 1
            self.counters["samples_solved"] += consumed  # its batch drawn, its SGD spared
            return [self._stats(model.round, t), skip(0.0)]
        self.last_train_s = time.perf_counter() - steps.started
        if not np.isfinite(z).all():
            # Diverged (a huge model came down, or a huge step): nothing worth uploading or
            # keeping.  A skip is still an answer, so the station does not wait for us.
            self.counters["skipped.non_finite"] += 1
            return [self._stats(model.round, t), skip(0.0)]
        self.local.keep(z, t)
        solved = self.local.head_solved  # kept for its merge; sent, it would count for nothing
        gap, upload = (0.0, False) if solved else self.upload.decide(z, zbar)
        self.counters["steps"] += 1
        self.counters["samples_trained"] += consumed
        if upload:
            self.counters["uploads"] += 1
            reply: m.Message = self.upload.update(model, z, consumed)
        else:
            self.counters["skipped.head_solved" if solved else "skipped.gate"] += 1
            reply = skip(gap)
        # Stats go first so the station selects the next super node on fresh histograms.
        return [self._stats(model.round, t), reply]

    def summary(self, *, error: str = "", **extra: Any) -> DeviceSummary:
        """What the device says of itself for the monitor; ``extra``: its service's
        ``transport`` and ``source`` counters and figures; ``error``: its last error."""
        model, line = self._model, self.line
        pre = line.prequential
        acc, samples = self.local.accuracy
        return DeviceSummary(device=self.id, station=self.config.station, state=self.state,
                             round=model.round if model else 0,
                             iteration=model.iteration if model else 0,
                             local_accuracy=acc if samples else None,
                             prequential_accuracy=pre.accuracy if pre and pre.samples else None,
                             deployed_round=line.deployable_round
                             if line.deployable is not None else None,
                             shadow_accuracy=line.last_verdict.shadow_accuracy,
                             epsilon=self.epsilon or None, counters=dict(self.counters),
                             error=error, **extra)

    @property
    def epsilon(self) -> float:
        """What this device's local differential privacy has spent (0 without noise)."""
        return self.upload.epsilon

    @property
    def pipeline(self) -> UpdatePipeline:
        return self.upload.pipeline

    def _stats(self, round_: int, iteration: int) -> m.DeviceStats:
        # The reported batch is pinned: it is the one trained on when this device is picked.
        self.buffer.pin(self.config.batch_size)
        nxt = self._next_counts()
        self._reported_next = nxt
        acc, samples = self.local.accuracy
        pre, verdict = self.line.prequential, self.line.last_verdict
        return m.DeviceStats(fleet=self.config.fleet, sender=self.id, round=round_,
                             iteration=iteration, station=self.config.station,
                             seen_counts=self.buffer.seen_counts, next_batch_counts=nxt,
                             local_accuracy=acc, local_samples=samples, epsilon=self.epsilon,
                             **(pre.reported() if pre else {}),
                             deployed_round=self.line.deployable_round,
                             shadow_accuracy=verdict.shadow_accuracy or 0.0,
                             shadow_samples=verdict.samples)
