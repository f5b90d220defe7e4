"""The fleet on real brokers: Mosquitto (password file and ACL) and the embedded amqtt.

Each role runs as its own OS process; the in-process bus with the same plan is the
reference, so equal accuracy shows the MQTT path runs the same code.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import signal
import socket
import time

import numpy as np
import paho.mqtt.client as paho
import pytest
from brokers import Amqtt, Mosquitto, acl_lines, fleet_mosquitto, free_port
from paho.mqtt.enums import CallbackAPIVersion

from aggregator.status import fleet_status, format_status
from edge_client import messages as m
from edge_client.codec import encode
from edge_client.config import BrokerConfig
from edge_client.errors import BrokerRefused, ConnectError
from edge_client.mqtt import MqttTransport
from edge_client.topics import topic_for
from lab.attacks import forge_nan
from lab.clock import ClockConfig
from lab.datasets import assign_groups, dirichlet_label_skew
from lab.demo import demo_strategies
from lab.launch import launch_fleet
from lab.simulation import FleetSpec, plan_fleet, run_federation

pytestmark = pytest.mark.skipif(shutil.which("mosquitto") is None,
                                reason="Mosquitto is installed by .ci/run")


def _spec(digits, rounds=8):
    rng = np.random.default_rng(0)
    # Well fed (43 new training samples an iteration against at most 32 consumed), so no
    # device's next batch changes between its own reports and stats cannot race.
    return FleetSpec(partitions=tuple(dirichlet_label_skew(digits.y_train, 6, 0.5, rng)),
                     groups=tuple(assign_groups(6, 2, rng)), rounds=rounds, lr=0.1,
                     arrivals_per_step=48, initial_samples=64)


STRATEGY = demo_strategies(super_node_size=2, sync_period=3)[1]  # FedGS
# The same, waiting for every member: the in-process bus (no clock) never cuts a member at a
# deadline, and a process that a busy 2-core machine schedules late would be cut over MQTT
# and change the trajectory (test_a_member_cut_at_the_deadline_... below).
PATIENT = dataclasses.replace(STRATEGY, station={**STRATEGY.station, "straggler_factor": 0.0})


def _mosquitto(tmp_path, spec, **kw):
    return fleet_mosquitto(tmp_path, plan_fleet(STRATEGY, spec), **kw)


def _creds(user):
    return (user, Mosquitto.PASSWORD)


@pytest.mark.slow
@pytest.mark.parametrize("broker", ["mosquitto", "amqtt"])
def test_processes_over_a_broker_match_the_in_process_bus(tmp_path, digits, broker):
    spec = _spec(digits)
    reference = run_federation(digits, PATIENT, spec)
    server = _mosquitto(tmp_path, spec) if broker == "mosquitto" else Amqtt(tmp_path)
    try:
        rows = launch_fleet(tmp_path / "run", digits, PATIENT, spec, server.url,
                            credentials=_creds if broker == "mosquitto" else None, timeout=240)
    finally:
        server.stop()
    assert [r["round"] for r in rows] == list(range(spec.rounds + 1))
    mqtt_acc = [r["accuracy"] for r in rows]
    local_acc = [r["accuracy"] for r in reference.rows]
    assert abs(mqtt_acc[-1] - local_acc[-1]) <= 0.02
    # Measured: the trajectories are identical, round by round.
    np.testing.assert_allclose(mqtt_acc, local_acc, atol=0.02)


def _late_replies(run_dir) -> int:
    """The stations' late replies, from the counters each logs as it finishes."""
    logs = [path.read_text() for path in (run_dir / "logs").glob("st*.log")]
    return sum(int(n) for log in logs for n in re.findall(r"'late_replies': (\d+)", log))


@pytest.mark.slow
def test_a_member_cut_at_the_deadline_departs_from_the_bus_and_waiting_for_all_matches_it(
        tmp_path, digits):
    """What made the equality test above flaky on a loaded machine: the stations cut a
    member whose reply came after 3x the median (since the straggler deadline), and the
    in-process bus never does.  One device made slow on purpose (0.8 s a step, the others
    0.4 ms) is cut by default; a station that waits for every member matches the bus all
    the same."""
    spec = _spec(digits, rounds=6)
    slow = dataclasses.replace(spec, clock=ClockConfig(
        profiles=(("x86-numpy", 1.0),), slow_devices=(0,), slow_factor=2000.0))
    late = {}
    for strategy in (STRATEGY, PATIENT):
        server = Amqtt(tmp_path)
        run = tmp_path / f"run-{strategy.station.get('straggler_factor', 3)}"
        try:
            rows = launch_fleet(run, digits, strategy, slow, server.url, timeout=240)
        finally:
            server.stop()
        late[strategy is PATIENT] = _late_replies(run)
    assert late[False] >= 1 and late[True] == 0, late
    reference = run_federation(digits, PATIENT, spec)
    np.testing.assert_allclose([r["accuracy"] for r in rows],
                               [r["accuracy"] for r in reference.rows], atol=0.02)


def test_chunked_model_larger_than_mosquittos_limit(tmp_path):
    limit = 1 << 20
    server = Mosquitto(tmp_path, ["d0", "st0", "tester"],
                       acl_lines("f", {"st0": ["d0"]}), message_size_limit=limit)
    try:
        def transport(user):
            cfg = BrokerConfig(url=server.url, username=user, password=Mosquitto.PASSWORD)
            return MqttTransport(cfg, client_id=user, fleet="f")

        station, device = transport("st0"), transport("d0")
        got = []
        station.subscribe("safl/f/dev/+/update", lambda t, msg: got.append(msg))
        station.connect()
        device.connect()
        time.sleep(0.2)
        weights = np.random.default_rng(0).random(700_000, dtype=np.float32)  # 2.8 MB
        assert weights.nbytes > limit > limit / 4
        msg = m.DeviceUpdate(fleet="f", sender="d0", round=0, iteration=0, station="st0",
                             weights=weights, num_samples=32)
        device.publish(topic_for(msg), msg)
        deadline = time.monotonic() + 15
        while not got and time.monotonic() < deadline:
            station.deliver()
            time.sleep(0.01)
        assert len(got) == 1 and np.array_equal(got[0].weights, weights)
        assert device.counters["bytes_out"] / weights.nbytes < 1.01
        device.close()
        station.close()
    finally:
        server.stop()


def test_devices_on_either_wire_version_reach_an_upgraded_station(tmp_path):
    """During an upgrade a device pinned to wire version 1 (``wire_version = 1``) and one
    on version 2 both reach a station on version 2; each writes its own version on the wire,
    chunks and presence included."""
    server = Mosquitto(tmp_path, ["d0", "d1", "st0", "tester"],
                       acl_lines("f", {"st0": ["d0", "d1"]}))
    try:
        seen = []
        raw = paho.Client(CallbackAPIVersion.VERSION2, client_id="tester")
        raw.username_pw_set("tester", Mosquitto.PASSWORD)
        raw.on_message = lambda c, u, msg: seen.append((msg.topic, msg.payload[:5]))
        raw.connect(*BrokerConfig(url=server.url).host_port)
        raw.subscribe("safl/f/dev/#", qos=1)
        raw.loop_start()

        def transport(user, **kw):
            cfg = BrokerConfig(url=server.url, username=user, password=Mosquitto.PASSWORD,
                               chunk_size=64 * 1024, **kw)
            presence = m.Presence(fleet="f", sender=user, round=0, iteration=0, role="dev",
                                  online=True)
            return MqttTransport(cfg, client_id=user, fleet="f",
                                 presence=presence if user != "st0" else None)

        station = transport("st0")
        old, new = transport("d0", wire_version=1), transport("d1")
        got = []
        station.subscribe("safl/f/dev/+/update", lambda t, msg: got.append(msg))
        for t in (station, old, new):
            t.connect()
        time.sleep(0.2)
        weights = np.random.default_rng(0).random(50_000, dtype=np.float32)  # 4 chunks
        for dev in ("d0", "d1"):
            msg = m.DeviceUpdate(fleet="f", sender=dev, round=0, iteration=0, station="st0",
                                 weights=weights, num_samples=32)
            (old if dev == "d0" else new).publish(topic_for(msg), msg)
        deadline = time.monotonic() + 15
        while len(got) < 2 and time.monotonic() < deadline:
            station.deliver()
            time.sleep(0.01)
        assert sorted(g.sender for g in got) == ["d0", "d1"]
        assert all(np.array_equal(g.weights, weights) for g in got)
        assert not any(k.startswith("rejected") for k in station.counters)
        raw.loop_stop()
        versions = {(t.split("/")[3], t.split("/")[4], p[:4], p[4]) for t, p in seen}
        assert {("d0", "update", b"SAFC", 1), ("d0", "status", b"SAFL", 1),
                ("d1", "update", b"SAFC", 2), ("d1", "status", b"SAFL", 2)} <= versions
        assert {v[3] for v in versions if v[0] == "d0"} == {1}
        for t in (old, new, station):
            t.close()
    finally:
        server.stop()


def test_broker_refuses_wrong_password(tmp_path):
    server = Mosquitto(tmp_path, ["d0"], acl_lines("f", {"st0": ["d0"]}))
    try:
        cfg = BrokerConfig(url=server.url, username="d0", password="wrong", connect_timeout=2)
        with pytest.raises(BrokerRefused):
            MqttTransport(cfg, client_id="d0", fleet="f").connect()
        # No identity at all: the refusal says what a binding broker wants.
        anonymous = BrokerConfig(url=server.url, connect_timeout=2)
        with pytest.raises(BrokerRefused, match="Not authorized.*binds client ids"):
            MqttTransport(anonymous, client_id="d0", fleet="f").connect()
    finally:
        server.stop()


def test_reconnect_pauses_double_with_jitter_of_the_participants_own(tmp_path):
    cfg = BrokerConfig(url="mqtt://127.0.0.1:1", backoff_min=0.5, backoff_max=4.0)

    def pauses(client_id):
        backoff = MqttTransport(cfg, client_id=client_id, fleet="f")._backoff()
        return [next(backoff) for _ in range(6)]

    first = pauses("d0")
    for pause, nominal in zip(first, [0.5, 1.0, 2.0, 4.0, 4.0, 4.0], strict=True):
        assert 0.5 * nominal <= pause <= nominal
    assert pauses("d0") == first and pauses("d1") != first  # its own, and repeatable
    # The first connection gives up within connect_timeout, on the same schedule.
    quick = BrokerConfig(url=f"mqtt://127.0.0.1:{free_port()}", backoff_min=0.1,
                         connect_timeout=1.0)
    started = time.monotonic()
    with pytest.raises(ConnectError, match="within 1 s"):
        MqttTransport(quick, client_id="d0", fleet="f").connect()
    assert time.monotonic() - started < 3.0
    # A service that lost its broker pauses before its first try too: a fleet that lost the
    # broker together does not reconnect together.
    lost = MqttTransport(BrokerConfig(url="mqtt://127.0.0.1:1", backoff_min=0.4),
                         client_id="d0", fleet="f")
    tries: list[float] = []
    started = time.monotonic()
    assert lost._retry(lambda: tries.append(time.monotonic()) or True)
    assert tries[0] - started >= 0.2
    tries.clear()
    started = time.monotonic()
    assert lost._retry(lambda: tries.append(time.monotonic()) or True, deadline=started + 5)
    assert tries[0] - started < 0.1  # the first connection tries at once


@pytest.mark.slow
def test_malformed_messages_are_counted_and_the_run_finishes(tmp_path, digits):
    spec = _spec(digits, rounds=16)
    plan = plan_fleet(STRATEGY, spec)
    server = _mosquitto(tmp_path, spec)
    fleet, st0 = plan.fleet, plan.stations[0]
    victim = st0["devices"][0]
    n = 64 * 128 + 128 + 128 * 10 + 10

    def update(**kw):
        base = dict(fleet=fleet, sender=victim, round=0, iteration=2, station="st0",
                    weights=np.zeros(n, np.float32), num_samples=32)
        return m.DeviceUpdate(**{**base, **kw})

    good = encode(update(), layout_hash="")
    attacks = [
        (encode(update(fleet="other")), "wrong_fleet"),
        (encode(update(), layout_hash="0123456789abcdef"), "wrong_layout"),
        (good[:100] + bytes([good[100] ^ 0xFF]) + good[101:], "bad_checksum"),
        (forge_nan(good, n), "non_finite"),
        (good[:-7], "wrong_length"),
        (b"\x00" * (3 << 20), "oversize"),
        (encode(update(iteration=9999)), "stale_iteration"),
        (encode(update(sender="intruder")), "topic_mismatch"),
    ]
    intruder = m.DeviceStats(fleet=fleet, sender="intruder", round=0, iteration=0,
                             station="st0", seen_counts=np.ones(10, int),
                             next_batch_counts=np.ones(10, int))
    sent = []

    def attack(running) -> None:
        if sent or not (tmp_path / "run" / "logs" / "cloud.log").exists():
            return
        if "round 1:" not in (tmp_path / "run" / "logs" / "cloud.log").read_text():
            return  # attack while the fleet is running
        client = paho.Client(CallbackAPIVersion.VERSION2, client_id="tester")
        client.username_pw_set("tester", Mosquitto.PASSWORD)
        client.connect("127.0.0.1", server.port)
        client.loop_start()
        topic = f"safl/{fleet}/dev/{victim}/update"
        for payload, _ in attacks:
            client.publish(topic, payload, qos=1).wait_for_publish(5)
        client.publish(topic_for(intruder), encode(intruder), qos=1).wait_for_publish(5)
        client.publish(topic, good, qos=1).wait_for_publish(5)  # a replay: stale or duplicate
        client.publish(topic, good, qos=1).wait_for_publish(5)
        client.loop_stop()
        client.disconnect()
        sent.append(True)

    try:
        rows = launch_fleet(tmp_path / "run", digits, STRATEGY, spec, server.url,
                            credentials=_creds, timeout=240, during=attack,
                            broker_extra={"max_message": 2 << 20})
        status = fleet_status(BrokerConfig(url=server.url, username="tester",
                                           password=Mosquitto.PASSWORD), fleet)
    finally:
        server.stop()
    assert sent and rows[-1]["round"] == spec.rounds
    summary = status.stations["st0"]
    rejected = {**summary.counters, **summary.transport}
    for _, reason in attacks:
        assert rejected.get(f"rejected.{reason}", 0) >= 1, (reason, rejected)
    assert rejected.get("rejected.unknown_sender", 0) >= 1  # the well-formed intruder's stats
    assert "fleet sim" in format_status(status, fleet)


@pytest.mark.slow
def test_a_killed_device_leaves_selection_through_its_last_will(tmp_path, digits):
    spec = _spec(digits, rounds=16)
    plan = plan_fleet(STRATEGY, spec)
    victim = plan.stations[0]["devices"][0]
    server = _mosquitto(tmp_path, spec)
    killed = []

    def kill(fleet) -> None:
        if not killed and fleet.last_round >= 1:
            fleet.procs[victim].send_signal(signal.SIGKILL)
            killed.append(victim)

    try:
        rows = launch_fleet(tmp_path / "run", digits, STRATEGY, spec, server.url,
                            credentials=_creds, timeout=240, during=kill)
        status = fleet_status(BrokerConfig(url=server.url, username="tester",
                                           password=Mosquitto.PASSWORD), plan.fleet)
    finally:
        server.stop()
    assert killed and rows[-1]["round"] == spec.rounds
    assert status.presence[("dev", victim)] is False
    assert status.stations["st0"].counters["devices_offline"] >= 1


def _pair(server, fleet="f"):
    def transport(user):
        cfg = BrokerConfig(url=server.url, username=user, password=Mosquitto.PASSWORD,
                           backoff_min=0.1, backoff_max=0.5)
        return MqttTransport(cfg, client_id=user, fleet=fleet)
    return transport("st0"), transport("d0")


def _pump(transport, got, n, seconds=15):
    deadline = time.monotonic() + seconds
    while len(got) < n and time.monotonic() < deadline:
        transport.deliver()
        time.sleep(0.01)


def test_qos1_duplicates_are_applied_once_and_reconnects_resubscribe(tmp_path):
    server = Mosquitto(tmp_path, ["d0", "st0", "tester"], acl_lines("f", {"st0": ["d0"]}))
    station, device = _pair(server)
    got = []
    station.subscribe("safl/f/dev/+/update", lambda t, msg: got.append(msg))
    try:
        station.connect()
        device.connect()
        time.sleep(0.2)
        msg = m.SkipNotice(fleet="f", sender="d0", round=0, iteration=1, station="st0", gap=0.5)
        frame = encode(msg)
        raw = paho.Client(CallbackAPIVersion.VERSION2, client_id="tester")
        raw.username_pw_set("tester", Mosquitto.PASSWORD)
        raw.connect("127.0.0.1", server.port)
        raw.loop_start()
        for _ in range(3):  # what a QoS 1 redelivery looks like: the same frame again
            raw.publish(topic_for(msg), frame, qos=1).wait_for_publish(5)
        raw.loop_stop()
        raw.disconnect()
        _pump(station, got, 1)
        time.sleep(0.3)
        station.deliver()
        assert len(got) == 1 and station.counters["duplicates"] == 2

        server.stop()  # the broker goes away and comes back on the same port
        time.sleep(0.5)
        server.start()
        deadline = time.monotonic() + 15
        while not (station.connected and device.connected) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert station.connected and device.connected
        assert station.counters["reconnects"] >= 1
        time.sleep(0.3)
        device.publish(topic_for(msg), m.SkipNotice(fleet="f", sender="d0", round=0,
                                                    iteration=2, station="st0", gap=0.5))
        _pump(station, got, 2)
        assert [g.iteration for g in got] == [1, 2]  # resubscribed after the restart
    finally:
        device.close()
        station.close()
        server.stop()


def test_a_flood_it_cannot_keep_up_with_does_not_keep_deliver_from_returning(tmp_path):
    """A station slower than its inbound traffic (a thousand devices' hellos on a loaded
    server) still gets back to its ticks, deadlines and summaries: one deliver() admits
    frames for its budget and returns, where it stayed in deliver as long as the flood
    lasted."""
    from edge_client.mqtt import DELIVER_BUDGET_S

    server = Mosquitto(tmp_path, ["d0", "st0", "tester"], acl_lines("f", {"st0": ["d0"]}))
    station, _ = _pair(server)
    handled = []
    # Each frame costs the handler 2 ms; the flood brings one every 0.5 ms.
    station.subscribe("safl/f/dev/+/update", lambda t, msg: (handled.append(msg),
                                                              time.sleep(0.002)))
    raw = paho.Client(CallbackAPIVersion.VERSION2, client_id="tester")
    try:
        station.connect()
        raw.username_pw_set("tester", Mosquitto.PASSWORD)
        raw.connect("127.0.0.1", server.port)
        raw.loop_start()
        for k in range(4000):
            msg = m.SkipNotice(fleet="f", sender="d0", round=0, iteration=k, station="st0",
                               gap=0.5)
            raw.publish(topic_for(msg), encode(msg), qos=0)
        time.sleep(1.0)  # a backlog of frames that takes seconds to handle
        began = time.monotonic()
        station.deliver()
        took = time.monotonic() - began
        assert took < DELIVER_BUDGET_S + 0.1 and 0 < len(handled) < 4000, (took, len(handled))
    finally:
        raw.loop_stop()
        raw.disconnect()
        station.close()
        server.stop()


def test_a_devices_answer_is_timed_from_its_selections_arrival(tmp_path, digits):
    """A board that falls behind shows it: the time a selection waited in the device's
    inbox (it was busy) counts towards its answer time, which /metrics and the device's
    last log line carry (the emulated-Pi check bounds it)."""
    from edge_client.config import DeviceConfig
    from edge_client.device import Device
    from edge_client.runner import RoleRunner
    from edge_client.trainers import build_trainer

    server = Mosquitto(tmp_path, ["d0", "st0"], acl_lines("f", {"st0": ["d0"]}))
    station, transport = _pair(server)
    trainer = build_trainer("softmax", input_shape=(8, 8), num_classes=10, lr=0.1, seed=0)
    device = Device(DeviceConfig(device_id="d0", station="st0", fleet="f"), trainer,
                    num_classes=10, sample_shape=(8, 8), rng=np.random.default_rng(0))
    device.ingest(digits.x_train[:64], digits.y_train[:64], 0.0)
    runner = RoleRunner(device, transport)
    replies: list[m.Message] = []
    runner.observers.append(replies.append)
    try:
        station.connect()
        transport.connect()
        time.sleep(0.2)
        for msg in (m.StationModel(fleet="f", sender="st0", round=0, iteration=0,
                                   weights=trainer.get_flat()),
                    m.Selection(fleet="f", sender="st0", round=0, iteration=0,
                                members=("d0",), deadline=1.0)):
            station.publish(topic_for(msg), msg)
        time.sleep(0.6)  # the device is busy elsewhere: both wait in its inbox
        _pump(transport, replies, 2)
        assert any(isinstance(r, m.DeviceUpdate) for r in replies)
        figures = runner.figures()
        assert 0.5 <= figures["answer_seconds"] <= figures["answer_max_seconds"] < 15
    finally:
        transport.close()
        station.close()
        server.stop()


def test_a_device_service_stops_cleanly_on_sigterm(tmp_path, digits):
    import subprocess
    import sys

    from edge_client.config import toml_text

    server = Mosquitto(tmp_path, ["d0", "st0", "tester"], acl_lines("f", {"st0": ["d0"]}))
    np.savez(tmp_path / "d0.npz", x=digits.x_train[:100], y=digits.y_train[:100])
    config = tmp_path / "d0.toml"
    config.write_text(toml_text({
        "device": {"device_id": "d0", "station": "st0", "fleet": "f"},
        "model": {"name": "mlp", "input_shape": [8, 8], "num_classes": 10},
        "source": {"kind": "replay", "path": str(tmp_path / "d0.npz"), "loop": True},
        "broker": {"url": server.url, "username": "d0", "password": Mosquitto.PASSWORD}}))
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "safl", "device", "--config",
                             str(config), "--metrics-port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        cfg = BrokerConfig(url=server.url, username="tester", password=Mosquitto.PASSWORD)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if fleet_status(cfg, "f", wait=0.3).presence.get(("dev", "d0")):
                break
        assert fleet_status(cfg, "f", wait=0.3).presence[("dev", "d0")] is True
        import json
        import urllib.request
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        labels = b'{role="device",fleet="f",station="st0",device="d0"}'
        assert b"safl_messages_out_total" + labels in body  # its stats went out
        assert b"safl_buffer_unread" + labels in body and b"# HELP safl_messages_out" in body
        assert b'safl_source_total{kind="samples",role="device"' in body  # the pump counts
        health = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz",
                                                   timeout=5).read())
        assert health["status"] == "ok" and health["device"] == "d0"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0, proc.stdout.read().decode()
        assert fleet_status(cfg, "f", wait=0.5).presence[("dev", "d0")] is False
    finally:
        if proc.poll() is None:
            proc.kill()
        server.stop()


def test_a_broken_config_names_the_key_before_connecting(tmp_path):
    import subprocess
    import sys

    config = tmp_path / "bad.toml"
    config.write_text('[device]\ndevice_id = "d0"\nstation = "st0"\nmix = 2.0\n'
                      '[source]\nkind = "synthetic"\n')
    out = subprocess.run([sys.executable, "-m", "safl", "device", "--config",
                          str(config)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "'mix'" in out.stderr


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")
def test_tls_with_client_certificates(tmp_path):
    from brokers import make_certs

    certs = make_certs(tmp_path)
    server = Mosquitto(tmp_path, ["d0", "st0"], acl_lines("f", {"st0": ["d0"]}),
                       tls={"ca": certs["ca"], "cert": certs["server_cert"],
                            "key": certs["server_key"]})
    try:
        def transport(user, **kw):
            cfg = BrokerConfig(url=f"mqtts://127.0.0.1:{server.port}", username=user,
                               password=Mosquitto.PASSWORD, connect_timeout=3, **kw)
            return MqttTransport(cfg, client_id=user, fleet="f")

        station = transport("st0", ca=str(certs["ca"]), cert=str(certs["cert"]),
                            key=str(certs["key"]))
        device = transport("d0", ca=str(certs["ca"]), cert=str(certs["cert"]),
                           key=str(certs["key"]))
        got = []
        station.subscribe("safl/f/dev/+/update", lambda t, msg: got.append(msg))
        station.connect()
        device.connect()
        time.sleep(0.2)
        msg = m.SkipNotice(fleet="f", sender="d0", round=0, iteration=0, station="st0", gap=0.0)
        device.publish(topic_for(msg), msg)
        _pump(station, got, 1)
        assert len(got) == 1
        device.close()
        station.close()
        # Without a client certificate the broker refuses the handshake.
        with pytest.raises(ConnectError):
            transport("d0", ca=str(certs["ca"])).connect()
    finally:
        server.stop()


@pytest.mark.slow
def test_a_fleet_written_by_the_demo_starts_by_hand_as_its_readme_says(tmp_path):
    import subprocess
    import sys

    from safl.cli import main

    folder = tmp_path / "fleet"
    assert main(["demo", "--fleet-out", str(folder), "--rounds", "2"]) == 0
    broker = Amqtt(tmp_path)
    readme = (folder / "README.md").read_text()
    lines = [line for line in readme.splitlines() if line.startswith("safl ")]
    assert len(lines) == 15  # the cloud, 2 stations, 12 devices
    procs = []
    try:
        for line in lines:  # exactly the documented commands, with this broker's URL
            args = line.replace("mqtt://127.0.0.1:1883", broker.url).split()[1:]
            procs.append(subprocess.Popen([sys.executable, "-m", "safl", *args],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        assert procs[0].wait(240) == 0  # the cloud finishes its rounds
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        broker.stop()
    rows = (folder / "metrics.csv").read_text().splitlines()
    assert [r.split(",")[0] for r in rows[1:]] == ["0", "1", "2"]
    for toml in folder.glob("*.toml"):  # every path in the files is absolute
        for line in toml.read_text().splitlines():
            if line.startswith(("path", "state_dir")):
                assert line.split('"')[1].startswith("/"), line


def test_documents_are_checked_and_a_failing_handler_is_counted(tmp_path):
    from edge_client.documents import StationSummary
    from edge_client.topics import summary_topic
    server = Mosquitto(tmp_path, ["tester"], ["user tester", "topic readwrite #"])
    try:
        cfg = BrokerConfig(url=server.url, username="tester", password=Mosquitto.PASSWORD)
        writer = MqttTransport(cfg, client_id="w", fleet="f")
        reader = MqttTransport(cfg, client_id="r", fleet="f", persistent=False)
        got = []

        def broken(topic, doc):
            raise RuntimeError("a bug in an observer")
        for handler in (broken, lambda topic, doc: got.append(doc)):
            reader.subscribe_documents(summary_topic("f", "+", "+"), handler)
        writer.connect()
        reader.connect()
        time.sleep(0.2)
        writer.publish_raw(summary_topic("f", "station", "s0"), b"{not json")
        doc = StationSummary(station="s1", state="waiting", round=2, iteration=20, devices=3,
                             online=3, quorum=1)
        writer.publish_document(summary_topic("f", "station", "s1"), doc)
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            reader.wait(0.1)
            reader.deliver()
        writer.close()
        reader.close()
    finally:
        server.stop()
    assert got == [doc]  # the next handler still ran
    assert reader.counters["rejected.internal"] == 1
    assert reader.counters["rejected.document"] == 1


def test_a_final_presence_stays_retained_for_a_device_that_comes_back_late(tmp_path):
    """What a station leaves behind at a normal end is its retained offline presence with
    ``final`` set (a Last Will never says final); one that reconnects later reads it."""
    server = Mosquitto(tmp_path, ["st0", "d0"], acl_lines("f", {"st0": ["d0"]}))
    try:
        def station(final):
            presence = m.Presence(fleet="f", sender="st0", round=0, iteration=0,
                                  role=m.Participant.STATION, online=True)
            t = MqttTransport(BrokerConfig(url=server.url, username="st0",
                                           password=Mosquitto.PASSWORD, connect_timeout=5),
                              client_id="st0", fleet="f", presence=presence)
            t.connect()
            time.sleep(0.2)
            t.close(final=final)

        seen = []
        for final in (False, True):
            station(final)
            device = MqttTransport(BrokerConfig(url=server.url, username="d0",
                                                password=Mosquitto.PASSWORD),
                                   client_id=f"d0-{final}", fleet="f", persistent=False)
            device.subscribe("safl/f/station/st0/status", lambda t, msg: seen.append(msg))
            device.connect()
            deadline = time.monotonic() + 3
            while len(seen) < 1 + final and time.monotonic() < deadline:
                device.deliver()
                time.sleep(0.05)
            device.close()
        assert [(p.online, p.final) for p in seen] == [(False, False), (False, True)]
    finally:
        server.stop()


def test_each_connection_leaves_a_last_will_of_its_own(tmp_path):
    """A broker restart fires every participant's will.  The will was one frame for all of a
    transport's connections, one message id: a device that took the station's will at the
    restart dropped its next one as a duplicate, silently (a station that then died, or a
    final presence that a will replaced, was never heard of).  Two wills, two deliveries."""
    server = Mosquitto(tmp_path, ["st0", "d0"], acl_lines("f", {"st0": ["d0"]}))
    presence = m.Presence(fleet="f", sender="st0", round=0, iteration=0,
                          role=m.Participant.STATION, online=True)
    station = MqttTransport(BrokerConfig(url=server.url, username="st0",
                                         password=Mosquitto.PASSWORD, backoff_min=0.05,
                                         backoff_max=0.2), client_id="st0", fleet="f",
                            presence=presence)
    device = MqttTransport(BrokerConfig(url=server.url, username="d0",
                                        password=Mosquitto.PASSWORD, backoff_min=0.05,
                                        backoff_max=0.2), client_id="d0", fleet="f")
    seen: list[bool] = []
    device.subscribe("safl/f/station/st0/status", lambda t, msg: seen.append(msg.online))
    try:
        device.connect()
        station.connect()
        for cut in range(2):
            _pump(device, seen, 2 * cut + 1)  # online
            # the station's connection cut under it (no DISCONNECT): the broker sends its will
            station._socket.submit(lambda: station._client.socket().shutdown(socket.SHUT_RDWR))
            _pump(device, seen, 2 * cut + 2)  # its will
        assert seen == [True, False, True, False], (seen, dict(device.counters))
    finally:
        station.close()
        device.close()
        server.stop()
