"""Crash-safe checkpoints of the cloud and station roles: arrays plus a JSON document.

A checkpoint is one ``.npz`` (no pickle: loaded with ``allow_pickle=False``) holding
the role's arrays and its scalar state as UTF-8 JSON.  It is written to a temporary
file, fsynced, renamed over the old one and the folder fsynced, so a crash at any
instant leaves either the previous checkpoint or the new one, never a torn file.
"""

from __future__ import annotations

import dataclasses
import io
import json
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from edge_client.errors import SaflError
from edge_client.files import write_atomic
from edge_client.messages import Participant

__all__ = ["CheckpointError", "RoleCheckpoint", "StationCheckpoint", "CloudCheckpoint",
           "save_checkpoint", "load_checkpoint", "group", "grouped", "CHECKPOINT_FORMAT"]

CHECKPOINT_FORMAT = 1
_META = "__meta__"


class CheckpointError(SaflError):
    """A checkpoint exists but cannot be read: the service refuses to start over silently."""

    exit_code = 8


R = TypeVar("R", bound="RoleCheckpoint")


@dataclass(frozen=True, kw_only=True)
class RoleCheckpoint:
    """The scalar part of a role's checkpoint, the JSON document beside its arrays; each
    role extends it with what it needs to continue bit for bit."""

    role: Participant  # whose checkpoint it is: a role refuses another's
    state: str
    round: int
    iteration: int
    counters: dict[str, int]
    # Central DP's clip bound where it adapts (None: fixed, or an older checkpoint).
    dp_bound: float | None = None

    @classmethod
    def from_doc(cls: type[R], doc: Mapping[str, Any]) -> R:
        """From a loaded document: keys it does not know are ignored, keys an older
        checkpoint lacks take their defaults, a missing required key is a
        :class:`CheckpointError`."""
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in doc.items() if k in names}
        if "role" in values:
            try:
                values["role"] = Participant(values["role"])
            except ValueError:
                raise CheckpointError(f"the checkpoint is of role {values['role']!r}, none of "
                                      f"{[p.value for p in Participant]}") from None
        try:
            return cls(**values)
        except TypeError as exc:
            raise CheckpointError(f"the checkpoint's document does not fit {cls.__name__}: "
                                  f"{exc}") from None


@dataclass(frozen=True, kw_only=True)
class StationCheckpoint(RoleCheckpoint):
    """A station's scalars at a round boundary (its arrays: the model, ``P_real``, each
    device's counts, the batches it was seen to train and replay sketches)."""

    role: Participant = Participant.STATION
    id: str
    consumed: int  # samples fused this round
    consumed_before: int = 0  # of the rounds already uploaded
    upload_samples: int | None  # of the upload the cloud has not answered yet
    seen_at: dict[str, int]
    # what each device had counted before it restarted (trust.SeenTotals)
    seen_carried: dict[str, int] = dataclasses.field(default_factory=dict)
    windows: dict[str, list[int]] = dataclasses.field(default_factory=dict)  # Roster.window
    trained_updates: dict[str, int] = dataclasses.field(default_factory=dict)
    # drift.py: each device's prequential counts fed, and the levels flagged devices fell from
    drift_counts: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    drift_levels: dict[str, float] = dataclasses.field(default_factory=dict)
    sitting_out: dict[str, int] = dataclasses.field(default_factory=dict)
    norms: list[float]  # the norm guard's history
    recent: list[list[str]]  # recent super nodes, for the seat cap
    rng: dict[str, Any]  # the generator's state
    tally: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)  # per device


@dataclass(frozen=True, kw_only=True)
class CloudCheckpoint(RoleCheckpoint):
    """The cloud's scalars as a round is broadcast (its arrays: the global model, the
    server optimiser's moments, each station's counts)."""

    role: Participant = Participant.CLOUD
    consumed: dict[str, int]  # samples each station claimed over the run


def group(arrays: Mapping[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    """The arrays saved under ``prefix`` (:func:`grouped`), keyed by what follows it: from
    a stack and its keys, or one array a key (as every checkpoint before stacks was)."""
    keys, stack = arrays.get(f"{prefix}__keys"), arrays.get(f"{prefix}__stack")
    out = {str(k): stack[i] for i, k in enumerate(keys)} \
        if keys is not None and stack is not None and len(keys) == len(stack) else {}
    head, own = f"{prefix}_", f"{prefix}__"
    return {**out, **{k.removeprefix(head): v for k, v in arrays.items()
                      if k.startswith(head) and not k.startswith(own)}}


def grouped(prefix: str, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``arrays`` named to be saved beside others under ``prefix`` (``opt_m``, ``seen_d0``).
    Many of one shape and dtype (a roster's histograms) go as one stack and its keys: a
    thousand devices' three histograms were 3,000 arrays, and each checkpoint of them took
    a station 0.1 s."""
    if len(arrays) > 1 and len({(v.shape, v.dtype.str) for v in arrays.values()}) == 1:
        return {f"{prefix}__keys": np.array(list(arrays)),
                f"{prefix}__stack": np.stack(list(arrays.values()))}
    return {f"{prefix}_{k}": v for k, v in arrays.items()}


def save_checkpoint(path: str | Path, arrays: dict[str, np.ndarray],
                    meta: RoleCheckpoint | Mapping[str, Any]) -> int:
    """Write ``arrays`` and ``meta`` atomically to ``path``; returns the bytes written."""
    fields = dataclasses.asdict(meta) if isinstance(meta, RoleCheckpoint) else dict(meta)
    doc = json.dumps({"format": CHECKPOINT_FORMAT, **fields}).encode()
    buf = io.BytesIO()
    savez: Any = np.savez  # its stub takes a name "allow_pickle" for the keyword of that name
    savez(buf, **arrays, **{_META: np.frombuffer(doc, dtype=np.uint8)})
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
