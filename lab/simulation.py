"""In-process federation: the real roles on a :class:`LocalBus`, fed by replayed streams.

The simulator owns no algorithm.  It builds a cloud, stations and devices from
their configs, replays each device's partition into its stream buffer as the
iterations pass, and records the global model's test accuracy every ``eval_every``
rounds, with the samples trained so far and the device-local accuracies the devices
reported.  Devices stream in proportion to their partition sizes, so the seen counts
behind ``P_real`` reflect the fleet's label distribution.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

import numpy as np

from aggregator.accuracy import device_accuracy_summary
from aggregator.cloud import Cloud, CloudState
from aggregator.config import CloudConfig, StationConfig
from aggregator.station import Station
from edge_client import messages as m
from edge_client.admission import Admission
from edge_client.config import DeviceConfig, InferenceConfig, TrainingSettings, from_mapping
from edge_client.device import Device
from edge_client.errors import SaflError
from edge_client.metrics import counted
from edge_client.runner import RoleRunner, StopFlag, pace_replay, serve
from edge_client.sources.replay import ReplaySource
from edge_client.topics import global_model_topic
from edge_client.trainers import build_trainer, layout_hash
from edge_client.transport import LocalBus

from .attacks import install
from .datasets import Dataset

__all__ = ["Strategy", "FleetSpec", "FleetPlan", "RunResult", "plan_fleet", "run_federation",
           "public_settings"]

# Simulated time does not pass inside one synchronous delivery; deadlines never fire.
_SIM_CLOCK: Callable[[], float] = lambda: 0.0  # noqa: E731


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

    @property
    def final_accuracy(self) -> float:
        return self.rows[-1]["accuracy"]

    @property
    def best_accuracy(self) -> float:
        return max(r["accuracy"] for r in self.rows)


C = TypeVar("C")


def _simulated(cls: type[C], values: dict[str, Any]) -> C:
    """A role's config for the simulator: reproducible, so its privacy noise is seeded too
    (never so on a board, a station or the cloud)."""
    return from_mapping(cls, {"noise_seeded": True, **values})


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
                            "_k": int(k), "_backend": spec.backends[k % len(spec.backends)]})
            replay[k] = seeds[3 * k + 1]
    sizes = np.array([len(p) for p in spec.partitions], dtype=np.float64)
    rates = spec.arrivals_per_step * sizes * n_dev / sizes.sum()
    return FleetPlan(fleet, cloud, stations, devices, replay, [float(r) for r in rates])


def public_settings(values: dict[str, Any]) -> dict[str, Any]:
    """A plan entry's config keys, without the plan's own ``_``-prefixed bookkeeping."""
    return {k: v for k, v in values.items() if not k.startswith("_")}


def run_federation(data: Dataset, strategy: Strategy, spec: FleetSpec,
                   progress: Callable[[int, float], None] | None = None) -> RunResult:
    """Run one strategy to completion; same ``spec`` gives same data, weights and seeds."""
    started = time.perf_counter()
    plan = plan_fleet(strategy, spec)
    bus = LocalBus()
    evaluator, trainer = _trainers(data, spec)
    cloud = Cloud(_simulated(CloudConfig, plan.cloud),
                  initial_weights=evaluator.get_flat(), num_classes=data.num_classes)
    configs = [_simulated(StationConfig, values) for values in plan.stations]
    stations = [Station(cfg, num_params=evaluator.num_params, num_classes=data.num_classes,
                        rng=np.random.default_rng(cfg.seed)) for cfg in configs]
    runners: list[RoleRunner[Any]] = [RoleRunner(role, bus, _SIM_CLOCK)
                                      for role in (cloud, *stations)]
    devices, admissions = _devices(data, spec, plan, bus, trainer, evaluator)
    rows: list[dict[str, Any]] = []
    per_device: list[dict[str, Any]] = []
    bus.subscribe(global_model_topic(plan.fleet),
                  _recorder(data, strategy, spec, bus, evaluator, cloud, stations,
                            [sim.device for sim in devices], (rows, per_device), started,
                            progress))
    for sim in devices:
        # Each new iteration, the sensors of that factory have produced fresh samples.
        pace_replay(sim.runner, sim.source, plan.stream_rates[sim.partition])

    def budget_spent() -> bool:
        return bool(spec.samples and rows and rows[-1]["samples"] >= spec.samples)

    serve([*runners, *(sim.runner for sim in devices)], bus, stop=StopFlag(install=False),
          done=lambda: cloud.state == CloudState.DONE or budget_spent() or bus.idle, linger=0.0)
    if cloud.state != CloudState.DONE and not budget_spent():
        raise SaflError(f"federation stalled in round {cloud.round} (cloud {cloud.state}); "
                        f"station states {[st.state for st in stations]}")
    counters: Counter[str] = Counter()
    for kept in (cloud.counters, *(st.counters for st in stations),
                 *(sim.device.counters for sim in devices), *(a.counters for a in admissions)):
        counters.update(kept)
    return RunResult(strategy.name, rows, dict(counters), time.perf_counter() - started,
                     p_real=[float(p) for p in cloud.p_real], devices=per_device)


class _SimDevice(NamedTuple):
    """A simulated device: the role, its replayed stream (partition ``partition``), its runner."""

    device: Device
    source: ReplaySource
    runner: RoleRunner
    partition: int


def _trainers(data: Dataset, spec: FleetSpec) -> tuple[Any, Callable[[str], Any]]:
    """The cloud's evaluator, and a maker of trainers on each backend that checks they lay
    the model out as the evaluator does (a mixed fleet is one fleet)."""
    def make(backend: str, layout: str | None) -> Any:
        return build_trainer(spec.model, backend=backend, input_shape=data.sample_shape,
                             num_classes=data.num_classes, lr=spec.lr, seed=spec.seed,
                             artifacts=spec.artifacts, expected_layout_hash=layout)

    evaluator = make(spec.backends[0], None)
    layout = layout_hash(evaluator.layout)
    return evaluator, lambda backend: make(backend, layout)


def _devices(data: Dataset, spec: FleetSpec, plan: FleetPlan, bus: LocalBus,
             trainer: Callable[[str], Any], evaluator: Any
             ) -> tuple[list[_SimDevice], list[Admission]]:
    """Every device of the plan with its replayed stream and runner (the compromised ones
    sending what their attack makes), and the admissions their forged frames go through."""
    devices: list[_SimDevice] = []
    admissions: list[Admission] = []
    shared: dict[str, Any] = {}
    for values in plan.devices:
        cfg = _simulated(DeviceConfig, public_settings(values))
        k = values["_k"]
        backend = values["_backend"]
        if spec.share_trainers:
            shared.setdefault(backend, trainer(backend))
        dev = Device(cfg, shared[backend] if spec.share_trainers else trainer(backend),
                     num_classes=data.num_classes,
                     sample_shape=data.sample_shape, rng=np.random.default_rng(cfg.seed),
                     inference=InferenceConfig(every=spec.prequential_every, publish=False)
                     if spec.prequential_every else None)
        idx = spec.partitions[k]
        source = ReplaySource(data.x_train[idx], data.y_train[idx],
                              np.random.default_rng(plan.replay_seeds[k]))
        dev.buffer.push(*source.read(spec.initial_samples))
        runner = RoleRunner(dev, bus, _SIM_CLOCK)
        if k in spec.attackers and spec.attack != "none":
            # What the station's transport does with a forged frame (counted with the roles).
            admission = Admission(fleet=plan.fleet, layout_hash=layout_hash(evaluator.layout),
                                  num_params=evaluator.num_params, max_message=1 << 30,
                                  reassembly_memory=1 << 30, chunk_timeout=60.0)
            install(runner, spec.attack, admission, bus)
            admissions.append(admission)
        devices.append(_SimDevice(dev, source, runner, k))
    return devices, admissions


def _recorder(data: Dataset, strategy: Strategy, spec: FleetSpec, bus: LocalBus, evaluator: Any,
              cloud: Cloud, stations: list[Station], devices: list[Device],
              tables: tuple[list[dict[str, Any]], list[dict[str, Any]]],
              started: float, progress: Callable[[int, float], None] | None
              ) -> Callable[[str, m.Message], None]:
    """What watches the global model: it stops the bus once the sample budget is spent, and
    every ``eval_every`` rounds (and at the end) scores the model and appends a row, and a
    row per device."""
    rows, per_device = tables
    x_eval, y_eval = data.x_test[:spec.eval_samples], data.y_test[:spec.eval_samples]

    def record(topic: str, message: m.Message) -> None:
        if not isinstance(message, m.GlobalModel):
            return  # only global models travel on this topic
        if progress:
            progress(message.round, rows[-1]["accuracy"] if rows else float("nan"))
        trained = sum(d.counters["samples_trained"] for d in devices)
        spent = 0 < spec.samples <= trained
        if spent:
            bus.stop()
        if message.round % spec.eval_every and not (message.final or spent):
            return
        evaluator.set_flat(message.weights)
        loss, acc = evaluator.evaluate(x_eval, y_eval)
        local = device_accuracy_summary(
            [a for s in stations for a in s.local_accuracies()],
            [a for s in stations for a in s.prequential_accuracies()])
        rows.append({
            "strategy": strategy.name, "round": message.round, "iteration": message.iteration,
            "samples": trained,
            "accuracy": acc, "loss": loss,
            "local_mean": local.get("local_mean", float("nan")),
            "local_worst10": local.get("local_worst10", float("nan")),
            "prequential_mean": local.get("prequential_mean", float("nan")),
            "prequential_worst10": local.get("prequential_worst10", float("nan")),
            "uploads": bus.messages["DeviceUpdate"], "skips": bus.messages["SkipNotice"],
            # Device links stay inside the factory; station links cross the WAN to the cloud.
            "bytes_device_up": bus.payload_bytes["DeviceUpdate"],
            "bytes_device_down": bus.payload_bytes["StationModel"],
            "bytes_station_up": bus.payload_bytes["StationUpdate"],
            "bytes_station_down": bus.payload_bytes["GlobalModel"],
            "wall_s": time.perf_counter() - started,
            **_privacy_columns(devices, stations, cloud),
        })
        per_device.extend(_device_rows(strategy.name, message.round, trained, devices,
                                       stations))
    return record


def _device_rows(strategy: str, round_: int, samples: int, devices: list[Device],
                 stations: list[Station]) -> list[dict[str, Any]]:
    """Each device now: what it says of itself, and what its station refused and clipped."""
    tally = {s.id: s.tally for s in stations}
    out = []
    for d in devices:
        doc = d.summary()
        seen_by = tally.get(doc.station)
        out.append({"strategy": strategy, "round": round_, "samples": samples,
                    "device": doc.device, "station": doc.station,
                    "local_accuracy": doc.local_accuracy,
                    "prequential_accuracy": doc.prequential_accuracy,
                    "uploads": doc.counters.get("uploads", 0),
                    "skips": counted(doc.counters, "skipped."),
                    "refused": seen_by.refused[doc.device] if seen_by else 0,
                    "clipped": seen_by.clipped[doc.device] if seen_by else 0})
    return out


def _privacy_columns(devices: list[Device], stations: list[Station],
                     cloud: Cloud) -> dict[str, float]:
    """The most epsilon any device's local DP has spent, where any adds noise, the most any
    device's data has spent in its station's noised syncs, and any station's in the cloud's,
    where those add noise."""
    out = cloud.privacy_summary()
    if any(d.pipeline.noise for d in devices):
        out["epsilon_local"] = max(d.epsilon for d in devices)
    if any(s.config.central_dp_noise for s in stations):
        out["epsilon_central"] = max(s.dp.privacy.worst() for s in stations)
    return out
