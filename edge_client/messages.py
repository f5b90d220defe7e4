"""Typed messages exchanged by the device, base-station and cloud roles.

Every message is a frozen, keyword-only dataclass with a protocol version,
fleet, sender and round/iteration.  Arrays are validated (1-D, finite, right
dtype) and frozen on construction, so a message that exists is well formed;
a malformed one raises :class:`~edge_client.errors.MessageError` with a
counter-ready ``reason``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from .errors import MessageError

__all__ = [
    "PROTOCOL_VERSION",
    "Message",
    "DeviceStats",
    "DeviceUpdate",
    "SkipNotice",
    "StationModel",
    "Selection",
    "StationStats",
    "StationUpdate",
    "GlobalModel",
    "Presence",
    "payload_nbytes",
]

PROTOCOL_VERSION = 1


def _frozen_vector(name: str, value: object, dtype: type) -> np.ndarray:
    arr = np.array(value, dtype=dtype, copy=True)
    if arr.ndim != 1:
        raise MessageError("wrong_shape", f"{name} must be 1-D, got shape {arr.shape}")
    if not np.isfinite(arr).all():
        raise MessageError("non_finite", f"{name} contains NaN or Inf")
    if dtype is np.int64 and (arr < 0).any():
        raise MessageError("negative_count", f"{name} has negative counts")
    arr.flags.writeable = False
    return arr


@dataclass(frozen=True, kw_only=True)
class Message:
    """Header fields shared by every message."""

    fleet: str
    sender: str
    round: int
    iteration: int
    version: int = PROTOCOL_VERSION

    # Array fields validated and frozen on construction: (name, dtype).
    _vectors: ClassVar[tuple[tuple[str, type], ...]] = ()

    def __post_init__(self) -> None:
        if self.version != PROTOCOL_VERSION:
            raise MessageError("version", f"protocol version {self.version} unsupported")
        if not self.fleet or not self.sender:
            raise MessageError("header", "fleet and sender must be non-empty")
        if self.round < 0 or self.iteration < 0:
            raise MessageError("header", "round and iteration must be >= 0")
        for name, dtype in self._vectors:
            object.__setattr__(self, name, _frozen_vector(name, getattr(self, name), dtype))


_WEIGHTS = (("weights", np.float32),)
_COUNTS = (("seen_counts", np.int64),)


@dataclass(frozen=True, kw_only=True)
class DeviceStats(Message):
    """Device -> station: label histograms of all data seen and of the next batch."""

    station: str
    seen_counts: np.ndarray
    next_batch_counts: np.ndarray
    _vectors = (("seen_counts", np.int64), ("next_batch_counts", np.int64))


@dataclass(frozen=True, kw_only=True)
class DeviceUpdate(Message):
    """Device -> station: the locally trained model ``z_t`` and its batch size."""

    station: str
    weights: np.ndarray
    num_samples: int
    _vectors = _WEIGHTS


@dataclass(frozen=True, kw_only=True)
class SkipNotice(Message):
    """Device -> station: the upload gate held the update back (no weights)."""

    station: str
    gap: float


@dataclass(frozen=True, kw_only=True)
class StationModel(Message):
    """Station -> its devices: the group model ``w^m`` at iteration ``t``; ``final`` ends it."""

    weights: np.ndarray
    final: bool = False
    _vectors = _WEIGHTS


@dataclass(frozen=True, kw_only=True)
class Selection(Message):
    """Station -> its devices: the super node ``C_t^m`` and its reply deadline."""

    members: tuple[str, ...]
    deadline: float


@dataclass(frozen=True, kw_only=True)
class StationStats(Message):
    """Station -> cloud: summed label counts of its devices, for ``P_real``."""

    seen_counts: np.ndarray
    _vectors = _COUNTS


@dataclass(frozen=True, kw_only=True)
class StationUpdate(Message):
    """Station -> cloud, every ``T`` iterations: ``w^m`` and the samples it consumed."""

    weights: np.ndarray
    num_samples: int
    seen_counts: np.ndarray
    _vectors = _WEIGHTS + _COUNTS


@dataclass(frozen=True, kw_only=True)
class GlobalModel(Message):
    """Cloud -> stations: the global model after external sync, with ``P_real``."""

    weights: np.ndarray
    p_real: np.ndarray
    final: bool = False
    _vectors = _WEIGHTS + (("p_real", np.float64),)


@dataclass(frozen=True, kw_only=True)
class Presence(Message):
    """Retained online/offline status of a participant; its Last Will says offline."""

    role: str  # "cloud", "station" or "dev": the topic level it lives under
    online: bool

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.role not in ("cloud", "station", "dev"):
            raise MessageError("header", f"presence role {self.role!r} unknown")


def payload_nbytes(message: Message) -> int:
    """Bytes of array payload a message carries (header bytes excluded)."""
    return sum(getattr(message, f.name).nbytes for f in dataclasses.fields(message)
               if isinstance(getattr(message, f.name), np.ndarray))
