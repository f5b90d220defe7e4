"""Faults on a real Mosquitto, one OS process per role: hostile device processes, ``kill -9``
of the cloud and of a station with a restart, and broker restarts with persistence on and
off.  Every run must finish all its rounds with the global model's accuracy within 2 points
of the honest, uninterrupted in-process run of the same plan (the MQTT path reproduces that
run round by round, see test_mqtt.py)."""

from __future__ import annotations

import hashlib
import json
import shutil
import signal
import socket
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from brokers import Mosquitto, ephemeral_low, fleet_mosquitto

from aggregator.checkpoint import load_checkpoint
from aggregator.status import fleet_status
from edge_client.config import BrokerConfig
from lab.datasets import assign_groups, dirichlet_label_skew
from lab.launch import launch_fleet
from lab.simulation import FleetSpec, Strategy, plan_fleet, run_federation

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("mosquitto") is None,
                                 reason="Mosquitto is installed by .ci/run")]

# FedGS on 12 devices in 2 factories; a lost reply costs at most a 5 s deadline.
STRATEGY = Strategy("fedgs", device={"mix": 1.0, "nu": 0.0},
                    station={"super_node_size": 3, "rand_per_group": 1, "selector": "gbp_cs",
                             "sync_period": 3, "iteration_timeout": 5.0})
HOSTILE = str(Path(__file__).parent / "hostile_device.py")
# Hostile runs wait 30 s for a missing reply: were a refusal not an answer, each of the
# attacker's ~46 iterations would cost that, and the run would blow its time limit; a slow
# process on a loaded machine does not miss a 30 s deadline.  The station waits for every
# member up to it (no straggler deadline: a busy CI machine's scheduling is not a straggler).
PATIENT = Strategy("fedgs", device=STRATEGY.device,
                   station={**STRATEGY.station, "iteration_timeout": 30.0,
                            "straggler_factor": 0.0})


def _spec(digits) -> FleetSpec:
    rng = np.random.default_rng(0)
    return FleetSpec(partitions=tuple(dirichlet_label_skew(digits.y_train, 12, 1.0, rng)),
                     groups=tuple(assign_groups(12, 2, rng)), rounds=24, lr=0.3,
                     arrivals_per_step=48, initial_samples=64)


# Accuracy is judged as the mean of the last 3 evaluations: single rounds swing by a point or
# two on 360 test digits, which would decide a 2-point criterion by chance.
LAST = 3


def _settled(rows) -> float:
    return float(np.mean([r["accuracy"] for r in rows[-LAST:]]))


@pytest.fixture(scope="module")
def honest(digits) -> float:
    return _settled(run_federation(digits, STRATEGY, _spec(digits)).rows)


def _broker(tmp_path, spec, **kw) -> Mosquitto:
    return fleet_mosquitto(tmp_path, plan_fleet(STRATEGY, spec), **kw)


def _launch(tmp_path, digits, server, spec, strategy=STRATEGY, **kw):
    return launch_fleet(tmp_path / "run", digits, strategy, spec, server.url,
                        credentials=lambda user: (user, Mosquitto.PASSWORD), timeout=300, **kw)


def _finished(rows, spec, honest, label, within=0.02):
    accuracy = _settled(rows)
    print(f"\n{label}: accuracy (mean of last {LAST}) {accuracy:.4f}, honest run {honest:.4f}, "
          f"diff {100 * (accuracy - honest):+.1f} points")
    assert [r["round"] for r in rows] == list(range(spec.rounds + 1))  # each round once
    assert abs(accuracy - honest) <= within


def _hostile_run(tmp_path, digits, spec, attack):
    """The fleet with its station st0's first device the hostile process; its rows and st0's
    counters (the role's and its transport's)."""
    plan = plan_fleet(STRATEGY, spec)
    victim = plan.stations[0]["devices"][0]
    server = _broker(tmp_path, spec)
    try:
        rows = _launch(tmp_path, digits, server, spec, PATIENT,
                       commands={victim: [sys.executable, HOSTILE, attack]})
        status = fleet_status(BrokerConfig(url=server.url, username="tester",
                                           password=Mosquitto.PASSWORD), plan.fleet)
    finally:
        server.stop()
    st0 = status.stations["st0"]
    return rows, {**st0.counters, **st0.transport}, status


@pytest.mark.parametrize("attack, reason", [("scale", "rejected.update_norm"),
                                            ("inflate", "rejected.bad_count"),
                                            ("nan", "rejected.non_finite"),
                                            ("replay", "rejected.replay")])
def test_a_hostile_device_is_refused_and_does_not_steer_the_model(tmp_path, digits, honest,
                                                                   attack, reason, capsys):
    spec = _spec(digits)
    rows, counters, _ = _hostile_run(tmp_path, digits, spec, attack)
    with capsys.disabled():
        print(f"\n{attack}: {counters.get(reason, 0)} refused ({reason}), "
              f"{counters.get('refused_replies', 0)} counted as answers, "
              f"{counters.get('replies_missed', 0)} deadlines missed")
        _finished(rows, spec, honest, f"attack {attack}")
    assert counters.get(reason, 0) >= 1 and counters.get("refused_replies", 0) >= 1
    assert counters.get("replies_missed", 0) == 0  # a refusal is an answer: no deadline wait


@pytest.mark.parametrize("attack", ["uniform_seen", "seen_at_bound", "seen_shape_at_bound"])
def test_a_device_lying_about_its_seen_counts_neither_stops_nor_steers_a_station(
        tmp_path, digits, honest, attack, capsys):
    # Every class at the int64 maximum once stopped the federation in its first round: the
    # station's sum of the claims wrapped negative, and its own counts with it.
    spec = _spec(digits)
    rows, counters, _ = _hostile_run(tmp_path, digits, spec, attack)
    with capsys.disabled():
        print(f"\n{attack}: seen counts clipped {counters.get('clipped.seen_counts', 0)}, "
              f"majority-capped {counters.get('seen_majority_capped', 0)}")
        _finished(rows, spec, honest, f"attack {attack}")
    if attack == "uniform_seen":
        assert counters.get("clipped.seen_counts", 0) >= 1


def test_a_device_whose_accuracy_falls_is_named_by_its_station_and_nothing_else(
        tmp_path, digits, honest, capsys):
    """The drift watch over the wire: a device's prequential counts in its stats frames,
    its station's ADWIN, the station's retained summary, safl status (aggregator/drift.py).
    The device lies (it predicts nothing here): only it is named, and the fleet is as
    good as an honest one."""
    from aggregator.status import format_status
    spec = _spec(digits)
    rows, counters, status = _hostile_run(tmp_path, digits, spec, "accuracy_fall")
    victim = plan_fleet(STRATEGY, spec).stations[0]["devices"][0]
    text = format_status(status, plan_fleet(STRATEGY, spec).fleet)
    with capsys.disabled():
        print("\n" + next(line for line in text.splitlines() if "drifting" in line))
        _finished(rows, spec, honest, "a device whose accuracy falls")
    st0 = status.stations["st0"]
    assert set(st0.drifting) == {victim} and st0.devices_drifting == 1
    assert 0.9 < st0.drifting[victim] <= 1.0 and counters["drift.detected"] == 1
    assert f"drifting, prequential accuracy fell: {victim} (from" in text
    assert all(not doc.drifting for sid, doc in status.stations.items() if sid != "st0")


@pytest.mark.parametrize("victim", ["cloud", "st0"])
def test_an_aggregator_killed_mid_run_resumes_from_its_checkpoint(tmp_path, digits, honest,
                                                                   victim, capsys):
    spec = _spec(digits)
    server = _broker(tmp_path, spec)
    checkpoint = tmp_path / "run" / "state" / f"{victim}.ckpt.npz"
    log = tmp_path / "run" / "logs" / f"{victim}.log"
    events: dict[str, object] = {}

    def fault(fleet) -> None:
        if "killed" not in events and fleet.last_round >= 6:
            fleet.procs[victim].send_signal(signal.SIGKILL)
            fleet.procs[victim].wait()
            arrays, meta = load_checkpoint(checkpoint)
            events.update(killed=True, round=meta["round"],
                          sha=hashlib.sha256(arrays["weights"].tobytes()).hexdigest())
            events["restarted"] = time.monotonic()
            fleet.restart(victim)
        if "restarted" in events and "resumed_s" not in events \
                and "resumed from" in log.read_text():
            events["resumed_s"] = time.monotonic() - events["restarted"]

    try:
        rows = _launch(tmp_path, digits, server, spec, during=fault)
    finally:
        server.stop()
    text = log.read_text()
    with capsys.disabled():
        print(f"\n{victim} killed at round {events['round']}, resumed (process start to "
              f"checkpoint restored) in {events.get('resumed_s', float('nan')):.2f} s")
        _finished(rows, spec, honest, f"kill -9 {victim}")
    assert f"model sha256 {events['sha']}" in text  # bit for bit what was checkpointed
    # A restarted station is back within the cloud's grace: no round closed without it
    # (closing at its Last Will, the fleet ran its last 18 rounds on one station).
    _every_station_fused(tmp_path)


def _every_station_fused(tmp_path) -> None:
    """No round of the cloud's closed without a station (``[cloud] station_grace``)."""
    counters = json.loads((tmp_path / "run" / "cloud.json").read_text())["counters"]
    assert not counters.get("stations_missed"), counters


# Reconnects within 0.2 s of the broker's return.  With the default backoff (0.5 s, doubling,
# each pause 50-100% of it) a device came back up to 2 s after a broker that was gone 1 s,
# and this fleet runs its 18 remaining rounds in about 0.6 s: which devices missed the end
# was the jitter's draw, and the accuracy moved with it (-4.7 and -5.1 points in 2 of 40
# runs; test_a_device_reconnecting_slower_than_the_fleet_runs_misses_its_end).
QUICK_RECONNECT = {"backoff_min": 0.05, "backoff_max": 0.2}


def _restart_broker(server, during=None):
    """A ``during`` hook that stops the broker once round 6 is done and starts it 1 s later."""
    restarted: list[bool] = []

    def fault(fleet) -> None:
        if not restarted and fleet.last_round >= 6:
            server.stop()
            time.sleep(1.0)
            server.start()
            restarted.append(True)
    return fault, restarted


def _away_at_the_end(run_dir, caplog) -> list[str]:
    """Devices not there when their station finished: back only for its final presence, or
    still reconnecting when the launcher stopped them (it says so; a device stopped logs
    its 'finished' line too, so that line alone does not tell)."""
    stopped = {r.getMessage().split()[0] for r in caplog.records
               if "after the cloud finished: stopped" in r.getMessage()}

    def away(log) -> bool:
        text = log.read_text()
        return f"device {log.stem} finished" not in text or "while this device was away" in text \
            or log.stem in stopped
    return sorted(log.stem for log in (run_dir / "logs").glob("dev*.log") if away(log))


@pytest.mark.parametrize("persistence", [True, False])
def test_a_broker_restart_is_survived(tmp_path, digits, honest, persistence, capsys, caplog):
    spec = _spec(digits)
    server = _broker(tmp_path, spec, persistence=persistence)
    fault, restarted = _restart_broker(server)
    try:
        rows = _launch(tmp_path, digits, server, spec, during=fault,
                       broker_extra=QUICK_RECONNECT)
    finally:
        server.stop()
    with capsys.disabled():
        # Measured: -0.5..0.0 points without persistence, -0.2..+1.0 with it, since rounds
        # wait for the stations whose wills the restart fired (+0.3..-2.8 before;
        # docs/reliability.md).  The bound stays looser than for the faults above: a device
        # slow to reconnect misses the end (the test below).
        _finished(rows, spec, honest, f"broker restart, persistence {persistence}",
                  within=0.04)
    assert restarted
    assert _away_at_the_end(tmp_path / "run", caplog) == []  # all back for the rest
    # The restart fires the stations' Last Wills too: without the grace 2 of 4 runs closed
    # a round without one.
    _every_station_fused(tmp_path)


def test_a_device_reconnecting_slower_than_the_fleet_runs_misses_its_end(tmp_path, digits,
                                                                      caplog):
    """The accuracy flake of the test above, on demand: two devices whose first reconnect
    waits 15-30 s miss every round the fleet runs after the restart (under 5 s here)."""
    spec = _spec(digits)
    server = _broker(tmp_path, spec)
    plan = plan_fleet(STRATEGY, spec)
    slow = plan.stations[0]["devices"][:2]
    fault, restarted = _restart_broker(server)
    # first reconnect 15-30 s after the restart: the fleet is done well before, even beside
    # the other workers of a parallel run (5-10 s let a loaded fleet wait for one of them)
    patient = ["env", "SAFL_BROKER_BACKOFF_MIN=30", "SAFL_BROKER_BACKOFF_MAX=60",
               sys.executable, "-m", "safl", "-v", "device"]
    try:
        _launch(tmp_path, digits, server, spec, during=fault, broker_extra=QUICK_RECONNECT,
                commands={d: patient for d in slow})
    finally:
        server.stop()
    # (back within the launcher's 30 s, for the final presence, or stopped still reconnecting
    # where a loaded machine held them longer: seen once in a parallel make test)
    assert restarted and _away_at_the_end(tmp_path / "run", caplog) == sorted(slow)


def test_a_broker_restarts_on_a_port_no_ephemeral_socket_can_be_handed(tmp_path):
    """The other cause of that flake, on demand: while a broker is down, a socket given its
    port stops it coming back ("Address already in use"), and the error says which port.
    The kernel hands ports of its ephemeral range to any bind(0) or connect() (paho's
    wake-up socket pair binds one at each reconnect); test brokers listen below that
    range, where it never reaches."""
    server = Mosquitto(tmp_path, ["u"], ["user u", "topic readwrite #"])
    server.stop()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", server.port))  # bound, as a connect()ing socket is
        with pytest.raises(RuntimeError, match=f"exited with 1; port {server.port}"):
            server.start()
    assert "Address already in use" in (tmp_path / "mosquitto.log").read_text()
    server.start()
    server.stop()
    low = ephemeral_low()
    assert server.port < low or low < 2024  # (no room below it: free_port says so)
