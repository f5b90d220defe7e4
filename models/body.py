"""``safl models export-body``: a frozen body as an ONNX inference graph and its manifest.

The body (``edge_client/trainers/bodies.py``, or a user's ``package.module:factory``) is
exported with the TorchScript exporter, then checked against torch, in eval mode, on real
frames the caller passes (Fashion-MNIST as a camera sees it, scikit-learn's photos): the
exporter leaves a module it flipped to eval back in training mode, where BatchNorm would use
batch statistics, so the reference is always computed after ``eval()`` again.  A user's own
ONNX body is copied and probed through ONNX Runtime instead (there is no torch reference).
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import torch

from edge_client.body import (
    BODY_FILE,
    BODY_MANIFEST,
    PROBE_TOLERANCE,
    BodyManifest,
    embed_in_chunks,
    ort_forward,
    probe_frames,
)
from edge_client.errors import ArtifactError
from edge_client.files import write_atomic
from edge_client.trainers.bodies import build_body_module
from edge_client.trainers.torch_backend import module_to_onnx

__all__ = ["export_body", "relative_error"]

log = logging.getLogger(__name__)


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    """Worst frame's largest absolute difference over its embedding's largest magnitude."""
    scale = np.maximum(np.abs(want).max(axis=1), 1e-12)
    return float((np.abs(got - want).max(axis=1) / scale).max())


def _ort_embed(path: Path, frames: np.ndarray) -> np.ndarray:
    return embed_in_chunks(ort_forward(path), frames)


def _torch_embed(module: torch.nn.Module, frames: np.ndarray) -> np.ndarray:
    module.eval()  # the exporter may have left it in training mode
    with torch.no_grad():
        return embed_in_chunks(lambda x: module(torch.from_numpy(x)).numpy(), frames)


def _onnx_input_shape(path: Path) -> tuple[int, int, int]:
    graph = onnx.load(str(path), load_external_data=False).graph
    dims = [d.dim_value for d in graph.input[0].type.tensor_type.shape.dim][1:]
    if len(dims) != 3 or min(dims) < 1:
        raise ArtifactError(f"{path}: a body's input must be (batch, C, H, W) with fixed C, H "
                            f"and W, got {dims}")
    return dims[0], dims[1], dims[2]


# Honest rows are clipped only past this many times the largest centred norm of the public
# frames: on Fashion-MNIST frames (far from photos) the 99th percentile was 1.06 times it.
ROW_CLIP_MARGIN = 1.5


def _centre(graph: Path, frames: np.ndarray | None) -> tuple[tuple[float, ...], float]:
    if frames is None or not len(frames):
        return (), 0.0
    embedded = _ort_embed(graph, np.ascontiguousarray(frames, dtype=np.float32))
    centre = embedded.mean(axis=0)
    clip = ROW_CLIP_MARGIN * float(np.linalg.norm(embedded - centre, axis=1).max())
    return tuple(round(float(v), 6) for v in centre), round(clip, 6)


def export_body(name: str, out: str | Path, *, input_shape: tuple[int, ...] = (3, 64, 64),
                check_frames: dict[str, np.ndarray] | None = None,
                normalisation: str = "",
                centre_frames: Callable[[tuple[int, int, int]], np.ndarray] | None = None
                ) -> BodyManifest:
    """Export body ``name`` (a registry name, ``package.module:factory`` or an ONNX file) to
    ``out``; returns its manifest.  ``check_frames`` (named sets of frames in [0, 1]) are
    embedded by torch and by ONNX Runtime, which must agree to :data:`PROBE_TOLERANCE`.
    ``centre_frames(input_shape)`` gives public frames, never a fleet's: their mean embedding
    is the manifest's ``centre`` for closed-form heads, and ``ROW_CLIP_MARGIN`` times their
    largest centred norm its ``row_clip``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    graph = out / BODY_FILE
    checked: dict[str, float] = {}
    if name.endswith(".onnx"):
        shutil.copyfile(name, graph)
        input_shape, factory, label = _onnx_input_shape(graph), "", Path(name).stem
        normalisation = normalisation or "as the graph does it (frames in [0, 1])"
    else:
        module = build_body_module(name, tuple(input_shape))
        write_atomic(graph, module_to_onnx(module, output="embedding",
                                           input_shape=tuple(input_shape)))
        factory, label = name, name
        normalisation = normalisation or "(x - 0.5) / 0.5, inside the graph"
        for what, frames in (check_frames or {}).items():
            frames = np.ascontiguousarray(frames, dtype=np.float32)
            checked[what] = relative_error(_ort_embed(graph, frames),
                                           _torch_embed(module, frames))
            if not checked[what] <= PROBE_TOLERANCE:
                raise ArtifactError(f"the exported body differs from torch on {what}: relative "
                                    f"error {checked[what]:.2e} > {PROBE_TOLERANCE:g}")
    shape = (int(input_shape[0]), int(input_shape[1]), int(input_shape[2]))
    probe = _ort_embed(graph, probe_frames(shape))
    centre, clip = _centre(graph, centre_frames(shape) if centre_frames else None)
    manifest = BodyManifest(name=label, input_shape=shape, embedding=int(probe.shape[1]),
                            onnx_sha256=hashlib.sha256(graph.read_bytes()).hexdigest(),
                            probe=tuple(tuple(float(v) for v in p) for p in probe),
                            factory=factory, normalisation=normalisation, folder=out,
                            centre=centre, row_clip=clip)
    write_atomic(out / BODY_MANIFEST, (json.dumps(manifest.to_json(
        checked_against_torch={k: float(f"{v:.3g}") for k, v in checked.items()}),
        indent=1) + "\n").encode())
    return manifest
