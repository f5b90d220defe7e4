"""The base-station and cloud services: their roles on MQTT, built from TOML files.

The cloud service can evaluate each global model on a held-out ``.npz`` test set
and appends each round to ``metrics.csv`` as it goes; both publish a small retained
JSON status that ``safl status`` reads.  With ``[service] state_dir`` set, both
checkpoint their role at every round boundary, before the round's message goes out,
and resume from it on start.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edge_client import messages as m
from edge_client.body import head_input_shape, open_body
from edge_client.catalogue import Catalogue
from edge_client.codec import encode
from edge_client.config import BrokerConfig, ModelConfig, ServiceConfig, load_config
from edge_client.documents import (
    ACCURACY_HISTORY,
    CloudSummary,
    ModelManifest,
    StationSummary,
    encode_document,
)
from edge_client.errors import ConfigError, MessageError, SourceError
from edge_client.head_stats import head_spec
from edge_client.mqtt import MqttTransport
from edge_client.privacy import keep_privacy_ledger
from edge_client.runner import RoleRunner, StopFlag, serve
from edge_client.service import model_trainer, role_transport, summaries, with_metrics
from edge_client.sources.preprocess import Preprocess
from edge_client.sources.replay import ImageFolderSource, load_arrays
from edge_client.topics import CLOUD_ID, manifest_topic, summary_topic

from .checkpoint import CloudCheckpoint, StationCheckpoint, load_checkpoint, save_checkpoint
from .cloud import Cloud, CloudState
from .config import CloudConfig, StationConfig
from .fedbuff import station_role
from .heads import attach_heads
from .role_files import camera_preprocess
from .selection import blas_threads
from .station import Station, StationState

__all__ = ["StationService", "CloudService", "evaluation_set"]

log = logging.getLogger(__name__)


def _checkpointing(role: Cloud | Station, state_dir: str, name: str, due) -> list:
    """Resume ``role`` from ``state_dir/name`` if a checkpoint is there; return the observers
    that write a new one whenever the role is about to send a message ``due`` accepts."""
    if not state_dir:
        log.info("%s: no [service] state_dir, so no checkpoints: a restart starts over", name)
        return []
    path = Path(state_dir) / f"{name}.ckpt.npz"
    started = time.perf_counter()
    found = load_checkpoint(path)
    if found is not None:
        arrays, doc = found
        if isinstance(role, Station):
            role.restore(arrays, StationCheckpoint.from_doc(doc))
        else:
            role.restore(arrays, CloudCheckpoint.from_doc(doc))
        digest = hashlib.sha256(found[0]["weights"].tobytes()).hexdigest() \
            if "weights" in found[0] else "-"
        log.warning("%s resumed from %s: round %d, iteration %d, state %s, model sha256 %s "
                    "(read in %.3f s)", name, path, role.round, role.iteration, role.state,
                    digest, time.perf_counter() - started)

    def observe(message: m.Message) -> None:
        if not due(message):
            return
        try:
            save_checkpoint(path, *role.snapshot())
        except OSError as exc:  # a full disk must not hold back the round's message
            role.counters["errors.checkpoint"] += 1
            log.error("%s could not write its checkpoint %s: %s", name, path, exc)
    return [observe]


class _MetricsLog:
    """``metrics.csv``, one row appended and flushed per round; a restart appends."""

    def __init__(self, folder: str) -> None:
        self.path = Path(folder) / "metrics.csv" if folder else None
        self.last_round = -1
        if self.path is not None and self.path.exists():
            with open(self.path, newline="") as fh:
                rounds = [int(r["round"]) for r in csv.DictReader(fh) if r.get("round")]
            self.last_round = max(rounds, default=-1)

    def append(self, row: dict[str, Any]) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        new = not self.path.exists() or self.path.stat().st_size == 0
        with open(self.path, "a", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=list(row))
            if new:
                writer.writeheader()
            writer.writerow(row)
        self.last_round = row["round"]


@dataclass
class StationService:
    station: StationConfig
    model: ModelConfig
    broker: BrokerConfig
    service: ServiceConfig = ServiceConfig()

    def run(self, stop: StopFlag | None = None) -> Station:
        trainer = model_trainer(self.model, lr=0.01)
        cfg = self.station
        role = station_role(cfg, num_params=trainer.num_params,
                            num_classes=self.model.num_classes,
                            rng=np.random.default_rng(cfg.seed))
        attach_heads(role, head_spec(self.model))  # before its checkpoint is read
        role.roster.drift.ready()  # river (0.8 s) before it serves, not at its first scores
        if cfg.central_dp_noise:
            keep_privacy_ledger(role.dp, self.service.state_dir)
        transport = role_transport(self.broker, fleet=cfg.fleet, role=m.Participant.STATION,
                                   participant=cfg.station_id, trainer=trainer,
                                   model=self.model)

        first_model: list[float] = []

        def note_start(message: m.Message) -> None:
            if not first_model and isinstance(message, m.StationModel):
                first_model.append(time.process_time())  # start-up CPU ends here

        def summary() -> StationSummary:
            drift = role.roster.drift
            return StationSummary(
                station=cfg.station_id, state=role.state, round=role.round,
                iteration=role.iteration, cpu_s=round(time.process_time(), 3),
                cpu_startup_s=round(first_model[0], 3) if first_model else None,
                devices=len(cfg.devices), online=role.roster.online, quorum=cfg.min_quorum,
                missing=tuple(role.roster.missing), **role.roster.accuracy_summary(),
                **role.privacy_summary(), **role.stragglers.reply_figures(),
                update_stages=role.admission.pipeline.id,
                counters=dict(role.counters), transport=dict(transport.counters),
                device_refused=dict(role.tally.refused), device_clipped=dict(role.tally.clipped),
                drifting=drift.shown(), devices_drifting=len(drift.drifting),
                drift_off=drift.off, error=runner.last_error)

        metrics = with_metrics(self.service, "station", lambda: (
            {**role.counters, **transport.counters},
            {"round": role.round, "iteration": role.iteration,
             "selected_devices": len(role.members), "devices_online": role.roster.online,
             "devices_drifting": len(role.roster.drift.drifting),
             **role.roster.accuracy_summary(), **role.privacy_summary(),
             **{k: v for k, v in role.stragglers.reply_figures().items() if v is not None}}),
            labels={"fleet": cfg.fleet, "station": cfg.station_id})
        # Round boundaries: the upload that ends a round, the model that begins one; and its
        # statistics sent upstream between them, so that a restart does not send them again.
        checkpoint = _checkpointing(role, self.service.state_dir, cfg.station_id, lambda msg: (
            isinstance(msg, (m.StationUpdate, m.HeadStats)) or isinstance(msg, m.StationModel)
            and msg.iteration % cfg.sync_period == 0))
        runner = RoleRunner(role, transport)
        runner.observers.extend([*checkpoint, note_start])
        with blas_threads(1):  # selection's linear algebra is small: threads only spin
            topic = summary_topic(cfg.fleet, m.Participant.STATION, cfg.station_id)
            serve(runner, transport, stop=StopFlag() if stop is None else stop,
                  done=lambda: role.state == StationState.DONE, metrics=metrics,
                  **summaries(transport, topic, summary))
        log.info("station %s finished: %s", cfg.station_id, summary())
        return role


def _manifests(transport: MqttTransport, broker: BrokerConfig,
               fleet: str) -> Callable[[m.Message], None]:
    """An observer that publishes each global model's manifest: chunked frames cannot be
    retained, so a late joiner learns the state from it."""
    def manifest(message: m.Message) -> None:
        if isinstance(message, m.GlobalModel):
            frame = encode(message, layout_hash=transport.layout_hash, fp16=broker.fp16,
                           wire_version=broker.wire_version)
            transport.publish_document(manifest_topic(fleet), ModelManifest(
                round=message.round, iteration=message.iteration, size=len(frame),
                final=message.final, layout=transport.layout_hash))
    return manifest


RELOAD_EVERY = 2.0  # s between looks at the cloud's file for products added or retired


def follow_file(role: Cloud, path: str, model: ModelConfig) -> Callable[[float], None]:
    """A serve hook: the cloud's catalogue is its file's ``[model] class_names`` and
    ``retired``, read again whenever the file changes (``safl provision`` rewrote it), and
    told to the fleet with the next round's model.  A file whose products move or rename a
    class, change anything else of ``[model]`` or do not parse is refused, at error level
    and counted (``catalogue.reload_refused``); the fleet keeps the products it has."""
    role.catalogue = Catalogue(model.num_classes, model.class_names, model.retired)
    seen = {"mtime": Path(path).stat().st_mtime_ns if path else 0, "next": 0.0}

    def hook(now: float) -> None:
        if not path or now < seen["next"]:
            return
        seen["next"] = now + RELOAD_EVERY
        try:
            mtime = Path(path).stat().st_mtime_ns
            if mtime == seen["mtime"]:
                return
            seen["mtime"] = mtime
            new = load_config(ModelConfig, "model", path)
            if dataclasses.replace(new, class_names=(), retired=()) != \
                    dataclasses.replace(model, class_names=(), retired=()):
                raise ConfigError("model", "changed beyond class_names and retired: restart "
                                  "the fleet for that")
            role.catalogue.check_extends(new.class_names)
        except (OSError, ConfigError, MessageError) as exc:
            role.counters["catalogue.reload_refused"] += 1
            log.error("cloud: %s not followed (catalogue.reload_refused): %s", path, exc)
            return
        old = role.catalogue
        role.catalogue = Catalogue(model.num_classes, new.class_names, new.retired)
        if (old.names, old.retired) != (new.class_names, frozenset(new.retired)):
            role.counters["catalogue.reloaded"] += 1
            log.info("cloud: products now %s%s (from round %d)", ", ".join(new.class_names),
                     f"; retired {', '.join(new.retired)}" if new.retired else "",
                     role.round + 1)
    return hook


def evaluation_set(path: str, model: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """The cloud's ``--eval`` set, checked at start-up against what the model takes, so that
    a wrong one stops the cloud naming it, instead of failing every round's evaluation.

    It may hold what the federated model takes (a body fleet's embeddings), or frames of
    ``[model] input_shape``: with a body the cloud embeds them once, here, as devices embed
    theirs at ingest.  A sample of the right size is reshaped, as a device's replay reshapes
    its own (28x28 images for a (1, 28, 28) CNN).  A folder holds photos, one
    sub-folder per class (``0/``, ``1/``, ...), read as a provisioned camera device reads its
    frames (``role_files.camera_preprocess``)."""
    x, y = (_photos(path, model) if Path(path).is_dir()
            else load_arrays(path, num_classes=model.num_classes))
    takes, frames = head_input_shape(model), tuple(model.input_shape)
    for shape in dict.fromkeys((takes, frames)):
        if x.shape[1:] != shape and x[0].size == int(np.prod(shape)):
            x = x.reshape(len(x), *shape)
        if x.shape[1:] != shape:
            continue
        if shape != takes:
            body = open_body(model)
            assert body is not None  # frames differ from what the model takes: a body
            began = time.perf_counter()
            x = body.embed(x)
            log.info("cloud: embedded the %d evaluation frames of %s with body %s in %.1f s",
                     len(x), path, body.manifest.name, time.perf_counter() - began)
        return x, y
    what = (f"frames of {frames} (embedded by the body {model.body}) or embeddings of "
            f"{takes}" if takes != frames else f"samples of {frames}")
    raise ConfigError("eval", f"{path} holds samples of shape {x.shape[1:]}; the model takes "
                      f"{what}: export the evaluation set as the devices' cameras deliver "
                      "frames ([model] input_shape), or give another --eval")


def _photos(folder: str, model: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    shape = tuple(model.input_shape)
    # Read as a provisioned camera device of this model reads its frames.
    settings = camera_preprocess(shape, model.body)
    preprocess = Preprocess(sample_shape=shape, grayscale=settings["grayscale"],
                            resize=tuple(settings["resize"]), rgb=settings.get("rgb", False))
    try:
        # Sub-folders are class numbers: the cloud has no class names to map others by.
        source = ImageFolderSource(folder, preprocess, num_classes=model.num_classes,
                                   rng=np.random.default_rng(0),
                                   classes=[str(k) for k in range(model.num_classes)])
        pairs = list(source.samples())
    except SourceError as exc:
        raise ConfigError("eval", str(exc)) from exc
    if not pairs:
        raise ConfigError("eval", f"no photo under {folder} could be read as {shape}")
    return np.stack([p[0] for p in pairs]), np.array([p[1] for p in pairs])


@dataclass
class CloudService:
    cloud: CloudConfig
    model: ModelConfig
    broker: BrokerConfig
    service: ServiceConfig = ServiceConfig()
    eval_path: str = ""
    out: str = ""
    config_path: str = ""  # its file, followed for products added and retired

    def run(self, stop: StopFlag | None = None) -> tuple[Cloud, list[dict[str, Any]]]:
        trainer = model_trainer(self.model, lr=0.01)
        cfg = self.cloud
        role = Cloud(cfg, initial_weights=trainer.get_flat(), num_classes=self.model.num_classes)
        attach_heads(role, head_spec(self.model))
        catalogue = follow_file(role, self.config_path, self.model)
        if cfg.central_dp_noise:
            keep_privacy_ledger(role.dp, self.service.state_dir)
        transport = role_transport(self.broker, fleet=cfg.fleet, role=m.Participant.CLOUD,
                                   participant=CLOUD_ID, trainer=trainer,
                                   model=self.model, client_id=f"{cfg.fleet}-cloud")
        rows: list[dict[str, Any]] = []
        log_rows = _MetricsLog(self.out)
        checkpoint = _checkpointing(role, self.service.state_dir, "cloud",
                                    lambda msg: isinstance(msg, m.GlobalModel))
        test = evaluation_set(self.eval_path, self.model) if self.eval_path else None
        started = time.perf_counter()

        def evaluate(message: m.Message) -> None:
            if not isinstance(message, m.GlobalModel) or message.round <= log_rows.last_round:
                return  # a model repeated after a restart was scored before it
            row = {"round": message.round, "iteration": message.iteration,
                   "wall_s": round(time.perf_counter() - started, 3)}
            if test is not None:
                trainer.set_flat(message.weights)
                row["loss"], row["accuracy"] = trainer.evaluate(*test)
                log.info("round %d: accuracy %.4f", message.round, row["accuracy"])
            rows.append(row)
            log_rows.append(row)

        def summary() -> CloudSummary:
            scored = [r for r in rows[-ACCURACY_HISTORY:] if "accuracy" in r]
            return CloudSummary(state=role.state, round=role.round, iteration=role.iteration,
                                stations=tuple(cfg.stations), offline=tuple(sorted(role.offline)),
                                accuracy=rows[-1].get("accuracy") if rows else None,
                                accuracy_rounds=tuple(r["round"] for r in scored),
                                accuracies=tuple(float(r["accuracy"]) for r in scored),
                                **role.accuracy_summary(), **role.privacy_summary(),
                                **role.catalogue_summary(), counters=dict(role.counters),
                                transport=dict(transport.counters), error=runner.last_error)

        metrics = with_metrics(self.service, "cloud", lambda: (
            {**role.counters, **transport.counters},
            {"round": role.round, "iteration": role.iteration,
             "last_accuracy": rows[-1].get("accuracy") if rows else None,
             **role.privacy_summary()}),
            labels={"fleet": cfg.fleet})
        runner = RoleRunner(role, transport)
        runner.observers.extend([*checkpoint, evaluate,
                                 _manifests(transport, self.broker, cfg.fleet)])
        published = summaries(transport, summary_topic(cfg.fleet, m.Participant.CLOUD,
                                                       CLOUD_ID), summary)
        serve(runner, transport, stop=StopFlag() if stop is None else stop,
              done=lambda: role.state == CloudState.DONE, linger=1.0, metrics=metrics,
              hooks=(catalogue, *published["hooks"]), on_stop=published["on_stop"])
        if self.out:
            out = Path(self.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / "cloud.json").write_bytes(encode_document(summary()) + b"\n")
        return role, rows
