"""``safl provision``: a fleet file in, every credential, broker config and role config out.

Output folder (``--out``):

- ``ca/``: the fleet CA (never replaced without ``--force``) and its CRL;
- ``cloud/``: the cloud broker (``broker/``: server certificate, ``mosquitto.conf``, ``acl``)
  and ``cloud.toml`` with the cloud's client certificate;
- ``stations/<sid>/``: the factory broker with its TLS bridge to the cloud, ``station.toml``;
- ``devices/<did>/``: ``device.toml``, a client certificate and key;
- ``monitor/``: a status-only certificate and ``status-<broker>.toml`` for ``safl status``;
- ``state.json``: ids issued and revoked, revoked serials, so re-runs only add.

A client certificate is its participant's identity: brokers require one and take its common
name as the username and as the client id (no passwords anywhere, and no session anyone else
can take over).  ACLs grant exact topics: devices write their
``dev/<id>/{stats,update,status}`` and read their station's model, selection and presence;
stations write their own topics and read their devices and the cloud's; the monitor reads
presence and summaries only.  ``--revoke`` puts the certificate on the CRL every listener
loads; after the brokers reload it, ``--kick`` ends the revoked participant's live
connections (:func:`kick`).  Private keys and ``state.json`` are 0600, every folder 0700.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from edge_client import topics
from edge_client.codec import DEFAULT_CHUNK_SIZE
from edge_client.config import BrokerConfig, check_id, read_toml, toml_text
from edge_client.errors import ConfigError, SaflError
from edge_client.messages import Participant
from edge_client.mqtt import MqttTransport
from edge_client.pipeline import UpdatePipeline
from edge_client.topics import CLOUD_LEAVES, DEVICE_LEAVES, STATION_LEAVES

from .pki import issue, make_ca, serial_of, write_crl, write_private
from .prometheus import ALERT_RULES, scrape_config

__all__ = ["FleetFile", "load_fleet_file", "provision", "kick", "MAX_PACKET"]

MONITOR = "monitor"  # read-only user for `safl status`
_DEV, _STATION, _CLOUD = Participant.DEVICE, Participant.STATION, Participant.CLOUD


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


# Every frame travels in chunks of at most this size; brokers refuse packets much larger.
CHUNK_SIZE = DEFAULT_CHUNK_SIZE
MAX_PACKET = CHUNK_SIZE + 4096  # the chunk plus MQTT's fixed header, topic and properties
STATION_UP = ("update", "stats", "status", "summary")  # what the bridge carries to the cloud


def _broker_conf(folder: Path, port: int, prefix: Path, extra: Sequence[str] = ()) -> str:
    ca = prefix / "ca"
    lines = [
        "# Generated by safl provision. Every client shows a certificate from the fleet CA and",
        "# acts as the participant its certificate names (no passwords); the ACL grants each",
        "# its exact topics and the CRL refuses revoked certificates at the handshake.",
        "per_listener_settings false",
        f"listener {port}",
        f"cafile {ca / 'ca.pem'}", f"crlfile {ca / 'crl.pem'}",
        f"certfile {folder / 'server.pem'}", f"keyfile {folder / 'server.key'}",
        "require_certificate true",
        "use_identity_as_username true",
        "# The client id is the certificate's name too: nobody can take over another",
        "# participant's session (kick it off, fire its Last Will, discard its queue).",
        "use_username_as_clientid true",
        "allow_anonymous false",
        f"acl_file {folder / 'acl'}",
        "persistence true",
        f"persistence_location {folder / 'data'}/",
        f"# Frames travel in chunks of at most {CHUNK_SIZE} bytes: a larger packet ends the",
        "# session, so a client can park only a few bounded retained messages.",
        f"max_packet_size {MAX_PACKET}",
        "max_queued_messages 10000",
        "set_tcp_nodelay true",
        "log_type error", "log_type warning", "log_type notice",
    ]
    return "\n".join([*lines, *extra]) + "\n"


def _acl(rules: dict[str, list[str]]) -> str:
    out = ["# Generated by safl provision: one block per certificate name, exact topics."]
    for user, lines in rules.items():
        out += ["", f"user {user}", *lines]
    return "\n".join(out) + "\n"


def _grant(access: str, below: str, leaves: tuple[str, ...]) -> list[str]:
    return [f"topic {access} {below}/{leaf}" for leaf in leaves]


def _monitor_rules(fleet: str) -> list[str]:
    """Presence, summaries (devices' too) and the model manifest: never updates or models."""
    return [*_grant("read", topics.prefix(fleet, _STATION, "+"), ("status", "summary")),
            *_grant("read", topics.prefix(fleet, _DEV, "+"), ("status", "summary")),
            *_grant("read", topics.prefix(fleet, _CLOUD), ("status", "summary", "model/manifest"))]


class _State:
    """What re-runs need: ids issued, and the revoked ids and certificate serials."""

    def __init__(self, path: Path) -> None:
        self.path = path
        doc = json.loads(path.read_text()) if path.exists() else {}
        # Fleets provisioned before certificates were identities kept passwords here.
        issued = set(doc.get("issued", [])) | set(doc.get("passwords", {}))
        self.doc = {"issued": sorted(issued), "revoked": doc.get("revoked", []),
                    "revoked_serials": doc.get("revoked_serials", [])}

    def save(self) -> None:
        write_private(self.path, (json.dumps(self.doc, indent=2, sort_keys=True) + "\n").encode())


def provision(fleet_path: str | Path, out: str | Path, *, force: bool = False,
              revoke: tuple[str, ...] = (), prefix: str | Path | None = None) -> dict[str, list]:
    """Generate (or extend) a fleet's credentials and configs; returns what was created."""
    fleet = load_fleet_file(fleet_path)
    out = Path(out).resolve()
    if force and out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    run = _Provisioner(fleet, out, Path(prefix) if prefix else out, _State(out / "state.json"))
    if not (out / "ca" / "ca.pem").exists():
        make_ca(out / "ca", fleet.name)
        run.created["ca"].append(str(out / "ca"))
    revoked = run.revoke(revoke)
    stations = [s for s in fleet.stations if s.id not in revoked]
    run.issue_credentials(stations, revoked)
    cloud_url = run.cloud_broker(stations)
    for s in stations:
        run.station_broker(s, [d for d in s.devices if d not in revoked])
    for name, url in (("cloud", cloud_url), *((s.id, f"mqtts://{s.host}:{s.port}")
                                              for s in stations)):
        (out / "monitor" / f"status-{name}.toml").write_text(toml_text(
            {"broker": run.broker_section(MONITOR, url)}))
    if fleet.metrics_port:
        run.prometheus(stations, revoked)
    run.state.save()
    for folder in [out, *(p for p in out.rglob("*") if p.is_dir())]:
        folder.chmod(0o700)  # the provisioned tree holds every private key of the fleet
    return run.created


@dataclass
class _Provisioner:
    """One run of :func:`provision`: the fleet, where its tree goes (``out``) and where the
    configs say it lies (``prefix``), what re-runs remember, and what this run created."""

    fleet: FleetFile
    out: Path
    prefix: Path
    state: _State
    created: dict[str, list] = field(
        default_factory=lambda: {"ca": [], "credentials": [], "revoked": []})
    credential_dirs: dict[str, Path] = field(default_factory=dict)

    def revoke(self, users: tuple[str, ...]) -> set[str]:
        """Revoke ``users`` (their certificates join the CRL); every id revoked so far."""
        out, doc = self.out, self.state.doc
        known = ({d for s in self.fleet.stations for d in s.devices}
                 | {s.id for s in self.fleet.stations})
        for user in users:
            if user not in known and user not in doc["issued"]:
                raise ConfigError("revoke", f"{user!r} is not in the fleet")
            for cert in (out / "devices" / user / "client.pem",
                         out / "stations" / user / "client.pem"):
                if cert.exists() and serial_of(cert) not in doc["revoked_serials"]:
                    doc["revoked_serials"].append(serial_of(cert))
            if user not in doc["revoked"]:
                doc["revoked"].append(user)
                self.created["revoked"].append(user)
            shutil.rmtree(out / "devices" / user, ignore_errors=True)
        write_crl(out / "ca", doc["revoked_serials"])
        return set(doc["revoked"])

    def credential(self, folder: Path, user: str) -> Path:
        """``user``'s certificate and key in ``folder`` (issued once)."""
        if not (folder / "client.pem").exists():
            issue(self.out / "ca", folder / "client.pem", folder / "client.key", user)
            self.created["credentials"].append(user)
        if user not in self.state.doc["issued"]:
            self.state.doc["issued"].append(user)
        self.credential_dirs[user] = folder
        return folder

    def issue_credentials(self, stations: list[StationEntry], revoked: set[str]) -> None:
        out = self.out
        self.credential(out / "cloud" / "client", "cloud")
        self.credential(out / "monitor", MONITOR)
        for s in stations:
            self.credential(out / "stations" / s.id, s.id)
            self.credential(out / "stations" / s.id / "line", line_id(s.id))
            for did in s.devices:
                if did not in revoked:
                    self.credential(out / "devices" / did, did)

    def service_section(self) -> dict:
        """The ``[service]`` table: metrics for the fleet's Prometheus, where it has one."""
        port = self.fleet.metrics_port
        return {"service": {"metrics_port": port, "metrics_host": "0.0.0.0"}} if port else {}

    def prometheus(self, stations: list[StationEntry], revoked: set[str]) -> None:
        """``prometheus/prometheus.yml`` (a job per role) and its ``alerts.yml``: the cloud
        aggregator is scraped on the cloud broker's host, each station on its factory
        broker's."""
        fleet, port = self.fleet, self.fleet.metrics_port
        hosts = dict(fleet.device_hosts)
        targets = {"cloud": [("cloud", f"{fleet.cloud_host}:{port}")],
                   "station": [(s.id, f"{s.host}:{port}") for s in stations],
                   "device": [(d, f"{hosts.get(d, d)}:{port}") for s in stations
                              for d in s.devices if d not in revoked]}
        folder = self.out / "prometheus"
        folder.mkdir(exist_ok=True)
        (folder / "prometheus.yml").write_text(scrape_config(fleet.name, targets))
        (folder / "alerts.yml").write_text(ALERT_RULES)

    def broker_section(self, user: str, url: str) -> dict:
        """The ``[broker]`` table of ``user``'s config: its certificate is its login."""
        folder = self.prefix / _rel(self.out, self.credential_dirs[user])
        return {"url": url, "ca": str(self.prefix / "ca" / "ca.pem"),
                "cert": str(folder / "client.pem"), "key": str(folder / "client.key"),
                "chunk_size": CHUNK_SIZE}

    def _server(self, folder: Path, host: str) -> None:
        (folder / "data").mkdir(parents=True, exist_ok=True)
        if not (folder / "server.pem").exists():
            issue(self.out / "ca", folder / "server.pem", folder / "server.key", host,
                  hosts=(host,), server=True)

    def cloud_broker(self, stations: list[StationEntry]) -> str:
        """The cloud broker (the cloud, each station's bridge, the monitor) and the cloud's
        config; returns the broker's address."""
        fleet, name = self.fleet, self.fleet.name
        folder = self.out / "cloud" / "broker"
        self._server(folder, fleet.cloud_host)
        (folder / "mosquitto.conf").write_text(_broker_conf(
            self.prefix / "cloud" / "broker", fleet.cloud_port, self.prefix))
        rules = {"cloud": [*_grant("write", topics.prefix(name, _CLOUD), CLOUD_LEAVES),
                           *_grant("read", topics.prefix(name, _STATION, "+"), STATION_UP)],
                 MONITOR: _monitor_rules(name)}
        for s in stations:
            rules[s.id] = [*_grant("write", topics.prefix(name, _STATION, s.id), STATION_UP),
                           *_grant("read", topics.prefix(name, _CLOUD), CLOUD_LEAVES)]
        (folder / "acl").write_text(_acl(rules))
        url = f"mqtts://{fleet.cloud_host}:{fleet.cloud_port}"
        (self.out / "cloud" / "cloud.toml").write_text(toml_text({
            "cloud": {"fleet": name, "stations": [s.id for s in stations], "rounds": 100},
            "model": {"name": "mlp"}, "broker": self.broker_section("cloud", url),
            **self.service_section()}))
        return url

    def station_broker(self, s: StationEntry, devices: list[str]) -> None:
        """A factory's broker (bridged to the cloud's), and the configs of its station, its
        devices and its line."""
        fleet, name, prefix = self.fleet, self.fleet.name, self.prefix
        folder = self.out / "stations" / s.id / "broker"
        self._server(folder, s.host)
        pb, cred = prefix / "stations" / s.id / "broker", prefix / "stations" / s.id
        bridge = [
            "", "# Only the station's reports go up and the cloud's model comes down: device",
            "# traffic stays on the factory network.  The bridge is the station: its",
            "# certificate is its identity on the cloud broker (no password to leak).",
            f"connection safl-{s.id}-to-cloud",
            f"address {fleet.cloud_host}:{fleet.cloud_port}",
            f"bridge_cafile {prefix / 'ca' / 'ca.pem'}",
            f"bridge_certfile {cred / 'client.pem'}", f"bridge_keyfile {cred / 'client.key'}",
            f"remote_clientid {s.id}", "cleansession false",
            "bridge_protocol_version mqttv311", "try_private true",
            *(f"topic {topics.prefix(name, _STATION, s.id)}/{leaf} out 1" for leaf in STATION_UP),
            *(f"topic {topics.prefix(name, _CLOUD)}/{leaf} in 1" for leaf in CLOUD_LEAVES),
        ]
        (folder / "mosquitto.conf").write_text(_broker_conf(pb, s.port, prefix, bridge))
        rules = {s.id: [*_grant("write", topics.prefix(name, _STATION, s.id), STATION_LEAVES),
                        *_grant("read", topics.prefix(name, _DEV, "+"), ("stats", "status")),
                        *(f"topic read {topics.prefix(name, _DEV, d)}/update" for d in devices),
                        *_grant("read", topics.prefix(name, _CLOUD), CLOUD_LEAVES)],
                 MONITOR: _monitor_rules(name),
                 line_id(s.id): [f"topic write {topics.line_prefix(s.id)}/#"]}
        for did in devices:
            rules[did] = [*_grant("write", topics.prefix(name, _DEV, did), DEVICE_LEAVES),
                          *_grant("read", topics.prefix(name, _STATION, s.id),
                                  ("model", "select", "status")),
                          f"topic read {topics.line_prefix(s.id)}/#"]
        (folder / "acl").write_text(_acl(rules))
        url = f"mqtts://{s.host}:{s.port}"
        stages = {"update_stages": list(fleet.update_stages)} if fleet.update_stages else {}
        (self.out / "stations" / s.id / "station.toml").write_text(toml_text({
            "station": {"fleet": name, "station_id": s.id, "devices": devices,
                        "super_node_size": max(1, min(4, len(devices))), **stages},
            "model": {"name": "mlp"}, "broker": self.broker_section(s.id, url),
            **self.service_section()}))
        for did in devices:
            (self.credential_dirs[did] / "device.toml").write_text(toml_text({
                "device": {"fleet": name, "device_id": did, "station": s.id, **stages},
                "model": {"name": "mlp"},
                "source": {"kind": "camera", "uri": "0", "label": 0},
                "broker": self.broker_section(did, url), **self.service_section()}))
        (self.out / "stations" / s.id / "line" / "line.toml").write_text(toml_text(
            {"broker": self.broker_section(line_id(s.id), url)}))


# A kick's certificate lives ten minutes and its key only in a temporary folder; its serial
# joins the CRL at once, so the next reload refuses it too.
_KICK_DAYS = 10 / (24 * 60)


def _brokers_of(fleet: FleetFile, user: str) -> list[str]:
    """Where ``user`` holds sessions: a device on its station's broker; a station on its own
    broker (the service) and on the cloud broker (its bridge)."""
    cloud = f"mqtts://{fleet.cloud_host}:{fleet.cloud_port}"
    for s in fleet.stations:
        if user == s.id:
            return [f"mqtts://{s.host}:{s.port}", cloud]
        if user in s.devices:
            return [f"mqtts://{s.host}:{s.port}"]
    return []


def kick(fleet_path: str | Path, out: str | Path, users: tuple[str, ...], *,
         timeout: float = 10.0) -> tuple[dict[str, list[str]], dict[str, str]]:
    """End the live sessions of revoked participants on every broker they use.

    A revoked certificate fails the handshake once a broker reloaded the CRL, but a
    connection opened before stays up.  With client ids bound to certificate names, the CA
    can end it: a short-lived certificate of the same name connects with a clean start,
    which makes the broker close the old connection and drop its session, and leaves at
    once.  Run it after the reload, or the revoked participant simply reconnects.  Returns
    the broker URLs where each user's session was ended, and the brokers that could not be
    reached with why.
    """
    fleet = load_fleet_file(fleet_path)
    out = Path(out).resolve()
    state = _State(out / "state.json")
    for user in users:
        if user not in state.doc["revoked"]:
            raise ConfigError("kick", f"{user!r} is not revoked: revoke it, reload the "
                              "brokers, then kick it")
    kicked: dict[str, list[str]] = {}
    failed: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        cert, key = Path(tmp) / "kick.pem", Path(tmp) / "kick.key"
        for user in users:
            issue(out / "ca", cert, key, user, days=_KICK_DAYS)
            state.doc["revoked_serials"].append(serial_of(cert))
            kicked[user] = []
            for url in _brokers_of(fleet, user):
                config = BrokerConfig(url=url, ca=str(out / "ca" / "ca.pem"), cert=str(cert),
                                      key=str(key), connect_timeout=timeout,
                                      handshake_timeout=min(5.0, timeout))
                transport = MqttTransport(config, client_id=user, fleet=fleet.name,
                                          persistent=False)
                try:
                    transport.connect()
                except SaflError as exc:
                    failed[url] = str(exc)
                    continue
                transport.close()
                kicked[user].append(url)
    write_crl(out / "ca", state.doc["revoked_serials"])
    state.save()
    return kicked, failed


def _rel(out: Path, folder: Path) -> Path:
    return folder.resolve().relative_to(out)
