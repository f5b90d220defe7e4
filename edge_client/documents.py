"""The retained JSON documents beside the frames, and their one codec.

Frames carry the federation (``messages.py``); documents tell operators and late joiners
where it stands: the global model's manifest (chunked frames cannot be retained) and each
service's summary for ``safl status``.  Each document is a frozen dataclass; on the wire it
is a JSON object with its ``kind`` and ``version``.  Decoding checks every field against
its annotation and refuses, with :class:`MessageError`, a document that is not JSON, of an
unknown kind or version, missing a field, or with a field of the wrong type; fields a newer
writer added are ignored.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import MessageError
from .messages import NamedEnum
from .states import CloudState, DeviceState, StationState

__all__ = ["ModelManifest", "StationSummary", "CloudSummary", "DeviceSummary", "Prediction",
           "Document",
           "DOCUMENT_VERSION", "ACCURACY_HISTORY",
           "encode_document", "decode_document"]

DOCUMENT_VERSION = 1
MAX_DOCUMENT = 1 << 16  # bytes: documents are small, and a retained one is read by all
# A role's last error, as its summary carries it to operators' terminals and pages: one
# printable line (no escape sequence reaches a terminal) of at most this many characters.
MAX_ERROR = 300
ACCURACY_HISTORY = 500  # rounds of accuracy a cloud summary carries (about 12 KB)


@dataclass(frozen=True, kw_only=True)
class ModelManifest:
    """The cloud's latest global model: what a late joiner should expect."""

    round: int
    iteration: int
    size: int  # bytes of the model's frame
    final: bool
    layout: str  # the model layout's hash


@dataclass(frozen=True, kw_only=True)
class StationSummary:
    """A base station's state, roster and counters."""

    station: str
    state: StationState
    round: int
    iteration: int
    devices: int  # on the roster
    online: int
    quorum: int
    missing: tuple[str, ...] = ()  # of the roster, while joining
    cpu_s: float = 0.0
    cpu_startup_s: float | None = None  # until the first station model
    local_mean: float | None = None  # device-local accuracy (docs/algorithms.md)
    local_worst10: float | None = None
    prequential_mean: float | None = None  # test-then-train accuracy on the stream
    prequential_worst10: float | None = None
    epsilon_local: float | None = None  # the most a device's local DP has spent (docs/privacy.md)
    epsilon_central: float | None = None  # the most this station's noised syncs have spent
    update_stages: str = "model"  # what it decodes its devices' updates by (docs/protocol.md)
    # Seconds from a super node's selection to its last in-time answer, over the last 64.
    reply_median_s: float | None = None
    reply_max_s: float | None = None
    counters: Mapping[str, int] = field(default_factory=dict)
    transport: Mapping[str, int] = field(default_factory=dict)
    # The station's own view of each roster device: its claims refused and clipped.
    device_refused: Mapping[str, int] = field(default_factory=dict)
    device_clipped: Mapping[str, int] = field(default_factory=dict)
    # Devices whose prequential accuracy fell (aggregator/drift.py), with the accuracy each
    # fell from: the SHOWN_DRIFTING that fell furthest, of ``devices_drifting``; and why
    # none is watched, where that is so ("": watched).
    drifting: Mapping[str, float] = field(default_factory=dict)
    devices_drifting: int = 0
    drift_off: str = ""
    # The last unexpected error of the role's service ("<counter>: <exception>"; "": none):
    # a failure that would otherwise sit in a log nobody reads.
    error: str = ""


@dataclass(frozen=True, kw_only=True)
class DeviceSummary:
    """What a device says of itself, for the fleet's monitor: where it is, how its
    deployable model does on its own stream, what it sent, and its source's counters
    (frames dropped).  A claim like any report: the station's summary says what it
    accepted and refused of it."""

    device: str
    station: str
    state: DeviceState
    round: int
    iteration: int
    local_accuracy: float | None = None  # held-out accuracy of its deployable model
    prequential_accuracy: float | None = None  # test-then-train on its stream
    deployed_round: int | None = None  # of the model the line predicts with
    shadow_accuracy: float | None = None  # of the last candidate, on the recent samples
    epsilon: float | None = None  # what its local DP has spent
    counters: Mapping[str, int] = field(default_factory=dict)
    transport: Mapping[str, int] = field(default_factory=dict)
    source: Mapping[str, int] = field(default_factory=dict)  # frames_dropped, wrong_shape
    # s the join adds to a label's time, and the lag its labels point to (sources.md)
    label_lag: float | None = None
    label_lag_estimate: float | None = None
    body_ms_per_frame: float | None = None  # what its pretrained body costs a frame
    # Unix time of its last prediction to the line (None before one): a reader's own clock
    # tells how long ago, so a stalled camera or a device gone quiet shows as such.
    last_prediction: float | None = None
    camera_outage: float | None = None  # s its live camera has been lost for (0: delivering)
    # Of the frames chosen for a prediction over the last minute, the share that went
    # unpredicted (over its [inference] budget): a camera the line hears too little from.
    predictions_behind: float | None = None
    # Frames labelled with a product the fleet has not added yet, held for it (catalogue.py).
    labels_held: int | None = None
    # The last unexpected error of the role's service ("<counter>: <exception>"; "": none):
    # a failure that would otherwise sit in a log nobody reads.
    error: str = ""


@dataclass(frozen=True, kw_only=True)
class CloudSummary:
    """The cloud's state, its stations and the last accuracy it measured."""

    state: CloudState
    round: int
    iteration: int
    stations: tuple[str, ...]
    offline: tuple[str, ...] = ()
    accuracy: float | None = None
    local_mean: float | None = None  # over every station's devices, as they reported
    local_worst10: float | None = None
    prequential_mean: float | None = None
    prequential_worst10: float | None = None
    epsilon_cloud: float | None = None  # the most a station's data spent (central DP)
    # The global model's test accuracy over the last rounds evaluated (at most
    # ACCURACY_HISTORY), so a monitor started late still draws the curve.
    accuracy_rounds: tuple[int, ...] = ()
    accuracies: tuple[float, ...] = ()
    # The fleet's products, class 0 first, of its model's classes (the rest free for
    # products to come), and those retired (edge_client/catalogue.py).
    classes: int = 0
    products: tuple[str, ...] = ()
    retired: tuple[str, ...] = ()
    counters: Mapping[str, int] = field(default_factory=dict)
    transport: Mapping[str, int] = field(default_factory=dict)
    # The last unexpected error of the role's service ("<counter>: <exception>"; "": none):
    # a failure that would otherwise sit in a log nobody reads.
    error: str = ""


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """What a device's deployable model says about one frame, for the line to act on."""

    t: float  # capture time, unix seconds
    frame: int  # the source's frame number
    label: int
    confidence: float  # softmax probability of ``label``
    model_round: int  # the federation round the deployable model came from
    latency_ms: float  # from capture to the prediction
    # The time of the item the frame shows, as the line stamps its labels: ``t`` less the
    # label lag the device applies (label_lag.py), so a line application matching items
    # by time matches the one its label would join.  ``t`` where labels do not come live.
    item_t: float | None = None
    product: str | None = None  # the name of ``label`` where the fleet names its classes
    # How far the frame lies from every product the fleet has labelled (novelty.py: about 1
    # for a known one where the fleet has labelled many), and whether that is past the
    # fleet's threshold: a part the line has never labelled.  None without a detector
    # (yet), ``unknown`` None before its threshold is calibrated.
    novelty: float | None = None
    unknown: bool | None = None


Document = ModelManifest | StationSummary | CloudSummary | DeviceSummary | Prediction
_KINDS: dict[str, type] = {cls.__name__: cls for cls in (ModelManifest, StationSummary,
                                                          CloudSummary, DeviceSummary,
                                                          Prediction)}


def encode_document(doc: Document, *, bare: bool = False) -> bytes:
    """The document as MQTT carries it: its kind, the format's version and its fields;
    ``bare``, the fields alone (a prediction's line in the JSON-lines file), serialised
    the same way."""
    head = {} if bare else {"kind": type(doc).__name__, "version": DOCUMENT_VERSION}
    return json.dumps({**head, **dataclasses.asdict(doc)}, sort_keys=True).encode()


def _check(name: str, value: Any, hint: Any) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        return _check(name, value, next(a for a in args if a is not type(None)))
    if origin is tuple:
        if not isinstance(value, list):
            raise MessageError("document", f"{name!r} must be a list")
        return tuple(_check(name, v, args[0]) for v in value)
    if origin is Mapping:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise MessageError("document", f"{name!r} must map names to {args[1].__name__}")
        return {k: _check(name, v, args[1]) for k, v in value.items()}
    if isinstance(hint, type) and issubclass(hint, NamedEnum):
        return hint.parse(value, "document", repr(name))
    if hint is float and type(value) in (int, float) and math.isfinite(value):
        return float(value)
    if type(value) is not hint:  # bool is not an int here, nor an int a string
        raise MessageError("document", f"{name!r} must be {hint.__name__}, got "
                           f"{str(value)[:40]!r}")
    return value


def decode_document(payload: bytes) -> Document:
    if len(payload) > MAX_DOCUMENT:
        raise MessageError("document", f"{len(payload)} bytes, more than {MAX_DOCUMENT}")
    try:
        doc = json.loads(payload)
    except (ValueError, UnicodeDecodeError) as exc:
        raise MessageError("document", f"not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise MessageError("document", "not a JSON object")
    if doc.get("kind") not in _KINDS:
        raise MessageError("document", f"unknown kind {str(doc.get('kind'))[:40]!r}")
    if doc.get("version") != DOCUMENT_VERSION:
        raise MessageError("document", f"version {doc.get('version')!r}, this reader knows "
                           f"{DOCUMENT_VERSION}")
    cls = _KINDS[doc["kind"]]
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        if f.name in doc:
            values[f.name] = _check(f.name, doc[f.name], hints[f.name])
            if f.name == "error" and not (len(values["error"]) <= MAX_ERROR
                                          and values["error"].isprintable()):
                raise MessageError("document", f"'error' must be one printable line of at "
                                   f"most {MAX_ERROR} characters")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise MessageError("document", f"{doc['kind']} without {f.name!r}")
    return cls(**values)
