"""A device's deployable model as a plain ONNX file, for the line's own application.

Each backend renders its model with given weights as an ONNX graph (``inference_onnx``):
the numpy backend builds it with ``onnx.helper``, torch exports its module, ORT fills the
artifacts' inference graph.  This module adds what a consumer needs to use the file without
safl (the input shape, the class count, the model round and layout in its metadata) and
writes it.  Plain ``onnxruntime``, which has aarch64 wheels, runs the result.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..errors import ArtifactError
from ..files import write_atomic
from .base import Trainer
from .manifest import layout_hash

__all__ = ["export_onnx", "OPSET"]


class FrozenBody(Protocol):
    """What the export needs of a body's manifest (``edge_client/body.py``, which imports
    the trainers, so not imported here)."""

    @property
    def name(self) -> str: ...

    @property
    def hash(self) -> str: ...

    @property
    def graph(self) -> Path: ...

OPSET = 17  # ONNX Runtime 1.19 (training) and every plain onnxruntime since read it


def export_onnx(trainer: Trainer, weights: np.ndarray, out: str | Path, *,
                input_shape: tuple[int, ...], num_classes: int, model_round: int,
                model_name: str = "", body: FrozenBody | None = None) -> Path:
    """Write ``weights`` as ``trainer``'s model to ``out`` (atomically) and return it.  With a
    ``body`` the file is one graph, frames through the body into the head, so the line's
    application needs no safl and makes one call a frame (a trainer whose body's last blocks
    trained renders that graph itself)."""
    try:
        import onnx
    except ImportError as exc:
        raise ArtifactError("exporting needs the onnx package: pip install "
                            "'safl-edge[export]'") from exc
    render = getattr(trainer, "inference_onnx", None)
    if render is None:
        raise ArtifactError(f"{type(trainer).__name__} cannot render its model as ONNX")
    model = onnx.load_from_string(render(np.asarray(weights, dtype=np.float32)))
    if body is not None and not getattr(trainer, "renders_body", False):
        model = _body_then_head(onnx, body, model)
    meta = {"safl.input_shape": ",".join(map(str, input_shape)),
            "safl.num_classes": str(num_classes), "safl.model_round": str(model_round),
            "safl.layout": layout_hash(trainer.layout), "safl.model": model_name,
            "safl.output": "logits (softmax them for confidences)",
            **({"safl.body": f"{body.name} {body.hash}"} if body is not None else {})}
    del model.metadata_props[:]
    for key, value in meta.items():
        model.metadata_props.add(key=key, value=value)
    out = Path(out)
    write_atomic(out, model.SerializeToString())
    return out


def _body_then_head(onnx: Any, body: FrozenBody, head: Any) -> Any:
    """One graph: the body's ``embedding`` feeds the head's ``input``; the frames are the
    input, named ``input`` as a bare head's is."""
    from onnx import compose

    first = onnx.load(str(body.graph))
    body_out = first.graph.output[0].name
    head_in = head.graph.input[0].name
    opset = max(o.version for o in first.opset_import if o.domain in ("", "ai.onnx"))
    head = onnx.version_converter.convert_version(head, opset) if max(
        o.version for o in head.opset_import if o.domain in ("", "ai.onnx")) != opset else head
    head.ir_version = first.ir_version
    merged = compose.merge_models(first, head, io_map=[(body_out, head_in)],
                                  prefix2="head.")
    out = merged.graph.output[0]
    for node in merged.graph.node:  # the head's output keeps the name a bare head's has
        node.output[:] = [head.graph.output[0].name if o == out.name else o
                          for o in node.output]
    out.name = head.graph.output[0].name
    onnx.checker.check_model(merged)
    return merged
