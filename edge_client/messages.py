"""Typed messages exchanged by the device, base-station and cloud roles.

Every message is a frozen, keyword-only dataclass with a protocol version,
fleet, sender and round/iteration.  Arrays are validated (1-D, finite, right
dtype) and frozen on construction, so a message that exists is well formed;
a malformed one raises :class:`~edge_client.errors.MessageError` with a
counter-ready ``reason``.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from .errors import MessageError
from .fields import (
    ID_PATTERN,
    MAX_INT,
    MAX_MEMBERS,
    MAX_NAME,
    MAX_PRODUCTS,
    NamedEnum,
    ProductNames,
    check_scalar,
    frozen_vector,
    is_id,
    is_product_name,
)

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
    "HeadStats",
    "Presence",
    "Refusal",
    "NamedEnum",
    "Participant",
    "payload_nbytes",
    "ID_PATTERN",
    "MAX_INT",
    "MODEL_ENCODING",
    "is_default",
    "is_id",
    "is_product_name",
    "ProductNames",
    "MAX_NAME",
    "MAX_PRODUCTS",
    "MAX_MEMBERS",
]

PROTOCOL_VERSION = 1
# A DeviceUpdate whose weights are the trained model itself, not an encoded step.
MODEL_ENCODING = "model"


class Participant(NamedEnum):
    """Who a participant is: the topic level its topics live under (``topics.py``)."""

    DEVICE = "dev"
    STATION = "station"
    CLOUD = "cloud"


_SCALARS: dict[type, tuple[tuple[str, object], ...]] = {}


def _scalar_fields(cls: type[Message]) -> tuple[tuple[str, object], ...]:
    """(name, type) of a message class's non-array fields, resolved once per class."""
    if cls not in _SCALARS:
        hints = typing.get_type_hints(cls)
        arrays = {n for n, _ in cls._vectors}
        _SCALARS[cls] = tuple((f.name, hints[f.name]) for f in dataclasses.fields(cls)
                              if f.name not in arrays)
    return _SCALARS[cls]


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
        # Every scalar is checked for type and range before the message can exist, so no
        # role ever sees a float round, a negative count or an id with a wildcard in it.
        for name, hint in _scalar_fields(type(self)):
            object.__setattr__(self, name,
                               check_scalar(type(self), name, hint, getattr(self, name)))
        if self.version != PROTOCOL_VERSION:
            raise MessageError("version", f"protocol version {self.version} unsupported")
        for name, dtype in self._vectors:
            object.__setattr__(self, name, frozen_vector(name, getattr(self, name), dtype))


OPTIONAL = {"optional": True}  # a field a frame may omit while it holds its default


def is_default(f: dataclasses.Field[object], value: object) -> bool:
    """Whether ``value`` is an optional field's default: the codec leaves it out."""
    if not f.metadata.get("optional"):
        return False
    if isinstance(value, np.ndarray):
        return value.size == 0
    return bool(value == f.default)


def _no(dtype: type) -> Callable[[], np.ndarray]:
    return lambda: np.zeros(0, dtype=dtype)


_WEIGHTS = (("weights", np.float32),)


_COUNTS = (("seen_counts", np.int64),)
# The fleet's unknown-part detector (edge_client/novelty.py), packed, where it changed or a
# device came online since the last model sent (empty otherwise: 3.3 MB at 1,280 features),
# and the score past which a frame is unknown (0: none calibrated yet), with every model.
_NOVELTY = (("novelty", np.float32),)


@dataclass(frozen=True, kw_only=True)
class DeviceStats(Message):
    """Device -> station: label histograms of all data seen and of the next batch, and the
    device-local accuracy of its deployable model on ``local_samples`` held-out samples
    (0: not measured yet), and its prequential accuracy over the last
    ``prequential_samples`` labelled samples it predicted before training on them."""

    station: str
    seen_counts: np.ndarray
    next_batch_counts: np.ndarray
    local_accuracy: float = 0.0
    local_samples: int = 0
    prequential_accuracy: float = 0.0
    prequential_samples: int = 0
    # Epsilon its local differential privacy has spent (0: none, or no noise stage).
    epsilon: float = field(default=0.0, metadata=OPTIONAL)
    # Safe promotion: the round of the model its line predicts with, and the last
    # candidate's shadow accuracy on ``shadow_samples`` recent samples (0: none scored).
    deployed_round: int = field(default=0, metadata=OPTIONAL)
    shadow_accuracy: float = field(default=0.0, metadata=OPTIONAL)
    shadow_samples: int = field(default=0, metadata=OPTIONAL)
    # Predictions scored against their labels since the device started, and how many were
    # right: the station watches each device's accuracy for drift (aggregator/drift.py).
    prequential_scored: int = field(default=0, metadata=OPTIONAL)
    prequential_hits: int = field(default=0, metadata=OPTIONAL)
    _vectors = (("seen_counts", np.int64), ("next_batch_counts", np.int64))


@dataclass(frozen=True, kw_only=True)
class DeviceUpdate(Message):
    """Device -> station: the locally trained model ``z_t`` and its batch size.

    With the fleet's update stages (``edge_client.pipeline``) it carries the step
    ``z_t - w^m`` encoded instead, named by ``encoding``: positions in ``indices`` (top-k)
    and the values in ``weights`` (float32), ``half`` (float16) or ``codes`` with one
    ``scales`` entry per block (int8).  ``encoding = "model"``: ``weights`` is ``z_t``.
    """

    station: str
    weights: np.ndarray
    num_samples: int
    # Left out of a frame while at their defaults, so a plain update's frame is what it was
    # before encodings existed, and stations not yet upgraded still read it.
    encoding: str = field(default=MODEL_ENCODING, metadata=OPTIONAL)
    indices: np.ndarray = field(default_factory=_no(np.uint32), metadata=OPTIONAL)
    half: np.ndarray = field(default_factory=_no(np.float16), metadata=OPTIONAL)
    codes: np.ndarray = field(default_factory=_no(np.int8), metadata=OPTIONAL)
    scales: np.ndarray = field(default_factory=_no(np.float32), metadata=OPTIONAL)
    _vectors = _WEIGHTS + (("indices", np.uint32), ("half", np.float16), ("codes", np.int8),
                           ("scales", np.float32))


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
    novelty: np.ndarray = field(default_factory=_no(np.float32), metadata=OPTIONAL)
    novelty_threshold: float = field(default=0.0, metadata=OPTIONAL)
    # The cloud's catalogue, relayed (edge_client/catalogue.py): () where none came yet.
    products: ProductNames = field(default=ProductNames(()), metadata=OPTIONAL)
    retired: ProductNames = field(default=ProductNames(()), metadata=OPTIONAL)
    # Drawn at random as the station's process started (a fleet that sums head statistics):
    # where it changes, the station restarted, and its devices send their statistics of its
    # last rounds again (head_sends.py).  0: not told.
    started: int = field(default=0, metadata=OPTIONAL)
    _vectors = _WEIGHTS + _NOVELTY


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
    """Station -> cloud, every ``T`` iterations: ``w^m`` and the samples it consumed, with
    the latest held-out and prequential accuracies its devices reported (metrics only)."""

    weights: np.ndarray
    num_samples: int
    seen_counts: np.ndarray
    local_accuracies: np.ndarray = dataclasses.field(default_factory=_no(np.float32))
    prequential_accuracies: np.ndarray = dataclasses.field(default_factory=_no(np.float32))
    _vectors = _WEIGHTS + _COUNTS + (("local_accuracies", np.float32),
                                     ("prequential_accuracies", np.float32))


@dataclass(frozen=True, kw_only=True)
class GlobalModel(Message):
    """Cloud -> stations: the global model after external sync, with ``P_real``."""

    weights: np.ndarray
    p_real: np.ndarray
    final: bool = False
    # Samples the cloud's closed-form head was last solved from (0: not yet): until then a
    # station starts its rounds from its own factory's solve.
    head_samples: int = field(default=0, metadata=OPTIONAL)
    novelty: np.ndarray = field(default_factory=_no(np.float32), metadata=OPTIONAL)
    novelty_threshold: float = field(default=0.0, metadata=OPTIONAL)
    # The fleet's products by class, and those retired (edge_client/catalogue.py): the cloud
    # reads them from its file, so a product added there reaches every role with the model.
    products: ProductNames = field(default=ProductNames(()), metadata=OPTIONAL)
    retired: ProductNames = field(default=ProductNames(()), metadata=OPTIONAL)
    _vectors = _WEIGHTS + (("p_real", np.float64),) + _NOVELTY


@dataclass(frozen=True, kw_only=True)
class HeadStats(Message):
    """Device -> station, station -> cloud: the statistics of a closed-form head on the
    body's embeddings added since the sender's last send (``edge_client/head_stats.py``):
    the Gram's upper triangle (empty for class means only), the cross term, the counts; or,
    for fewer rows than half the Gram's side, the Gram as a factor."""

    station: str
    gram: np.ndarray
    cross: np.ndarray
    counts: np.ndarray
    # In place of ``gram`` and ``cross`` (both empty): ``F`` (``k x (d+1)``, row by row),
    # the Gram being ``F^T F``, and ``L`` (``k x classes``), the cross term ``F^T L``: the
    # R and Q^T onehot(y) of the rows' QR, bytes in proportion to the rows.
    factor: np.ndarray = field(default_factory=_no(np.float32), metadata=OPTIONAL)
    factor_labels: np.ndarray = field(default_factory=_no(np.float32), metadata=OPTIONAL)
    # The labelled frames' unknown-part scores, binned (novelty.binned), by the detector
    # solved from ``novelty_of`` samples, each scored before it joined these sums.
    novelty: np.ndarray = field(default_factory=_no(np.int64), metadata=OPTIONAL)
    novelty_of: int = field(default=0, metadata=OPTIONAL)
    # The sender's running count of samples sent, these included, in its ``epoch`` (random,
    # anew at a restart without state): a receiver counts each send once (head_sends.py).
    # 0: not stamped (a sender before them).
    upto: int = field(default=0, metadata=OPTIONAL)
    epoch: int = field(default=0, metadata=OPTIONAL)
    _vectors = (("gram", np.float32), ("cross", np.float32), ("counts", np.int64),
                ("novelty", np.int64), ("factor", np.float32), ("factor_labels", np.float32))


@dataclass(frozen=True, kw_only=True)
class Presence(Message):
    """Retained online/offline status of a participant; its Last Will says offline.

    ``final``: the offline status of a participant whose part of the federation is over (a
    station after its final model): a device that was away when that model went out learns
    from it, retained, that nothing more will come."""

    role: Participant
    online: bool
    final: bool = field(default=False, metadata=OPTIONAL)


@dataclass(frozen=True, kw_only=True)
class Refusal(Message):
    """Transport -> role, never on the wire: a frame on ``sender``'s topic was refused.

    The broker's ACL ties a topic to its participant, so the topic names who sent a
    frame even when the frame itself is garbage; a station counts the refusal as that
    member's answer instead of waiting out the deadline for it.
    """

    reason: str
    role: Participant  # the topic level the refused frame came in under
    leaf: str  # the last topic level: "update", "stats", ...


def traffic_kind(message: Message) -> str:
    """What a bus counts a message's traffic under: its type, with a station's head
    statistics told from a device's (they cross to the cloud, a device's stay in the
    factory)."""
    if isinstance(message, HeadStats) and message.sender == message.station:
        return "StationHeadStats"
    return type(message).__name__


def payload_nbytes(message: Message) -> int:
    """Bytes of array payload a message carries (header bytes excluded)."""
    return sum(getattr(message, f.name).nbytes for f in dataclasses.fields(message)
               if isinstance(getattr(message, f.name), np.ndarray))
