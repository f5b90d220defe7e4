"""Benchmark: the MQTT wire against the in-process bus, on one fleet and one plan.

Runs FedGS (2 stations x 3 devices, MLP on digits; small_cnn-sized models are covered by the
frame table) in process, then as 9 OS processes over a Mosquitto started on a free loopback
port, and prints:

- wire bytes per model-carrying frame / raw float32 model bytes (headers and chunking in);
- one-way latency of a 101,770-parameter update from a sender process to a receiver
  process, the transport against raw paho publishing the same frame, interleaved, at this
  checkout and at ``BASELINE``;
- iteration latency over Mosquitto / in-process (ratio, same run);
- station CPU time per received update (the station process's CPU after start-up).

Run: ``python bench/wire.py [--rounds N]``.  Needs Debian's mosquitto.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from baseline import ROOT, checkout, probe  # noqa: E402
from brokers import Mosquitto, acl_lines  # noqa: E402

from aggregator.status import fleet_status  # noqa: E402
from edge_client import messages as m  # noqa: E402
from edge_client.codec import DEFAULT_CHUNK_SIZE, encode, split  # noqa: E402
from lab.datasets import assign_groups, dirichlet_label_skew, load_dataset  # noqa: E402
from lab.demo import demo_strategies  # noqa: E402
from lab.launch import launch_fleet  # noqa: E402
from lab.simulation import FleetSpec, plan_fleet, run_federation  # noqa: E402

BASELINE = "9ed31b9"  # main before issue 14's wire work (incremental checks, wire version 2)
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


# Sender and receiver are separate processes, as a device and a station are; each stamps
# its side with time.perf_counter (CLOCK_MONOTONIC: one clock for the whole machine), and
# the receiver acknowledges each delivery on a control topic before the next is sent.
_COMMON = r"""
import json, sys, threading, time
import numpy as np
import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion
from edge_client import messages as m
from edge_client.codec import encode
from edge_client.config import BrokerConfig
from edge_client.mqtt import MqttTransport
from edge_client.topics import topic_for
url, password, n, reps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
host, port = url.removeprefix("mqtt://").split(":")
msg = m.DeviceUpdate(fleet="bench", sender="d0", round=0, iteration=0, station="s",
                     weights=np.random.default_rng(0).standard_normal(n).astype(np.float32),
                     num_samples=32)
cfg = BrokerConfig(url=url, username="tester", password=password)

def raw_client(name, topic=None, on_message=None):
    c = paho.Client(CallbackAPIVersion.VERSION2, client_id=name)
    c.username_pw_set("tester", password)
    if on_message:
        c.on_message = on_message
    c.connect(host, int(port))
    c.loop_start()
    if topic:
        c.subscribe(topic, qos=1)
    return c
"""

_RECEIVER = _COMMON + r"""
stamps = {"raw": [], "transport": []}
stop = threading.Event()
ack = raw_client("ack-out")
def on_raw(client, userdata, message):
    stamps["raw"].append(time.perf_counter())
    ack.publish("bench/ack", b"r", qos=1)
def on_control(client, userdata, message):
    stop.set()
raw = raw_client("raw-sub", "bench/raw", on_raw)
control = raw_client("control", "bench/stop", on_control)
receiver = MqttTransport(cfg, client_id="s", fleet="bench", num_params=n)
def on_update(topic, message):
    stamps["transport"].append(time.perf_counter())
    ack.publish("bench/ack", b"t", qos=1)
receiver.subscribe(topic_for(msg), on_update)
receiver.connect()
print("ready", flush=True)
while not stop.is_set():  # a service's loop: wait, then deliver on this thread
    receiver.wait(0.05)
    receiver.deliver()
receiver.close()
print(json.dumps(stamps))
"""

_SENDER = _COMMON + r"""
acked = threading.Event()
listener = raw_client("ack-in", "bench/ack", lambda *_: acked.set())
pub = raw_client("raw-pub")
sender = MqttTransport(cfg, client_id="d0", fleet="bench")
sender.connect()
payload = encode(msg, layout_hash="0" * 16)
time.sleep(0.3)
stamps = {"raw": [], "transport": []}
for _ in range(reps + 3):  # interleaved, so both see the same machine
    for kind in ("raw", "transport"):
        acked.clear()
        stamps[kind].append(time.perf_counter())
        if kind == "raw":
            pub.publish("bench/raw", payload, qos=1)
        else:
            sender.publish(topic_for(msg), msg)
        acked.wait(5.0)
pub.publish("bench/stop", b"", qos=1).wait_for_publish(5.0)
sender.close()
print(json.dumps(stamps | {"bytes": len(payload)}))
"""


def _one_way(tree: Path, url: str, n: int, reps: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tree)}
    args = [url, Mosquitto.PASSWORD, str(n), str(reps)]
    receiver = subprocess.Popen([sys.executable, "-c", _RECEIVER, *args], cwd=tree, env=env,
                                stdout=subprocess.PIPE, text=True)
    try:
        assert receiver.stdout.readline().strip() == "ready"
        sent = json.loads(probe(tree, _SENDER, *args))
        got = json.loads(receiver.communicate(timeout=60)[0].strip().splitlines()[-1])
    finally:
        receiver.kill()
    return {k: statistics.median(r - s for s, r in zip(sent[k][3:], got[k][3:], strict=True))
            for k in ("raw", "transport")} | {"bytes": sent["bytes"]}


def latency_table(reps: int, rounds: int = 3) -> None:
    """One-way latency of a model update between two processes: raw paho and the safl
    transport interleaved, at this checkout and at ``BASELINE``, against one Mosquitto,
    ``rounds`` times alternately (raw paho's own latency moves between runs)."""
    sizes = (101_770, 1_000_000)
    runs: dict[tuple[int, str], list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        broker = Mosquitto(Path(tmp), ["tester"], ["user tester", "topic readwrite #"])
        try:
            with checkout(BASELINE) as tree:
                for _ in range(rounds):
                    for n in sizes:
                        for name, where in (("baseline", tree), ("now", ROOT)):
                            runs.setdefault((n, name), []).append(
                                _one_way(where, broker.url, n, reps))
        finally:
            broker.stop()
    print(f"\none-way latency of a model update over Mosquitto, sender and receiver in two "
          f"processes, raw paho (the same frame, one publish) interleaved with the transport; "
          f"median of {reps} per run, {rounds} runs alternating; baseline = {BASELINE}")
    print(f"{'params':>9} {'frame bytes':>12} {'':<9} {'raw paho ms':>12} {'transport ms':>13} "
          f"{'ratio per run':>20} {'median':>7}")
    for (n, name), rs in runs.items():
        ratios = [r["transport"] / r["raw"] for r in rs]
        raw = statistics.median(r["raw"] for r in rs)
        ours = statistics.median(r["transport"] for r in rs)
        print(f"{n:>9} {rs[0]['bytes']:>12} {name:<9} {1e3 * raw:>12.2f} {1e3 * ours:>13.2f} "
              f"{' '.join(f'{x:.2f}' for x in ratios):>20} {statistics.median(ratios):>7.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--reps", type=int, default=100)
    parser.add_argument("--latency-runs", type=int, default=5,
                        help="alternating runs of the latency table (raw paho moves run to run)")
    args = parser.parse_args()
    latency_table(args.reps, args.latency_runs)
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
