"""Crash-safe files: what a service writes (a checkpoint, its deployable model, an export) is
either the old file or the new one after a crash, never a torn one."""

from __future__ import annotations

import os
import threading
from pathlib import Path

__all__ = ["write_atomic"]


def write_atomic(path: str | Path, data: bytes | memoryview) -> int:
    """Write ``data`` to a temporary file beside ``path``, fsync it, rename it over ``path``
    and fsync the folder; returns the bytes written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Named for this process and thread: two writers of one path (two devices given one
    # state folder) each rename a whole file, and neither pulls the other's away.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)
    return len(data)
