"""The link emulator (lab/relay.py), the paced trainer a rehearsal slows its devices with, and
a real fleet that survives its links failing: a station cut from the cloud for longer than a
round, a device's link lost mid-upload."""

from __future__ import annotations

import dataclasses
import json
import shutil
import socket
import threading
import time

import numpy as np
import pytest

from edge_client.trainers import build_trainer
from edge_client.trainers.paced import REFERENCE_BATCH, PacedTrainer
from lab.clock import ClockConfig, LinkSpec
from lab.relay import LinkRelay


@pytest.fixture
def echo():
    """A TCP echo server on loopback: its address."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=_echo, args=(conn,), daemon=True).start()
    threading.Thread(target=serve, daemon=True).start()
    yield server.getsockname()
    server.close()


def _echo(conn: socket.socket) -> None:
    with conn:
        try:
            while data := conn.recv(65536):
                conn.sendall(data)
        except OSError:
            pass


def _round_trip(sock: socket.socket, payload: bytes) -> tuple[bytes, float]:
    started = time.perf_counter()
    sock.sendall(payload)
    got = b""
    while len(got) < len(payload):
        chunk = sock.recv(1 << 20)
        if not chunk:
            break
        got += chunk
    return got, time.perf_counter() - started


def test_the_relay_adds_its_latency_both_ways_and_keeps_the_bytes(echo):
    with LinkRelay(echo, LinkSpec(latency_ms=20)) as relay:
        sock = socket.create_connection(("127.0.0.1", relay.port))
        times = []
        for i in range(5):
            payload = bytes([i]) * 1000
            got, took = _round_trip(sock, payload)
            assert got == payload
            times.append(took)
        sock.close()
    assert min(times) >= 0.040  # two crossings of 20 ms
    assert relay.counters["bytes_up"] == relay.counters["bytes_down"] == 5000


def test_the_relay_caps_the_bandwidth(echo):
    with LinkRelay(echo, LinkSpec(bandwidth_mbps=8)) as relay:
        sock = socket.create_connection(("127.0.0.1", relay.port))
        payload = np.random.default_rng(0).bytes(200_000)
        got, took = _round_trip(sock, payload)
        sock.close()
    assert got == payload
    assert took >= 0.2 * 0.95  # 200 kB at 8 Mbit/s: 0.2 s (the echo overlaps both ways)


def test_a_partition_holds_every_byte_until_it_heals(echo):
    with LinkRelay(echo, LinkSpec(latency_ms=1)) as relay:
        sock = socket.create_connection(("127.0.0.1", relay.port))
        assert _round_trip(sock, b"before")[0] == b"before"
        relay.partition()
        sock.sendall(b"during")
        sock.settimeout(0.5)
        with pytest.raises(TimeoutError):
            sock.recv(100)
        relay.heal()
        sock.settimeout(5)
        got = b""
        while len(got) < 6:
            got += sock.recv(100)
        assert got == b"during"
        sock.close()
    assert relay.counters["partitions"] == 1


def test_a_reset_drops_the_connection_and_the_client_may_reconnect(echo):
    with LinkRelay(echo, LinkSpec()) as relay:
        sock = socket.create_connection(("127.0.0.1", relay.port))
        assert _round_trip(sock, b"x")[0] == b"x"
        relay.reset()
        sock.settimeout(5)
        with pytest.raises(OSError):
            sock.sendall(b"y" * 100)
            if not sock.recv(100):
                raise ConnectionResetError("closed")
        again = socket.create_connection(("127.0.0.1", relay.port))
        assert _round_trip(again, b"z")[0] == b"z"
        again.close()
    assert relay.counters["connections"] == 2 and relay.counters["resets"] == 1


def test_a_cut_lets_the_first_bytes_through_and_drops_the_link():
    server = socket.create_server(("127.0.0.1", 0))
    received = bytearray()

    def sink() -> None:
        conn, _ = server.accept()
        with conn:
            try:
                while data := conn.recv(65536):
                    received.extend(data)
            except OSError:
                pass
    reader = threading.Thread(target=sink, daemon=True)
    reader.start()
    with LinkRelay(server.getsockname(), LinkSpec()) as relay:
        sock = socket.create_connection(("127.0.0.1", relay.port))
        relay.cut_after(1000)
        sock.sendall(b"u" * 5000)
        reader.join(5)
        sock.settimeout(5)
        with pytest.raises(OSError):  # the client sees its link drop
            if not sock.recv(100):
                raise ConnectionResetError("closed")
        sock.close()
    server.close()
    assert bytes(received) == b"u" * 1000  # what crossed before the cut, nothing after
    assert relay.counters["cuts"] == 1


def test_a_paced_trainer_takes_its_boards_time_and_learns_the_same(digits):
    def trainer():
        return build_trainer("mlp", input_shape=digits.sample_shape, num_classes=10, lr=0.1)
    slept = []
    paced, plain = PacedTrainer(trainer(), 0.5, sleep=slept.append), trainer()
    x, y = digits.x_train[:REFERENCE_BATCH], digits.y_train[:REFERENCE_BATCH]
    assert paced.train_step(x, y) == plain.train_step(x, y)
    np.testing.assert_array_equal(paced.get_flat(), plain.get_flat())
    paced.train_step(x[:16], y[:16])  # half a reference batch: half the step's time
    paced.evaluate(x, y)  # a forward pass: a third of a step
    assert [round(s, 1) for s in slept] == [0.5, 0.2, 0.2]
    assert slept[1] < 0.25 and slept[2] < 0.5 / 3
    paced.lr = 0.01
    assert plain.lr != paced.inner.lr == 0.01


def test_a_paced_trainer_really_waits(digits):
    paced = PacedTrainer(build_trainer("mlp", input_shape=digits.sample_shape, num_classes=10,
                                       lr=0.1), 0.2)
    started = time.perf_counter()
    paced.train_step(digits.x_train[:32], digits.y_train[:32])
    assert time.perf_counter() - started >= 0.2 and paced.padded_s > 0


# A real fleet whose links fail: Mosquitto, the cloud and 2 stations of 2 devices as
# processes, each device and the cloud behind a relay.

def _fleet(digits, rounds: int):
    from lab.datasets import assign_groups, dirichlet_label_skew
    from lab.simulation import FleetSpec, Strategy
    rng = np.random.default_rng(0)
    spec = FleetSpec(partitions=tuple(dirichlet_label_skew(digits.y_train, 4, 1.0, rng)),
                     groups=tuple(assign_groups(4, 2, rng)), rounds=rounds, lr=0.1,
                     arrivals_per_step=32, initial_samples=64, eval_samples=300,
                     clock=ClockConfig(profiles=(("zero", 1.0),),
                                       device_link=LinkSpec(latency_ms=2),
                                       cloud_link=LinkSpec(latency_ms=5)))
    strategy = Strategy("fedgs", device={"mix": 1.0, "local_steps": 2},
                        station={"super_node_size": 2, "rand_per_group": 1, "sync_period": 2,
                                 "iteration_timeout": 10.0},
                        cloud={"round_timeout": 60.0})
    return strategy, spec


def _run(tmp_path, digits, rounds, during):
    """Launch the fleet with ``during(fleet, relays)`` each poll; returns the cloud's rows,
    its summary, the relays and every station's retained summary."""
    from brokers import Mosquitto, fleet_mosquitto

    from aggregator.status import fleet_status
    from edge_client.config import BrokerConfig
    from lab.relay import launch_relayed
    from lab.simulation import plan_fleet
    strategy, spec = _fleet(digits, rounds)
    plan = plan_fleet(strategy, spec)
    server = fleet_mosquitto(tmp_path, plan)
    try:
        rows, relays = launch_relayed(tmp_path / "run", digits, strategy, spec, server.url,
                                      credentials=lambda user: (user, Mosquitto.PASSWORD),
                                      during=during, timeout=300)
        found = fleet_status(BrokerConfig(url=server.url, username="tester",
                                          password=Mosquitto.PASSWORD), plan.fleet)
    finally:
        server.stop()
    cloud = json.loads((tmp_path / "run" / "cloud.json").read_text())
    return rows, cloud, relays, [found.stations[s["station_id"]] for s in plan.stations]


def _fused_whole(cloud: dict) -> bool:
    """No round closed without a station, and nothing refused but QoS 1's redeliveries."""
    counters = cloud["counters"]
    return not (counters.get("stations_missed") or counters.get("rounds_below_quorum")) \
        and _only_redeliveries(counters)


def _only_redeliveries(counters) -> bool:
    """Refused nothing but what QoS 1 delivered again after a reconnect, handled before (or
    too late for its iteration) and stale by then: at least once, refused as such."""
    return {k for k in counters if k.startswith("rejected")} <= {"rejected.stale_iteration"}


needs_mosquitto = pytest.mark.skipif(shutil.which("mosquitto") is None,
                                     reason="Mosquitto is installed by .ci/run")


@pytest.mark.slow
@needs_mosquitto
def test_the_cloud_cut_off_for_longer_than_a_round_loses_nothing(tmp_path, digits):
    cut: dict[str, float] = {}

    def during(fleet, relays):
        if "at" not in cut and fleet.last_round >= 2:
            rows = fleet.rows()
            cut["round_s"] = rows[-1]["wall_s"] - rows[-2]["wall_s"]
            cut["at"] = time.monotonic()
            relays["cloud"].partition()
        elif "at" in cut and "healed" not in cut and time.monotonic() - cut["at"] > max(
                3.0, 3 * cut["round_s"]):
            relays["cloud"].heal()
            relays["cloud"].reset()  # the link came back as a new connection
            cut["healed"] = time.monotonic()

    rows, cloud, relays, stations = _run(tmp_path, digits, 6, during)
    assert "healed" in cut and cut["healed"] - cut["at"] > cut["round_s"]
    assert [r["round"] for r in rows] == list(range(7))
    # Every round fused both stations' updates: none was lost or closed short.
    assert _fused_whole(cloud), cloud["counters"]
    assert cloud["transport"]["reconnects"] >= 1 and relays["cloud"].counters["connections"] >= 2
    assert all(_only_redeliveries(doc.counters) for doc in stations)
    assert rows[-1]["accuracy"] > 0.3  # it went on learning (chance: 0.1)


@pytest.mark.slow
@needs_mosquitto
def test_a_device_cut_off_mid_upload_reconnects_and_its_update_arrives(tmp_path, digits):
    armed: dict[str, int] = {}

    def during(fleet, relays):
        relay = relays["dev000"]
        if "bytes" not in armed and fleet.last_round >= 1:
            armed["bytes"] = relay.counters["bytes_up"]
            relay.cut_after(20_000)  # an MLP update is 38 kB: the link drops inside one

    rows, cloud, relays, stations = _run(tmp_path, digits, 5, during)
    relay = relays["dev000"]
    assert relay.counters["cuts"] == 1 and relay.counters["connections"] >= 2
    assert [r["round"] for r in rows] == list(range(6))
    assert _fused_whole(cloud), cloud["counters"]
    # The half-sent frame never became a message anyone refused (its whole resend may come
    # after its iteration closed, and the station benches a device that misses one), and
    # a whole update's worth went up the new connection after the cut.
    assert all(_only_redeliveries(doc.counters) for doc in stations)
    assert relay.counters["bytes_up"] - armed["bytes"] - 20_000 > 38_440
    assert rows[-1]["accuracy"] > 0.3  # it went on learning (chance: 0.1)


@pytest.mark.slow
@needs_mosquitto
def test_a_participant_that_outlives_the_cloud_is_stopped_not_waited_for(tmp_path, digits,
                                                                         monkeypatch, caplog):
    import sys

    from brokers import Mosquitto, fleet_mosquitto

    from lab import launch
    from lab.simulation import plan_fleet
    monkeypatch.setattr(launch, "LINGER_S", 1.0)
    strategy, spec = _fleet(digits, 2)
    spec = dataclasses.replace(spec, clock=None)
    # dev000 runs as it should, then its process stays on (as one that missed the end would).
    lingering = [sys.executable, "-c", "import subprocess, sys, time; subprocess.call([sys."
                 "executable, '-m', 'safl', 'device', *sys.argv[1:]]); time.sleep(120)"]
    server = fleet_mosquitto(tmp_path, plan_fleet(strategy, spec))
    started = time.monotonic()
    try:
        rows = launch.launch_fleet(tmp_path / "run", digits, strategy, spec, server.url,
                                   credentials=lambda user: (user, Mosquitto.PASSWORD),
                                   commands={"dev000": lingering}, timeout=120)
    finally:
        server.stop()
    assert [r["round"] for r in rows] == [0, 1, 2]
    assert "dev000 still ran 1 s after the cloud finished" in caplog.text
    assert time.monotonic() - started < 60
