"""``safl status``: what the retained topics of a fleet say about it, as a table.

It reads through the MQTT transport like any participant, as an observer: no presence,
no session left on the broker, only presences, summaries and the manifest (no weights).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from edge_client import messages as m
from edge_client.config import BrokerConfig
from edge_client.documents import (
    CloudSummary,
    DeviceSummary,
    Document,
    ModelManifest,
    Prediction,
    StationSummary,
)
from edge_client.inference import FallingBehind
from edge_client.metrics import counted
from edge_client.mqtt import MqttTransport
from edge_client.states import StationState
from edge_client.topics import (
    CLOUD_ID,
    document_filters,
    manifest_topic,
    participant_of,
    predictions_topic,
    presence_filters,
    summary_topic,
)

from .fleet_file import CONNECTIONS_AT_1024

__all__ = ["FleetStatus", "fleet_status", "format_status", "observer", "watch_predictions",
           "prediction_age", "STALE_PREDICTION_S"]

# A device whose last prediction is older than this is not predicting now (the page and
# safl status say so): a line's camera predicts each frame its budget allows, and a slow
# [inference] fps is a frame every few seconds.
STALE_PREDICTION_S = 30.0


def prediction_age(last: float | None, now: float | None = None) -> float | None:
    """Seconds since a device's last prediction, on this host's clock (None before one)."""
    return None if last is None else round(max(0.0, (now or time.time()) - last), 1)


@dataclass
class FleetStatus:
    # (role, id) -> online
    presence: dict[tuple[m.Participant, str], bool] = field(default_factory=dict)
    stations: dict[str, StationSummary] = field(default_factory=dict)
    cloud: CloudSummary | None = None
    manifest: ModelManifest | None = None
    devices: dict[str, DeviceSummary] = field(default_factory=dict)  # what each says of itself

    def take(self, doc: Document) -> None:
        """Keep a retained document (a prediction is not the fleet's state)."""
        if isinstance(doc, StationSummary):
            self.stations[doc.station] = doc
        elif isinstance(doc, CloudSummary):
            self.cloud = doc
        elif isinstance(doc, ModelManifest):
            self.manifest = doc
        elif isinstance(doc, DeviceSummary):
            self.devices[doc.device] = doc


def observer(broker: BrokerConfig, fleet: str, found: FleetStatus, name: str = "status",
             on_document: Callable[[Document], None] | None = None) -> MqttTransport:
    """A transport (not yet connected) that keeps ``found`` up to date with the fleet's
    presences and documents, as an observer: no presence, no session left on the broker,
    nothing but what the monitor's credentials may read.  ``on_document`` sees each
    document after ``found`` took it."""
    def on_presence(topic: str, message: m.Message) -> None:
        if isinstance(message, m.Presence):
            found.presence[(message.role, message.sender)] = message.online

    def on_doc(topic: str, doc: Document) -> None:
        if not _from_its_subject(topic, fleet, doc):
            transport.counters["rejected.document_sender"] += 1
            return
        found.take(doc)
        if on_document is not None:
            on_document(doc)

    transport = MqttTransport(broker, client_id=f"safl-{name}-{time.time_ns()}", fleet=fleet,
                              persistent=False)
    for topic_filter in presence_filters(fleet):
        transport.subscribe(topic_filter, on_presence)
    for topic_filter in document_filters(fleet):
        transport.subscribe_documents(topic_filter, on_doc)
    return transport


def _from_its_subject(topic: str, fleet: str, doc: Document) -> bool:
    """Whether ``doc`` came on its subject's own topic (which the broker lets only that
    participant write): a device's summary may not speak for another device."""
    who = participant_of(topic, fleet)
    if isinstance(doc, DeviceSummary):
        return who is not None and who[:2] == (m.Participant.DEVICE, doc.device)
    if isinstance(doc, StationSummary):
        return who is not None and who[:2] == (m.Participant.STATION, doc.station)
    return topic in (summary_topic(fleet, m.Participant.CLOUD, CLOUD_ID), manifest_topic(fleet))


def fleet_status(broker: BrokerConfig, fleet: str, wait: float = 1.5,
                 until: Callable[[FleetStatus], bool] | None = None) -> FleetStatus:
    """Collect what is retained under ``safl/<fleet>/`` for ``wait`` seconds, or until
    ``until(found)`` holds (a caller that knows whom it waits for)."""
    found = FleetStatus()
    _listen(observer(_quick(broker), fleet, found), wait,
            (lambda: until(found)) if until is not None else lambda: False)
    return found


def _quick(broker: BrokerConfig) -> BrokerConfig:
    """An operator's command fails fast on a wrong address, not retrying like a service."""
    return dataclasses.replace(broker, connect_timeout=min(broker.connect_timeout, 10.0))


def _listen(transport: MqttTransport, seconds: float,
            enough: Callable[[], bool] = lambda: False) -> None:
    """Connect, deliver what arrives for ``seconds`` (0: until interrupted) or until
    ``enough()``, then close."""
    transport.connect()
    try:
        end = time.monotonic() + seconds if seconds else float("inf")
        while time.monotonic() < end and not enough():
            transport.deliver()
            transport.wait(min(0.1, max(0.0, end - time.monotonic())))
        transport.deliver()
    finally:
        transport.close()


# Ids a line names before it counts the rest: a thousand-device fleet's status stays a page.
SHOWN = 20


def _some(items: Sequence[str]) -> str:
    """The first ``SHOWN`` of ``items``, and how many more."""
    more = len(items) - SHOWN
    return ", ".join(items[:SHOWN]) + (f" and {more} more" if more > 0 else "")


def _fraction(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _devices_accuracy(doc) -> str:
    """Held-out and prequential accuracy of the devices: mean (worst 10%)."""
    parts = [f"{name} {_fraction(getattr(doc, f'{key}_mean'))} "
             f"({_fraction(getattr(doc, f'{key}_worst10'))})"
             for key, name in (("local", "held-out"), ("prequential", "prequential"))
             if getattr(doc, f"{key}_mean") is not None]
    return ("  " + ", ".join(parts)) if parts else ""


def _device_lines(found: FleetStatus) -> list[str]:
    """How many devices are online, which are not, and whose models are kept out of use."""
    devices = {s: o for (r, s), o in found.presence.items() if r == m.Participant.DEVICE}
    lines = [f"devices online: {sum(devices.values())} of {len(devices)} seen"]
    offline = sorted(d for d, o in devices.items() if not o)
    if offline:
        lines.append("devices offline: " + _some(offline))
    quiet = [f"{d} (" + (f"camera lost {doc.camera_outage:.0f} s, " if doc.camera_outage
                         else "") + f"last {age:.0f} s ago)"
             for d, doc in sorted(found.devices.items())
             if (age := prediction_age(doc.last_prediction)) is not None
             and age > STALE_PREDICTION_S]
    if quiet:
        lines.append("not predicting now: " + _some(quiet))
    behind = [f"{d} ({share:.0%} of frames unpredicted)"
              for d, doc in sorted(found.devices.items())
              if (share := doc.predictions_behind) is not None and share > FallingBehind.BEHIND]
    if behind:
        lines.append("predictions falling behind: " + _some(behind))
    lost = [f"{d} {doc.camera_outage:.0f} s" for d, doc in sorted(found.devices.items())
            if doc.camera_outage and prediction_age(doc.last_prediction) is None]
    if lost:
        lines.append("cameras lost: " + _some(lost))
    lines += _drift_lines(found)
    kept = {d: doc for d, doc in sorted(found.devices.items())
            if doc.counters.get("promotions_refused")}
    if kept:
        lines.append("models kept out of use: " + _some([
            f"{d} {doc.counters['promotions_refused']} (predicts with round "
            f"{doc.deployed_round}, last candidate {_fraction(doc.shadow_accuracy)})"
            for d, doc in kept.items()]))
    return lines


def _drift_lines(found: FleetStatus) -> list[str]:
    """Devices whose prequential accuracy fell, by their stations' detectors (drift.py):
    the level each fell from and where it is now, by its own summary; and stations that
    watch none, with why."""
    fell, unnamed = [], 0
    for _, doc in sorted(found.stations.items()):
        unnamed += max(0, doc.devices_drifting - len(doc.drifting))  # a station's claim
        for d, level in sorted(doc.drifting.items()):
            now = found.devices[d].prequential_accuracy if d in found.devices else None
            fell.append(f"{d} (from {level:.3f} to {_fraction(now)})")
    lines = [f"drifting, prequential accuracy fell: {_some(fell)}"
             + (f" and {unnamed} more their stations did not name" if unnamed else "")
             ] if fell or unnamed else []
    return lines + [f"{sid} watches no camera for drift: {doc.drift_off}"
                    for sid, doc in sorted(found.stations.items()) if doc.drift_off]


def _product_lines(found: FleetStatus) -> list[str]:
    """The fleet's products as the cloud tells them, the frames devices hold for products
    to come, and a catalogue the cloud or a device would not follow (catalogue.py)."""
    cloud, lines = found.cloud, []
    if cloud is not None and cloud.products:
        lines.append(f"products: {', '.join(cloud.products)}; "
                     f"{cloud.classes - len(cloud.products)} of {cloud.classes} classes free"
                     + (f"; retired: {', '.join(cloud.retired)}" if cloud.retired else ""))
    if cloud is not None and cloud.counters.get("catalogue.reload_refused"):
        lines.append(f"ERROR cloud: its rewritten file was not followed "
                     f"({cloud.counters['catalogue.reload_refused']} times, "
                     "catalogue.reload_refused): its log says why")
    held = {d: doc.labels_held for d, doc in sorted(found.devices.items()) if doc.labels_held}
    if held:
        lines.append("labels held for products to come: "
                     + _some([f"{d} {n}" for d, n in held.items()]))
    refusing = [d for d, doc in sorted(found.devices.items())
                if doc.counters.get("catalogue.refused")]
    if refusing:
        lines.append(f"ERROR {_some(refusing)}: refused the cloud's products "
                     "(catalogue.refused): provisioned from another fleet file")
    return lines


def format_status(found: FleetStatus, fleet: str) -> str:
    """Stations, devices online, round, iteration, last accuracy and upload counts."""
    lines = [f"fleet {fleet}"]
    cloud = found.cloud
    online = found.presence.get((m.Participant.CLOUD, CLOUD_ID))
    acc = cloud.accuracy if cloud else None
    lines.append(f"cloud: {'online' if online else 'offline' if online is False else 'unknown'}"
                 f", state {cloud.state if cloud else '?'}, round "
                 f"{cloud.round if cloud else '?'}, iteration {cloud.iteration if cloud else '?'}"
                 f", last accuracy {'-' if acc is None else f'{acc:.4f}'}"
                 + (_devices_accuracy(cloud) if cloud else "")
                 + (f", central DP epsilon up to {cloud.epsilon_cloud:.3g} a station"
                    if cloud and cloud.epsilon_cloud is not None else ""))
    lines += _product_lines(found) + _device_lines(found)
    lines.append(f"{'station':<10} {'presence':<9} {'state':<11} {'round':>5} {'iter':>5} "
                 f"{'online':>7} {'uploads':>8} {'skips':>6} {'rejected':>9}  device accuracy")
    stations = sorted({s for (r, s) in found.presence if r == m.Participant.STATION}
                      | set(found.stations))
    for sid in stations:
        doc = found.stations.get(sid)
        presence = found.presence.get((m.Participant.STATION, sid))
        if doc is None:
            lines.append(f"{sid:<10} {('online' if presence else 'offline'):<9} {'?':<11} "
                         f"{'?':>5} {'?':>5} {'?':>7} {0:>8} {0:>6} {0:>9}")
            continue
        rejected = counted({**doc.counters, **doc.transport}, "rejected.")
        lines.append(f"{sid:<10} {('online' if presence else 'offline'):<9} "
                     f"{doc.state:<11} {doc.round:>5} {doc.iteration:>5} "
                     f"{f'{doc.online}/{doc.devices}':>7} "
                     f"{doc.counters.get('received_updates', 0):>8} "
                     f"{doc.counters.get('received_skips', 0):>6} {rejected:>9}"
                     f"{_devices_accuracy(doc)}"
                     + (f", local DP epsilon up to {doc.epsilon_local:.3g}"
                        if doc.epsilon_local else "")
                     + (f", central DP epsilon up to {doc.epsilon_central:.3g}"
                        if doc.epsilon_central is not None else "")
                     + (f", updates as {doc.update_stages}"
                        if doc.update_stages != m.MODEL_ENCODING else ""))
    # A role's last unexpected error, at the top of its own line: the log says more.
    errors = [("cloud", cloud.error)] if cloud is not None and cloud.error else []
    errors += [(sid, found.stations[sid].error) for sid in stations
               if sid in found.stations and found.stations[sid].error]
    failing = [(d, doc.error) for d, doc in sorted(found.devices.items()) if doc.error]
    errors += failing[:SHOWN]
    lines += [f"ERROR {who}: {error} (its log has the traceback)" for who, error in errors]
    if len(failing) > SHOWN:
        lines.append(f"ERROR and {len(failing) - SHOWN} devices more in error")
    for doc in (found.stations[sid] for sid in stations if sid in found.stations):
        if doc.state == StationState.GATHERING:
            lines.append(f"{doc.station} waits for devices: {doc.online} online, "
                         f"quorum {doc.quorum}")
        if doc.state == StationState.JOINING and doc.missing:
            lines.append(f"{doc.station} waits for its roster: missing {_some(doc.missing)}"
                         + (" (past about 1,000 devices a broker under the usual 1,024 file "
                            "descriptors refuses the rest: docs/deploy.md)"
                            if doc.devices > CONNECTIONS_AT_1024 else ""))
    return "\n".join(lines)


def format_prediction(device: str, doc: Prediction) -> str:
    """One prediction as ``safl predictions`` prints it."""
    return (f"{device} frame {doc.frame} t {doc.t:.3f}"
            + (f" item_t {doc.item_t:.3f}" if doc.item_t is not None else "")
            + f" label {doc.label}" + (f" ({doc.product})" if doc.product else "")
            + f" confidence {doc.confidence:.3f} model round "
            f"{doc.model_round} latency {doc.latency_ms:.0f} ms")


def watch_predictions(broker: BrokerConfig, fleet: str, devices: tuple[str, ...] = (), *,
                      seconds: float = 0.0, count: int = 0,
                      emit: Callable[[str], None] = print) -> int:
    """Print the predictions of ``devices`` (every device the credentials may read, where
    none are named) as they arrive, for ``seconds`` (0: until interrupted) or until
    ``count`` were printed; returns how many were.  A line application's certificate reads
    its own devices' predictions; the monitor's reads none (docs/deploy.md)."""
    transport = MqttTransport(_quick(broker), client_id=f"safl-predictions-{time.time_ns()}",
                              fleet=fleet, persistent=False)
    printed = 0

    def on_doc(topic: str, doc: Document) -> None:
        nonlocal printed
        who = participant_of(topic, fleet)
        if isinstance(doc, Prediction) and who is not None and (not count or printed < count):
            emit(format_prediction(who[1], doc))
            printed += 1
    for device in devices or ("+",):
        transport.subscribe_documents(predictions_topic(fleet, device), on_doc)
    _listen(transport, seconds, lambda: bool(count) and printed >= count)
    return printed
