"""The fleet file ``safl provision`` reads: the fleet's name, its cloud, its stations with
their devices, the line applications that read predictions and publish labels, the model
and training settings every participant shares, and where brokers, metrics and the
monitor listen; each key checked, ids unique across the fleet and the reserved ones (the
cloud, the monitor, the default lines' logins) refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge_client.config import ModelConfig, TrainingSettings, check_id, from_mapping, read_toml
from edge_client.errors import ConfigError
from edge_client.pipeline import UpdatePipeline

# Clients a broker with a soft limit of 1,024 descriptors serves, with room for the station,
# its lines, the monitor and the bridge (Mosquitto refused past 1,015: docs/scale.md).
CONNECTIONS_AT_1024 = 950


__all__ = ["FleetFile", "StationEntry", "LineEntry", "load_fleet_file", "line_id", "MONITOR",
           "STATUS", "watch_id"]

MONITOR = "monitor"  # read-only user for `safl monitor`'s page
# `safl status`'s own read-only user: a broker binds client ids to certificate names, and a
# status run on the monitor's certificate took the page's session.
STATUS = "status"


RESERVED_IDS = frozenset({MONITOR, STATUS, "cloud"})  # the logins no participant may take
RESERVED_PREFIXES = ("line-", "watch-")  # the lines' logins: line-<station>, watch-<line>


def watch_id(line: str) -> str:
    """The login of ``safl predictions`` for ``line``: read-only, beside the application's."""
    return f"watch-{line}"


def line_id(station: str) -> str:
    """The default line application of a station (its devices no ``[[lines]]`` entry
    names): it reads their predictions and publishes their labels."""
    return f"line-{station}"


@dataclass(frozen=True)
class StationEntry:
    id: str
    host: str
    port: int
    devices: tuple[str, ...]
    bind: str = ""  # the address its broker listens on ("": every interface)


@dataclass(frozen=True)
class LineEntry:
    """A line application (an inspection station, a PLC gateway): its own certificate,
    reading its devices' predictions and writing their label topics, and nobody else's."""

    id: str
    station: str
    devices: tuple[str, ...]


@dataclass(frozen=True)
class FleetFile:
    name: str
    cloud_host: str
    cloud_port: int
    stations: tuple[StationEntry, ...]
    # What every device's update passes through (edge_client/pipeline.py): written into each
    # device.toml and station.toml alike, so a station decodes what its devices send.
    update_stages: tuple[str, ...] = ()
    # Prometheus: the cloud serves /metrics on this port, stations on the next, devices on
    # the one after (0: none), and provisioning writes a scrape configuration; devices are
    # reached at their ``host`` from the fleet file, or at their id as a host name.
    metrics_port: int = 0
    device_hosts: tuple[tuple[str, str], ...] = ()
    lines: tuple[LineEntry, ...] = ()
    cloud_bind: str = ""  # the cloud broker's listening address ("": every interface)
    # Where every service's /metrics and the monitor's page listen: loopback unless the
    # fleet file opens them (a central Prometheus needs metrics_bind = "0.0.0.0").
    metrics_bind: str = "127.0.0.1"
    monitor_http: str = "127.0.0.1:8080"
    # What every participant trains and how: one [model] table, and the batch a station
    # bounds its devices' claims by, written alike into every role's file.
    model: ModelConfig = ModelConfig()
    training: TrainingSettings = TrainingSettings()
    cameras: tuple[tuple[str, str], ...] = ()  # a device's camera uri, where the file says
    # The cloud's rounds before the final model; 0: none, the line learns until stopped.
    rounds: int = 0


def load_fleet_file(path: str | Path) -> FleetFile:
    """Parse and check a fleet file; every problem names the key or the id."""
    doc = read_toml(path, "fleet")
    fleet = doc.get("fleet", {})
    for key in ("name", "cloud_host"):
        if not isinstance(fleet.get(key), str) or not fleet[key]:
            raise ConfigError(f"fleet.{key}", "is required")
    check_id("fleet.name", fleet["name"])
    stages = fleet.get("update_stages", [])
    if not isinstance(stages, list) or not all(isinstance(x, str) for x in stages):
        raise ConfigError("fleet.update_stages", "must be a list of stages, as [\"int8:256\"]")
    try:
        UpdatePipeline(stages)
    except ConfigError as exc:
        raise ConfigError("fleet.update_stages", str(exc).split(": ", 1)[-1]) from None
    seen: set[str] = set()
    stations = _stations(doc, seen)
    if not stations:
        raise ConfigError("stations", "the fleet needs at least one station")
    if seen & RESERVED_IDS:
        raise ConfigError("stations.id", f"{sorted(RESERVED_IDS)} are reserved ids")
    lines = sorted(i for i in seen if i.startswith(RESERVED_PREFIXES))
    if lines:
        raise ConfigError("stations.id", f"{lines[0]!r}: ids beginning 'line-' and 'watch-' "
                          "are the factory lines' logins")
    metrics_port = fleet.get("metrics_port", 0)
    if type(metrics_port) is not int or not 0 <= metrics_port <= 65533:
        raise ConfigError("fleet.metrics_port", f"must be a port number up to 65533 (the "
                          f"cloud's; stations take the next, devices the one after; 0: none), "
                          f"got {metrics_port!r}")
    hosts = tuple((str(raw["id"]), str(raw["host"])) for raw in doc.get("devices", [])
                  if raw.get("host"))
    cameras = tuple((str(raw["id"]), str(raw["camera"])) for raw in doc.get("devices", [])
                    if raw.get("camera"))
    model = _table(ModelConfig, "model", doc)
    if cameras and len(model.input_shape) < 2:  # before anything is written, not midway
        raise ConfigError("devices.camera", f"device {cameras[0][0]} names a camera, and the "
                          f"fleet's model takes vectors of shape {list(model.input_shape)}, "
                          "not frames")
    rounds = fleet.get("rounds", 0)
    if type(rounds) is not int or rounds < 0:
        raise ConfigError("fleet.rounds", f"must be a whole number of rounds (0: learn until "
                          f"stopped), got {rounds!r}")
    unknown = sorted(set(fleet) - _FLEET_KEYS)
    if unknown:
        raise ConfigError(f"fleet.{unknown[0]}", f"unknown key; known: {sorted(_FLEET_KEYS)}")
    monitor_http = str(fleet.get("monitor_http", "127.0.0.1:8080"))
    host, _, port = monitor_http.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError("fleet.monitor_http", f"must be HOST:PORT, got {monitor_http!r}")
    return FleetFile(fleet["name"], fleet["cloud_host"], int(fleet.get("cloud_port", 8883)),
                     tuple(stations), tuple(stages), metrics_port, hosts,
                     _lines(doc.get("lines", []), stations, seen),
                     _address("fleet.cloud_bind", fleet.get("cloud_bind", "")),
                     _address("fleet.metrics_bind", fleet.get("metrics_bind", "127.0.0.1")),
                     monitor_http, model,
                     _table(TrainingSettings, "training", doc), cameras, rounds)


def _stations(doc: dict[str, Any], seen: set[str]) -> list[StationEntry]:
    """The ``[[stations]]`` with their devices, and the devices listed apart: a
    ``[[devices]]`` entry adds a device to its station, or says more (host, camera) of one
    a station lists already.  Every id joins ``seen``."""
    stations = []
    for raw in doc.get("stations", []):
        sid = raw.get("id")
        check_id("stations.id", sid)
        if sid in seen:
            raise ConfigError("stations.id", f"duplicate id {sid!r}")
        seen.add(sid)
        devices = tuple(raw.get("devices", ()))
        for did in devices:
            check_id("stations.devices", did)
            if did in seen:
                raise ConfigError("stations.devices", f"duplicate id {did!r}")
            seen.add(did)
        stations.append(StationEntry(sid, str(raw.get("host", "127.0.0.1")),
                                     int(raw.get("port", 8883)), devices,
                                     _address("stations.bind", raw.get("bind", ""))))
    listed = {d: s.id for s in stations for d in s.devices}
    for raw in doc.get("devices", []):
        if raw.get("station") not in {s.id for s in stations}:
            raise ConfigError("devices.station", f"device {raw.get('id')!r} names unknown "
                              f"station {raw.get('station')!r}")
    extra: dict[str, list[str]] = {}
    for raw in doc.get("devices", []):
        check_id("devices.id", raw.get("id"))
        if listed.get(raw["id"]) == raw["station"]:
            continue
        if raw["id"] in seen:
            raise ConfigError("devices.id", f"duplicate id {raw['id']!r}")
        seen.add(raw["id"])
        extra.setdefault(raw["station"], []).append(raw["id"])
    stations = [StationEntry(s.id, s.host, s.port, s.devices + tuple(extra.get(s.id, ())),
                             s.bind) for s in stations]
    return stations


_FLEET_KEYS = {"name", "cloud_host", "cloud_port", "update_stages", "metrics_port",
               "cloud_bind", "metrics_bind", "monitor_http", "rounds"}


def _address(key: str, value: Any) -> str:
    if not isinstance(value, str) or any(c in value for c in " /\t"):  # "::" is IPv6's all
        raise ConfigError(key, f"must be a host name or address to listen on, got {value!r}")
    return value


def _table(cls: type, name: str, doc: dict[str, Any]) -> Any:
    """The fleet's ``[model]`` or ``[training]`` table, checked as the roles will check it."""
    raw = doc.get(name, {})
    if not isinstance(raw, dict):
        raise ConfigError(name, "must be a table")
    if name == "training" and "update_stages" in raw:
        raise ConfigError("training.update_stages", "belongs in [fleet]")
    try:
        return from_mapping(cls, raw, name)
    except ConfigError as exc:
        raise ConfigError(f"{name}.{exc.key}", exc.problem) from None


def _lines(raws: list[dict[str, Any]], stations: list[StationEntry], seen: set[str]
           ) -> tuple[LineEntry, ...]:
    """The declared ``[[lines]]``, then a default line per station for the devices none of
    them names.  A device belongs to one line at most: two applications publishing one
    device's labels would contradict each other."""
    by_station = {s.id: s for s in stations}
    lines: list[LineEntry] = []
    owner: dict[str, str] = {}
    for raw in raws:
        lid, sid = str(raw.get("id", "")), str(raw.get("station", ""))
        check_id("lines.id", lid)
        if lid in seen or lid in RESERVED_IDS or lid.startswith(RESERVED_PREFIXES):
            raise ConfigError("lines.id", f"{lid!r} is taken, or reserved (ids beginning "
                              "'line-' and 'watch-' are the lines' logins)")
        seen.add(lid)
        if sid not in by_station:
            raise ConfigError("lines.station", f"line {lid!r} names unknown station {sid!r}")
        devices = tuple(raw.get("devices", ()))
        for did in devices:
            if did not in by_station[sid].devices:
                raise ConfigError("lines.devices", f"line {lid!r}: {did!r} is not a device of "
                                  f"station {sid!r}")
            if did in owner:
                raise ConfigError("lines.devices", f"{did!r} is on lines {owner[did]!r} and "
                                  f"{lid!r}: its labels need one publisher")
            owner[did] = lid
        if not devices:
            raise ConfigError("lines.devices", f"line {lid!r} names no device")
        lines.append(LineEntry(lid, sid, devices))
    for s in stations:
        rest = tuple(d for d in s.devices if d not in owner)
        if rest:
            lines.append(LineEntry(line_id(s.id), s.id, rest))
    return tuple(lines)
