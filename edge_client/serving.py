"""The device's stream loop: every sample a source delivers is predicted by the deployable
model, published for the line, scored prequentially and, once labelled, trained on.  With a
frozen body (``body.py``) each frame is embedded once, as it is drained: the head predicts
from that embedding, and the embedding is what is buffered, parked for a label and trained on.

:class:`StreamFeed` is the device service's hook.  Each loop turn it drains the source's
pump; predicts the frames ``[inference]`` allows (``fps``, ``every``) in one batched
forward pass, at most ``max_batch`` of the newest and as many as its ``budget`` pays for
(``inference.py``), the rest of a backlog skipped and counted (``inference_skipped``,
``inference.over_budget``) so that inference never holds training up and never
drops a frame training would take; hands labelled samples to the device with their
predictions, and parks unlabelled ones with :class:`~edge_client.sources.LiveLabels` until
the line's label arrives (:meth:`on_label`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from . import messages as m
from .body import Body
from .codec import decode, encode
from .config import InferenceConfig
from .device import Device
from .documents import Prediction, encode_document
from .errors import ConfigError, MessageError
from .files import write_atomic
from .inference import NOT_PREDICTED, one_in
from .sources.live_labels import LiveLabels
from .sources.pump import UNLABELLED, Drained, SourcePump

__all__ = ["StreamFeed", "DeployableKeeper", "save_deployable", "load_deployable",
           "resume_deployable", "roll_back", "DEPLOYABLE_FILE", "PREVIOUS_FILE", "SAVE_EVERY"]

log = logging.getLogger(__name__)

DEPLOYABLE_FILE = "deployable.frame"  # in the device's state directory
PREVIOUS_FILE = "deployable.previous.frame"  # the one it replaced: what a rollback restores
SAVE_EVERY = 5.0  # seconds between writes of the deployable model (an SD card wears)


class StreamFeed:
    """Moves what the pump holds through inference into the device (see the module)."""

    def __init__(self, device: Device, pump: SourcePump, *, inference: InferenceConfig,
                 labels: LiveLabels | None = None,
                 publish: Callable[[Prediction], None] | None = None,
                 max_samples: int = 256, body: Body | None = None) -> None:
        self.device, self.pump, self.inference, self.labels = device, pump, inference, labels
        self.body = body
        self.publish, self.max_samples = publish, max_samples
        self.counters = device.counters  # one set of metrics per device
        self._next_t = 0.0  # earliest capture time the fps cap lets through
        self.last_prediction: float | None = None  # unix time of the last one made
        self._arrivals = 0
        self._jsonl = None
        if inference.enabled and inference.jsonl:
            try:
                self._jsonl = open(inference.jsonl, "a", buffering=1)  # noqa: SIM115
            except OSError as exc:
                raise ConfigError("jsonl", f"cannot append to {inference.jsonl}: "
                                  f"{exc.strerror}") from exc

    def __call__(self, now: float) -> list[m.Message]:
        """One loop turn; returns the messages the device wants published.  A dead source
        raises once what it queued has been drained (``SourcePump.check``)."""
        if self.labels is not None:
            self.labels.expire()
        batch = self.pump.drain(self.max_samples)
        if batch is None:
            self.pump.check()
            return []
        if self.body is not None:  # once per frame: the prediction and the sample share it
            batch = batch._replace(x=self.body.embed(batch.x))
        predicted = self._infer(batch)
        labelled = batch.y != UNLABELLED
        out: list[m.Message] = []
        if labelled.any():
            out += self.device.ingest(batch.x[labelled], batch.y[labelled], now,
                                      predicted=predicted[labelled])
        if not labelled.all():
            if self.labels is None:  # a source that defers labels without a label topic
                self.counters["unlabelled_dropped"] += int((~labelled).sum())
            else:
                out += self._train(self.labels.add_frames(
                    batch.x[~labelled], batch.times[~labelled], predicted[~labelled]), now)
        return out

    def on_label(self, payload: bytes, now: float) -> list[m.Message]:
        """A label message from the line: train on the frame it labels, once read."""
        return self._train(self.labels.add_label(payload), now) if self.labels else []

    def _train(self, joined: list[tuple[np.ndarray, int, int]], now: float) -> list[m.Message]:
        held = self.device.products.held
        if held is not None and any(label < 0 for _, label, _ in joined):
            # Frames of products to come (catalogue.py): held, unless added meanwhile.
            to_come = [(x, label) for x, label, _ in joined if label < 0]
            ready, classes = held.hold([x for x, _ in to_come], [c for _, c in to_come])
            joined = [j for j in joined if j[1] >= 0] + [
                (x, c, NOT_PREDICTED) for x, c in zip(ready, classes, strict=True)]
        if not joined:
            return []
        samples, labels, predicted = zip(*joined, strict=True)
        return self.device.ingest(np.stack(samples), np.array(labels), now,
                                  predicted=np.array(predicted))

    def _chosen(self, batch: Drained) -> np.ndarray:
        """Indices of the frames to predict: ``every`` and ``fps``, then the backlog bound."""
        cfg = self.inference
        chosen = one_in(cfg.every, self._arrivals, len(batch.y))
        self._arrivals += len(batch.y)
        if cfg.fps:
            kept = []
            for i in chosen:
                if batch.times[i] >= self._next_t:
                    kept.append(i)
                    self._next_t = batch.times[i] + 1.0 / cfg.fps
            chosen = np.array(kept, dtype=np.int64)
        if len(chosen) > cfg.max_batch:
            self.counters["inference_skipped"] += len(chosen) - cfg.max_batch
            chosen = chosen[-cfg.max_batch:]  # the newest: what is in front of the camera
        return self.device.line.within_budget(chosen)

    def _infer(self, batch: Drained) -> np.ndarray:
        predicted = np.full(len(batch.y), NOT_PREDICTED, dtype=np.int64)
        if not self.inference.enabled:
            return predicted
        chosen = self._chosen(batch)
        if not len(chosen):
            return predicted
        out = self.device.line.infer(batch.x[chosen])
        if out is None:
            return predicted
        labels, confidence = out
        predicted[chosen] = labels
        scores, unknown = self._novelty(batch.x[chosen])
        done = self.last_prediction = time.time()
        lag = self.labels.lag if self.labels is not None else 0.0
        catalogue = self.device.products.catalogue
        for j, (i, label, conf) in enumerate(zip(chosen, labels, confidence, strict=True)):
            doc = Prediction(t=float(batch.times[i]), frame=int(batch.frames[i]),
                             label=int(label), confidence=round(float(conf), 6),
                             model_round=self.device.line.deployable_round,
                             latency_ms=round(max(0.0, done - batch.times[i]) * 1000, 3),
                             item_t=float(batch.times[i]) - lag,
                             product=catalogue.name(int(label)),
                             novelty=None if scores is None else round(float(scores[j]), 4),
                             unknown=None if unknown is None else bool(unknown[j]))
            if self.inference.publish and self.publish is not None:
                self.publish(doc)
            if self._jsonl is not None:
                self._jsonl.write(encode_document(doc, bare=True).decode() + "\n")
        return predicted

    def _novelty(self, x: np.ndarray) -> tuple[np.ndarray | None, np.ndarray | None]:
        """The predicted frames' unknown-part scores and flags, where the fleet's detector
        has come (and its threshold: flags)."""
        head = self.device.head
        if head is None or head.novelty is None:
            return None, None
        judged = head.novelty.judge(head.rows(x))
        return (None, None) if judged is None else judged

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()


class DeployableKeeper:
    """A serve hook keeping the device's deployable model in its state directory (for
    ``safl-device export``): written when it changed, at most every ``SAVE_EVERY`` seconds,
    and by :meth:`save` at the end of a run."""

    def __init__(self, folder: str | Path, device: Device, layout_hash: str) -> None:
        self.folder, self.device, self.layout_hash = folder, device, layout_hash
        # Of the model on disk: a model resumed from there is on disk already.
        line = device.line
        self._iteration = line.deployable_iteration if line.deployable is not None else -1
        self._at = -SAVE_EVERY

    def __call__(self, now: float) -> None:
        if self.device.line.deployable_iteration != self._iteration and \
                now - self._at >= SAVE_EVERY:
            self.save(now)

    def save(self, now: float = 0.0) -> None:
        if save_deployable(self.folder, self.device, self.layout_hash,
                           on_disk=self._iteration) is not None:
            self._iteration, self._at = self.device.line.deployable_iteration, now


def save_deployable(folder: str | Path, device: Device, layout_hash: str,
                    on_disk: int | None = None) -> Path | None:
    """Write the device's deployable model to its state directory as one wire frame (the
    versioned, checksummed format models travel in), atomically; None before it has one.
    The model it replaces is kept beside it for a rollback; ``on_disk``, the iteration of
    the model there where the caller knows it, spares reading the file to tell."""
    if device.line.deployable is None:
        return None
    path = Path(folder) / DEPLOYABLE_FILE
    if path.exists():
        there = _frame_iteration(path) if on_disk is None else on_disk
        if there not in (None, -1, device.line.deployable_iteration):
            os.replace(path, Path(folder) / PREVIOUS_FILE)
    frame = encode(m.StationModel(fleet=device.config.fleet, sender=device.config.station,
                                  round=device.line.deployable_round,
                                  iteration=device.line.deployable_iteration,
                                  weights=device.line.deployable), layout_hash=layout_hash)
    write_atomic(path, frame)
    return path


def _frame_iteration(path: Path) -> int | None:
    try:
        return decode(path.read_bytes(), max_size=path.stat().st_size + 1).message.iteration
    except (OSError, MessageError):
        return None


def resume_deployable(folder: str | Path, device: Device, layout_hash: str) -> None:
    """Put the model a device was predicting with before a restart back into use, so that
    the first candidate after it is judged against it; a torn or foreign file is logged and
    counted (``errors.deployable``), and the device starts without one."""
    if not (Path(folder) / DEPLOYABLE_FILE).exists():
        return
    try:
        saved = load_deployable(folder, layout_hash=layout_hash)
    except ConfigError as exc:
        device.counters["errors.deployable"] += 1
        log.error("device %s: the deployable model it kept cannot be used: %s", device.id, exc)
        return
    device.line.restore(saved.round, saved.iteration, np.array(saved.weights))
    log.info("device %s: predicting with the model of round %d it kept", device.id, saved.round)


def roll_back(folder: str | Path, *, layout_hash: str) -> tuple[m.StationModel, m.StationModel]:
    """Swap the deployable model in ``folder`` with the one it replaced (so that a second
    rollback undoes the first); returns (now in use, set aside).  The device must be
    stopped: a running one keeps the model it holds and writes it back."""
    folder = Path(folder)
    current = load_deployable(folder, layout_hash=layout_hash)
    if not (folder / PREVIOUS_FILE).exists():
        raise ConfigError("state_dir", f"no earlier model in {folder} to roll back to: the "
                          "device has deployed one model only")
    previous = load_deployable(folder, layout_hash=layout_hash, name=PREVIOUS_FILE)
    # Killed at any point, no model is lost: the one in use is copied aside first.
    aside = folder / (PREVIOUS_FILE + ".swap")
    write_atomic(aside, (folder / DEPLOYABLE_FILE).read_bytes())
    write_atomic(folder / DEPLOYABLE_FILE, (folder / PREVIOUS_FILE).read_bytes())
    os.replace(aside, folder / PREVIOUS_FILE)
    return previous, current


def load_deployable(folder: str | Path, *, layout_hash: str,
                    name: str = DEPLOYABLE_FILE) -> m.StationModel:
    """The deployable model a device left in ``folder``; a missing, torn or foreign file is
    a :class:`ConfigError` on ``state_dir`` that says which."""
    path = Path(folder) / name
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError("state_dir", f"no deployable model at {path} ({exc.strerror}): has "
                          "this device received a model yet?") from exc
    try:
        frame = decode(data, max_size=len(data) + 1)
    except MessageError as exc:
        raise ConfigError("state_dir", f"{path} is not a model frame: {exc}") from exc
    if frame.layout_hash != layout_hash or not isinstance(frame.message, m.StationModel):
        raise ConfigError("state_dir", f"{path} holds a model of layout {frame.layout_hash}, "
                          f"the configured model has {layout_hash}")
    return frame.message
