"""One factory of a simulated federation: its base station and devices on their own bus.

Between two of the cloud's broadcasts a factory talks to nobody but the cloud, so the
simulator runs each one as a :class:`Factory`: the driver hands it the global model, the
factory's roles run until they are idle, and the driver collects what its station sent the
cloud.  A factory lives in the driver's process (the local engine) or in a Ray actor on any
node of a cluster (``lab/ray_engine.py``); both run the same roles in the same order, so a
federation is the same bit for bit on either.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import numpy as np

from aggregator.config import StationConfig
from aggregator.fedbuff import station_role
from aggregator.heads import attach_heads
from aggregator.roster import SHAPE_TOLERANCE
from edge_client import messages as m
from edge_client.admission import Admission
from edge_client.config import DeviceConfig, InferenceConfig, from_mapping
from edge_client.device import Device, LocalSteps
from edge_client.head_stats import HeadStatsPath
from edge_client.metrics import counted
from edge_client.personal_head import PersonalHead
from edge_client.promotion import judge_on
from edge_client.runner import RoleRunner, pace_replay
from edge_client.sources.replay import ReplaySource
from edge_client.states import StationState
from edge_client.topics import cloud_topics, selection_topic
from edge_client.trainers import build_trainer, pretrained_embedding
from edge_client.trainers.paced import FORWARD_SHARE, REFERENCE_BATCH
from edge_client.transport import Handler, LocalBus

from .attacks import install
from .clock import (
    PROFILES,
    Channel,
    ClockConfig,
    Port,
    TimedBus,
)
from .fleet import PREQUENTIAL_PROMOTE

if TYPE_CHECKING:
    from .fleet import FleetSpec

__all__ = ["Factory", "FactoryPlan", "Outbox", "factory_plans", "merged_privacy",
           "public_settings", "simulated", "trainer_maker", "SIM_CLOCK"]

# Simulated time does not pass inside one synchronous delivery; deadlines never fire.
SIM_CLOCK: Callable[[], float] = lambda: 0.0  # noqa: E731

C = TypeVar("C")

# What a factory's station sent the cloud, in order, with each message's virtual arrival
# time at the cloud (0 without a clock).
Outbox = list[tuple[str, m.Message, float]]


def simulated(cls: type[C], values: dict[str, Any]) -> C:
    """A role's config for the simulator: reproducible, so its privacy noise is seeded too
    (never so on a board, a station or the cloud)."""
    return from_mapping(cls, {"noise_seeded": True, **values})


def public_settings(values: dict[str, Any]) -> dict[str, Any]:
    """A plan entry's config keys, without the plan's own ``_``-prefixed bookkeeping."""
    return {k: v for k, v in values.items() if not k.startswith("_")}


@dataclass(frozen=True)
class FactoryPlan:
    """What one factory needs to run anywhere: its station's and devices' config values
    (from the fleet's plan), each device's stream (partition samples, replay seed, rate),
    and the fleet's model settings.  Plain values and arrays, so it travels to a Ray node."""

    station: dict[str, Any]
    devices: list[dict[str, Any]]  # each with its partition index "_k" and backend "_backend"
    streams: list[tuple[np.ndarray, np.ndarray]]  # each device's partition, in devices' order
    replay_seeds: list[int]
    rates: list[float]
    spec: FleetSpec  # model, seeds, attack; its partitions are not read here
    sample_shape: tuple[int, ...]
    num_classes: int
    num_params: int
    layout: str  # the evaluator's layout hash, which every trainer must match


class _SimDevice(NamedTuple):
    """A simulated device: the role, its replayed stream, its runner."""

    device: Device
    source: ReplaySource
    runner: RoleRunner[Device]


class Factory:
    """A station and its devices on a bus of their own, run by the simulation's driver.

    Per round the driver calls :meth:`receive` (the roles take the global model, nothing
    else happens yet: the driver records the round as the local engine always did, reading
    the views below), then :meth:`resume` (the roles run until idle; returns what the
    station sent the cloud) or, once the sample budget is spent, :meth:`drop`.
    """

    def __init__(self, plan: FactoryPlan, trainer: Callable[[str], Any]) -> None:
        self.plan = plan
        cfg = simulated(StationConfig, plan.station)
        self.station = station_role(cfg, num_params=plan.num_params,
                                    num_classes=plan.num_classes,
                                    rng=np.random.default_rng(cfg.seed))
        attach_heads(self.station, plan.spec.head)
        clock = plan.spec.clock
        self.bus: LocalBus = LocalBus()
        self.links: _Links | None = None
        if clock is not None:
            timed = TimedBus(
                # A station mid-iteration waits on its deadline; one that waits for the cloud
                # waits on the cloud's model, which the driver brings.
                keep_time=lambda: self.station.state in (StationState.COLLECTING,
                                                         StationState.GATHERING),
                hold=lambda: self.station.state == StationState.WAITING,
                max_virtual_s=clock.max_virtual_s, handling_s=clock.handling_ms / 1e3)
            self.bus, self.links = timed, _Links(clock, timed, cfg.seed)
        self.runners: list[RoleRunner[Any]] = [self._runner(self.station, None)]
        self.steps = SuperNodeSteps(self.bus) if plan.spec.batched_steps else None
        self.devices, self.admissions = self._devices(trainer)
        self.runners += [sim.runner for sim in self.devices]
        if self.steps:  # after every member's own subscriptions: the super node is complete
            self.steps.subscribe(cfg)
        self._outbox: Outbox = []
        outbox = self.links.outbox if self.links else self.bus
        for topic_filter in cloud_topics(cfg.fleet):
            outbox.subscribe(topic_filter, lambda topic, msg: self._outbox.append(
                (topic, msg, self.links.bus.now if self.links else 0.0)))
        for sim, rate in zip(self.devices, plan.rates, strict=True):
            # Each new iteration, the sensors of that factory have produced fresh samples.
            pace_replay(sim.runner, sim.source, rate)

    def _devices(self, trainer: Callable[[str], Any]) -> tuple[list[_SimDevice], list[Admission]]:
        """Every device of the plan with its replayed stream and runner (the compromised ones
        sending what their attack makes), and the admissions their forged frames go through."""
        plan, spec = self.plan, self.plan.spec
        devices: list[_SimDevice] = []
        admissions: list[Admission] = []
        shared: dict[str, Any] = {}
        for values, (x, y), seed in zip(plan.devices, plan.streams, plan.replay_seeds,
                                        strict=True):
            cfg = simulated(DeviceConfig, public_settings(values))
            backend = values["_backend"]
            if spec.share_trainers:
                shared.setdefault(backend, trainer(backend))
            dev = Device(cfg, shared[backend] if spec.share_trainers else trainer(backend),
                         num_classes=plan.num_classes, sample_shape=plan.sample_shape,
                         rng=np.random.default_rng(cfg.seed),
                         # a simulation's results must not depend on the host's speed:
                         # every sample [inference] every picks is predicted
                         inference=InferenceConfig(every=spec.prequential_every, publish=False,
                                                   promote=PREQUENTIAL_PROMOTE, budget=1.0)
                         if spec.prequential_every else None)
            HeadStatsPath.attach(dev, spec.head, spec.head_stats_every,
                                 embed=pretrained_embedding(spec.tail))
            if spec.personal_heads and dev.head is not None:  # measured, not predicted with
                dev.head.personal = PersonalHead(dev.head.spec)
            source = ReplaySource(x, y, np.random.default_rng(seed))
            dev.sense(*source.read(spec.initial_samples))
            diverted = self.steps.divert(dev) if self.steps else None
            runner = RoleRunner(dev, diverted, SIM_CLOCK) if diverted else \
                self._runner(dev, values)
            if diverted:
                diverted.runner = runner
            if values["_k"] in spec.attackers and spec.attack != "none":
                # What the station's transport does with a forged frame (counted with the roles).
                admission = Admission(fleet=cfg.fleet, layout_hash=plan.layout,
                                      num_params=plan.num_params, max_message=1 << 30,
                                      reassembly_memory=1 << 30, chunk_timeout=60.0)
                st = self.station.config  # the attacker has read it: it lies at its bounds
                install(runner, spec.attack, admission, self.bus,
                        growth=st.max_seen_rate * st.local_steps, tolerance=SHAPE_TOLERANCE,
                        clip=spec.head.clip if spec.head else 0.0)
                admissions.append(admission)
            devices.append(_SimDevice(dev, source, runner))
        return devices, admissions

    def _runner(self, role: Any, values: dict[str, Any] | None) -> RoleRunner[Any]:
        """A role's runner: on the bus, or with a clock on a port of its own (a device's
        priced by its profile and link; the station's beside its broker, free)."""
        if self.links is None:
            return RoleRunner(role, self.bus, SIM_CLOCK)
        port = self.links.port(role, values, self.plan.spec)
        runner = RoleRunner(role, port, lambda: port.now)
        port.tick = runner.tick
        return runner

    def _sent(self) -> Outbox:
        out, self._outbox = self._outbox, []
        return out

    def start(self) -> Outbox:
        """Start the station, then the devices, and run them until they wait for the cloud."""
        for runner in self.runners:
            if isinstance(runner.transport, Port):
                runner.transport.run(0.0, runner.start)
            else:
                runner.start()
        self.bus.deliver()
        return self._sent()

    def receive(self, topic: str, model: m.GlobalModel, sent: float = 0.0) -> int:
        """Hand the roles the global model (the cloud sent it at virtual time ``sent``), and
        pause; returns the samples trained so far."""
        if self.links is None:
            self.bus.publish(topic, model)
            self.bus.deliver(limit=1)
        else:  # what the devices did before the model arrived, then the model
            self.links.bus.deliver(through=self.links.from_cloud(topic, model, sent))
        return self.trained()

    def advance(self, until: float) -> Outbox:
        """Run the roles until virtual time ``until`` (the cloud's next event while it waits
        for round 0's statistics), the station waiting or not: a device's first frames
        embedded on a slow board are summed after its station first reported."""
        if self.links is not None:
            self.links.bus.deliver(until=until)
        return self._sent()

    def resume(self) -> Outbox:
        """Run the round the global model began until the station reports to the cloud."""
        self.bus.deliver()
        return self._sent()

    def drop(self) -> None:
        """The run's sample budget is spent: what the global model set off never happens."""
        self.bus.stop()
        self.bus.deliver()

    def finish(self) -> dict[str, int]:
        """The roles' last tick (as a service's loop ends), then every counter summed."""
        for runner in self.runners:
            runner.tick()
        counters: Counter[str] = Counter()
        for kept in (self.station.counters,
                     *(sim.device.counters for sim in self.devices),
                     *(a.counters for a in self.admissions)):
            counters.update(kept)
        if self.steps:
            counters["batched_step_calls"] += self.steps.batched_calls
        return dict(counters)

    # What the driver reads when it records a round.

    def trained(self) -> int:
        # A solved head's batches count too: drawn and learnt from through the statistics,
        # though no SGD step took them (LocalModel.head_solved).
        return sum(sim.device.counters["samples_trained"] + sim.device.counters["samples_solved"]
                   for sim in self.devices)

    def accuracies(self) -> tuple[list[float], list[float]]:
        """The devices' held-out and prequential accuracies, as their stations know them."""
        roster = self.station.roster
        return roster.local_accuracies(), roster.prequential_accuracies()

    def head_accuracies(self) -> list[tuple[float, float]]:
        """Each device's accuracy on its held-out slice with the station's head (the one it
        was last sent) and with its personal head beside it, where it keeps one."""
        out = []
        for sim in self.devices:
            dev, weights = sim.device, self.station.weights
            x, y = dev.buffer.holdout()
            if dev.head is None or dev.head.personal is None or weights is None or not len(y):
                continue
            verdict = judge_on(dev.trainer, x, y, [dev.head.personal_head(weights)], weights,
                              0.0)
            out.append((verdict.deployed_accuracy or 0.0, verdict.shadow_accuracy or 0.0))
        return out

    def traffic(self) -> tuple[dict[str, int], dict[str, int]]:
        """Messages and payload bytes published here, per message type."""
        return dict(self.bus.messages), dict(self.bus.payload_bytes)

    def privacy(self) -> dict[str, float]:
        """The most epsilon any device's local DP has spent, where any adds noise, and the
        most any device's data has spent in its station's noised syncs, where those do."""
        out = {}
        devices = [sim.device for sim in self.devices]
        if any(d.pipeline.noise for d in devices):
            out["epsilon_local"] = max(d.epsilon for d in devices)
        if self.station.config.central_dp_noise:
            out["epsilon_central"] = self.station.dp.privacy.worst()
        return out

    def device_rows(self, strategy: str, round_: int, samples: int) -> list[dict[str, Any]]:
        """Each device now: what it says of itself, and what its station refused and
        clipped of it."""
        tally, out = self.station.tally, []
        for sim in self.devices:
            doc = sim.device.summary()
            out.append({"strategy": strategy, "round": round_, "samples": samples,
                        "device": doc.device, "station": doc.station,
                        "local_accuracy": doc.local_accuracy,
                        "prequential_accuracy": doc.prequential_accuracy,
                        "uploads": doc.counters.get("uploads", 0),
                        "skips": counted(doc.counters, "skipped."),
                        "refused": tally.refused[doc.device],
                        "clipped": tally.clipped[doc.device]})
        return out


class _Links:
    """A factory's ports in virtual time: the station beside its broker, each device on its
    link and profile (every device's jitter and loss from a stream of its own), and the
    station's link to the cloud, both ways."""

    def __init__(self, clock: ClockConfig, bus: TimedBus, seed: int) -> None:
        self.clock, self.bus = clock, bus
        self.seeds = np.random.SeedSequence([clock.seed, seed])
        wan = np.random.default_rng(self.seeds.spawn(1)[0])
        # What the station's transport hands the cloud crosses the WAN up; the cloud's model
        # crosses it down.
        self.outbox = bus.port("wan", down=clock.cloud_link, rng=wan)
        self.outbox.immediate = True
        self.down = Channel(clock.cloud_link, wan)

    def from_cloud(self, topic: str, model: m.GlobalModel, sent: float) -> tuple[int, int]:
        return self.bus.publish_at(topic, model,
                                   self.down.arrival(sent, m.payload_nbytes(model)))

    def port(self, role: Any, values: dict[str, Any] | None, spec: FleetSpec) -> Port:
        if values is None:  # the station
            port = self.bus.port(role.id)
        else:
            port = self.bus.port(role.id, self.clock.device_link,
                                 rng=np.random.default_rng(self.seeds.spawn(1)[0]))
            port.cost = _compute_cost(role, self.clock, values, spec.priced_model, spec.body)
        port.wakeup = role.wakeup
        return port


def _compute_cost(device: Device, clock: ClockConfig, values: dict[str, Any], model: str,
                  body: str = "none") -> Callable[[], float]:
    """What a device's handling cost, from what its counters say it did: frames through its
    body, samples trained, held-out evaluations, predictions (each priced by its profile)."""
    profile = PROFILES[values["_profile"]]
    per_sample = profile.step_seconds(model, device.buffer.sample_shape) / REFERENCE_BATCH
    per_frame = profile.body_seconds(body)
    if values["_k"] in clock.slow_devices:
        per_sample *= clock.slow_factor
        per_frame *= clock.slow_factor
    per_eval = per_sample * FORWARD_SHARE * device.config.holdout_capacity
    per_prediction = per_sample * FORWARD_SHARE
    counters, buffer = device.counters, device.buffer
    seen = [0, 0, 0, 0]

    def cost() -> float:
        now = [counters["samples_trained"], counters["local_evaluations"],
               counters["predictions"], buffer.samples_seen]
        spent = ((now[0] - seen[0]) * per_sample + (now[1] - seen[1]) * per_eval
                 + (now[2] - seen[2]) * per_prediction + (now[3] - seen[3]) * per_frame)
        seen[:] = now
        return spent
    return cost


class SuperNodeSteps:
    """A super node's local steps in one batched call: each member's selection is taken up
    to its steps (``Device.selected_steps``), then the trainer's ``train_members`` runs them
    all, then each member replies in turn, in the order one-by-one delivery would have."""

    def __init__(self, bus: LocalBus) -> None:
        self.bus = bus
        self._pending: list[tuple[Device, RoleRunner[Device], LocalSteps]] = []
        self.batched_calls = 0

    def divert(self, device: Device) -> _Diverted:
        """The bus as a device's runner sees it, with its selections collected here."""
        return _Diverted(self, device)

    def subscribe(self, station: StationConfig) -> None:
        self.bus.subscribe(selection_topic(station.fleet, station.station_id), self._run)

    def collect(self, member: _Diverted, handle: Handler, topic: str,
                message: m.Message) -> None:
        """A selection reaching one device: its steps wait for the batch, or (not selected,
        its model not here yet) the device handles it as ever."""
        device = member.device
        steps = device.selected_steps(message) if isinstance(message, m.Selection) else None
        if steps is None:
            handle(topic, message)
        else:
            self._pending.append((device, member.runner, steps))

    def _run(self, topic: str, message: m.Message) -> None:
        pending, self._pending = self._pending, []
        if not pending:
            return
        trainer = pending[0][0].trainer
        if hasattr(trainer, "train_members") and all(d.trainer is trainer for d, _, _ in pending):
            trained = trainer.train_members([s.start for _, _, s in pending],
                                            [s.batches for _, _, s in pending],
                                            [s.lr for _, _, s in pending])
            self.batched_calls += 1
        else:  # a backend without it, or devices with trainers of their own: one by one
            trained = []
            for device, _, steps in pending:
                device.trainer.set_flat(steps.start)
                trained.append(device.take_steps(steps))
        for (device, runner, steps), z in zip(pending, trained, strict=True):
            device.trainer.set_flat(z)  # the gate scores the model the trainer holds
            runner.publish(device.end_steps(steps, z))


class _Diverted:
    """A device runner's view of the bus: its selections go to the super node's batch."""

    def __init__(self, steps: SuperNodeSteps, device: Device) -> None:
        self.steps, self.device = steps, device
        self.runner: Any = None  # set once the runner exists: it publishes the replies

    def subscribe(self, topic_filter: str, handler: Handler) -> None:
        if topic_filter == selection_topic(self.device.config.fleet, self.device.config.station):
            self.steps.bus.subscribe(topic_filter, lambda topic, msg: self.steps.collect(
                self, handler, topic, msg))
        else:
            self.steps.bus.subscribe(topic_filter, handler)

    def __getattr__(self, name: str) -> Any:  # publish, deliver, ...: the bus's own
        return getattr(self.steps.bus, name)


def trainer_maker(spec: FleetSpec, sample_shape: tuple[int, ...], num_classes: int
                  ) -> Callable[[str, str | None], Any]:
    """A maker of trainers on each backend that checks they lay the model out as the
    evaluator does (a mixed fleet is one fleet): ``make(backend, layout_hash)``."""
    def make(backend: str, layout: str | None) -> Any:
        return build_trainer(spec.model, backend=backend, input_shape=sample_shape,
                             num_classes=num_classes, lr=spec.lr, seed=spec.seed,
                             artifacts=spec.artifacts, expected_layout_hash=layout,
                             device=spec.torch_device, hidden=spec.hidden, tail=spec.tail)
    return make


def factory_plans(plan: Any, spec: FleetSpec, x_train: np.ndarray, y_train: np.ndarray,
                  *, num_classes: int, num_params: int, layout: str) -> list[FactoryPlan]:
    """The fleet's plan (:class:`~lab.simulation.FleetPlan`) cut into its factories, each
    with its own devices' samples (what a Ray node is sent, and no more)."""
    light = dataclasses.replace(spec, partitions=(), groups=())
    by_station: dict[str, list[dict[str, Any]]] = {s["station_id"]: [] for s in plan.stations}
    for values in plan.devices:
        by_station[values["station"]].append(values)
    out = []
    for station in plan.stations:
        members = by_station[station["station_id"]]
        ks = [v["_k"] for v in members]
        out.append(FactoryPlan(
            station=station, devices=members,
            streams=[(x_train[spec.partitions[k]], y_train[spec.partitions[k]]) for k in ks],
            replay_seeds=[plan.replay_seeds[k] for k in ks],
            rates=[plan.stream_rates[k] for k in ks], spec=light,
            sample_shape=tuple(x_train.shape[1:]), num_classes=num_classes,
            num_params=num_params, layout=layout))
    return out


def merged_privacy(parts: list[Mapping[str, float]]) -> dict[str, float]:
    """The factories' privacy figures as one fleet's: the most any of them spent."""
    out: dict[str, float] = {}
    for part in parts:
        for key, value in part.items():
            out[key] = max(out.get(key, value), value)
    return out
