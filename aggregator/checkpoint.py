"""Crash-safe checkpoints of the cloud and station roles: arrays plus a JSON document.

A checkpoint is one ``.npz`` (no pickle: loaded with ``allow_pickle=False``) holding
the role's arrays and its scalar state as UTF-8 JSON.  It is written to a temporary
file, fsynced, renamed over the old one and the folder fsynced, so a crash at any
instant leaves either the previous checkpoint or the new one, never a torn file.
"""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from edge_client.errors import SaflError
from edge_client.files import write_atomic

__all__ = ["CheckpointError", "save_checkpoint", "load_checkpoint", "CHECKPOINT_FORMAT"]

CHECKPOINT_FORMAT = 1
_META = "__meta__"


class CheckpointError(SaflError):
    """A checkpoint exists but cannot be read: the service refuses to start over silently."""

    exit_code = 8


def save_checkpoint(path: str | Path, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> int:
    """Write ``arrays`` and ``meta`` atomically to ``path``; returns the bytes written."""
    doc = json.dumps({"format": CHECKPOINT_FORMAT, **meta}).encode()
    buf = io.BytesIO()
    np.savez(buf, **arrays, **{_META: np.frombuffer(doc, dtype=np.uint8)})
    return write_atomic(path, buf.getbuffer())


def load_checkpoint(path: str | Path) -> tuple[dict[str, np.ndarray], dict[str, Any]] | None:
    """The arrays and document of a checkpoint, or None if there is none yet."""
    path = Path(path)
    if not path.exists():
        return None
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {k: np.array(npz[k]) for k in npz.files}
        meta = json.loads(arrays.pop(_META).tobytes().decode())
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as exc:
        raise CheckpointError(f"checkpoint {path} cannot be read ({exc}); move it away to "
                              "start this role over") from exc
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"checkpoint {path} has format {meta.get('format')}, expected "
                              f"{CHECKPOINT_FORMAT}")
    return arrays, meta
