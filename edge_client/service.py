"""Running a role as a service: the loop, signals, and the device service.

:func:`serve` connects a transport, starts the role, then delivers messages and
ticks deadlines until SIGTERM/SIGINT or until the role is done.  The station and
cloud services (in :mod:`aggregator.services`) use the same loop.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from . import messages as m
from .config import (
    BrokerConfig,
    DeviceConfig,
    ModelConfig,
    ServiceConfig,
    SourceConfig,
    load_config,
)
from .device import Device
from .errors import ConfigError
from .metrics import MetricsServer
from .mqtt import MqttTransport
from .role import Role
from .sources import SourcePump, build_source, feed_device
from .sources.replay import ReplaySource
from .topics import station_model_topic
from .trainers import build_trainer, layout_hash
from .transport import RoleRunner, Transport

__all__ = ["serve", "StopFlag", "DeviceService", "load_role_file", "with_metrics",
           "model_trainer", "role_transport"]

log = logging.getLogger(__name__)


class StopFlag:
    """Set by SIGTERM/SIGINT (when installed from the main thread) or by hand."""

    def __init__(self, install: bool = True) -> None:
        self.event = threading.Event()
        if install and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: self.event.set())

    def __bool__(self) -> bool:
        return self.event.is_set()


def serve(role: Role, transport: Transport, *, stop: StopFlag,
          done: Callable[[], bool] = lambda: False,
          hooks: tuple[Callable[[RoleRunner, float], None], ...] = (),
          attach: Callable[[RoleRunner], None] | None = None,
          on_stop: Callable[[], None] | None = None,
          metrics: MetricsServer | None = None,
          clock: Callable[[], float] = time.monotonic, idle_sleep: float = 0.05,
          linger: float = 0.5) -> RoleRunner:
    """Run ``role`` on ``transport`` until ``stop`` is set or ``done()`` is true.

    ``hooks`` run every loop turn; ``attach`` may add subscriptions that must see a
    message after the role has; ``metrics`` is closed with the service.
    """
    runner = RoleRunner(role, transport, clock)
    if attach is not None:
        attach(runner)
    transport.connect()
    try:
        runner.start()
        while not stop and not done():
            if metrics is not None:
                metrics.beat()
            busy = transport.deliver()
            runner.tick()
            for hook in hooks:
                try:
                    hook(runner, clock())
                except Exception:  # feeding or reporting failed once: count it, keep serving
                    runner.count_error("errors.tick", "a service hook failed")
            if not busy:
                wait = getattr(transport, "wait", None)  # wake as soon as a frame arrives
                wait(idle_sleep) if wait else time.sleep(idle_sleep)
        end = time.monotonic() + linger  # let the last answers go out before saying goodbye
        while time.monotonic() < end and not stop:
            transport.deliver()
            time.sleep(idle_sleep)
        if on_stop is not None:
            on_stop()
    finally:
        transport.close()
        if metrics is not None:
            metrics.close()
    return runner


def load_role_file(path: str | Path | None, tables: dict[str, type],
                   overrides: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Load several config tables of one role's TOML file, each with its overrides."""
    return {name: load_config(cls, name, path, overrides.get(name))
            for name, cls in tables.items()}


def model_trainer(model: ModelConfig, lr: float):
    """The trainer a role's ``[model]`` table describes (stations and the cloud use it for the
    layout, the initial weights and evaluation, never for SGD)."""
    return build_trainer(model.spec, backend=model.backend, input_shape=model.input_shape,
                         num_classes=model.num_classes, lr=lr, seed=model.seed,
                         artifacts=model.artifacts or None, device=model.device)


def role_transport(broker: BrokerConfig, *, fleet: str, role: str, participant: str,
                   trainer, client_id: str | None = None) -> MqttTransport:
    """The MQTT transport of one participant, with its presence and the model's layout."""
    presence = m.Presence(fleet=fleet, sender=participant, round=0, iteration=0, role=role,
                          online=True)
    return MqttTransport(broker, client_id=client_id or participant, fleet=fleet,
                         layout_hash=layout_hash(trainer.layout), presence=presence,
                         num_params=trainer.num_params)


def with_metrics(config: ServiceConfig, role: str, collect,
                 labels: dict[str, str] | None = None) -> MetricsServer | None:
    """Start the Prometheus endpoint if the service config asks for one."""
    if not config.metrics_port:
        return None
    return MetricsServer(config.metrics_port, role, collect, host=config.metrics_host,
                         labels=labels)


@dataclass
class DeviceService:
    """A device: trainer, role, source and MQTT transport built from its TOML file."""

    device: DeviceConfig
    model: ModelConfig
    source: SourceConfig
    broker: BrokerConfig
    service: ServiceConfig = ServiceConfig()
    # The running source's pump: its counters (frames dropped, wrong shapes, a recording's
    # end) are metrics too.  None for federation-paced replay.
    pump: SourcePump | None = field(default=None, init=False, repr=False)

    def build(self) -> tuple[Device, MqttTransport, dict[str, Any]]:
        """The role, its transport, and the ``serve`` keywords that feed it samples."""
        cfg, mc = self.device, self.model
        trainer = model_trainer(mc, cfg.lr)
        device = Device(cfg, trainer, num_classes=mc.num_classes, sample_shape=mc.input_shape,
                        rng=np.random.default_rng(cfg.seed))
        transport = role_transport(self.broker, fleet=cfg.fleet, role="dev",
                                   participant=cfg.device_id, trainer=trainer)
        source, drops = build_source(self.source, sample_shape=mc.input_shape,
                                     num_classes=mc.num_classes,
                                     rng=np.random.default_rng(self.source.seed))
        if self.source.initial and isinstance(source, ReplaySource):
            device.buffer.push(*source.read(self.source.initial))
        if self.source.per_iteration:
            return device, transport, {"attach": self._paced(device, source, transport)}
        pump = SourcePump(source, capacity=self.source.queue_size, drop_when_full=drops,
                          name=cfg.device_id).start()
        self.pump = pump
        return device, transport, {
            "hooks": (lambda runner, now: runner.publish(feed_device(device, pump, now)),)}

    def _paced(self, device: Device, source, transport: MqttTransport) -> Callable:
        if not isinstance(source, ReplaySource):
            raise ConfigError("per_iteration", "federation-paced replay needs an array source")
        rate, steps = self.source.per_iteration, device.config.local_steps

        def attach(runner: RoleRunner) -> None:
            # Subscribed after the role: the device stores each station model, then that
            # iteration's samples arrive, as in the in-process simulation.
            def on_model(topic: str, message: m.Message) -> None:
                x, y = source.paced(rate, steps)
                if len(y):
                    runner.publish(device.ingest(x, y, runner.clock()))
            transport.subscribe(station_model_topic(device.config.fleet,
                                                    device.config.station), on_model)
        return attach

    def run(self, stop: StopFlag | None = None, *, exit_when_done: bool = True) -> Device:
        device, transport, feeding = self.build()
        pump = self.pump
        metrics = with_metrics(self.service, "device", lambda: (
            {**device.counters, **transport.counters,
             **({f"source.{k}": v for k, v in pump.metrics().items() if k != "queued"}
                if pump else {})},
            {**device.metrics(), **({"source_queued": pump.metrics()["queued"]} if pump
                                    else {})}),
            labels={"fleet": device.config.fleet, "station": device.config.station,
                    "device": device.id})
        serve(device, transport, stop=stop or StopFlag(), metrics=metrics,
              done=(lambda: device.finished) if exit_when_done else (lambda: False), **feeding)
        log.info("device %s finished: %s %s", device.id, dict(device.counters), device.metrics())
        return device
