"""A device's deployable model as a plain ONNX file, for the line's own application.

Each backend renders its model with given weights as an ONNX graph (``inference_onnx``):
the numpy backend builds it with ``onnx.helper``, torch exports its module, ORT fills the
artifacts' inference graph.  This module adds what a consumer needs to use the file without
safl (the input shape, the class count, the model round and layout in its metadata) and
writes it.  Plain ``onnxruntime``, which has aarch64 wheels, runs the result.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import ArtifactError
from ..files import write_atomic
from .base import Trainer
from .manifest import layout_hash

__all__ = ["export_onnx", "OPSET"]

OPSET = 17  # ONNX Runtime 1.19 (training) and every plain onnxruntime since read it


def export_onnx(trainer: Trainer, weights: np.ndarray, out: str | Path, *,
                input_shape: tuple[int, ...], num_classes: int, model_round: int,
                model_name: str = "") -> Path:
    """Write ``weights`` as ``trainer``'s model to ``out`` (atomically) and return it."""
    try:
        import onnx
    except ImportError as exc:
        raise ArtifactError("exporting needs the onnx package: pip install "
                            "'safl-edge[export]'") from exc
    render = getattr(trainer, "inference_onnx", None)
    if render is None:
        raise ArtifactError(f"{type(trainer).__name__} cannot render its model as ONNX")
    model = onnx.load_from_string(render(np.asarray(weights, dtype=np.float32)))
    meta = {"safl.input_shape": ",".join(map(str, input_shape)),
            "safl.num_classes": str(num_classes), "safl.model_round": str(model_round),
            "safl.layout": layout_hash(trainer.layout), "safl.model": model_name,
            "safl.output": "logits (softmax them for confidences)"}
    del model.metadata_props[:]
    for key, value in meta.items():
        model.metadata_props.add(key=key, value=value)
    out = Path(out)
    write_atomic(out, model.SerializeToString())
    return out
