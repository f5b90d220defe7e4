"""The MQTT topic tree, and the one mapping from a message to its topic.

Each device writes only below ``safl/<fleet>/dev/<device_id>/`` so a broker ACL
can confine it; the in-process bus uses the same names.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from . import messages as m
from .messages import Participant

__all__ = [
    "CLOUD_ID",
    "topic_for",
    "matches",
    "Routes",
    "device_topics",
    "station_topics",
    "cloud_topics",
    "selection_topic",
    "station_model_topic",
    "global_model_topic",
    "status_topic",
    "summary_topic",
    "manifest_topic",
    "presence_filters",
    "document_filters",
    "is_document_topic",
    "participant_of",
    "prefix",
    "line_prefix",
    "label_topic",
    "predictions_topic",
    "DEVICE_LEAVES",
    "STATION_LEAVES",
    "CLOUD_LEAVES",
    "ROSTER_LEAVES",
]

# The leaves below each participant's prefix: everything it publishes (broker ACLs grant
# them one by one, ``aggregator/provision.py``).
DEVICE_LEAVES = ("stats", "update", "head", "status", "summary", "predictions")
STATION_LEAVES = ("model", "select", "update", "stats", "head", "status", "summary")
CLOUD_LEAVES = ("model", "model/manifest", "status", "summary")
# What a station reads from the devices of its roster only, device by device: their updates
# and head statistics (its subscriptions and its broker's ACL both name these).
ROSTER_LEAVES = ("update", "head")


# The cloud's participant id: one cloud per fleet, so its topics need no id level.
CLOUD_ID = "cloud"
_DEV, _STATION, _CLOUD = Participant.DEVICE, Participant.STATION, Participant.CLOUD


def _root(fleet: str) -> str:
    return f"safl/{fleet}"


def prefix(fleet: str, role: Participant | str, participant: str = "") -> str:
    """``safl/<fleet>/cloud``, or ``safl/<fleet>/<role>/<participant>`` for a device or a
    station (``participant`` may be the ``+`` wildcard)."""
    if role == _CLOUD:
        return f"{_root(fleet)}/{_CLOUD}"
    return f"{_root(fleet)}/{role}/{participant}"


def topic_for(message: m.Message) -> str:
    """Topic a message is published on."""
    if isinstance(message, m.DeviceStats):
        return f"{prefix(message.fleet, _DEV, message.sender)}/stats"
    if isinstance(message, (m.DeviceUpdate, m.SkipNotice)):
        return f"{prefix(message.fleet, _DEV, message.sender)}/update"
    if isinstance(message, m.StationModel):
        return station_model_topic(message.fleet, message.sender)
    if isinstance(message, m.Selection):
        return selection_topic(message.fleet, message.sender)
    if isinstance(message, m.StationStats):
        return f"{prefix(message.fleet, _STATION, message.sender)}/stats"
    if isinstance(message, m.StationUpdate):
        return f"{prefix(message.fleet, _STATION, message.sender)}/update"
    if isinstance(message, m.HeadStats):
        role = _DEV if message.sender != message.station else _STATION
        return f"{prefix(message.fleet, role, message.sender)}/head"
    if isinstance(message, m.GlobalModel):
        return global_model_topic(message.fleet)
    if isinstance(message, m.Presence):
        return status_topic(message.fleet, message.role, message.sender)
    if isinstance(message, m.Refusal):  # delivered locally where the refused frame came in
        return f"{prefix(message.fleet, message.role, message.sender)}/{message.leaf}"
    raise TypeError(f"no topic for {type(message).__name__}")


def predictions_topic(fleet: str, device: str) -> str:
    """Where a device publishes what its model says about each frame (JSON, QoS 0)."""
    return f"{prefix(fleet, _DEV, device)}/predictions"


def line_prefix(station: str) -> str:
    """The factory line's own topics on a station's broker (labels it publishes live;
    provisioned brokers let the station's devices read them)."""
    return f"line/{station}"


def label_topic(station: str, device: str) -> str:
    """Where a device's line application publishes its labels (its ``[source]
    label_topic`` in the files ``safl provision`` writes; the ACL lets that line alone
    write it and that device alone read it)."""
    return f"{line_prefix(station)}/{device}/labels"


def station_model_topic(fleet: str, station: str) -> str:
    """Where ``station`` publishes ``w^m`` (``+`` for every station)."""
    return f"{prefix(fleet, _STATION, station)}/model"


def selection_topic(fleet: str, station: str) -> str:
    """Where ``station`` names the super node of each iteration."""
    return f"{prefix(fleet, _STATION, station)}/select"


def global_model_topic(fleet: str) -> str:
    """Where the cloud publishes the global model."""
    return f"{prefix(fleet, _CLOUD)}/model"


def status_topic(fleet: str, role: Participant | str, participant: str) -> str:
    """Retained presence of a participant (``role`` may be the ``+`` wildcard)."""
    return f"{prefix(fleet, role, participant)}/status"


def summary_topic(fleet: str, role: Participant | str, participant: str) -> str:
    """Retained JSON summary a participant publishes for ``safl status`` and the monitor."""
    return status_topic(fleet, role, participant).removesuffix("/status") + "/summary"


def manifest_topic(fleet: str) -> str:
    """Retained JSON manifest of the global model (its chunked frames cannot be retained)."""
    return global_model_topic(fleet) + "/manifest"


def presence_filters(fleet: str) -> list[str]:
    """Every participant's retained presence (what ``safl status`` reads, with the next)."""
    return [status_topic(fleet, "+", "+"), status_topic(fleet, _CLOUD, CLOUD_ID)]


def document_filters(fleet: str) -> list[str]:
    """Every summary and the model manifest: the fleet's state, and no weights."""
    return [summary_topic(fleet, "+", "+"), summary_topic(fleet, _CLOUD, CLOUD_ID),
            manifest_topic(fleet)]


def is_document_topic(topic: str) -> bool:
    """JSON documents (``documents.py``) travel here, not frames."""
    return topic.endswith(("/summary", "/manifest", "/predictions"))


def device_topics(fleet: str, station: str) -> list[str]:
    """What a device of ``station`` subscribes to (its presence too: a station that comes
    back online is asking for stats)."""
    return [station_model_topic(fleet, station), selection_topic(fleet, station),
            status_topic(fleet, _STATION, station)]


def station_topics(fleet: str, devices: list[str] | tuple[str, ...]) -> list[str]:
    """What a base station subscribes to.

    Model updates only from its roster (on a shared broker a wildcard would carry every
    factory's models to every station); stats and presence from all, so an unknown
    device is seen and counted.
    """
    devs = prefix(fleet, _DEV, "+")
    return [f"{devs}/stats", f"{devs}/status", global_model_topic(fleet),
            status_topic(fleet, _CLOUD, CLOUD_ID),
            *(f"{prefix(fleet, _DEV, d)}/{leaf}" for d in devices for leaf in ROSTER_LEAVES)]


def cloud_topics(fleet: str) -> list[str]:
    """What the cloud subscribes to."""
    stations = prefix(fleet, _STATION, "+")
    return [f"{stations}/stats", f"{stations}/update", f"{stations}/head", f"{stations}/status"]


def matches(topic_filter: str, topic: str) -> bool:
    """MQTT topic-filter matching with ``+`` and ``#`` wildcards."""
    fparts, tparts = topic_filter.split("/"), topic.split("/")
    for i, part in enumerate(fparts):
        if part == "#":
            return True
        if i >= len(tparts) or (part != "+" and part != tparts[i]):
            return False
    return len(fparts) == len(tparts)


H = TypeVar("H")
MAX_ROUTED = 65_536  # topics whose handlers are kept found: a wildcard's topics are not few


class Routes(Generic[H]):
    """Topic filters and their handlers, found for a topic in subscription order (an
    index, which decides who sees a message first).  Exact topics are looked up, wildcard
    filters scanned, and what a topic reaches is kept until the next subscription: a
    station subscribes two exact topics per roster device, and matching each frame against
    every filter cost a thousand-device station 5 ms a frame."""

    def __init__(self) -> None:
        self._exact: dict[str, list[tuple[int, H]]] = {}
        self._wild: list[tuple[int, str, H]] = []
        self._found: dict[str, list[tuple[int, H]]] = {}
        self.count = 0  # subscriptions so far: the last one's index

    def add(self, topic_filter: str, handler: H) -> int:
        """Subscribe ``handler``; returns the subscription's index."""
        self.count += 1
        if "+" in topic_filter or "#" in topic_filter:
            self._wild.append((self.count, topic_filter, handler))
        else:
            self._exact.setdefault(topic_filter, []).append((self.count, handler))
        self._found = {}
        return self.count

    def filters(self) -> set[str]:
        return {*self._exact, *(f for _, f, _ in self._wild)}

    def find(self, topic: str) -> list[tuple[int, H]]:
        """``(index, handler)`` of each subscription ``topic`` reaches, in order."""
        found = self._found.get(topic)
        if found is None:
            found = sorted([*self._exact.get(topic, ()),
                            *((i, h) for i, f, h in list(self._wild) if matches(f, topic))],
                           key=lambda pair: pair[0])
            if len(self._found) < MAX_ROUTED:
                self._found[topic] = found
        return found

    def handlers(self, topic: str) -> list[H]:
        return [h for _, h in self.find(topic)]


def participant_of(topic: str, fleet: str) -> tuple[Participant, str, str] | None:
    """``(role, id, leaf)`` of a participant's own topic in ``fleet``, else None.

    The broker's ACL lets only that participant write there, so the topic names the
    sender of a frame even when the frame cannot be decoded.
    """
    parts = topic.split("/")
    if len(parts) == 5 and parts[0] == "safl" and parts[1] == fleet \
            and parts[2] in (_DEV, _STATION) and m.is_id(parts[3]):
        return Participant(parts[2]), parts[3], parts[4]
    return None
