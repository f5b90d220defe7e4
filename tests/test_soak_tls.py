"""A provisioned TLS fleet soaked for minutes: the field path as a factory runs it.

Both Mosquitto brokers as provisioned (the factory's bridged to the cloud's over TLS, every
client on its certificate), the cloud, the station and four devices as their own
processes: two on MJPEG cameras (ffmpeg on loopback, a line of items filmed) with
predictions on and labels published live by two line applications, each on its own
certificate; two on synthetic frames at 20 a second.  It runs ``SAFL_SOAK_SECONDS`` (300
by default) and then counts: TLS errors in both brokers' logs, connections each
participant opened (one each: any more is an unplanned reconnect), lost brokers in the
roles' logs, processes that died, and the rounds the cloud closed (consecutive, none
missing).  ``docs/reliability.md`` quotes its figures.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import paho.mqtt.client as paho
import pytest
from brokers import free_port
from paho.mqtt.enums import CallbackAPIVersion
from stream_servers import Line, StreamServer, have_ffmpeg
from test_deploy import Broker, _broker_cfg

from aggregator.provision import provision
from aggregator.status import fleet_status
from edge_client import messages as m
from edge_client.topics import predictions_topic
from lab.launch import _stop as stop_processes

pytest.importorskip("cv2")
pytest.importorskip("cryptography")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("mosquitto") is None,
                                 reason="Mosquitto is installed by .ci/run"),
              pytest.mark.skipif(not have_ffmpeg(), reason="ffmpeg is installed by .ci/run")]

SECONDS = float(os.environ.get("SAFL_SOAK_SECONDS", "300"))
CAMERAS, OTHERS = ("cam1", "cam2"), ("dev3", "dev4")
CLASSES = (0, 1, 2, 3)
TLS_ERRORS = re.compile(r"OpenSSL Error|Protocol error|bad record mac|wrong version number")
# What the test itself does to a broker: its readiness probe (a bare TCP connect, closed
# before any TLS byte, before the first client) and the station's kill -9 (a connection cut
# mid-record) each log an "unexpected eof".  Neither is a TLS error of the fleet's.
KILLED = re.compile(r".*OpenSSL Error.*\n.*Client st0 closed its connection\.")


def _served(log: str) -> str:
    """A broker's log from its first client on, without the station's deliberate cut."""
    first = log.find("New client connected")
    return KILLED.sub("", log[first:] if first >= 0 else log)

FLEET = """
[fleet]
name = "plant"
cloud_host = "127.0.0.1"
cloud_port = {cloud}
cloud_bind = "127.0.0.1"

[model]
name = "mlp"
input_shape = [8, 8]
num_classes = 4

[training]
batch_size = 8
lr = 0.5

[[stations]]
id = "st0"
host = "127.0.0.1"
port = {st0}
bind = "127.0.0.1"
devices = ["cam1", "cam2", "dev3", "dev4"]

[[devices]]
id = "cam1"
station = "st0"
camera = "{cam1}"

[[devices]]
id = "cam2"
station = "st0"
camera = "{cam2}"

[[lines]]
id = "press-a"
station = "st0"
devices = ["cam1"]

[[lines]]
id = "press-b"
station = "st0"
devices = ["cam2"]
"""


class LineApplication:
    """A line's own program on its certificate: publishes its camera's labels, reads its
    camera's predictions (paho in its threaded mode, one thread on the socket)."""

    def __init__(self, out: Path, lid: str, port: int, device: str) -> None:
        cfg = _broker_cfg(out, out / "lines" / lid / "line.toml")
        self.predictions = 0
        self.client = paho.Client(CallbackAPIVersion.VERSION2, client_id=lid)
        self.client.tls_set(ca_certs=cfg.ca, certfile=cfg.cert, keyfile=cfg.key)
        self.client.on_message = lambda _c, _u, _m: self._count()
        self.client.connect("127.0.0.1", port)
        self.client.subscribe(predictions_topic("plant", device), qos=0)
        self.client.loop_start()

    def _count(self) -> None:
        self.predictions += 1

    def publish(self, topic: str, payload: bytes) -> None:
        self.client.publish(topic, payload, qos=1)

    def stop(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def _connections(log: str) -> Counter[str]:
    return Counter(re.findall(r"New (?:client|bridge) connected from \S+ as (\S+) ", log))


@pytest.mark.timeout(int(SECONDS) + 240)
def test_a_provisioned_tls_fleet_with_cameras_holds_for_minutes(tmp_path, digits):
    cams = {c: StreamServer("mjpeg", free_port(), tmp_path / f"{c}-ffmpeg.log")
            for c in CAMERAS}
    ports = {"cloud": free_port(), "st0": free_port()}
    fleet_path = tmp_path / "fleet.toml"
    fleet_path.write_text(FLEET.format(**ports, **{c: s.uri for c, s in cams.items()}))
    out = tmp_path / "fleet"
    provision(fleet_path, out)
    brokers = {"cloud": Broker(out / "cloud" / "broker" / "mosquitto.conf", ports["cloud"]),
               "st0": Broker(out / "stations" / "st0" / "broker" / "mosquitto.conf",
                             ports["st0"])}
    logs, procs, lines, belts = tmp_path / "logs", {}, {}, []
    logs.mkdir()
    time.sleep(1.0)  # the bridge connects

    def start(name: str, *command: str, env: dict[str, str] | None = None) -> None:
        procs[name] = subprocess.Popen([sys.executable, "-m", *command],
                                       stdout=open(logs / f"{name}.log", "w"),
                                       stderr=subprocess.STDOUT,
                                       env={**os.environ, **(env or {})})

    try:
        start("cloud", "safl", "cloud", "--config", str(out / "cloud" / "cloud.toml"),
              "--rounds", "100000", "--out", str(tmp_path / "cloud-out"))
        start("st0", "safl", "station", "--config", str(out / "stations" / "st0" /
                                                         "station.toml"))
        for lid, cam in (("press-a", "cam1"), ("press-b", "cam2")):
            lines[cam] = LineApplication(out, lid, ports["st0"], cam)
            belt = Line(digits.x_train, digits.y_train, CLASSES,
                        topic=f"line/st0/{cam}/labels", publish=lines[cam].publish,
                        seed=len(belts))
            belt.run([cams[cam]])
            belts.append(belt)
        time.sleep(2.0)  # ffmpeg listens once frames flow
        for cam in CAMERAS:  # each keeps its model in use here, not in the host's /var/lib
            start(cam, "edge_client", "--config", str(out / "devices" / cam / "device.toml"),
                  "--state-dir", str(tmp_path / "state" / cam))
        for dev in OTHERS:
            start(dev, "edge_client", "--config", str(out / "devices" / dev / "device.toml"),
                  "--state-dir", str(tmp_path / "state" / dev),
                  env={"SAFL_SOURCE_KIND": "synthetic", "SAFL_SOURCE_LABEL_TOPIC": "",
                       "SAFL_SOURCE_URI": "", "SAFL_SOURCE_SAMPLE_FPS": "20"})
        started = time.monotonic()
        while time.monotonic() - started < SECONDS:
            time.sleep(5.0)
            dead = {n: p.returncode for n, p in procs.items() if p.poll() is not None}
            assert not dead, (dead, {n: (logs / f"{n}.log").read_text()[-2000:] for n in dead})
        elapsed = time.monotonic() - started
        # What an operator sees from the factory's status file: every device, and the
        # line's labels joined on the camera devices.
        factory = fleet_status(_broker_cfg(out, out / "monitor" / "status-st0.toml"), "plant")
        joined = {d: factory.devices[d].source.get("label_joined", 0) for d in CAMERAS}
        online = sum(o for (r, _), o in factory.presence.items() if r == m.Participant.DEVICE)
        # The soak's record ends here; then the station vanishes (kill -9, which the broker
        # sees as a connection cut mid-record): its Last Will reaches the cloud's broker
        # through the bridge, the cloud says so, and the cloud's status file shows it offline.
        broker_logs = {"cloud": (out / "cloud" / "broker" / "log.txt").read_text(),
                       "st0": (out / "stations" / "st0" / "broker" / "log.txt").read_text()}
        procs["st0"].kill()
        killed, vanished = time.monotonic(), None
        cloud_view = _broker_cfg(out, out / "monitor" / "status-cloud.toml")
        while time.monotonic() - killed < 90 and vanished is None:
            seen = fleet_status(cloud_view, "plant", wait=0.5).presence
            if seen.get((m.Participant.STATION, "st0")) is False:
                vanished = time.monotonic() - killed
        time.sleep(1.0)
    finally:
        for belt in belts:
            belt.stop()
        for line in lines.values():
            line.stop()
        # A device under load may take its close_timeout (10 s) to flush: no kill before.
        stop_processes(procs, grace=20.0)
        for broker in brokers.values():
            broker.stop()
        for server in cams.values():
            server.stop()

    tls_errors = {name: len(TLS_ERRORS.findall(_served(text))) for name, text in
                  broker_logs.items()}
    connections = {name: _connections(text) for name, text in broker_logs.items()}
    role_logs = {n: (logs / f"{n}.log").read_text() for n in procs}
    said = {n: "st0 went offline" in role_logs[n] for n in ("cloud", *CAMERAS, *OTHERS)}
    lost = {n: text.count("lost the broker") for n, text in role_logs.items()}
    with open(tmp_path / "cloud-out" / "metrics.csv") as f:
        rounds = [int(row["round"]) for row in csv.DictReader(f)]
    predictions = {cam: lines[cam].predictions for cam in CAMERAS}
    labels = sum(b.sent for b in belts)
    figures = {"seconds": round(elapsed), "rounds": len(rounds), "tls_errors": tls_errors,
               "connections": {n: dict(c) for n, c in connections.items()}, "lost_broker": lost,
               "predictions_read_by_lines": predictions, "labels_published": labels,
               "labels_joined": joined, "devices_online": online,
               "station_shown_offline_after_s": vanished and round(vanished, 1),
               "exit_codes": {n: p.returncode for n, p in procs.items()}}
    print("\nsoak: " + json.dumps(figures))
    assert tls_errors == {"cloud": 0, "st0": 0}, figures
    # One connection each, none re-opened: the roles and both lines at the factory, the
    # cloud and the bridge (as its station) at the cloud; `safl status` on its own login.
    watchers = {"monitor", "status"}
    assert set(connections["st0"]) - watchers == {"st0", *CAMERAS, *OTHERS, "press-a",
                                                  "press-b"}, figures
    assert set(connections["cloud"]) - watchers == {"cloud", "st0"}, figures
    assert max(n for c in connections.values() for n in c.values()) == 1, figures
    assert sum(lost.values()) == 0, figures
    # Every round closed, in order, none skipped; a round takes seconds here.
    assert rounds == list(range(rounds[0], rounds[0] + len(rounds))), rounds
    assert len(rounds) >= SECONDS / 30, figures
    # The line read its camera's predictions all along (10 fps), and published labels.
    assert min(predictions.values()) >= 3 * SECONDS and labels >= SECONDS, figures
    codes = {n: rc for n, rc in figures["exit_codes"].items() if n != "st0"}
    assert all(rc in (0, -15) for rc in codes.values()), figures
    assert online == 4 and min(joined.values()) > 0, figures
    # Within two keep-alive periods (30 s each); a Last Will fires as the socket closes.
    assert vanished is not None and vanished <= 60, figures
    assert all(said.values()), said
    # A station that waits for its devices' data between iterations is not a fault.
    assert "quorum" not in role_logs["st0"] and "untrained" not in role_logs["st0"]
