"""Provisioned fleets on real Mosquitto brokers: bridge, authentication, ACLs, revocation."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from brokers import free_port, wait_for_port

from aggregator.pki import serial_of
from aggregator.provision import load_fleet_file, provision
from edge_client import messages as m
from edge_client.config import BrokerConfig, load_config
from edge_client.errors import BrokerRefused, ConfigError, ConnectError
from edge_client.metrics import MetricsServer, render
from edge_client.mqtt import MqttTransport
from edge_client.service import DEVICE_TABLES, load_role_file
from edge_client.tls import check_pair
from edge_client.topics import topic_for

pytest.importorskip("cryptography")
needs_mosquitto = pytest.mark.skipif(shutil.which("mosquitto") is None,
                                     reason="Mosquitto is installed by .ci/run")

FLEET = """
[fleet]
name = "plant"
cloud_host = "127.0.0.1"
cloud_port = {cloud}

[[stations]]
id = "st0"
host = "127.0.0.1"
port = {st0}
devices = ["cam1", "cam2"]

[[stations]]
id = "st1"
host = "127.0.0.1"
port = {st1}
devices = ["cam3"]
"""


class Broker:
    def __init__(self, conf: Path, port: int) -> None:
        if os.geteuid() == 0:  # a root mosquitto drops to its own user, which cannot read tmp
            conf.write_text(conf.read_text() + "user root\n")
        self.log = open(conf.parent / "log.txt", "a")
        self.proc = subprocess.Popen(["mosquitto", "-c", str(conf)], stdout=self.log,
                                     stderr=subprocess.STDOUT)
        wait_for_port(port, self.proc)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(5)
        self.log.close()


@pytest.fixture
def fleet(tmp_path):
    ports = {"cloud": free_port(), "st0": free_port(), "st1": free_port()}
    path = tmp_path / "fleet.toml"
    path.write_text(FLEET.format(**ports))
    out = tmp_path / "fleet"
    provision(path, out)
    return path, out, ports


def _broker_cfg(out: Path, toml: Path) -> BrokerConfig:
    return load_config(BrokerConfig, "broker", toml)


def _transport(cfg: BrokerConfig, client_id: str, fleet="plant") -> MqttTransport:
    return MqttTransport(cfg, client_id=client_id, fleet=fleet)


def _wait(transport, got, n, seconds=10.0):
    deadline = time.monotonic() + seconds
    while len(got) < n and time.monotonic() < deadline:
        transport.deliver()
        time.sleep(0.02)


def _update(sender, station="st0", fleet="plant"):
    return m.DeviceUpdate(fleet=fleet, sender=sender, round=0, iteration=0, station=station,
                          weights=np.ones(8, np.float32), num_samples=1)


@needs_mosquitto
def test_bridge_carries_station_reports_up_and_the_model_down(fleet):
    _, out, ports = fleet
    cloud_broker = Broker(out / "cloud" / "broker" / "mosquitto.conf", ports["cloud"])
    station_broker = Broker(out / "stations" / "st0" / "broker" / "mosquitto.conf", ports["st0"])
    try:
        cam = _transport(_broker_cfg(out, out / "devices" / "cam1" / "device.toml"), "cam1")
        station = _transport(_broker_cfg(out, out / "stations" / "st0" / "station.toml"), "st0")
        cloud = _transport(_broker_cfg(out, out / "cloud" / "cloud.toml"), "cloud")
        at_station, at_cloud, from_cloud = [], [], []
        station.subscribe("safl/plant/dev/cam1/update", lambda t, msg: at_station.append(msg))
        station.subscribe("safl/plant/cloud/model", lambda t, msg: from_cloud.append(msg))
        cloud.subscribe("safl/plant/station/+/update", lambda t, msg: at_cloud.append(msg))
        for t in (cam, station, cloud):
            t.connect()
        time.sleep(1.0)  # the bridge connects to the cloud broker
        cam.publish(topic_for(_update("cam1")), _update("cam1"))
        _wait(station, at_station, 1)
        up = m.StationUpdate(fleet="plant", sender="st0", round=0, iteration=5,
                             weights=np.ones(8), num_samples=3, seen_counts=[1, 2])
        station.publish(topic_for(up), up)
        _wait(cloud, at_cloud, 1)
        glob = m.GlobalModel(fleet="plant", sender="cloud", round=1, iteration=5,
                             weights=np.full(300_000, 0.5), p_real=[0.5, 0.5])  # chunked
        cloud.publish(topic_for(glob), glob)
        _wait(station, from_cloud, 1)
        assert len(at_station) == 1 and len(at_cloud) == 1 and len(from_cloud) == 1
        assert from_cloud[0].weights.size == 300_000
        for t in (cam, station, cloud):
            t.close()
        # A device's certificate grants nothing on the cloud broker, where every station's
        # traffic meets: it reads no station's update and cannot pose as a station.
        cam_cfg = _broker_cfg(out, out / "devices" / "cam1" / "device.toml")
        on_cloud = BrokerConfig(**{**vars(cam_cfg), "url": f"mqtts://127.0.0.1:{ports['cloud']}"})
        cam, cloud = _transport(on_cloud, "cam1"), _transport(
            _broker_cfg(out, out / "cloud" / "cloud.toml"), "cloud")
        seen_by_cam, at_cloud = [], []
        cam.subscribe("safl/plant/#", lambda t, msg: seen_by_cam.append(t))
        cloud.subscribe("safl/plant/station/+/update", lambda t, msg: at_cloud.append(msg))
        cam.connect()
        cloud.connect()
        time.sleep(0.3)
        cam.publish(topic_for(up), up)
        station = _transport(_broker_cfg(out, out / "stations" / "st0" / "station.toml"), "st0")
        station.connect()
        time.sleep(1.0)
        station.publish(topic_for(up), up)  # through the bridge: the cloud gets this one only
        _wait(cloud, at_cloud, 1)
        time.sleep(0.5)
        for t in (cam, cloud, station):
            t.deliver()
        assert len(at_cloud) == 1 and not any("/station/" in t for t in seen_by_cam)
        for t in (cam, cloud, station):
            t.close()
    finally:
        station_broker.stop()
        cloud_broker.stop()


@needs_mosquitto
def test_acls_confine_devices_and_bad_credentials_are_refused(fleet, tmp_path):
    _, out, ports = fleet
    broker = Broker(out / "stations" / "st0" / "broker" / "mosquitto.conf", ports["st0"])
    try:
        cam1_cfg = _broker_cfg(out, out / "devices" / "cam1" / "device.toml")
        cam2_cfg = _broker_cfg(out, out / "devices" / "cam2" / "device.toml")
        station_cfg = _broker_cfg(out, out / "stations" / "st0" / "station.toml")
        station, cam1, cam2 = (_transport(station_cfg, "st0"), _transport(cam1_cfg, "cam1"),
                               _transport(cam2_cfg, "cam2"))
        seen_by_station, seen_by_cam2, seen_by_cam1 = [], [], []
        station.subscribe("safl/plant/dev/+/update", lambda t, msg: seen_by_station.append(msg))
        station.subscribe("safl/plant/cloud/model", lambda t, msg: seen_by_station.append(msg))
        cam2.subscribe("safl/plant/station/st0/model", lambda t, msg: seen_by_cam2.append(msg))
        cam1.subscribe("safl/plant/#", lambda t, msg: seen_by_cam1.append((t, msg)))
        for t in (station, cam1, cam2):
            t.connect()
        time.sleep(0.3)
        # cam1 impersonates cam2, the station and the cloud: the broker drops all three.
        cam1.publish_raw("safl/plant/dev/cam2/update", b"x")
        forged_model = m.StationModel(fleet="plant", sender="st0", round=0, iteration=0,
                                      weights=np.zeros(8))
        cam1.publish(topic_for(forged_model), forged_model)
        forged_global = m.GlobalModel(fleet="plant", sender="cloud", round=9, iteration=0,
                                      weights=np.zeros(8), p_real=[1.0])
        cam1.publish(topic_for(forged_global), forged_global)
        # cam2's own update goes through, and cam1 (subscribed to everything) cannot read it.
        cam2.publish(topic_for(_update("cam2")), _update("cam2"))
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            for t in (station, cam1, cam2):
                t.deliver()
            time.sleep(0.02)
        assert [msg.sender for msg in seen_by_station] == ["cam2"]
        assert seen_by_cam2 == []
        assert not any("/dev/cam2/" in t for t, _ in seen_by_cam1)
        for t in (station, cam1, cam2):
            t.close()

        def refused(error=BrokerRefused, **changes) -> None:
            cfg = BrokerConfig(**{**vars(cam1_cfg), "connect_timeout": 2, **changes})
            with pytest.raises(error):
                _transport(cfg, "cam1").connect()

        refused(ConnectError, cert="", key="")                   # no client certificate
        other = tmp_path / "other"                               # a certificate of another CA
        from aggregator.pki import issue, make_ca
        make_ca(other, "intruder")
        issue(other, other / "c.pem", other / "c.key", "cam1")
        refused(ConnectError, cert=str(other / "c.pem"), key=str(other / "c.key"),
                ca=str(other / "ca.pem"))               # the TLS handshake fails
    finally:
        broker.stop()


def test_rerun_adds_devices_keeps_credentials_and_revokes(fleet):
    path, out, ports = fleet
    before = (out / "devices" / "cam1" / "client.pem").read_bytes()
    ca = (out / "ca" / "ca.pem").read_bytes()
    path.write_text(path.read_text() + '\n[[devices]]\nid = "cam9"\nstation = "st1"\n')
    created = provision(path, out)
    assert created["credentials"] == ["cam9"] and not created["ca"]
    assert (out / "devices" / "cam1" / "client.pem").read_bytes() == before
    assert (out / "ca" / "ca.pem").read_bytes() == ca
    assert "cam1" in json.loads((out / "state.json").read_text())["issued"]
    assert "user cam9" in (out / "stations" / "st1" / "broker" / "acl").read_text()
    serial = serial_of(out / "devices" / "cam2" / "client.pem")
    provision(path, out, revoke=("cam2",))
    assert not (out / "devices" / "cam2").exists()
    assert serial in json.loads((out / "state.json").read_text())["revoked_serials"]
    assert "user cam2" not in (out / "stations" / "st0" / "broker" / "acl").read_text()
    assert "cam2" not in (out / "stations" / "st0" / "station.toml").read_text()
    with pytest.raises(ConfigError, match="revoke"):
        provision(path, out, revoke=("nobody",))


@pytest.mark.parametrize("text, key", [
    ('[fleet]\nname = "p"\ncloud_host = "c"\n[[stations]]\nid = "a"\ndevices = ["x"]\n'
     '[[stations]]\nid = "a"\n', "duplicate id 'a'"),
    ('[fleet]\nname = "p"\ncloud_host = "c"\n[[stations]]\nid = "a"\ndevices = ["x", "x"]\n',
     "duplicate id 'x'"),
    ('[fleet]\nname = "p"\ncloud_host = "c"\n[[stations]]\nid = "a"\n'
     '[[devices]]\nid = "y"\nstation = "b"\n', "unknown station 'b'"),
    ('[fleet]\nname = "p"\n[[stations]]\nid = "a"\n', "fleet.cloud_host"),
    ('[fleet]\nname = "p"\ncloud_host = "c"\nupdate_stages = ["int9"]\n[[stations]]\nid = "a"\n',
     "fleet.update_stages"),
])
def test_bad_fleet_files_fail_before_anything_is_written(tmp_path, text, key):
    path = tmp_path / "fleet.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=key):
        provision(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(ConfigError):
        load_fleet_file(path)


def test_a_fleets_update_stages_reach_every_station_and_device(tmp_path):
    from aggregator.config import StationConfig
    from edge_client.config import DeviceConfig

    path = tmp_path / "fleet.toml"
    path.write_text('[fleet]\nname = "p"\ncloud_host = "c"\n'
                    'update_stages = ["topk:0.1", "int8:256"]\n'
                    '[[stations]]\nid = "a"\ndevices = ["x", "y"]\n')
    provision(path, tmp_path / "out")
    station = load_config(StationConfig, "station", tmp_path / "out/stations/a/station.toml")
    assert station.update_stages == ("topk:0.1", "int8:256")
    for did in ("x", "y"):
        device = load_config(DeviceConfig, "device", tmp_path / f"out/devices/{did}/device.toml")
        assert device.update_stages == station.update_stages


def test_bad_certificates_are_refused_before_connecting(fleet, tmp_path):
    _, out, _ = fleet
    cam = out / "devices" / "cam1"
    other = out / "devices" / "cam3"
    with pytest.raises(ConfigError, match="does not match key"):
        check_pair(str(out / "ca" / "ca.pem"), str(cam / "client.pem"), str(other / "client.key"))
    from aggregator.pki import issue, make_ca
    make_ca(tmp_path / "x", "x")
    issue(tmp_path / "x", tmp_path / "x.pem", tmp_path / "x.key", "cam1")
    with pytest.raises(ConfigError, match="not signed by the CA"):
        check_pair(str(out / "ca" / "ca.pem"), str(tmp_path / "x.pem"), str(tmp_path / "x.key"))
    issue(tmp_path / "x", tmp_path / "old.pem", tmp_path / "old.key", "cam1", days=-1,
          backdate_days=30)
    with pytest.raises(ConfigError, match="expired"):
        check_pair(str(tmp_path / "x" / "ca.pem"), str(tmp_path / "old.pem"),
                   str(tmp_path / "old.key"))
    with pytest.raises(ConfigError, match="'cert'.*does not exist"):  # a missing credential
        BrokerConfig(url="mqtts://h:1", ca=str(out / "ca" / "ca.pem"), cert=str(cam / "c.pem"),
                     key=str(cam / "client.key"))
    mismatched = BrokerConfig(url="mqtts://h:1", ca=str(out / "ca" / "ca.pem"),
                              cert=str(cam / "client.pem"), key=str(other / "client.key"))
    with pytest.raises(ConfigError, match="'key'"):  # refused at start, before any connection
        MqttTransport(mismatched, client_id="cam1", fleet="plant")


def test_metrics_endpoint_is_scrapable():
    counters = {"received_updates": 7, "rejected.bad_checksum": 2, "rejected.wrong_fleet": 1,
                "bytes_in": 1024}
    server = MetricsServer(0, "station", lambda: (counters, {"round": 3, "iteration": 31}))
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics",
                                      timeout=5).read().decode()
    finally:
        server.close()
    assert '# TYPE safl_rejected_total counter' in body
    assert 'safl_rejected_total{reason="bad_checksum",role="station"} 2' in body
    assert 'safl_received_updates_total{role="station"} 7' in body
    assert 'safl_round{role="station"} 3' in body
    assert "# HELP safl_rejected_total messages or frames refused" in body
    assert render("x", {}, {"accuracy": None}) == "\n"
    labelled = render("device", {"rejected.bad_id": 1}, {}, {"fleet": "f", "device": "d0"})
    assert 'safl_rejected_total{reason="bad_id",role="device",fleet="f",device="d0"} 1' in labelled


def test_health_turns_503_when_the_loop_stalls_and_a_busy_port_is_one_line():
    from edge_client.errors import SaflError
    server = MetricsServer(0, "cloud", lambda: ({}, {}), labels={"fleet": "f"},
                           stall_after=0.2)
    try:
        url = f"http://127.0.0.1:{server.port}/healthz"
        assert json.loads(urllib.request.urlopen(url, timeout=5).read())["status"] == "ok"
        time.sleep(0.4)
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(url, timeout=5)
        assert err.value.code == 503
        server.beat()
        assert json.loads(urllib.request.urlopen(url, timeout=5).read())["fleet"] == "f"
        with pytest.raises(SaflError, match="port taken"):
            MetricsServer(server.port, "cloud", lambda: ({}, {}))
    finally:
        server.close()


DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


def _unit(path: Path) -> dict[str, dict[str, list[str]]]:
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for line in path.read_text().splitlines():
        line = line.strip()
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
        elif line and not line.startswith("#") and current is not None:
            key, _, value = line.partition("=")
            current.setdefault(key, []).append(value)
    return sections


@pytest.mark.parametrize("role", ["device", "station", "cloud"])
def test_systemd_units_are_sandboxed_and_restart(role):
    unit = _unit(DEPLOY / "systemd" / f"safl-{role}.service")
    service = unit["Service"]
    # Aggregators checkpoint under their StateDirectory so a restart resumes (a device's file
    # names its folder there); a device stays up after a last round, predicting for its line.
    resume = " --keep-running" if role == "device" else " --state-dir /var/lib/safl/state"
    assert service["ExecStart"] == [
        f"/opt/safl/bin/safl {role} --config /etc/safl/{role}.toml{resume}"]
    assert service["Restart"] == ["on-failure"] and service["User"] == ["safl"]
    assert service["StateDirectory"] == ["safl"] and service["ReadWritePaths"] == ["/var/lib/safl"]
    for key in ("NoNewPrivileges", "ProtectHome", "PrivateTmp", "RestrictNamespaces"):
        assert service[key] == ["true"], key
    assert service["ProtectSystem"] == ["strict"] and service["CapabilityBoundingSet"] == [""]
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]
    if shutil.which("systemd-analyze"):
        out = subprocess.run(["systemd-analyze", "verify", "--man=no",
                              str(DEPLOY / "systemd" / f"safl-{role}.service")],
                             capture_output=True, text=True)
        assert "Unknown key" not in out.stderr and "Invalid" not in out.stderr, out.stderr


def test_compose_file_runs_the_provisioned_hierarchy(tmp_path, monkeypatch):
    yaml = pytest.importorskip("yaml")
    doc = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = doc["services"]
    fleet = load_fleet_file(DEPLOY / "fleet.compose.toml")
    provision(DEPLOY / "fleet.compose.toml", tmp_path / "fleet", prefix="/fleet")

    def on_host(path: str) -> Path:
        assert path.startswith("/fleet/"), path
        return tmp_path / "fleet" / path[len("/fleet/"):]

    brokers = {name for name, s in services.items() if "mosquitto" in s.get("image", "")}
    assert brokers == {"cloud-broker", *(f"{s.id}-broker" for s in fleet.stations)}
    assert fleet.cloud_host == "cloud-broker"
    for name in brokers:
        conf = on_host(services[name]["command"].split()[-1])
        assert conf.exists() and services[name]["volumes"] == ["./fleet:/fleet"]
    roles = {"cloud": ["cloud"], "station": [s.id for s in fleet.stations],
             "device": [d for s in fleet.stations for d in s.devices]}
    for role, names in roles.items():
        for name in names:
            command = services[name]["command"]
            config = on_host(command[command.index("--config") + 1])
            assert command[0] == role and config.exists()
            broker = services[name]["depends_on"][0]
            assert broker in brokers
            if role == "device":  # runs as the compose file starts it: files as provisioned
                with monkeypatch.context() as env:
                    for key, value in services[name]["environment"].items():
                        env.setenv(key, value)
                    cfg = load_role_file(config, DEVICE_TABLES, {"broker": {
                        key: str(on_host(f"/fleet/{sub}")) for key, sub in (
                            ("ca", "ca/ca.pem"), ("cert", f"devices/{name}/client.pem"),
                            ("key", f"devices/{name}/client.key"))}})
                assert cfg["source"].kind == "synthetic"
    for s in fleet.stations:  # each station's broker bridges to the cloud broker by name
        conf = (tmp_path / "fleet" / "stations" / s.id / "broker" / "mosquitto.conf").read_text()
        assert "address cloud-broker:8883" in conf and "/fleet/ca/ca.pem" in conf
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"],
                                                 capture_output=True).returncode == 0:
        out = subprocess.run(["docker", "compose", "-f", str(DEPLOY / "compose.yaml"),
                              "config", "--quiet"], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr


def test_the_arm64_device_image_installs_a_cpu_only_torch():
    """Through the torch extra, whose aarch64 marker takes torch 2.9.1 (CPU-only, runs on a
    Pi 4: tests/test_backends.py, and deploy/check_aarch64.py installs it so), not an index
    whose newest aarch64 wheel dies of SIGILL on a Cortex-A72."""
    text = (DEPLOY / "docker" / "device-arm64.Dockerfile").read_text()
    assert "'.[torch,camera]'" in text
    assert "--index-url" not in text and "pip install --no-cache-dir torch" not in text
