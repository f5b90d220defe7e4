"""The load fleet's body (``lab/fleet_load.py``, ``--body``): a camera fleet that solves its
head in closed form, as the docs recommend, at a size one machine can host.

A thousand EfficientNet-Lite0 bodies do not run on two cores, so the body here is the
embedding itself: an ONNX graph that flattens a ``(1, 1, 1,280)`` "frame" into the 1,280
features EfficientNet-Lite0 gives, exported with a manifest (probe, centre and clip) as
``safl models export-body`` writes one.  Everything past the frame is the product's: every
device opens the body in ONNX Runtime, embeds its samples, sums the head statistics and sends
them (``HeadStats``, a factor or the triangle) with each ``head_stats_every`` station models;
the station checks and adds them and owes them to the cloud, which solves the head each
round (``head_init = "auto"``: lda).  Each camera labels ``LABELLED_PER_ITERATION`` frames a
station iteration.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from edge_client.body import BODY_FILE, BODY_MANIFEST, BodyManifest, ort_forward, probe_frames

__all__ = ["BODY_NAME", "LABELLED_PER_ITERATION", "write_load_body"]

BODY_NAME = "load-embedding"
# A camera labelling 2 frames a second on a station that turns an iteration a second (1,000
# devices turned one in 0.94 s: docs/scale.md).
LABELLED_PER_ITERATION = 2.0
ROW_CLIP_MARGIN = 1.5  # as models/body.py exports a body's clip: past its public frames'


def write_load_body(folder: Path, features: int, public: np.ndarray) -> Path:
    """The body in ``folder`` (made if need be): its graph, and its manifest, whose centre
    and clip come from ``public`` (frames that are not the fleet's, as an export takes
    photos); returns the folder."""
    from onnx import TensorProto, helper

    folder.mkdir(parents=True, exist_ok=True)
    shape = (1, 1, features)
    frames = helper.make_tensor_value_info("frames", TensorProto.FLOAT, ["n", *shape])
    embedding = helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["n", features])
    graph = helper.make_graph([helper.make_node("Flatten", ["frames"], ["embedding"], axis=1)],
                              BODY_NAME, [frames], [embedding])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8  # read by every ONNX Runtime the extras allow
    path = folder / BODY_FILE
    path.write_bytes(model.SerializeToString())
    forward = ort_forward(path)
    probe = forward(probe_frames(shape))
    embedded = forward(np.ascontiguousarray(public.reshape(-1, *shape), np.float32))
    centre = embedded.mean(axis=0)
    clip = ROW_CLIP_MARGIN * float(np.linalg.norm(embedded - centre, axis=1).max())
    manifest = BodyManifest(
        name=BODY_NAME, input_shape=shape, embedding=features,
        onnx_sha256=hashlib.sha256(path.read_bytes()).hexdigest(),
        probe=tuple(tuple(float(v) for v in p) for p in probe),
        normalisation="none: the frames are the embeddings", folder=folder,
        centre=tuple(round(float(v), 6) for v in centre), row_clip=round(clip, 6))
    (folder / BODY_MANIFEST).write_text(json.dumps(manifest.to_json(), indent=1) + "\n")
    return folder
