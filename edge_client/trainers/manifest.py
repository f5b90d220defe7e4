"""The model manifest: what a device needs to know about its artifacts, without torch.

``manifest.json`` (written by ``safl models export``) names the model, its input
shape and classes, and the flat layout: each tensor's name, shape and offset in
the float32 vector that travels on the wire.  The layout hash identifies that
layout, so devices with different backends can prove they share one model.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ArtifactError

__all__ = ["MANIFEST_NAME", "MANIFEST_VERSION", "Manifest", "layout_hash"]

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 1


def layout_hash(layout: Sequence[tuple[str, Sequence[int]]], body: str = "") -> str:
    """SHA-256 (first 16 hex digits) of the ordered tensor names and shapes, and of the
    frozen body's hash where the model is a head on one (``edge_client/body.py``)."""
    tensors = [[name, list(shape)] for name, shape in layout]
    canon = json.dumps([*tensors, ["body", body]] if body else tensors, separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Manifest:
    model: str
    input_shape: tuple[int, ...]
    num_classes: int
    layout: tuple[tuple[str, tuple[int, ...]], ...]
    optimizer: str
    files: dict[str, str]

    @property
    def num_params(self) -> int:
        return sum(math.prod(shape) for _, shape in self.layout)

    @property
    def layout_hash(self) -> str:
        return layout_hash(self.layout)

    def to_json(self) -> dict[str, Any]:
        offset, tensors = 0, []
        for name, shape in self.layout:
            size = math.prod(shape)
            tensors.append({"name": name, "shape": list(shape), "offset": offset, "size": size})
            offset += size
        return {"manifest_version": MANIFEST_VERSION, "model": self.model,
                "input_shape": list(self.input_shape), "num_classes": self.num_classes,
                "num_params": self.num_params, "optimizer": self.optimizer,
                "layout": tensors, "layout_hash": self.layout_hash, "files": self.files}

    def write(self, folder: Path) -> Path:
        path = Path(folder) / MANIFEST_NAME
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        return path

    @classmethod
    def read(cls, folder: str | Path) -> Manifest:
        """Read and check ``manifest.json``; every problem is an :class:`ArtifactError`."""
        path = Path(folder) / MANIFEST_NAME
        try:
            doc = json.loads(path.read_text())
        except FileNotFoundError as exc:
            raise ArtifactError(f"no {MANIFEST_NAME} in {folder}: export the model with "
                                "`safl models export`") from exc
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ArtifactError(f"{path} is unreadable or not JSON: {exc}") from exc
        try:
            if doc["manifest_version"] != MANIFEST_VERSION:
                raise ArtifactError(f"{path}: manifest version {doc['manifest_version']} "
                                    f"unsupported (expected {MANIFEST_VERSION})")
            manifest = cls(model=str(doc["model"]),
                           input_shape=tuple(int(d) for d in doc["input_shape"]),
                           num_classes=int(doc["num_classes"]),
                           layout=tuple((str(t["name"]), tuple(int(d) for d in t["shape"]))
                                        for t in doc["layout"]),
                           optimizer=str(doc["optimizer"]),
                           files={str(k): str(v) for k, v in doc["files"].items()})
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ArtifactError(f"{path} is missing or mangles a field: {exc!r}") from exc
        if manifest.layout_hash != doc.get("layout_hash"):
            raise ArtifactError(f"{path}: layout hash {doc.get('layout_hash')!r} does not match "
                                f"its own layout ({manifest.layout_hash}); the file was edited")
        return manifest
