"""``safl status``: what the retained topics of a fleet say about it, as a table."""

from __future__ import annotations

import json
import time

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion

from edge_client import messages as m
from edge_client.codec import decode
from edge_client.config import BrokerConfig
from edge_client.errors import MessageError
from edge_client.mqtt import ConnectError

__all__ = ["fleet_status", "format_status"]


def fleet_status(broker: BrokerConfig, fleet: str, wait: float = 1.5) -> dict:
    """Collect presences and summaries retained under ``safl/<fleet>/``."""
    found: dict = {"presence": {}, "summary": {}, "manifest": None}

    def on_message(client, userdata, msg) -> None:
        if msg.topic.endswith("/status"):
            try:
                presence = decode(msg.payload, max_size=1 << 16).message
            except MessageError:
                return
            if isinstance(presence, m.Presence):
                found["presence"][(presence.role, presence.sender)] = presence.online
        elif msg.topic.endswith(("/summary", "/manifest")):
            try:
                doc = json.loads(msg.payload)
            except ValueError:
                return
            key = "manifest" if msg.topic.endswith("/manifest") else None
            if key:
                found["manifest"] = doc
            else:
                found["summary"][msg.topic.split("/")[-2]] = doc

    client = paho.Client(CallbackAPIVersion.VERSION2, client_id=f"safl-status-{time.time_ns()}")
    if broker.username:
        client.username_pw_set(broker.username, broker.password or None)
    if broker.tls:
        client.tls_set(ca_certs=broker.ca or None, certfile=broker.cert or None,
                       keyfile=broker.key or None)
    client.on_message = on_message
    client.on_connect = lambda c, *a: c.subscribe(f"safl/{fleet}/#", qos=1)
    host, port = broker.host_port
    try:
        client.connect(host, port, 10)
    except OSError as exc:
        raise ConnectError(f"cannot reach {broker.url}: {exc}") from exc
    end = time.monotonic() + wait
    while time.monotonic() < end:
        client.loop(timeout=0.1)
    client.disconnect()
    return found


def format_status(found: dict, fleet: str) -> str:
    """Stations, devices online, round, iteration, last accuracy and upload counts."""
    lines = [f"fleet {fleet}"]
    cloud = found["summary"].get("cloud") or {}
    online = found["presence"].get(("cloud", "cloud"))
    acc = cloud.get("accuracy")
    lines.append(f"cloud: {'online' if online else 'offline' if online is False else 'unknown'}"
                 f", state {cloud.get('state', '?')}, round {cloud.get('round', '?')}, "
                 f"iteration {cloud.get('iteration', '?')}, last accuracy "
                 f"{'-' if acc is None else f'{acc:.4f}'}")
    devices = {s: o for (r, s), o in found["presence"].items() if r == "dev"}
    lines.append(f"devices online: {sum(devices.values())} of {len(devices)} seen")
    lines.append(f"{'station':<10} {'presence':<9} {'state':<11} {'round':>5} {'iter':>5} "
                 f"{'online':>7} {'uploads':>8} {'skips':>6} {'rejected':>9}")
    stations = sorted({s for (r, s) in found["presence"] if r == "station"}
                      | {k for k in found["summary"] if k != "cloud"})
    for sid in stations:
        doc = found["summary"].get(sid, {})
        counters = doc.get("counters", {})
        rejected = sum(v for k, v in {**counters, **doc.get("transport", {})}.items()
                       if k.startswith("rejected."))
        presence = found["presence"].get(("station", sid))
        lines.append(f"{sid:<10} {('online' if presence else 'offline'):<9} "
                     f"{doc.get('state', '?'):<11} {doc.get('round', '?'):>5} "
                     f"{doc.get('iteration', '?'):>5} "
                     f"{str(doc.get('online', '?')) + '/' + str(doc.get('devices', '?')):>7} "
                     f"{counters.get('received_updates', 0):>8} "
                     f"{counters.get('received_skips', 0):>6} {rejected:>9}")
    for sid in stations:
        doc = found["summary"].get(sid, {})
        if doc.get("state") == "starved":
            lines.append(f"{sid} waits for devices: {doc.get('online', '?')} online, "
                         f"quorum {doc.get('quorum', '?')}")
        if doc.get("state") == "joining" and doc.get("missing"):
            lines.append(f"{sid} waits for its roster: missing {', '.join(doc['missing'])}")
    return "\n".join(lines)
