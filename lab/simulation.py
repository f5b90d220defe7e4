"""A simulated federation: the real roles, fed by replayed streams, on either engine.

The simulator owns no algorithm.  It plans a fleet (ids, rosters, seeds: ``lab/fleet.py``),
builds the cloud on this process's :class:`LocalBus` and each factory (a station and its
devices, ``lab/factory.py``) on the engine a run names (:func:`open_factories`: this
process, ``lab/engine.py``, or a Ray cluster, ``lab/ray_engine.py``), hands every
global model to the factories, and records the global model's test accuracy every
``eval_every`` rounds, with the samples trained so far and the device-local accuracies the
devices reported.  Devices stream in proportion to their partition sizes, so the seen counts
behind ``P_real`` reflect the fleet's label distribution.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aggregator.accuracy import device_accuracy_summary
from aggregator.cloud import Cloud, CloudState
from aggregator.config import CloudConfig
from aggregator.heads import attach_heads
from edge_client import messages as m
from edge_client.errors import SaflError
from edge_client.runner import RoleRunner
from edge_client.topics import global_model_topic
from edge_client.trainers import layout_hash
from edge_client.transport import LocalBus

from .clock import TimedBus
from .datasets import Dataset
from .engine import Factories, InProcess, SimulationConfig
from .factory import (
    SIM_CLOCK,
    FactoryPlan,
    Outbox,
    factory_plans,
    merged_privacy,
    public_settings,
    simulated,
    trainer_maker,
)
from .fleet import FleetPlan, FleetSpec, Strategy, plan_fleet

__all__ = ["Strategy", "FleetSpec", "FleetPlan", "RunResult", "plan_fleet", "run_federation",
           "open_factories", "public_settings"]


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


def open_factories(plans: list[FactoryPlan], sim: SimulationConfig,
                   trainer: Callable[[str], Any]) -> Factories:
    """The run's factories on ``sim``'s engine (``trainer`` makes the local engine's)."""
    if sim.engine == "ray":  # Ray is an extra: imported only where a run asks for it
        from .ray_engine import RayFactories
        return RayFactories(plans, sim)
    return InProcess(plans, trainer)


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
    attach_heads(cloud, spec.head)
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
        bus = TimedBus(keep_time=lambda: cloud.wakeup() is not None,  # a round, or round 0's wait
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
        if isinstance(bus, TimedBus):
            bus.before = None  # round 0 is out: the factories run on the driver's calls again
        now = bus.now if isinstance(bus, TimedBus) else 0.0
        trained = sum(factories.call("receive", topic, message, now))
        if record(message, trained, now):  # the sample budget is spent: the run ends here
            factories.call("drop")
            bus.stop()
            return
        to_cloud(factories.call("resume"))

    bus.subscribe(global_model_topic(cloud.config.fleet), on_global)
    if isinstance(bus, TimedBus):  # round 0 waits for the statistics of the first frames
        bus.before = lambda at: to_cloud(factories.call("advance", at)) \
            if cloud.state == CloudState.JOINING else None
    if spec.clock is None:
        runner.start()
    else:
        port.run(0.0, runner.start)
    to_cloud(factories.call("start"))
    bus.deliver()
    if spec.clock is None and (wait := cloud.wakeup()) is not None \
            and cloud.state == CloudState.JOINING:  # untimed, nothing in flight: its wait is over
        runner.publish(cloud.tick(wait))
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
            "head_samples": message.head_samples,  # what the closed-form head was solved from
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
            "bytes_head_device_up": payload["HeadStats"],
            "bytes_head_station_up": payload["StationHeadStats"],
            "wall_s": time.perf_counter() - started,
            **view.privacy(),
        })
        if spent or message.final:  # a solve per device: at the end only
            heads = [a for part in view.factories.call("head_accuracies") for a in part]
            if heads:
                rows[-1]["local_global_head"] = sum(g for g, _ in heads) / len(heads)
                rows[-1]["local_personal_head"] = sum(p for _, p in heads) / len(heads)
        per_device.extend(view.device_rows(strategy.name, message.round, trained))
        return spent
    return record
