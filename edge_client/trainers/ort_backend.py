"""ONNX Runtime training backend: trains from exported artifacts, never imports torch.

``import onnxruntime`` pulls in ``onnxruntime.training``, whose ``__init__`` loads
torch (through ``optim`` and ``ortmodule``).  :func:`load_training_api` registers a
bare ``onnxruntime.training`` package whose ``__path__`` is the installed folder
and hides ``ortmodule``, so ``api`` and ``artifacts`` load without torch
(measured: 0.06 s instead of 1.9 s, SPEC §6).  A body's inference imports ONNX Runtime
the same way (``body.py``), whichever build is installed.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ArtifactError, ShapeError
from .base import check_flat
from .manifest import Manifest

__all__ = ["OrtTrainer", "import_onnxruntime", "load_training_api", "build"]

EVAL_CHUNK = 512  # samples per eval run: bounds memory on large test sets


def import_onnxruntime(training: bool = True) -> types.ModuleType:
    """Import ``onnxruntime`` without letting it import torch, whichever build is installed:
    the training build's own ``import onnxruntime`` imports torch wherever torch is
    (microsoft/onnxruntime#22070), plain onnxruntime never does.  ``training``: the caller
    needs the training build (its ``api``); a body's inference takes either."""
    if "onnxruntime.training" not in sys.modules:
        spec = importlib.util.find_spec("onnxruntime")
        if spec is None or spec.origin is None:
            raise ArtifactError("onnxruntime-training is not installed: "
                                "pip install 'safl-edge[ort]'" if training else
                                "a body on ONNX Runtime needs onnxruntime: pip install "
                                "'safl-edge[body]'")
        folder = Path(spec.origin).parent / "training"
        if folder.is_dir():
            package = types.ModuleType("onnxruntime.training")
            package.__path__ = [str(folder)]
            sys.modules["onnxruntime.training"] = package
            # Its import needs torch: a None entry makes importing it fail fast instead.
            sys.modules.setdefault("onnxruntime.training.ortmodule",
                                   None)  # type: ignore[arg-type]
        elif training:
            raise ArtifactError(f"{spec.origin} is plain onnxruntime, not onnxruntime-training; "
                                "installing both overwrites the training build (SPEC §6)")
    import onnxruntime

    onnxruntime.set_default_logger_severity(3)
    return onnxruntime


def load_training_api() -> types.ModuleType:
    """Import ``onnxruntime.training.api`` without importing torch."""
    import_onnxruntime()
    from onnxruntime.training import api

    return api


class OrtTrainer:
    """Trainer over ONNX Runtime training artifacts (training, eval, optimizer, checkpoint).

    Parameters
    ----------
    folder : path
        Output of ``safl models export``: the artifacts and ``manifest.json``.
    lr : float
        Learning rate given to the exported optimizer.
    expected_layout_hash : str, optional
        The federation's layout hash; artifacts with another layout are refused.
    """

    def __init__(self, folder: str | Path, *, lr: float,
                 expected_layout_hash: str | None = None) -> None:
        self.folder = folder = Path(folder)
        self.manifest = Manifest.read(folder)
        if expected_layout_hash and self.manifest.layout_hash != expected_layout_hash:
            raise ArtifactError(f"artifacts in {folder} have layout {self.manifest.layout_hash}, "
                                f"the federation uses {expected_layout_hash}: re-export the "
                                "federation's model")
        paths = {}
        for key in ("training", "eval", "optimizer", "checkpoint"):
            paths[key] = folder / self.manifest.files.get(key, "")
            if key not in self.manifest.files or not paths[key].exists():
                raise ArtifactError(f"{folder} lacks the {key} artifact "
                                    f"({self.manifest.files.get(key, 'unnamed')})")
        api = load_training_api()
        self._ortvalue = sys.modules["onnxruntime"].OrtValue
        try:
            self._state = api.CheckpointState.load_checkpoint(str(paths["checkpoint"]))
            self._module = api.Module(str(paths["training"]), self._state, str(paths["eval"]))
            self._optimizer = api.Optimizer(str(paths["optimizer"]), self._module)
        except Exception as exc:  # ORT raises its own pybind exceptions for corrupt files
            raise ArtifactError(f"cannot load the artifacts in {folder}: {exc}") from exc
        size = self._module.get_parameters_size(True)
        if size != self.manifest.num_params:
            raise ArtifactError(f"{folder}: checkpoint holds {size} parameters, manifest says "
                                f"{self.manifest.num_params}")
        self.layout = self.manifest.layout
        self.input_shape = self.manifest.input_shape
        self.lr = lr

    @property
    def lr(self) -> float:
        return self._lr

    @lr.setter
    def lr(self, value: float) -> None:
        self._lr = float(value)
        self._optimizer.set_learning_rate(self._lr)

    @property
    def num_params(self) -> int:
        return self.manifest.num_params

    def get_flat(self) -> np.ndarray:
        return self._module.get_contiguous_parameters(True).numpy().copy()

    def set_flat(self, flat: np.ndarray) -> None:
        flat = np.ascontiguousarray(check_flat(flat, self.num_params))
        # The api wrapper hands the buffer straight to C++, which wants the bare OrtValue.
        self._module.copy_buffer_to_parameters(
            self._ortvalue.ortvalue_from_numpy(flat)._ortvalue, True)

    def _inputs(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float32)
        if len(x) and x[0].size != np.prod(self.input_shape):
            raise ShapeError(f"input samples have {x[0].size} values, model expects shape "
                             f"{self.input_shape}")
        return np.ascontiguousarray(x.reshape(len(x), *self.input_shape))

    def train_step(self, x: np.ndarray, y: np.ndarray) -> float:
        self._module.train()
        loss, _ = self._module(self._inputs(x), np.asarray(y, dtype=np.int64))
        self._optimizer.step()
        self._module.lazy_reset_grad()
        return float(loss)

    def _eval_chunks(self, x: np.ndarray, y: np.ndarray) -> Iterator[Any]:
        self._module.eval()
        for i in range(0, len(x), EVAL_CHUNK):
            yield self._module(self._inputs(x[i:i + EVAL_CHUNK]),
                               np.asarray(y[i:i + EVAL_CHUNK], dtype=np.int64))

    @contextlib.contextmanager
    def _lent(self, weights: np.ndarray | None) -> Iterator[None]:
        """An ORT session runs the parameters it holds: lend it ``weights``, then restore."""
        if weights is None:
            yield
            return
        own = self.get_flat()
        self.set_flat(weights)
        try:
            yield
        finally:
            self.set_flat(own)

    def logits(self, x: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
        dummy = np.zeros(len(x), dtype=np.int64)  # the eval graph still takes labels
        with self._lent(weights):
            return np.concatenate([out[1] for out in self._eval_chunks(x, dummy)])

    def evaluate(self, x: np.ndarray, y: np.ndarray,
                 weights: np.ndarray | None = None) -> tuple[float, float]:
        if weights is not None:
            with self._lent(weights):
                return self.evaluate(x, y)
        y = np.asarray(y)
        if len(y) == 0:
            return float("nan"), float("nan")
        loss_sum, correct = 0.0, 0
        for i, (loss, logits) in enumerate(self._eval_chunks(x, y)):
            part = y[i * EVAL_CHUNK:(i + 1) * EVAL_CHUNK]
            loss_sum += float(loss) * len(part)
            correct += int((logits.argmax(axis=1) == part).sum())
        return loss_sum / len(y), correct / len(y)


    def inference_onnx(self, weights: np.ndarray) -> bytes:
        """The artifacts' inference graph with ``weights`` in its initializers, which are
        named as the layout (``trainers/onnx_export.py``)."""
        import onnx
        from onnx import numpy_helper

        path = self.folder / self.manifest.files.get("inference", "")
        if "inference" not in self.manifest.files or not path.exists():
            raise ArtifactError(f"{self.folder} has no inference graph to export; re-export "
                                "the model with this version of safl")
        model = onnx.load(str(path))
        flat, offset = check_flat(weights, self.num_params), 0
        by_name = {t.name: t for t in model.graph.initializer}
        for name, shape in self.layout:
            size = int(np.prod(shape))
            if name not in by_name:
                raise ArtifactError(f"{path} has no initializer {name!r} of the layout")
            by_name[name].CopyFrom(numpy_helper.from_array(
                flat[offset:offset + size].reshape(shape), name))
            offset += size
        return model.SerializeToString()


def build(model: str, *, artifacts: str | Path, lr: float,
          expected_layout_hash: str | None = None) -> OrtTrainer:
    trainer = OrtTrainer(artifacts, lr=lr, expected_layout_hash=expected_layout_hash)
    if model and trainer.manifest.model != model:
        raise ArtifactError(f"artifacts in {artifacts} are for {trainer.manifest.model!r}, "
                            f"not {model!r}")
    return trainer
