"""The fleet file ``safl provision`` reads: the fleet's name, its cloud, its stations with
their devices, the update stages every participant shares and the metrics port, each key
checked, ids unique across the fleet and the reserved ones (the cloud, the monitor, the
factory lines' logins) refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from edge_client.config import check_id, read_toml
from edge_client.errors import ConfigError
from edge_client.pipeline import UpdatePipeline

__all__ = ["FleetFile", "StationEntry", "load_fleet_file", "line_id", "MONITOR"]

MONITOR = "monitor"  # read-only user for `safl status`


def line_id(station: str) -> str:
    """The factory line's login on a station's broker: it publishes labels below
    :func:`edge_client.topics.line_prefix` (an inspection station, a PLC gateway)."""
    return f"line-{station}"


@dataclass(frozen=True)
class StationEntry:
    id: str
    host: str
    port: int
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
    # Prometheus: every service serves /metrics on this port (0: none), and provisioning
    # writes a scrape configuration; devices are reached at their ``host`` from the fleet
    # file, or at their id as a host name.
    metrics_port: int = 0
    device_hosts: tuple[tuple[str, str], ...] = ()


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
    stations, seen = [], set()
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
                                     int(raw.get("port", 8883)), devices))
    for raw in doc.get("devices", []):  # devices listed apart must name a known station
        if raw.get("station") not in seen:
            raise ConfigError("devices.station", f"device {raw.get('id')!r} names unknown "
                              f"station {raw.get('station')!r}")
    extra: dict[str, list[str]] = {}
    for raw in doc.get("devices", []):
        check_id("devices.id", raw.get("id"))
        if raw["id"] in seen:
            raise ConfigError("devices.id", f"duplicate id {raw['id']!r}")
        seen.add(raw["id"])
        extra.setdefault(raw["station"], []).append(raw["id"])
    stations = [StationEntry(s.id, s.host, s.port, s.devices + tuple(extra.get(s.id, ())))
                for s in stations]
    if not stations:
        raise ConfigError("stations", "the fleet needs at least one station")
    if MONITOR in seen or "cloud" in seen:
        raise ConfigError("stations.id", f"'cloud' and {MONITOR!r} are reserved ids")
    lines = sorted(i for i in seen if i.startswith("line-"))
    if lines:
        raise ConfigError("stations.id", f"{lines[0]!r}: ids beginning 'line-' are the "
                          "factory lines' logins")
    metrics_port = fleet.get("metrics_port", 0)
    if type(metrics_port) is not int or not 0 <= metrics_port <= 65535:
        raise ConfigError("fleet.metrics_port", f"must be a port number (0: none), got "
                          f"{metrics_port!r}")
    hosts = tuple((str(raw["id"]), str(raw["host"])) for raw in doc.get("devices", [])
                  if raw.get("host"))
    return FleetFile(fleet["name"], fleet["cloud_host"], int(fleet.get("cloud_port", 8883)),
                     tuple(stations), tuple(stages), metrics_port, hosts)
