"""Benchmark: the MQTT wire against the in-process bus, on one fleet and one plan.

Runs FedGS (2 stations x 3 devices, MLP on digits; small_cnn-sized models are covered by the
frame table) in process, then as 9 OS processes over a Mosquitto started on a free loopback
port, and prints:

- wire bytes per model-carrying frame / raw float32 model bytes (headers and chunking in);
- iteration latency over Mosquitto / in-process (ratio, same run);
- station CPU time per received update (the station process's CPU after start-up).

Run: ``python bench/wire.py [--rounds N]``.  Needs Debian's mosquitto.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from brokers import Mosquitto, acl_lines  # noqa: E402

from aggregator.datasets import assign_groups, dirichlet_label_skew, load_dataset  # noqa: E402
from aggregator.demo import demo_strategies  # noqa: E402
from aggregator.launch import launch_fleet  # noqa: E402
from aggregator.simulation import FleetSpec, plan_fleet, run_federation  # noqa: E402
from aggregator.status import fleet_status  # noqa: E402
from edge_client import messages as m  # noqa: E402
from edge_client.codec import DEFAULT_CHUNK_SIZE, encode, split  # noqa: E402
from edge_client.config import BrokerConfig  # noqa: E402


def _wire(msg: m.Message) -> tuple[int, int]:
    parts = split(encode(msg, layout_hash="0123456789abcdef"), DEFAULT_CHUNK_SIZE)
    return sum(len(p) for p in parts), len(parts)


def frame_table(super_node: int = 4) -> None:
    """Bytes one iteration publishes (station model, selection, and per member its stats and
    update) over the raw float32 bytes of the 1 + L models it carries."""
    h = dict(fleet="factory-7", round=12, iteration=604)
    members = tuple(f"camera-{i:04d}" for i in range(super_node))
    print(f"{'params':>9} {'raw model':>10} {'update frame':>13} {'chunks':>7} "
          f"{'frame/raw':>10} {'iteration/raw':>14}")
    for n in (9_610, 101_770, 114_314, 1_000_000, 6_497_162):  # digits MLP ... FEMNIST CNN
        w = np.zeros(n, np.float32)
        update, chunks = _wire(m.DeviceUpdate(**h, sender=members[0], station="station-3",
                                              weights=w, num_samples=32))
        stats, _ = _wire(m.DeviceStats(**h, sender=members[0], station="station-3",
                                       seen_counts=np.zeros(62, int),
                                       next_batch_counts=np.zeros(62, int)))
        model, _ = _wire(m.StationModel(**h, sender="station-3", weights=w))
        select, _ = _wire(m.Selection(**h, sender="station-3", members=members, deadline=1e9))
        iteration = model + select + super_node * (stats + update)
        print(f"{n:>9} {4 * n:>10} {update:>13} {chunks:>7} {update / (4 * n):>10.4f} "
              f"{iteration / ((1 + super_node) * 4 * n):>14.4f}")


def _raw_latency(url: str, payload: bytes, reps: int) -> float:
    """Median one-way latency of ``payload`` between two raw paho clients (QoS 1)."""
    import paho.mqtt.client as paho
    from paho.mqtt.enums import CallbackAPIVersion

    host, port = url.removeprefix("mqtt://").split(":")
    got = threading.Event()
    clients = []
    for name in ("raw-pub", "raw-sub"):
        c = paho.Client(CallbackAPIVersion.VERSION2, client_id=name)
        c.username_pw_set("tester", Mosquitto.PASSWORD)
        c.connect(host, int(port))
        c.loop_start()
        clients.append(c)
    pub, sub = clients
    sub.on_message = lambda *_: got.set()
    sub.subscribe("bench/raw", qos=1)
    time.sleep(0.3)
    times = []
    for _ in range(reps + 3):
        got.clear()
        start = time.perf_counter()
        pub.publish("bench/raw", payload, qos=1)
        got.wait(5.0)
        times.append(time.perf_counter() - start)
    for c in clients:
        c.loop_stop()
        c.disconnect()
    return statistics.median(times[3:])


def _transport_latency(url: str, n: int, reps: int) -> tuple[float, int]:
    """Median one-way latency of a DeviceUpdate of ``n`` weights, transport to handler."""
    from edge_client.mqtt import MqttTransport
    from edge_client.topics import topic_for

    cfg = BrokerConfig(url=url, username="tester", password=Mosquitto.PASSWORD)
    msg = m.DeviceUpdate(fleet="bench", sender="d0", round=0, iteration=0, station="s",
                         weights=np.random.default_rng(0).standard_normal(n).astype(np.float32),
                         num_samples=32)
    got = []
    sender = MqttTransport(cfg, client_id="d0", fleet="bench")
    receiver = MqttTransport(cfg, client_id="s", fleet="bench", num_params=n)
    receiver.subscribe(topic_for(msg), lambda topic, message: got.append(message))
    for t in (sender, receiver):
        t.connect()
    time.sleep(0.3)
    times = []
    try:
        for _ in range(reps + 3):
            got.clear()
            start = time.perf_counter()
            sender.publish(topic_for(msg), msg)
            while not got:  # what a service's loop does: wait, then deliver on its thread
                receiver.wait(0.5)
                receiver.deliver()
            times.append(time.perf_counter() - start)
    finally:
        for t in (sender, receiver):
            t.close()
    return statistics.median(times[3:]), len(encode(msg, layout_hash="0" * 16))


def latency_table(reps: int) -> None:
    n = 101_770
    with tempfile.TemporaryDirectory() as tmp:
        broker = Mosquitto(Path(tmp), ["tester"], ["user tester", "topic readwrite #"])
        try:
            ours, frame = _transport_latency(broker.url, n, reps)
            raw = _raw_latency(broker.url, bytes(frame), reps)
        finally:
            broker.stop()
    print(f"\none-way latency of a {n}-parameter update ({frame} bytes) over Mosquitto, "
          f"median of {reps}: raw paho {1e3 * raw:.2f} ms, safl transport {1e3 * ours:.2f} ms, "
          f"ratio {ours / raw:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--reps", type=int, default=100)
    args = parser.parse_args()
    latency_table(args.reps)
    print("wire bytes over raw float32 model bytes (256 KiB chunks, 62-class stats, L = 4):")
    frame_table()

    digits = load_dataset("digits")
    rng = np.random.default_rng(0)
    spec = FleetSpec(partitions=tuple(dirichlet_label_skew(digits.y_train, 6, 0.5, rng)),
                     groups=tuple(assign_groups(6, 2, rng)), rounds=args.rounds, lr=0.1,
                     arrivals_per_step=48, initial_samples=64)
    strategy = demo_strategies(super_node_size=2, sync_period=3)[1]
    iterations = args.rounds * 3
    local = run_federation(digits, strategy, spec)
    local_iter = (local.rows[-1]["wall_s"] - local.rows[0]["wall_s"]) / iterations

    plan = plan_fleet(strategy, spec)
    stations = {s["station_id"]: list(s["devices"]) for s in plan.stations}
    with tempfile.TemporaryDirectory() as tmp:
        users = ["cloud", "tester", *stations, *(d for ds in stations.values() for d in ds)]
        broker = Mosquitto(Path(tmp), users, acl_lines(plan.fleet, stations))
        try:
            creds = lambda u: (u, Mosquitto.PASSWORD)  # noqa: E731
            rows = launch_fleet(Path(tmp) / "run", digits, strategy, spec, broker.url,
                                credentials=creds)
            found = fleet_status(BrokerConfig(url=broker.url, username="tester",
                                              password=Mosquitto.PASSWORD), plan.fleet)
        finally:
            broker.stop()
    mqtt_iter = (rows[-1]["wall_s"] - rows[0]["wall_s"]) / iterations
    docs = [found.stations[s] for s in stations]
    updates = sum(d.counters.get("received_updates", 0) for d in docs)
    cpu = sum(d.cpu_s - d.cpu_startup_s for d in docs)
    n_params = 64 * 128 + 128 + 128 * 10 + 10
    print(f"\nfleet: 2 stations x 3 devices, FedGS L=2 T=3, {args.rounds} rounds "
          f"({iterations} iterations), MLP {n_params} params")
    print(f"accuracy: in-process {local.final_accuracy:.4f}, over Mosquitto "
          f"{rows[-1]['accuracy']:.4f}")
    print(f"iteration latency: in-process {1e3 * local_iter:.2f} ms, over Mosquitto "
          f"{1e3 * mqtt_iter:.2f} ms, ratio {mqtt_iter / local_iter:.1f}x")
    print(f"station CPU per received update: {1e3 * cpu / max(updates, 1):.2f} ms "
          f"({cpu:.2f} s over {updates} updates, after start-up; decoding, selection, fusion "
          "and publishing included)")


if __name__ == "__main__":
    main()
