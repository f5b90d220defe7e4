"""``safl models export``: zoo model -> ONNX Runtime training artifacts + manifest.

Writes ``training_model.onnx``, ``eval_model.onnx``, ``optimizer_model.onnx``,
``checkpoint``, an inference model ``inference.onnx`` (logits only) and
``manifest.json``.  Export needs torch and onnx; training from the result does not.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

import onnx
import torch

from edge_client.errors import ArtifactError, ConfigError
from edge_client.trainers.manifest import Manifest
from edge_client.trainers.ort_backend import load_training_api
from edge_client.trainers.torch_backend import input_shape_of, module_to_onnx
from edge_client.trainers.zoo import DEFAULT_INPUT, build_module

__all__ = ["export_model", "export_onnx", "OPTIMIZERS"]

log = logging.getLogger(__name__)

OPTIMIZERS = ("sgd", "adamw")
FILES = {"training": "training_model.onnx", "eval": "eval_model.onnx",
         "optimizer": "optimizer_model.onnx", "checkpoint": "checkpoint",
         "inference": "inference.onnx"}


def _to_onnx(module: torch.nn.Module, *, training: bool) -> onnx.ModelProto:
    return onnx.load_from_string(module_to_onnx(module, training=training))


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


def _artifacts(model: onnx.ModelProto, requires_grad: list[str], out: Path,
               optimizer: str) -> None:
    """ONNX Runtime's training, eval and optimizer models and checkpoint for ``model``,
    whose first output is the logits."""
    load_training_api()  # registers onnxruntime.training without its torch-only parts
    from onnxruntime.training import artifacts

    with _native_logs_quiet():
        artifacts.generate_artifacts(
            model, requires_grad=requires_grad, frozen_params=[],
            loss=artifacts.LossType.CrossEntropyLoss,
            optimizer=artifacts.OptimType.SGD if optimizer == "sgd"
            else artifacts.OptimType.AdamW,
            artifact_directory=str(out), additional_output_names=[model.graph.output[0].name])


def _prepare(out: str | Path, optimizer: str, force: bool) -> Path:
    if optimizer not in OPTIMIZERS:
        raise ConfigError("optimizer", f"must be one of {OPTIMIZERS}, got {optimizer!r}")
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not force:
        raise ArtifactError(f"{out} is not empty; pass --force to overwrite it")
    out.mkdir(parents=True, exist_ok=True)  # generate_artifacts needs the folder to exist
    return out


def export_onnx(path: str | Path, out: str | Path, *, optimizer: str = "sgd",
                input_shape: tuple[int, ...] | None = None, force: bool = False) -> Manifest:
    """Training artifacts for a user's ONNX classifier (no torch module needed).

    Every float initializer is trained, in the file's order: that order is the model's flat
    layout, so all devices of such a fleet train from these same artifacts (ORT only).  The
    graph takes one float input (batch first) and its first output are the logits.
    """
    try:
        model = onnx.load(str(path))
    except Exception as exc:  # a missing file, or bytes protobuf cannot parse
        raise ArtifactError(f"cannot read ONNX model {path}: {exc}") from exc
    if model.ir_version > 10:
        raise ArtifactError(f"{path} has IR version {model.ir_version}; ONNX Runtime training "
                            "1.19 reads up to 10: export with onnx < 1.18 or opset <= 21")
    graph = model.graph
    inputs = [i for i in graph.input if i.name not in {t.name for t in graph.initializer}]
    dims = [d.dim_value for d in inputs[0].type.tensor_type.shape.dim][1:] if inputs else []
    shape = tuple(input_shape) if input_shape else tuple(dims)
    if not shape or min(shape) < 1:
        raise ConfigError("input-shape", f"{path} has no static sample shape ({dims}); pass "
                          "--input-shape")
    out_dims = [d.dim_value for d in graph.output[0].type.tensor_type.shape.dim]
    if len(out_dims) != 2 or out_dims[1] < 2:
        raise ArtifactError(f"{path}'s first output must be (batch, classes) logits, got "
                            f"{out_dims}")
    floats = [t for t in graph.initializer if t.data_type == onnx.TensorProto.FLOAT]
    if not floats:
        raise ArtifactError(f"{path} has no float initializers to train")
    out = _prepare(out, optimizer, force)
    shutil.copyfile(path, out / FILES["inference"])
    _artifacts(model, [t.name for t in floats], out, optimizer)
    manifest = Manifest(model=Path(path).stem, input_shape=shape, num_classes=out_dims[1],
                        layout=tuple((t.name, tuple(t.dims)) for t in floats),
                        optimizer=optimizer, files=dict(FILES))
    manifest.write(out)
    return manifest


def export_model(name: str, out: str | Path, *, optimizer: str = "sgd", num_classes: int = 10,
                 input_shape: tuple[int, ...] | None = None, seed: int = 0,
                 force: bool = False) -> Manifest:
    """Export a registered model, or a user's ``"package.module:factory"``, to ``out``;
    returns the manifest written there."""
    if num_classes < 2:
        raise ConfigError("classes", f"must be >= 2, got {num_classes}")
    out = _prepare(out, optimizer, force)
    torch.manual_seed(seed)
    module = build_module(name, input_shape=input_shape or DEFAULT_INPUT.get(name, ()),
                          num_classes=num_classes)
    module.eval()
    names = [n for n, _ in module.named_parameters()]
    inference = _to_onnx(module, training=False)
    onnx.save(inference, str(out / FILES["inference"]))
    _artifacts(_to_onnx(module, training=True), names, out, optimizer)
    manifest = Manifest(model=name, input_shape=input_shape_of(module),
                        num_classes=num_classes,
                        layout=tuple((n, tuple(p.shape)) for n, p in module.named_parameters()),
                        optimizer=optimizer, files=dict(FILES))
    manifest.write(out)
    log.info("exported %s (%d parameters, layout %s) to %s", name, manifest.num_params,
             manifest.layout_hash, out)
    return manifest
