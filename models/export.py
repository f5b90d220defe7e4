"""``safl models export``: zoo model -> ONNX Runtime training artifacts + manifest.

Writes ``training_model.onnx``, ``eval_model.onnx``, ``optimizer_model.onnx``,
``checkpoint``, an inference model ``inference.onnx`` (logits only) and
``manifest.json``.  Export needs torch and onnx; training from the result does not.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import tempfile
import warnings
from pathlib import Path

import onnx
import torch

from edge_client.errors import ArtifactError, ConfigError
from edge_client.trainers.manifest import Manifest
from edge_client.trainers.ort_backend import load_training_api

from .zoo import DEFAULT_INPUT, build_module

__all__ = ["export_model", "OPTIMIZERS"]

log = logging.getLogger(__name__)

OPTIMIZERS = ("sgd", "adamw")
OPSET = 17
FILES = {"training": "training_model.onnx", "eval": "eval_model.onnx",
         "optimizer": "optimizer_model.onnx", "checkpoint": "checkpoint",
         "inference": "inference.onnx"}


def _to_onnx(module: torch.nn.Module, *, training: bool) -> onnx.ModelProto:
    dummy = torch.zeros(2, *module.input_shape)
    buf = io.BytesIO()
    mode = torch.onnx.TrainingMode.TRAINING if training else torch.onnx.TrainingMode.EVAL
    # The TorchScript exporter keeps parameter names as initializer names, which the
    # artifacts and the manifest's layout rely on.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the legacy exporter is deliberate
        torch.onnx.export(module, (dummy,), buf, input_names=["input"], output_names=["logits"],
                          dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}},
                          opset_version=OPSET, dynamo=False, training=mode,
                          do_constant_folding=not training, export_params=True)
    return onnx.load_from_string(buf.getvalue())


@contextlib.contextmanager
def _native_logs_quiet():
    """Hold back what ONNX Runtime's C++ side writes to stderr (some 20 INFO lines an export,
    whatever its Python logger level) unless logging is at DEBUG; shown if the export fails."""
    if logging.getLogger().isEnabledFor(logging.DEBUG):
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        except BaseException:
            os.dup2(saved, 2)
            held.seek(0)
            sys.stderr.write(held.read().decode(errors="replace"))
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def export_model(name: str, out: str | Path, *, optimizer: str = "sgd", num_classes: int = 10,
                 input_shape: tuple[int, ...] | None = None, seed: int = 0,
                 force: bool = False) -> Manifest:
    """Export zoo model ``name`` to ``out``; returns the manifest written there."""
    if optimizer not in OPTIMIZERS:
        raise ConfigError("optimizer", f"must be one of {OPTIMIZERS}, got {optimizer!r}")
    if num_classes < 2:
        raise ConfigError("classes", f"must be >= 2, got {num_classes}")
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not force:
        raise ArtifactError(f"{out} is not empty; pass --force to overwrite it")
    out.mkdir(parents=True, exist_ok=True)  # generate_artifacts needs the folder to exist
    torch.manual_seed(seed)
    module = build_module(name, input_shape=input_shape or DEFAULT_INPUT.get(name, ()),
                          num_classes=num_classes)
    module.eval()
    names = [n for n, _ in module.named_parameters()]
    load_training_api()  # registers onnxruntime.training without its torch-only parts
    from onnxruntime.training import artifacts

    inference = _to_onnx(module, training=False)
    onnx.save(inference, str(out / FILES["inference"]))
    with _native_logs_quiet():
        artifacts.generate_artifacts(
            _to_onnx(module, training=True), requires_grad=names, frozen_params=[],
            loss=artifacts.LossType.CrossEntropyLoss,
            optimizer=artifacts.OptimType.SGD if optimizer == "sgd"
            else artifacts.OptimType.AdamW,
            artifact_directory=str(out), additional_output_names=["logits"])
    manifest = Manifest(model=name, input_shape=tuple(module.input_shape),
                        num_classes=num_classes,
                        layout=tuple((n, tuple(p.shape)) for n, p in module.named_parameters()),
                        optimizer=optimizer, files=dict(FILES))
    manifest.write(out)
    log.info("exported %s (%d parameters, layout %s) to %s", name, manifest.num_params,
             manifest.layout_hash, out)
    return manifest
