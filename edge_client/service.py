"""A role as a service: config files, the trainer and MQTT transport a role's tables
describe, the metrics endpoint, and the device service.  The loop itself is
:func:`edge_client.runner.serve`, which the station and cloud services
(:mod:`aggregator.services`) and the simulations run too.
"""

from __future__ import annotations

import difflib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from . import messages as m
from .body import Body, body_id, body_tail, head_input_shape, open_body
from .catalogue import Catalogue, HeldLabels
from .config import (
    BrokerConfig,
    DeviceConfig,
    InferenceConfig,
    ModelConfig,
    ServiceConfig,
    SourceConfig,
    load_config,
    read_toml,
)
from .device import Device
from .documents import Document
from .errors import ConfigError
from .head_stats import HeadStatsPath, head_spec
from .metrics import Collect, MetricsServer
from .mqtt import MqttTransport
from .personal_head import attach_personal
from .privacy import keep_privacy_ledger
from .runner import RoleRunner, StopFlag, pace_replay, serve
from .serving import DeployableKeeper, StreamFeed, resume_deployable
from .sources import LiveLabels, SourcePump, build_source
from .sources.replay import ReplaySource
from .sources.video import VideoSource
from .topics import predictions_topic, summary_topic
from .trainers import Trainer, build_trainer, layout_hash, pretrained_embedding
from .trainers.paced import PacedTrainer

__all__ = ["DeviceService", "load_role_file", "with_metrics", "model_trainer",
           "role_transport", "federation_layout", "DEVICE_TABLES", "SHARED_TABLES"]

log = logging.getLogger(__name__)

# Gauges that are times: Prometheus names a time by its unit.
_SECONDS = ("label_lag", "label_lag_estimate", "camera_outage")


# The tables every role's file has beside its own ([station], [cloud]), and a device's.
SHARED_TABLES = {"model": ModelConfig, "broker": BrokerConfig, "service": ServiceConfig}
DEVICE_TABLES = {"device": DeviceConfig, "model": ModelConfig, "source": SourceConfig,
                 "inference": InferenceConfig, "broker": BrokerConfig, "service": ServiceConfig}


def load_role_file(path: str | Path | None, tables: dict[str, type],
                   overrides: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Load several config tables of one role's TOML file, each with its overrides.  A
    table the role does not read (``[inferense]``) is refused like an unknown key: its
    settings would be silently ignored."""
    if path is not None:
        unknown = sorted(set(read_toml(path, "config")) - set(tables))
        if unknown:
            near = difflib.get_close_matches(unknown[0], list(tables), n=1)
            raise ConfigError(unknown[0], f"unknown table [{unknown[0]}] in {path}"
                              + (f"; did you mean [{near[0]}]?" if near else "")
                              + f"; this role reads {', '.join(f'[{t}]' for t in tables)}")
    return {name: load_config(cls, name, path, overrides.get(name))
            for name, cls in tables.items()}


def model_trainer(model: ModelConfig, lr: float) -> Trainer:
    """The trainer a role's ``[model]`` table describes (stations and the cloud use it for the
    layout, the initial weights and evaluation, never for SGD).  With a body it is the
    head, on the body's embeddings, or the body's last blocks and the head."""
    return build_trainer(model.spec, backend=model.backend, input_shape=head_input_shape(model),
                         num_classes=model.num_classes, lr=lr, seed=model.seed,
                         artifacts=model.artifacts or None, device=model.device,
                         hidden=model.hidden, tail=body_tail(model))


def federation_layout(model: ModelConfig, trainer: Trainer) -> str:
    """The layout hash every frame carries: the model's tensors, and its body's hash."""
    return layout_hash(trainer.layout, body=body_id(model))


def role_transport(broker: BrokerConfig, *, fleet: str, role: m.Participant, participant: str,
                   trainer: Trainer, model: ModelConfig,
                   client_id: str | None = None) -> MqttTransport:
    """The MQTT transport of one participant, with its presence and the model's layout."""
    presence = m.Presence(fleet=fleet, sender=participant, round=0, iteration=0, role=role,
                          online=True)
    return MqttTransport(broker, client_id=client_id or participant, fleet=fleet,
                         layout_hash=federation_layout(model, trainer), presence=presence,
                         num_params=trainer.num_params)


def summaries(transport: MqttTransport, topic: str, summary: Callable[[], Document],
              every: float = 1.0) -> dict[str, Any]:
    """``serve`` keywords that publish a retained summary every ``every`` seconds and once
    at the end."""
    last = [0.0]

    def hook(now: float) -> None:
        if now - last[0] >= every:
            last[0] = now
            transport.publish_document(topic, summary())
    return {"hooks": (hook,), "on_stop": lambda: transport.publish_document(topic, summary())}


def with_metrics(config: ServiceConfig, role: str, collect: Collect,
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
    inference: InferenceConfig = InferenceConfig()
    # The running source's pump: its counters (frames dropped, wrong shapes, a recording's
    # end) are metrics too.  None for federation-paced replay.
    pump: SourcePump | None = field(default=None, init=False, repr=False)
    feed: StreamFeed | None = field(default=None, init=False, repr=False)
    labels: LiveLabels | None = field(default=None, init=False, repr=False)
    # Keeps the deployable model in state_dir (None without one).
    keeper: DeployableKeeper | None = field(default=None, init=False, repr=False)
    held: HeldLabels | None = field(default=None, init=False, repr=False)
    body: Body | None = field(default=None, init=False, repr=False)  # its ms a frame: /metrics

    def build(self) -> tuple[RoleRunner[Device], MqttTransport,
                             tuple[Callable[[float], None], ...]]:
        """The device on its transport, and the ``serve`` hooks that feed it and keep its
        deployable model on disk (no feed where the federation paces a replay)."""
        cfg, mc, src = self.device, self.model, self.source
        trainer = model_trainer(mc, cfg.lr)
        self.body = body = open_body(mc, threads=self.service.body_threads)
        if body and src.decoded and not src.rgb and body.manifest.input_shape[0] == 3:
            raise ConfigError("rgb", f"body {mc.body} takes RGB frames and OpenCV delivers BGR: "
                              "set [source] rgb = true")
        if body is not None:
            log.info("device %s: body %s (%s) on %s, embeddings of %s (%d bytes a buffered "
                     "sample)%s", cfg.device_id, body.manifest.name, body.manifest.hash,
                     body.runtime, body.out_shape, body.bytes_per_sample,
                     f", its last {body.blocks} block(s) training" if body.blocks else "")
        if self.service.emulate_step_s:
            trainer = PacedTrainer(trainer, self.service.emulate_step_s)
        device = Device(cfg, trainer, num_classes=mc.num_classes, inference=self.inference,
                        sample_shape=head_input_shape(mc), rng=np.random.default_rng(cfg.seed))
        HeadStatsPath.attach(device, head_spec(mc), cfg.head_stats_every, await_station=True,
                             embed=pretrained_embedding(body_tail(mc)))
        attach_personal(device, self.service.state_dir, background=True)
        catalogue, held = self._products(device)
        transport = role_transport(self.broker, fleet=cfg.fleet, role=m.Participant.DEVICE,
                                   participant=cfg.device_id, trainer=trainer, model=mc)
        runner = RoleRunner(device, transport)
        if device.pipeline.noise:
            keep_privacy_ledger(device.upload, self.service.state_dir)
        if self.service.state_dir:
            resume_deployable(self.service.state_dir, device, transport.layout_hash)
            self.keeper = DeployableKeeper(self.service.state_dir, device,
                                           transport.layout_hash)
        keep = (self.keeper,) if self.keeper else ()
        source, drops = build_source(self.source, sample_shape=mc.input_shape,
                                     num_classes=mc.num_classes,
                                     rng=np.random.default_rng(self.source.seed))
        if self.source.initial and isinstance(source, ReplaySource):
            x, y = source.read(self.source.initial)
            device.sense(body.embed(x) if body is not None else x, y)
        if self.source.per_iteration:
            if not isinstance(source, ReplaySource):
                raise ConfigError("per_iteration", "federation-paced replay needs an array "
                                  "source")
            pace_replay(runner, source, self.source.per_iteration, body=body)
            return runner, transport, keep
        self.pump = pump = SourcePump(source, capacity=self.source.queue_size,
                                      drop_when_full=drops, name=cfg.device_id).start()
        if src.label_topic:
            self.labels = LiveLabels(mc.num_classes, catalogue=catalogue, held=held,
                                     window=src.label_window,
                                     delay_max=src.label_delay_max, lag=src.label_lag)
        topic = predictions_topic(cfg.fleet, cfg.device_id)
        self.feed = feed = StreamFeed(device, pump, inference=self.inference, labels=self.labels,
                                      body=body, publish=lambda doc: transport.publish_document(
                                          topic, doc, retain=False, qos=0))
        if src.label_topic:
            transport.subscribe_raw(src.label_topic, lambda _topic, payload: runner.publish(
                feed.on_label(payload, runner.clock())))
        keep = (*keep, held.keep) if held is not None else keep
        return runner, transport, (lambda now: runner.publish(feed(now)), *keep)

    def _products(self, device: Device) -> tuple[Catalogue, HeldLabels | None]:
        """The products of this device's file, until the cloud's come with a model, and
        where a live line's labels of products to come are held (edge_client/catalogue.py)."""
        mc, src = self.model, self.source
        catalogue = Catalogue(mc.num_classes, mc.class_names, mc.retired,
                              counters=device.counters)
        self.held = HeldLabels(catalogue, hold_for=src.hold_labels_for,
                               hold_max=src.hold_labels_max,
                               folder=self.service.state_dir or None) \
            if src.label_topic and mc.class_names else None
        device.products.use(catalogue, self.held)
        return catalogue, self.held

    def _gauges(self) -> dict[str, float | None]:
        """What the page and ``/metrics`` show beside the device's own figures."""
        labels, source = self.labels, self.pump.source if self.pump else None
        return {"label_lag": labels.lag if labels else None,
                "label_lag_estimate": labels.estimate if labels else None,
                "body_ms_per_frame": self.body.ms_per_frame if self.body else None,
                "camera_outage": source.outage_s if isinstance(source, VideoSource)
                and source.live else None,
                "predictions_behind": self.feed.device.line.behind.share
                if self.feed is not None and self.feed.inference.enabled else None,
                "labels_held": len(self.held) if self.held is not None else None}

    def _last_prediction(self) -> float | None:
        return self.feed.last_prediction if self.feed is not None else None

    def _prediction_age(self) -> dict[str, float]:
        last = self._last_prediction()
        return {} if last is None else {"last_prediction_age_seconds": time.time() - last}

    def summaries(self, runner: RoleRunner[Device], transport: MqttTransport) -> dict[str, Any]:
        """``serve`` keywords that publish the device's retained summary: every 2 s, the
        pace the monitor's page redraws at (about 500 bytes, against an update's hundreds
        of kilobytes on the factory's Wi-Fi), and once at the end."""
        device, pump = runner.role, self.pump
        return summaries(transport, summary_topic(device.config.fleet, m.Participant.DEVICE,
                                                  device.id), lambda: device.summary(
            error=runner.last_error, transport=dict(transport.counters),
            source={**{k: int(v) for k, v in (pump.metrics() if pump else {}).items()
                       if k != "queued"},
                    **(dict(self.labels.counters) if self.labels else {})},
            last_prediction=self._last_prediction(), **self._gauges()), every=2.0)

    def run(self, stop: StopFlag | None = None, *, exit_when_done: bool = True) -> Device:
        runner, transport, hooks = self.build()
        device, pump = runner.role, self.pump
        published = self.summaries(runner, transport)
        metrics = with_metrics(self.service, "device", lambda: (
            {**device.counters, **transport.counters,
             **({f"source.{k}": v for k, v in pump.metrics().items() if k != "queued"}
                if pump else {}),
             **(dict(self.labels.counters) if self.labels else {})},
            {**device.metrics(), **runner.figures(),
             **({"source_queued": pump.metrics()["queued"]} if pump else {}),
             # Prometheus names a time by its unit.
             **{k + ("_seconds" if k in _SECONDS else ""): v
                for k, v in self._gauges().items() if v is not None},
             **self._prediction_age()}),
            labels={"fleet": device.config.fleet, "station": device.config.station,
                    "device": device.id})
        keeper, last_summary = self.keeper, published["on_stop"]

        def on_stop() -> None:
            if keeper is not None:
                keeper.save()
            if self.held is not None:
                self.held.keep(time.time(), force=True)
            last_summary()
        try:
            serve(runner, transport, stop=StopFlag() if stop is None else stop, metrics=metrics,
                  hooks=(*hooks, *published["hooks"]), on_stop=on_stop,
                  done=(lambda: device.finished) if exit_when_done else (lambda: False))
        finally:
            if self.feed is not None:
                self.feed.close()
            if pump is not None:
                pump.stop()
        log.info("device %s finished: %s %s", device.id, dict(device.counters),
                 {**device.metrics(), **runner.figures()})
        return device
