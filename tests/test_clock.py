"""The simulator's virtual clock (lab/clock.py) and the station's straggler deadline
(aggregator/stragglers.py), on real data (scikit-learn digits)."""

from __future__ import annotations

import csv
import dataclasses
import json

import numpy as np
import pytest

from aggregator.stragglers import StragglerWatch
from edge_client import messages as m
from edge_client.errors import ConfigError
from edge_client.trainers.paced import REFERENCE_BATCH
from lab.clock import (
    FRAME_OVERHEAD,
    MIN_RTO,
    PROFILES,
    Channel,
    ClockConfig,
    LinkSpec,
    TimedBus,
    assign_profiles,
)
from lab.datasets import assign_groups, dirichlet_label_skew
from lab.engine import SimulationConfig
from lab.simulation import FleetSpec, Strategy, run_federation

FEDGS = Strategy("fedgs", device={"mix": 1.0, "local_steps": 5},
                 station={"super_node_size": 3, "rand_per_group": 1, "sync_period": 5})


def _spec(digits, devices=8, stations=2, rounds=4, seed=0, clock=None):
    rng = np.random.default_rng(seed)
    return FleetSpec(partitions=tuple(dirichlet_label_skew(digits.y_train, devices, 0.5, rng)),
                     groups=tuple(assign_groups(devices, stations, rng)), rounds=rounds,
                     lr=0.1, seed=seed, arrivals_per_step=16, initial_samples=32, clock=clock)


def _comparable(result):
    """A run's rows and counters as text (NaN equal to NaN), less its wall-clock seconds."""
    rows = [{k: v for k, v in r.items() if k not in ("wall_s", "virtual_s")}
            for r in result.rows]
    return json.dumps([rows, result.counters], sort_keys=True)


@pytest.mark.parametrize("recipe", ["fedgs", "safl_fedgs", "fedavg"])
def test_a_zero_cost_clock_changes_no_result(digits, recipe):
    from lab.strategies import RecipeSettings, build_strategy
    s = build_strategy(recipe, RecipeSettings(factories=2, super_node=3, rand_per_group=1,
                                              sync_period=3))
    plain = run_federation(digits, s, _spec(digits, rounds=3))
    clocked = run_federation(digits, s, _spec(digits, rounds=3,
                                              clock=ClockConfig(profiles=(("zero", 1.0),))))
    assert _comparable(clocked) == _comparable(plain)
    assert all(r["virtual_s"] == 0.0 for r in clocked.rows + plain.rows)


def test_round_time_is_the_boards_and_links_priced(digits):
    # FedGS, T = 5 internal syncs a round of 5 local steps each on pi4-numpy's MLP, 20 ms
    # one way to the station and 50 ms to the cloud: an iteration is a round trip to the
    # station plus the slowest member's steps, a round T of them plus the cloud's trip.
    clock = ClockConfig(profiles=(("pi4-numpy", 1.0),), device_link=LinkSpec(latency_ms=20),
                        cloud_link=LinkSpec(latency_ms=50))
    r = run_federation(digits, FEDGS, _spec(digits, rounds=4, clock=clock))
    per_round = np.diff([row["virtual_s"] for row in r.rows])
    steps = 5 * 16 / REFERENCE_BATCH * PROFILES["pi4-numpy"].step_s["mlp"]  # 16-sample batches
    expected = 5 * (0.040 + steps) + 0.100
    assert per_round.min() > 0.9 * expected and per_round.max() < 1.3 * expected, per_round


def _straggler_run(digits, seed, slow, **station):
    # The MLP on a pi4 answers in about 50 ms here, so the deadline's floor (0.25 s by
    # default, for real networks' jitter) comes down to 0.1 s, under 3x that.
    station = {"straggler_min_wait": 0.1, **station}
    s = dataclasses.replace(FEDGS, station={**FEDGS.station, **station})
    clock = ClockConfig(profiles=(("pi4-numpy", 1.0),), device_link=LinkSpec(latency_ms=20),
                        cloud_link=LinkSpec(latency_ms=50), slow_devices=slow, slow_factor=30)
    r = run_federation(digits, s, _spec(digits, devices=12, rounds=10, seed=seed, clock=clock))
    v = [row["virtual_s"] for row in r.rows]
    return (v[-1] - v[0]) / (len(v) - 1), r


def test_one_device_30x_slower_keeps_the_round_rate(digits):
    # Measured 2026-12-03 (12 devices, 2 stations, seeds 0-2): 0.362 s a round without the
    # straggler; with it 0.389 / 0.391 / 0.393 (0.93x the rate), and 0.949 / 0.620 / 0.845 s
    # (0.38-0.58x) when the station waits for every member (straggler_factor = 0).
    ratios, waiting = [], []
    for seed in (0, 1, 2):
        clean, _ = _straggler_run(digits, seed, ())
        slow, r = _straggler_run(digits, seed, (0,))
        ratios.append(clean / slow)
        assert r.counters["stragglers_benched"] >= 1 and r.counters["late_replies"] >= 1
        waited, _ = _straggler_run(digits, seed, (0,), straggler_factor=0.0)
        waiting.append(clean / waited)
    assert min(ratios) >= 0.8, ratios
    assert max(waiting) < 0.7, waiting  # the watch is what keeps the rate


def test_a_held_bus_runs_nothing_past_now_until_the_driver_brings_the_next_message():
    # A factory whose station waits for the cloud must not run its devices' later events
    # (a straggler's late answer at 5 s) before the cloud's model, which arrives at 1 s.
    held = [True]
    bus = TimedBus(hold=lambda: held[0])
    seen: list[tuple[str, float]] = []
    for topic in ("late", "model"):
        bus.subscribe(topic, lambda t, msg: seen.append((t, bus.now)))
    msg = m.DeviceStats(fleet="t", sender="d0", round=0, iteration=0, station="s",
                        seen_counts=np.ones(2, int), next_batch_counts=np.ones(2, int))
    bus.publish_at("late", msg, 5.0)
    bus.deliver()
    assert seen == []  # held at 0
    bus.deliver(through=bus.publish_at("model", msg, 1.0))
    assert seen == [("model", 1.0)]
    held[0] = False
    bus.deliver()
    assert seen == [("model", 1.0), ("late", 5.0)]


def test_the_station_deadline_fires_in_virtual_time(digits):
    # One device 30x slower with the watch off: every iteration it sits in waits out its
    # steps (never the 30 s timeout) ...
    _, r = _straggler_run(digits, 0, (0,), straggler_factor=0.0, iteration_timeout=0.2)
    # ... and with a 0.2 s timeout, shorter than its 0.36 s of steps, it misses each one.
    assert r.counters["replies_missed"] >= 3 and r.counters["late_replies"] >= 3
    assert "stragglers_benched" not in r.counters  # the watch is off: no bench


def test_each_message_handled_costs_its_role_the_handling_time(digits):
    # The same FedGS fleet with 5 ms of handling a message: each internal sync has at least
    # a device's two messages in and the station's in and out on its critical path.
    clock = ClockConfig(profiles=(("pi4-numpy", 1.0),), device_link=LinkSpec(latency_ms=20),
                        cloud_link=LinkSpec(latency_ms=50))
    bare = run_federation(digits, FEDGS, _spec(digits, rounds=3, clock=clock))
    handled = run_federation(digits, FEDGS, _spec(digits, rounds=3, clock=dataclasses.replace(
        clock, handling_ms=5.0)))
    added = np.diff([r["virtual_s"] for r in handled.rows]) - np.diff(
        [r["virtual_s"] for r in bare.rows])
    assert (added > 5 * 3 * 0.005).all(), added  # T = 5 syncs, 3 handlings each at least
    with pytest.raises(ConfigError):
        dataclasses.replace(clock, handling_ms=-1.0)


def test_a_super_node_of_two_closes_at_the_factor_once_one_answered():
    w = StragglerWatch(factor=3.0, min_wait=0.1, sit_out=10, timeout=30.0)
    assert w.peer_budget([0.2], members=2) == pytest.approx(0.6)
    assert w.peer_budget([0.2], members=3) is None  # two of three first
    assert w.peer_budget([0.2, 0.4], members=3) == pytest.approx(0.9)


def test_a_rehearsed_fleet_trains_at_its_profiles_pace_and_predicts_as_simulated(tmp_path,
                                                                                  digits):
    import tomllib

    from lab.launch import write_fleet
    clock = ClockConfig(profiles=(("pi4-numpy", 1.0),), slow_devices=(1,), slow_factor=30.0)
    paths = write_fleet(tmp_path, digits, FEDGS, _spec(digits, devices=4, clock=clock),
                        "mqtt://127.0.0.1:1")
    step = PROFILES["pi4-numpy"].step_s["mlp"]
    dev0, dev1 = (tomllib.loads(paths[d].read_text()) for d in ("dev000", "dev001"))
    assert dev0["service"]["emulate_step_s"] == step
    assert dev1["service"]["emulate_step_s"] == pytest.approx(30 * step)
    assert dev0["inference"] == {"enabled": False, "every": 1, "publish": False,
                                 "promote": "always"}
    plain = write_fleet(tmp_path / "plain", digits, FEDGS, _spec(digits, devices=4),
                        "mqtt://127.0.0.1:1")
    assert "service" not in tomllib.loads(plain["dev000"].read_text())


def test_the_straggler_watch_learns_the_budget_and_backs_off():
    w = StragglerWatch(factor=3.0, min_wait=0.1, sit_out=10, timeout=30.0)
    assert w.budget() == 30.0  # nothing measured yet: the timeout
    for d, s in (("a", 0.05), ("b", 0.06), ("c", 0.2)):
        w.answered(d, s, True)
    assert w.budget() == pytest.approx(0.18)  # 3 x the median
    w.answered("a", 0.01, True)
    w.answered("b", 0.01, True)
    assert w.budget() == 0.1  # never under min_wait
    assert [w.missed("c") for _ in range(6)] == [10, 20, 40, 80, 160, 160]
    w.answered("c", 0.05, True)
    assert w.missed("c") == 10  # an answer in time clears the streak
    assert StragglerWatch(factor=0.0, min_wait=0.1, sit_out=10, timeout=30.0).missed("c") == 0


def test_the_straggler_settings_are_checked_at_their_bounds():
    from aggregator.config import StationConfig
    devices = ("a", "b", "c", "d")
    for ok in ({"straggler_factor": 1.0}, {"straggler_factor": 0.0},
               {"straggler_min_wait": 0.0}, {"straggler_sit_out": 0}):
        StationConfig(fleet="t", station_id="s", devices=devices, **ok)
    for key, bad in (("straggler_factor", 0.999), ("straggler_min_wait", -0.001),
                     ("straggler_sit_out", -1)):
        with pytest.raises(ConfigError) as err:
            StationConfig(fleet="t", station_id="s", devices=devices, **{key: bad})
        assert err.value.key == key


def test_a_channel_prices_latency_bandwidth_and_order():
    rng = np.random.default_rng(0)
    assert Channel(LinkSpec(), rng).arrival(1.5, 10_000) == 1.5
    ch = Channel(LinkSpec(latency_ms=20, bandwidth_mbps=8), rng)
    wire = (10_000 + FRAME_OVERHEAD) * 8 / 8e6
    first = ch.arrival(0.0, 10_000)
    assert first == pytest.approx(wire + 0.020)
    # Sent at once after it: waits for the wire, arrives after the first (TCP's order).
    assert ch.arrival(0.0, 10_000) == pytest.approx(2 * wire + 0.020)
    jittery = Channel(LinkSpec(latency_ms=20, jitter_ms=30), rng)
    times = [jittery.arrival(0.001 * i, 100) for i in range(200)]
    assert times == sorted(times) and max(np.diff(times)) > 0.005


def test_a_lost_tail_segment_costs_a_retransmission_timeout():
    rng = np.random.default_rng(1)
    lossy = Channel(LinkSpec(latency_ms=5, loss=0.3), rng)
    delays = [lossy.arrival(10.0 * i, 500) - 10.0 * i - 0.005 for i in range(300)]
    lost = [d for d in delays if d > 1e-9]
    # One segment each: lost 30% of the time, each loss an RTO of 200 ms, doubling.
    assert 0.2 < len(lost) / len(delays) < 0.4
    assert min(lost) == pytest.approx(MIN_RTO) and max(lost) >= 3 * MIN_RTO


def test_profiles_are_assigned_by_fraction_and_seed():
    clock = ClockConfig(profiles=(("pi4-numpy", 0.4), ("pi4-torch", 0.5),
                                  ("jetson-orin-cuda", 0.1)))
    names = assign_profiles(clock, 10)
    assert sorted(names) == sorted(["pi4-numpy"] * 4 + ["pi4-torch"] * 5
                                   + ["jetson-orin-cuda"])
    assert names == assign_profiles(clock, 10)
    assert names != assign_profiles(dataclasses.replace(clock, seed=1), 10)


@pytest.mark.parametrize(("table", "key"), [
    ({"profiles": ("pi5-numpy",)}, "profiles"),
    ({"profiles": ("pi4-numpy=0.5",)}, "profiles"),  # fractions must sum to 1
    ({"profiles": ("pi4-numpy=half",)}, "profiles"),
    ({"profiles": ("pi4-numpy",), "device_loss": 0.7}, "device_loss"),
    ({"profiles": ("pi4-numpy",), "cloud_latency_ms": -1}, "cloud_latency_ms"),
    ({"profiles": ("pi4-numpy",), "slow_factor": 0.5}, "slow_factor"),
    ({"device_latency_ms": 20}, "profiles"),  # a link without a clock
    ({"handling_ms": 5}, "profiles"),
    ({"profiles": ("pi4-numpy",), "handling_ms": -1}, "handling_ms"),
    ({"profiles": ("pi4-numpy",), "batched_steps": True}, "batched_steps"),
])
def test_a_bad_clock_setting_names_its_key(table, key):
    with pytest.raises(ConfigError) as err:
        SimulationConfig(**table)
    assert err.value.key == key


def test_a_fleet_spec_refuses_batched_steps_under_a_clock(digits):
    with pytest.raises(ConfigError) as err:
        dataclasses.replace(_spec(digits), clock=ClockConfig(profiles=(("zero", 1.0),)),
                            batched_steps=True)
    assert err.value.key == "batched_steps"


def test_the_clock_keys_runs_apart_in_the_cache():
    assert SimulationConfig().cache_tag == ""  # runs cached before the clock keep their keys
    a = SimulationConfig(profiles=("pi4-numpy",)).cache_tag
    b = SimulationConfig(profiles=("pi4-numpy",), device_loss=0.01).cache_tag
    assert a and b and a != b
    # Handling priced keys a run apart; unpriced, a clocked run keeps the key it had before.
    assert "handling" not in a
    assert SimulationConfig(profiles=("pi4-numpy",), handling_ms=5).cache_tag not in (a, b)


def test_an_experiment_reports_virtual_time(tmp_path):
    from lab.experiment import run_experiment
    toml = tmp_path / "clocked.toml"
    toml.write_text("""
[experiment]
name = "clocked"
dataset = "digits"
factories = 2
devices_per_factory = 4
super_node = 2
sync_period = 3
rounds = 3
lr = 0.1
eval_samples = 200
target_accuracy = 0.3
at_virtual_s = 0.5
strategies = ["fedgs", "fedavg"]

[simulation]
profiles = ["pi4-numpy=0.5", "jetson-orin-cuda=0.5"]
device_latency_ms = 20
device_loss = 0.01
cloud_latency_ms = 50
""")
    _, results, out = run_experiment(toml, out=tmp_path / "out")
    for r in results:
        v = [row["virtual_s"] for row in r.rows]
        assert v == sorted(v) and v[-1] > 3 * 0.1  # three rounds, each a cloud round trip
    table = list(csv.DictReader(open(out / "results.csv")))
    assert "virtual_s_to_0.3" in table[0]
    # The accuracy at 0.5 virtual seconds: each seed's last evaluation by then.
    from lab.summary import accuracy_at
    for row in table:
        runs = [r for r in results if r.strategy == row["strategy"]]
        assert float(row["accuracy_at_0.5s"]) == pytest.approx(
            np.mean([accuracy_at(r.rows, 0.5) for r in runs]), abs=1e-4)
    assert accuracy_at([{"virtual_s": 0.0, "accuracy": 0.1}, {"virtual_s": 1.0, "accuracy": 0.5},
                        {"virtual_s": 2.0, "accuracy": 0.7}], 1.5) == 0.5
    assert (out / "accuracy_vs_time.png").stat().st_size > 0


def test_the_mixed_fleet_experiment_loads_with_its_clock():
    from lab.experiment import load_experiment, load_simulation
    from lab.strategies import build_strategy
    cfg = load_experiment("experiments/mixed_fleet.toml")
    clock = load_simulation("experiments/mixed_fleet.toml").clock(0)
    assert clock is not None and dict(clock.profiles)["pi4-torch"] == 0.5
    assert build_strategy("fedgs_buffered", cfg.settings).station["mode"] == "buffered"
    assert build_strategy("fedgs_long", cfg.settings).device["local_steps"] == 5



def test_round_0s_head_holds_the_first_frames_of_devices_that_report_after_their_station(
        digits):
    """A station reports its first counts to the cloud as its first devices' come in, and
    then waits for the cloud; devices whose statistics come after that (their links'
    jitter, their boards' forward through the body) are in round 0's solve all the same,
    made at the end of the cloud's wait for them.  The simulator ran a factory only until
    its first report: round 0 of the camera fleet held 638 of 2,320 first samples."""
    from edge_client.head_stats import HeadSpec
    head = HeadSpec("ridge", 64, 10, np.full(64, 4.0, np.float32), 200.0)
    wide = Strategy("fedgs", device={"mix": 1.0, "local_steps": 5},
                    station={"super_node_size": 5, "rand_per_group": 1, "sync_period": 5})

    def round0(clock):
        spec = dataclasses.replace(_spec(digits, devices=20, stations=2, rounds=1, clock=clock),
                                   model="linear", head=head, body="efficientnet-lite0")
        return run_federation(digits, wide, spec).rows[0]

    at_once = round0(ClockConfig(profiles=(("zero", 1.0),)))
    late = round0(ClockConfig(profiles=(("pi4-numpy", 1.0),),
                              device_link=LinkSpec(latency_ms=20, jitter_ms=5)))
    assert at_once["head_samples"] > 500 and late["head_samples"] == at_once["head_samples"]
    assert late["virtual_s"] > 5.0 and late["accuracy"] == pytest.approx(at_once["accuracy"])
