"""A simulated federation: the real roles, fed by replayed streams, on either engine.

The simulator owns no algorithm.  It plans a fleet (ids, rosters, seeds), builds the cloud
on this process's :class:`LocalBus` and each factory (a station and its devices,
``lab/factory.py``) in this process or on a Ray cluster (``lab/engine.py``), hands every
global model to the factories, and records the global model's test accuracy every
``eval_every`` rounds, with the samples trained so far and the device-local accuracies the
devices reported.  Devices stream in proportion to their partition sizes, so the seen counts
behind ``P_real`` reflect the fleet's label distribution.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from aggregator.accuracy import device_accuracy_summary
from aggregator.cloud import Cloud, CloudState
from aggregator.config import CloudConfig
from edge_client import messages as m
from edge_client.config import DeviceConfig, TrainingSettings
from edge_client.errors import SaflError
from edge_client.runner import RoleRunner
from edge_client.topics import global_model_topic
from edge_client.trainers import layout_hash
from edge_client.transport import LocalBus

from .clock import ClockConfig, TimedBus, assign_profiles, check_batched_steps
from .datasets import Dataset
from .engine import Factories, SimulationConfig, open_factories
from .factory import (
    SIM_CLOCK,
    Outbox,
    factory_plans,
    merged_privacy,
    public_settings,
    simulated,
    trainer_maker,
)

__all__ = ["Strategy", "FleetSpec", "FleetPlan", "RunResult", "plan_fleet", "run_federation",
           "public_settings"]


@dataclass(frozen=True)
class Strategy:
    """A named federation recipe: overrides for each role's config."""

    name: str
    device: Mapping[str, Any] = field(default_factory=dict)
    station: Mapping[str, Any] = field(default_factory=dict)
    cloud: Mapping[str, Any] = field(default_factory=dict)
    flat: bool = False  # one station for the whole fleet (the SAFL paper's setting)


@dataclass(frozen=True)
class FleetSpec:
    """Fleet shape, model and streaming rate shared by every strategy of a run."""

    partitions: tuple[np.ndarray, ...]  # sample indices per device
    groups: tuple[np.ndarray, ...]  # device numbers per station
    rounds: int  # the cloud's rounds; only a cap when ``samples`` is set
    # Stop after the round in which the devices have trained this many samples in all
    # (0: run ``rounds``).  Budgets count samples trained, not batches scheduled: a device
    # that has sensed fewer than a batch trains on what it has.
    samples: int = 0
    model: str = "mlp"
    backends: tuple[str, ...] = ("numpy",)  # assigned to devices in turn: a mixed fleet
    artifacts: str | None = None  # exported model folder, for the "ort" backend
    lr: float = TrainingSettings.lr
    seed: int = 0
    arrivals_per_step: int = 32  # samples sensed per local-step time, fleet mean per device
    initial_samples: int = 64
    eval_samples: int | None = None  # test samples per evaluation (None: all)
    eval_every: int = 1  # rounds between evaluations of the global model (and the last)
    # Devices of one backend share one trainer: a device's model lives in its flat vectors,
    # the trainer is only compute.  Memory per simulated device then excludes the model.
    share_trainers: bool = False
    # Compromised devices (by number) and what they send (lab.attacks.ATTACKS).
    attack: str = "none"
    attackers: tuple[int, ...] = ()
    # Prequential accuracy: each device predicts one arriving sample in this many with its
    # deployable model before it may be trained on (0: off; each prediction is a forward pass).
    prequential_every: int = 0
    # Where the torch backend trains: "auto" (CUDA where torch sees one), "cpu", "cuda:N".
    torch_device: str = "auto"
    # A super node's members take their local steps in one batched call (torch's
    # train_members, vmap over their weights: the GPU's way); float-close to one by one.
    batched_steps: bool = False
    # Virtual time (lab/clock.py): the devices' boards and every link, priced; None: no
    # clock (every message arrives at once, no deadline fires, as before).
    clock: ClockConfig | None = None

    def __post_init__(self) -> None:
        check_batched_steps(self.batched_steps, self.clock is not None)


@dataclass
class RunResult:
    strategy: str
    rows: list[dict[str, Any]]
    counters: dict[str, int]
    wall_s: float
    p_real: list[float] = field(default_factory=list)  # the cloud's estimate at the end
    # Each device at each evaluation, as it says of itself (DeviceSummary) with what its
    # station refused and clipped of it: the report's per-device figures.
    devices: list[dict[str, Any]] = field(default_factory=list)
    nodes: list[str] = field(default_factory=list)  # the node each factory ran on (Ray)

    @property
    def final_accuracy(self) -> float:
        return self.rows[-1]["accuracy"]

    @property
    def best_accuracy(self) -> float:
        return max(r["accuracy"] for r in self.rows)


def _device_id(k: int) -> str:
    return f"dev{k:03d}"


@dataclass(frozen=True)
class FleetPlan:
    """Every role's config values for one strategy on one fleet (plain mappings).

    The in-process simulation builds its roles from these, and the process launcher
    writes the same values into TOML files, so both run the same federation.
    """

    fleet: str
    cloud: dict[str, Any]
    stations: list[dict[str, Any]]
    devices: list[dict[str, Any]]  # each with its partition index "_k" and backend "_backend"
    replay_seeds: list[int]
    # Samples each device senses per local-step time: in proportion to its share of the
    # fleet's data, so that the seen counts behind P_real are the fleet's distribution.
    stream_rates: list[float]


_DEVICE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(DeviceConfig)}


def plan_fleet(strategy: Strategy, spec: FleetSpec) -> FleetPlan:
    """Ids, rosters and integer seeds of a fleet: one source of truth for sim and processes."""
    n_dev = len(spec.partitions)
    seeds = [int(s.generate_state(1)[0]) for s in
             np.random.SeedSequence(spec.seed).spawn(3 * n_dev + len(spec.groups))]
    fleet = strategy.device.get("fleet", "sim")
    groups = (np.arange(n_dev),) if strategy.flat else spec.groups
    station_ids = [f"st{g}" for g in range(len(groups))]
    cloud = {"fleet": fleet, "stations": tuple(station_ids), "rounds": spec.rounds,
             **strategy.cloud}
    stations, devices, replay = [], [], [0] * n_dev
    profiles = assign_profiles(spec.clock, n_dev) if spec.clock else None
    # The station bounds its devices' claims by their settings, so it is told them.
    device_values = {"lr": spec.lr, **strategy.device}
    known = {f.name: device_values.get(f.name, _DEVICE_DEFAULTS[f.name])
             for f in dataclasses.fields(TrainingSettings)}
    for g, (sid, members) in enumerate(zip(station_ids, groups, strict=True)):
        stations.append({"fleet": fleet, "station_id": sid, "seed": seeds[-1 - g],
                         "devices": tuple(_device_id(k) for k in members), **known,
                         **strategy.station})
        for k in members:
            devices.append({"device_id": _device_id(k), "station": sid, "lr": spec.lr,
                            "seed": seeds[3 * k], **strategy.device, "fleet": fleet,
                            "_k": int(k), "_backend": spec.backends[k % len(spec.backends)],
                            **({"_profile": profiles[k]} if profiles else {})})
            replay[k] = seeds[3 * k + 1]
    sizes = np.array([len(p) for p in spec.partitions], dtype=np.float64)
    rates = spec.arrivals_per_step * sizes * n_dev / sizes.sum()
    return FleetPlan(fleet, cloud, stations, devices, replay, [float(r) for r in rates])


def run_federation(data: Dataset, strategy: Strategy, spec: FleetSpec,
                   progress: Callable[[int, float], None] | None = None,
                   engine: SimulationConfig | None = None) -> RunResult:
    """Run one strategy to completion; same ``spec`` gives same data, weights and seeds,
    on either engine (``engine``: the ``[simulation]`` table; default, this process)."""
    started = time.perf_counter()
    plan = plan_fleet(strategy, spec)
    make = trainer_maker(spec, data.sample_shape, data.num_classes)
    evaluator = make(spec.backends[0], None)
    layout = layout_hash(evaluator.layout)
    cloud = Cloud(simulated(CloudConfig, plan.cloud),
                  initial_weights=evaluator.get_flat(), num_classes=data.num_classes)
    plans = factory_plans(plan, spec, data.x_train, data.y_train, num_classes=data.num_classes,
                          num_params=evaluator.num_params, layout=layout)
    factories = open_factories(plans, engine or SimulationConfig(),
                               lambda backend: make(backend, layout))
    try:
        rows, per_device, counters = _drive(data, strategy, spec, cloud, factories, evaluator,
                                            started, progress)
    finally:
        factories.close()
    return RunResult(strategy.name, rows, counters, time.perf_counter() - started,
                     p_real=[float(p) for p in cloud.p_real], devices=per_device,
                     nodes=factories.nodes)


def _drive(data: Dataset, strategy: Strategy, spec: FleetSpec, cloud: Cloud,
           factories: Factories, evaluator: Any, started: float,
           progress: Callable[[int, float], None] | None
           ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, int]]:
    """The cloud on this process's bus, the factories wherever they run: each global model
    goes to every factory, the round is recorded, then the factories run until their
    stations report, and their reports reach the cloud in the factories' order."""
    bus: LocalBus
    if spec.clock is None:
        bus = LocalBus()
        runner = RoleRunner(cloud, bus, SIM_CLOCK)
    else:  # the cloud sits beside its broker; the stations' links are the factories'
        bus = TimedBus(keep_time=lambda: cloud.state == CloudState.COLLECTING,
                       max_virtual_s=spec.clock.max_virtual_s,
                       handling_s=spec.clock.handling_ms / 1e3)
        port = bus.port("cloud")
        runner = RoleRunner(cloud, port, lambda: port.now)
        port.wakeup, port.tick = cloud.wakeup, runner.tick
    rows: list[dict[str, Any]] = []
    per_device: list[dict[str, Any]] = []
    record = _recorder(data, strategy, spec, evaluator, _FleetView(factories, bus, cloud),
                       (rows, per_device), started, progress)

    def to_cloud(outboxes: list[Outbox]) -> None:
        for outbox in outboxes:
            for topic, message, at in outbox:
                if isinstance(bus, TimedBus):
                    bus.publish_at(topic, message, at)
                else:
                    bus.publish(topic, message)

    def on_global(topic: str, message: m.Message) -> None:
        if not isinstance(message, m.GlobalModel):
            return  # only global models travel on this topic
        now = bus.now if isinstance(bus, TimedBus) else 0.0
        trained = sum(factories.call("receive", topic, message, now))
        if record(message, trained, now):  # the sample budget is spent: the run ends here
            factories.call("drop")
            bus.stop()
            return
        to_cloud(factories.call("resume"))

    bus.subscribe(global_model_topic(cloud.config.fleet), on_global)
    if spec.clock is None:
        runner.start()
    else:
        port.run(0.0, runner.start)
    to_cloud(factories.call("start"))
    bus.deliver()
    if cloud.state != CloudState.DONE and not (spec.samples and rows
                                               and rows[-1]["samples"] >= spec.samples):
        raise SaflError(f"federation stalled in round {cloud.round} (cloud {cloud.state})")
    runner.tick()  # the last tick every role gets as its loop ends
    counters: Counter[str] = Counter(cloud.counters)
    for part in factories.call("finish"):
        counters.update(part)
    return rows, per_device, dict(counters)


class _FleetView:
    """The whole fleet as the recorder reads it: every factory's figures, merged."""

    def __init__(self, factories: Factories, bus: LocalBus, cloud: Cloud) -> None:
        self.factories, self.bus, self.cloud = factories, bus, cloud

    def accuracies(self) -> tuple[list[float], list[float]]:
        parts = self.factories.call("accuracies")
        return [a for local, _ in parts for a in local], [a for _, pre in parts for a in pre]

    def traffic(self) -> tuple[Counter[str], Counter[str]]:
        """Messages and bytes by type; the global model counted once, as the cloud sent it
        (each factory's bus carried a copy)."""
        messages: Counter[str] = Counter()
        payload: Counter[str] = Counter()
        for sent, size in self.factories.call("traffic"):
            messages.update(sent)
            payload.update(size)
        messages["GlobalModel"] = self.bus.messages["GlobalModel"]
        payload["GlobalModel"] = self.bus.payload_bytes["GlobalModel"]
        return messages, payload

    def privacy(self) -> dict[str, float]:
        return {**self.cloud.privacy_summary(), **merged_privacy(self.factories.call("privacy"))}

    def device_rows(self, strategy: str, round_: int, samples: int) -> list[dict[str, Any]]:
        return [row for part in self.factories.call("device_rows", strategy, round_, samples)
                for row in part]


def _recorder(data: Dataset, strategy: Strategy, spec: FleetSpec, evaluator: Any,
              view: _FleetView, tables: tuple[list[dict[str, Any]], list[dict[str, Any]]],
              started: float, progress: Callable[[int, float], None] | None
              ) -> Callable[[m.GlobalModel, int, float], bool]:
    """What watches the global model: every ``eval_every`` rounds (and at the end) it scores
    the model and appends a row, and a row per device; it says when the sample budget is
    spent (given the samples the devices have trained)."""
    rows, per_device = tables
    x_eval, y_eval = data.x_test[:spec.eval_samples], data.y_test[:spec.eval_samples]

    def record(message: m.GlobalModel, trained: int, virtual_s: float) -> bool:
        if progress:
            progress(message.round, rows[-1]["accuracy"] if rows else float("nan"))
        spent = 0 < spec.samples <= trained
        if message.round % spec.eval_every and not (message.final or spent):
            return spent
        evaluator.set_flat(message.weights)
        loss, acc = evaluator.evaluate(x_eval, y_eval)
        local = device_accuracy_summary(*view.accuracies())
        messages, payload = view.traffic()
        rows.append({
            "strategy": strategy.name, "round": message.round, "iteration": message.iteration,
            "samples": trained, "virtual_s": virtual_s,
            "accuracy": acc, "loss": loss,
            "local_mean": local.get("local_mean", float("nan")),
            "local_worst10": local.get("local_worst10", float("nan")),
            "prequential_mean": local.get("prequential_mean", float("nan")),
            "prequential_worst10": local.get("prequential_worst10", float("nan")),
            "uploads": messages["DeviceUpdate"], "skips": messages["SkipNotice"],
            # Device links stay inside the factory; station links cross the WAN to the cloud.
            "bytes_device_up": payload["DeviceUpdate"],
            "bytes_device_down": payload["StationModel"],
            "bytes_station_up": payload["StationUpdate"],
            "bytes_station_down": payload["GlobalModel"],
            "wall_s": time.perf_counter() - started,
            **view.privacy(),
        })
        per_device.extend(view.device_rows(strategy.name, message.round, trained))
        return spent
    return record
