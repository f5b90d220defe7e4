"""What ``safl provision`` writes runs as written: complete device files whose batch agrees
with their station's, line applications with their own certificates and exact grants, bind
addresses from the fleet file, and role files refusing tables they do not read."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from brokers import free_port
from test_deploy import Broker, _broker_cfg, _transport, needs_mosquitto

from aggregator.config import StationConfig
from aggregator.fleet_file import load_fleet_file
from aggregator.provision import provision
from edge_client import topics
from edge_client.documents import Prediction
from edge_client.errors import ConfigError
from edge_client.service import DEVICE_TABLES, SHARED_TABLES, load_role_file
from edge_client.topics import predictions_topic

pytest.importorskip("cryptography")

FLEET = """
[fleet]
name = "plant"
cloud_host = "127.0.0.1"
cloud_port = {cloud}
cloud_bind = "127.0.0.1"
metrics_port = 9101

[model]
name = "mlp"
input_shape = [3, 16, 16]
num_classes = 4
class_names = ["bolt", "nut", "washer", "bracket"]

[training]
batch_size = 16
local_steps = 2

[[stations]]
id = "st0"
host = "127.0.0.1"
port = {st0}
bind = "127.0.0.1"
devices = ["cam1", "cam2", "cam3"]

[[devices]]
id = "cam1"
station = "st0"
camera = "http://127.0.0.1:8090/cam.mjpg"

[[lines]]
id = "press-line"
station = "st0"
devices = ["cam1"]

[[lines]]
id = "paint-line"
station = "st0"
devices = ["cam2"]
"""


@pytest.fixture
def lined(tmp_path):
    ports = {"cloud": free_port(), "st0": free_port()}
    path = tmp_path / "fleet.toml"
    path.write_text(FLEET.format(**ports))
    out = tmp_path / "fleet"
    provision(path, out)
    return path, out, ports


def _station(out) -> dict:
    return load_role_file(out / "stations" / "st0" / "station.toml",
                          {"station": StationConfig, **SHARED_TABLES}, {})


def test_device_files_run_as_written_and_agree_with_their_station(lined):
    _, out, _ = lined
    station = _station(out)["station"]
    for did in ("cam1", "cam2", "cam3"):
        text = (out / "devices" / did / "device.toml").read_text()
        if did == "cam1":  # the fleet file names its camera: the file loads as it is
            cfg = load_role_file(out / "devices" / did / "device.toml", DEVICE_TABLES, {})
        else:  # the one value left to fill is named, and start-up names it too
            assert "FILL IN" in text and "uri" in text
            with pytest.raises(ConfigError, match="'uri'"):
                load_role_file(out / "devices" / did / "device.toml", DEVICE_TABLES, {})
            cfg = load_role_file(out / "devices" / did / "device.toml", DEVICE_TABLES,
                                 {"source": {"uri": "0"}})
        device, model, source = cfg["device"], cfg["model"], cfg["source"]
        # What the station accepts bounds what the device can claim: no refusals by config.
        assert device.batch_size * device.local_steps <= station.batch_size * station.local_steps
        assert device.min_batch <= device.batch_size
        assert model.input_shape == (3, 16, 16) and model.num_classes == 4
        assert model.class_names == ("bolt", "nut", "washer", "bracket")  # in every file
        assert _station(out)["model"] == model
        assert source.kind == "camera" and source.resize == (16, 16) and not source.grayscale
        assert source.label_topic == f"line/st0/{did}/labels"
        assert cfg["inference"].enabled and cfg["inference"].publish
        assert cfg["service"].metrics_host == "127.0.0.1"  # loopback unless the fleet opens it
    assert station.batch_size == 16 and station.local_steps == 2
    # The line application's file names the products its labels may carry.
    import tomllib
    line = tomllib.loads((out / "lines" / "press-line" / "line.toml").read_text())
    assert line["line"]["products"] == ["bolt", "nut", "washer", "bracket"]


def test_brokers_listen_where_the_fleet_file_says(lined, tmp_path):
    _, out, ports = lined
    assert f"listener {ports['st0']} 127.0.0.1\n" in (
        out / "stations" / "st0" / "broker" / "mosquitto.conf").read_text()
    assert f"listener {ports['cloud']} 127.0.0.1\n" in (
        out / "cloud" / "broker" / "mosquitto.conf").read_text()
    # Without a bind, every interface, as before.
    path = tmp_path / "open.toml"
    path.write_text(FLEET.format(**ports).replace('cloud_bind = "127.0.0.1"\n', "")
                    .replace('bind = "127.0.0.1"\n', ""))
    provision(path, tmp_path / "open")
    assert f"listener {ports['st0']}\n" in (
        tmp_path / "open" / "stations" / "st0" / "broker" / "mosquitto.conf").read_text()
    page = (out / "monitor" / "monitor-st0.toml").read_text()
    assert '[monitor]\nhttp = "127.0.0.1:8080"' in page


@pytest.mark.parametrize("text, key", [
    ('[[lines]]\nid = "x"\nstation = "st0"\ndevices = ["cam1"]\n', "lines.devices"),
    ('[[lines]]\nid = "cam3"\nstation = "st0"\ndevices = ["cam3"]\n', "lines.id"),
    ('[[lines]]\nid = "y"\nstation = "st9"\ndevices = ["cam3"]\n', "lines.station"),
    # The watchers' logins: `safl status`'s, and each line's `safl predictions`'.
    ('[[lines]]\nid = "status"\nstation = "st0"\ndevices = ["cam3"]\n', "lines.id"),
    ('[[lines]]\nid = "watch-a"\nstation = "st0"\ndevices = ["cam3"]\n', "lines.id"),
    ('[[lines]]\nid = "y"\nstation = "st0"\ndevices = ["cam9"]\n', "lines.devices"),
    ('[training]\nupdate_stages = ["int8:256"]\n', "training.update_stages"),
])
def test_bad_lines_and_tables_are_named(tmp_path, text, key):
    path = tmp_path / "fleet.toml"
    body = FLEET.format(cloud=1883, st0=1884).replace("[training]\nbatch_size = 16\n"
                                                      "local_steps = 2\n", "")
    path.write_text(body + text)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_fleet_file(path)


@pytest.mark.parametrize("was, now, said", [
    ("[inference]", "[inferense]", r"unknown table \[inferense\].*did you mean \[inference\]"),
    ("[source]\n", "[source]\nretrys = 3\n",
     r"'retrys': unknown key in \[source\]; did you mean 'retries'\?"),
])
def test_a_misspelled_table_or_key_is_named_with_the_nearest_one(lined, was, now, said):
    _, out, _ = lined
    path = out / "devices" / "cam1" / "device.toml"
    path.write_text(path.read_text().replace(was, now))
    with pytest.raises(ConfigError, match=said):
        load_role_file(path, DEVICE_TABLES, {})


def test_a_provisioned_device_keeps_its_model_where_its_unit_keeps_state(lined, tmp_path,
                                                                         capsys):
    """The device file and the board's unit name one state directory, so a restarted device
    predicts with the model it had in use, and ``safl-device export`` and ``rollback`` (run
    on the provisioned file, as docs/sources.md says) find it."""
    import dataclasses
    import re
    from pathlib import Path

    import numpy as np

    from aggregator.role_files import STATE_DIR
    from edge_client import messages as m
    from edge_client.cli import main as device_main
    from edge_client.device import Device
    from edge_client.service import federation_layout, model_trainer
    from edge_client.serving import load_deployable, resume_deployable, save_deployable

    _, out, _ = lined
    path = out / "devices" / "cam1" / "device.toml"
    cfg = load_role_file(path, DEVICE_TABLES, {})
    assert cfg["service"].state_dir == f"{STATE_DIR}/cam1"
    unit = (Path(__file__).resolve().parents[1] / "deploy" / "systemd" /
            "safl-device.service").read_text()
    assert re.search(r"^StateDirectory=safl$", unit, re.M)
    assert STATE_DIR.startswith("/var/lib/safl/")
    exec_start = re.search(r"^ExecStart=(.*)$", unit, re.M).group(1)
    assert "--state-dir" not in exec_start and "--keep-running" in exec_start

    # The board's state directory, here a folder of the test (--state-dir, as the unit).
    state = tmp_path / "state"
    model = cfg["model"]
    trainer = model_trainer(model, cfg["device"].lr)
    layout = federation_layout(model, trainer)

    def device(**inference):
        return Device(cfg["device"], model_trainer(model, cfg["device"].lr),
                      num_classes=model.num_classes, sample_shape=tuple(model.input_shape),
                      rng=np.random.default_rng(0),
                      inference=dataclasses.replace(cfg["inference"], **inference))
    # Each model goes into use as it comes (no line's labels here to promote it by).
    running = device(promote="always")
    for k in (1, 2):
        weights = np.random.default_rng(k).normal(0, 0.1, trainer.num_params)
        running.handle(m.StationModel(fleet="plant", sender="st0", round=k, iteration=k,
                                      weights=weights), 0.0)
        save_deployable(state, running, layout)
    restarted = device()
    resume_deployable(state, restarted, layout)
    assert restarted.line.deployable_round == 2
    np.testing.assert_array_equal(restarted.line.deployable, running.line.deployable)
    args = ["--config", str(path), "--state-dir", str(state)]
    assert device_main(["export", *args, "--out", str(tmp_path / "cam1.onnx")]) == 0
    assert (tmp_path / "cam1.onnx").stat().st_size > 0
    assert device_main(["rollback", *args]) == 0
    assert load_deployable(state, layout_hash=layout).round == 1
    capsys.readouterr()


@needs_mosquitto
def test_each_line_reads_its_devices_predictions_and_writes_only_their_labels(lined):
    _, out, ports = lined
    broker = Broker(out / "stations" / "st0" / "broker" / "mosquitto.conf", ports["st0"])
    try:
        def connect(*parts, client):
            return _transport(_broker_cfg(out, out.joinpath(*parts)), client)

        press = connect("lines", "press-line", "line.toml", client="press-line")
        paint = connect("lines", "paint-line", "line.toml", client="paint-line")
        default = connect("lines", "line-st0", "line.toml", client="line-st0")
        cams = {d: connect("devices", d, "device.toml", client=d) for d in ("cam1", "cam2")}
        seen = {name: [] for name in ("press", "paint", "cam1", "cam2")}
        for name, t in (("press", press), ("paint", paint)):
            t.subscribe_raw(predictions_topic("plant", "+"),
                            lambda topic, p, name=name: seen[name].append(topic))
        for d, t in cams.items():
            t.subscribe_raw(f"line/st0/{d}/labels", lambda topic, p, d=d: seen[d].append(p))
        for t in (press, paint, default, *cams.values()):
            t.connect()
        time.sleep(0.3)
        for d, t in cams.items():
            t.publish_raw(predictions_topic("plant", d), b'{"label": 1}', qos=1)
        press.publish_raw("line/st0/cam1/labels", json.dumps({"t": 1.0, "label": 1}).encode())
        press.publish_raw("line/st0/cam2/labels", b'{"t": 1.0, "label": 3}')  # not its device
        paint.publish_raw("line/st0/cam2/labels", b'{"t": 2.0, "label": 2}')
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            for t in (press, paint, *cams.values()):
                t.deliver()
            time.sleep(0.05)
        assert seen["press"] == [predictions_topic("plant", "cam1")]
        assert seen["paint"] == [predictions_topic("plant", "cam2")]
        assert seen["cam1"] == [b'{"t": 1.0, "label": 1}']
        assert seen["cam2"] == [b'{"t": 2.0, "label": 2}']
        # Two line applications at once, each its own identity: neither kicked the other off.
        assert all(t.connected and t.counters["disconnects"] == 0 for t in (press, paint))
        # The default line has cam3 only (the others are declared lines').
        acl = (out / "stations" / "st0" / "broker" / "acl").read_text()
        block = acl.split("user line-st0\n")[1].split("\n\n")[0]
        assert "cam3" in block and "cam1" not in block and "cam2" not in block
        # `safl predictions` with the line's watch file prints what its devices predict, and
        # nothing of the devices it may not read, on a certificate of its own: the running
        # line application keeps its session (on the line's own, the broker ended it).
        watch = subprocess.Popen(
            [sys.executable, "-m", "safl", "predictions", "--config",
             str(out / "lines" / "press-line" / "watch.toml"), "--fleet", "plant",
             "--seconds", "6"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(3)  # its subscription
        for k, (d, t) in enumerate(cams.items()):
            t.publish_document(predictions_topic("plant", d), Prediction(
                t=100.0 + k, frame=7 + k, label=2 + k, confidence=0.75, model_round=3,
                latency_ms=41.0), retain=False, qos=1)
        printed, said = watch.communicate(timeout=60)
        assert watch.returncode == 0, said
        assert printed.splitlines() == ["cam1 frame 7 t 100.000 label 2 confidence 0.750 model "
                                        "round 3 latency 41 ms"], (printed, said)
        press.deliver()
        assert press.connected and press.counters["disconnects"] == 0
        # The watch may read, and nothing more: no label reaches cam1 from it.
        block = acl.split("user watch-press-line\n")[1].split("\n\n")[0]
        assert "predictions" in block and "labels" not in block and "cam2" not in block
        # `safl status` beside a running `safl monitor`: each on its own certificate, so the
        # page's session survives the status run (it was taken over, and said so twice).
        page = connect("monitor", "monitor-st0.toml", client="monitor")
        page.connect()
        status = subprocess.run([sys.executable, "-m", "safl", "status", "--config",
                                 str(out / "monitor" / "status-st0.toml"), "--fleet", "plant"],
                                capture_output=True, text=True, timeout=60)
        assert status.returncode == 0, status.stderr
        time.sleep(0.5)
        page.deliver()
        assert page.connected and page.counters["disconnects"] == 0
        for t in (press, paint, default, page, *cams.values()):
            t.close()
    finally:
        broker.stop()


@pytest.mark.parametrize("line, ok", [
    ('monitor_http = "127.0.0.1:65535"', True), ('monitor_http = "127.0.0.1:65536"', False),
    ('monitor_http = "127.0.0.1:0"', False), ('monitor_http = "8080"', False),
    ('metrics_bind = "::"', True), ('metrics_bind = "0.0.0.0 "', False),
    ('metrics_bind = "10.0.0.1/24"', False),
])
def test_listening_addresses_are_checked_at_their_edges(tmp_path, line, ok):
    path = tmp_path / "fleet.toml"
    path.write_text(FLEET.format(cloud=1883, st0=1884).replace(
        'cloud_bind = "127.0.0.1"', f'cloud_bind = "127.0.0.1"\n{line}'))
    if ok:
        load_fleet_file(path)
    else:
        with pytest.raises(ConfigError, match=line.split(" = ")[0]):
            load_fleet_file(path)


@pytest.mark.parametrize("line, ok", [
    ("metrics_port = 65533", True), ("metrics_port = 65534", False),  # devices take +2
    ("rounds = 0", True), ("rounds = 1", True), ("rounds = -1", False), ('rounds = "5"', False),
])
def test_metrics_ports_and_rounds_are_checked_at_their_edges(tmp_path, line, ok):
    path = tmp_path / "fleet.toml"
    path.write_text(FLEET.format(cloud=1883, st0=1884).replace("metrics_port = 9101", line))
    if not ok:
        with pytest.raises(ConfigError, match=line.split(" = ")[0]):
            load_fleet_file(path)
        return
    provision(path, tmp_path / "out")
    cloud = (tmp_path / "out" / "cloud" / "cloud.toml").read_text()
    if line.startswith("rounds"):  # what the cloud is told, 0 (until stopped) by default
        assert f"\n{line}\n" in cloud
    else:
        assert "metrics_port = 65533" in cloud and "metrics_port = 65535" in (
            tmp_path / "out" / "devices" / "cam1" / "device.toml").read_text()


def test_a_fleet_with_a_body_gives_every_role_the_body_and_its_cameras_rgb(tmp_path):
    ports = {"cloud": free_port(), "st0": free_port()}
    path = tmp_path / "fleet.toml"
    body = tmp_path / "body"
    path.write_text(FLEET.format(**ports).replace(
        'name = "mlp"\n', f'name = "linear"\nbody = "efficientnet-lite0"\n'
        f'body_dir = "{body}"\n'))
    out = tmp_path / "fleet"
    provision(path, out)
    cfg = load_role_file(out / "devices" / "cam1" / "device.toml", DEVICE_TABLES, {})
    assert cfg["model"] == _station(out)["model"]
    assert cfg["model"].body == "efficientnet-lite0" and cfg["model"].body_dir == str(body)
    assert cfg["source"].rgb and not cfg["source"].grayscale
    # Without a body the same camera is decoded as OpenCV gives it, as before.
    lined = tmp_path / "plain.toml"
    lined.write_text(FLEET.format(**ports))
    provision(lined, tmp_path / "plain")
    assert not load_role_file(tmp_path / "plain" / "devices" / "cam1" / "device.toml",
                              DEVICE_TABLES, {})["source"].rgb


def test_a_fleet_of_feature_vectors_gives_its_devices_a_file_source(tmp_path):
    """A sensor box's model takes vectors, not frames: its devices read a file of samples
    (provisioning crashed on the camera's resize of a 1-D shape), and a camera named for
    one is refused, naming the key."""
    ports = {"cloud": free_port(), "st0": free_port()}
    path = tmp_path / "fleet.toml"
    vectors = FLEET.format(**ports).replace("input_shape = [3, 16, 16]", "input_shape = [64]")
    path.write_text(vectors.split("[[devices]]")[0])
    out = tmp_path / "fleet"
    provision(path, out)
    text = (out / "devices" / "cam2" / "device.toml").read_text()
    assert "FILL IN [source] path" in text
    with pytest.raises(ConfigError, match="'path'"):
        load_role_file(out / "devices" / "cam2" / "device.toml", DEVICE_TABLES, {})
    cfg = load_role_file(out / "devices" / "cam2" / "device.toml", DEVICE_TABLES,
                         {"source": {"path": str(tmp_path / "x.npz")}})
    assert cfg["source"].kind == "replay" and cfg["model"].input_shape == (64,)
    path.write_text(vectors)
    with pytest.raises(ConfigError, match="'devices.camera'"):
        provision(path, tmp_path / "named")
    assert not (tmp_path / "named").exists()  # refused with the fleet file, nothing written


def _grants(acl: str, user: str, access: str) -> list[str]:
    block = acl.split(f"\nuser {user}\n")[1].split("\n\n")[0]
    return [line.split()[2] for line in block.splitlines()
            if line.startswith("topic ") and line.split()[1] in (access, "readwrite")]


def test_every_subscription_and_bridged_topic_of_a_role_is_granted_by_its_broker(lined):
    """Mosquitto refuses a subscription its ACL does not grant without telling the client:
    a station that could not read its devices' head statistics learnt nothing from them
    over a provisioned fleet, and said nothing (the camera line's head was never solved)."""
    _, out, _ = lined
    station_acl = (out / "stations" / "st0" / "broker" / "acl").read_text()
    cloud_acl = (out / "cloud" / "broker" / "acl").read_text()
    wants = {("st0", station_acl): topics.station_topics("plant", ["cam1", "cam2", "cam3"]),
             ("cam2", station_acl): topics.device_topics("plant", "st0"),
             ("cloud", cloud_acl): topics.cloud_topics("plant")}
    for (user, acl), filters in wants.items():
        granted = _grants(acl, user, "read")
        refused = [f for f in filters if not any(topics.matches(g, f) for g in granted)]
        assert not refused, (user, refused)
    # What the cloud reads of a station arrives over the station's bridge, and its broker
    # lets the station (the bridge's name) write it.
    bridge = (out / "stations" / "st0" / "broker" / "mosquitto.conf").read_text()
    outgoing = [line.split()[1] for line in bridge.splitlines()
                if line.startswith("topic ") and line.split()[2] == "out"]
    written = _grants(cloud_acl, "st0", "write")
    for wanted in topics.cloud_topics("plant"):
        if "/station/" in wanted:
            leaf = wanted.replace("/+/", "/st0/")
            assert leaf in outgoing and leaf in written, leaf


def test_a_station_of_more_devices_than_a_stock_broker_serves_is_named(tmp_path):
    """Past about 1,000 clients a broker under the usual limit of 1,024 descriptors refuses
    the rest, and the station waits for its whole roster for good (measured with 1,100
    devices: docs/scale.md); provisioning such a station says so, and what to do."""
    from aggregator.provision import CONNECTIONS_AT_1024

    ports = {"cloud": free_port(), "st0": free_port()}
    many = ", ".join(f'"d{k}"' for k in range(CONNECTIONS_AT_1024 + 1))
    path = tmp_path / "fleet.toml"
    path.write_text(FLEET.format(**ports).split("[[devices]]")[0].replace(
        'devices = ["cam1", "cam2", "cam3"]', f"devices = [{many}]"))
    notes = provision(path, tmp_path / "many")["notes"]
    assert len(notes) == 1 and "station st0" in notes[0] and "docs/deploy.md" in notes[0]
    out = subprocess.run([sys.executable, "-m", "safl", "provision", str(path), "--out",
                          str(tmp_path / "again")], capture_output=True, text=True)
    assert out.returncode == 0 and "warning: station st0" in out.stderr
    path.write_text(FLEET.format(**ports))  # three devices: nothing to say
    assert provision(path, tmp_path / "small")["notes"] == []
    at_bound = ", ".join(f'"d{k}"' for k in range(CONNECTIONS_AT_1024))  # exactly on it
    path.write_text(FLEET.format(**ports).split("[[devices]]")[0].replace(
        'devices = ["cam1", "cam2", "cam3"]', f"devices = [{at_bound}]"))
    assert provision(path, tmp_path / "at-bound")["notes"] == []
