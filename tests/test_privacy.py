"""Local differential privacy: the noise stage, the accountant against dp-accounting, the
budget a device stops at, and epsilon where operators read it."""

from __future__ import annotations

import dataclasses

import dp_accounting as dpa
import numpy as np
import pytest
from dp_accounting import rdp

from aggregator.config import StationConfig
from aggregator.station import Station
from edge_client import messages as m
from edge_client.config import DeviceConfig
from edge_client.errors import ConfigError
from edge_client.pipeline import UpdatePipeline
from edge_client.privacy import PrivacyLedger, gaussian_epsilon, noise_for_epsilon
from lab.experiment import ExperimentConfig
from lab.simulation import run_federation
from lab.strategies import build_strategy


@pytest.mark.parametrize("noise, releases", [(1.0, 1), (1.0, 100), (0.5, 10), (2.0, 1000),
                                             (5.0, 1), (1.1, 35_200)])
def test_epsilon_is_dp_accountings_for_the_same_releases(noise, releases):
    accountant = rdp.RdpAccountant()
    accountant.compose(dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(noise), releases))
    assert gaussian_epsilon(noise, releases, 1e-5) == pytest.approx(
        accountant.get_epsilon(1e-5), rel=1e-9)


def test_a_ledger_counts_each_participant_apart():
    ledger = PrivacyLedger(1.0, 1e-5)
    assert ledger.worst() == 0.0 and ledger.epsilon("a") == 0.0
    for _ in range(3):
        ledger.record("a")
    ledger.record("b")
    assert ledger.epsilon("a") == gaussian_epsilon(1.0, 3, 1e-5) == ledger.worst()
    assert ledger.epsilon("b", extra=2) == ledger.epsilon("a") > ledger.epsilon("b")
    assert gaussian_epsilon(0.0, 1, 1e-5) == float("inf")


def test_a_ledgers_epsilon_is_computed_once_per_change(monkeypatch):
    from edge_client import privacy
    calls = []
    real = privacy._rdp
    monkeypatch.setattr(privacy, "_rdp", lambda c: calls.append(c) or real(c))
    privacy._spent.cache_clear()
    ledger = PrivacyLedger(noise_multiplier=1.37, delta=1e-5)
    ledger.record("a")
    first = [ledger.epsilon("a") for _ in range(5)] + [ledger.worst() for _ in range(5)]
    assert len(calls) == 1 and len(set(first)) == 1
    ledger.record("a")
    assert ledger.epsilon("a") > first[0] and len(calls) == 2


def test_the_noise_stage_adds_noise_scaled_to_the_clip_bound():
    pipe = UpdatePipeline(["clip:0.5", "noise:2"])
    assert pipe.noise_multiplier == 2.0 and pipe.id == "clip:0.5-noise:2"
    step = np.zeros(20_000, np.float32)
    enc, residual = pipe.encode(step, None, np.random.default_rng(0))
    assert residual is None  # nothing lossy: the noise is the release, not an error
    assert pipe.decode(enc, step.size).std() == pytest.approx(1.0, rel=0.02)  # 2 x 0.5
    with pytest.raises(ConfigError, match="clip stage before"):
        UpdatePipeline(["noise:1"])
    with pytest.raises(ConfigError, match="privacy_budget"):
        DeviceConfig(device_id="d", station="s", privacy_budget=8.0)


def test_production_noise_cannot_be_reproduced_from_the_seed(digits):
    from edge_client.device import Device
    from edge_client.trainers import build_trainer

    def noise_of(seeded):
        cfg = DeviceConfig(device_id="d", station="s", update_stages=("clip:1", "noise:1"),
                           noise_seeded=seeded)
        trainer = build_trainer("mlp", input_shape=digits.sample_shape, num_classes=10,
                                lr=0.1, seed=0)
        dev = Device(cfg, trainer, num_classes=10, sample_shape=digits.sample_shape,
                     rng=np.random.default_rng(0))
        return dev.upload._noise.standard_normal(4)

    assert np.array_equal(noise_of(True), noise_of(True))
    assert not np.array_equal(noise_of(False), noise_of(False))


def test_a_station_reports_the_most_any_device_has_spent():
    st = Station(StationConfig(fleet="t", station_id="s", devices=("a", "b"),
                               super_node_size=1), num_params=4, num_classes=2,
                 rng=np.random.default_rng(0))
    assert st.privacy_summary() == {}

    def stats(sender, eps):
        return m.DeviceStats(fleet="t", sender=sender, round=0, iteration=0, station="s",
                             seen_counts=np.array([1, 1]), next_batch_counts=np.array([1, 1]),
                             epsilon=eps)

    st.handle(stats("a", 3.5), 0.0)
    st.handle(stats("b", -1.0), 0.0)  # a claim, and an impossible one
    assert st.privacy_summary() == {"epsilon_local": 3.5}
    assert st.counters["clipped.epsilon"] == 1


@pytest.mark.slow
def test_devices_stop_uploading_when_their_budget_is_spent(digits):
    from test_experiment import _spec

    settings = ExperimentConfig(name="t", factories=2, devices_per_factory=4, super_node=2,
                                sync_period=3, rounds=4).settings
    strategy = build_strategy("fedgs", settings)
    budget = 8.0  # noise 1: one upload spends 4.73, two 7.08, three 9.01
    strategy = dataclasses.replace(strategy, device={
        **strategy.device, "update_stages": ("clip:1", "noise:1"), "privacy_budget": budget})
    run = run_federation(digits, strategy, dataclasses.replace(_spec(digits), rounds=4))
    assert run.counters["skipped.privacy_budget"] > 0
    eps = [r["epsilon_local"] for r in run.rows]
    assert eps == sorted(eps) and 0 < eps[-1] <= budget
    assert eps[-1] == pytest.approx(gaussian_epsilon(1.0, 2, 1e-5))
    # No device uploaded a third noised step: 8 devices, two each at most.
    assert run.rows[-1]["uploads"] <= 16


def test_a_station_fuses_honest_locally_noised_steps_from_the_first():
    """Before its guard has a history, it starts from a noised step's length: an unnoised
    step's (lr x steps x gradient bound) refused every noised update of a FedGS fleet."""
    from test_pipeline import _encoded_update, _station

    stages = ("clip:1.0", "noise:10")
    st, pipe = _station(stages), UpdatePipeline(list(stages))
    rng = np.random.default_rng(0)
    for d in ("d0", "d1"):
        step = np.full(8, 0.1, np.float32)
        enc, _ = pipe.encode(step, None, rng)
        st.handle(_encoded_update(d, pipe, step, weights=enc.values), 1.0)
    assert st.counters["received_updates"] == 2 and not st.counters["rejected.update_norm"]
    bound = 1.0 * (1 + 10 * (np.sqrt(8) + 4))
    assert st.admission.guard.initial == pytest.approx(bound)
    # A step at the bound (less float32's rounding) is fused as sent; 1% longer is clipped.
    for it, length in ((1, bound * 0.9999), (2, bound * 1.01)):
        for d in ("d0", "d1"):
            step = np.full(8, length / np.sqrt(8), np.float32)
            st.handle(_encoded_update(d, pipe, step, iteration=it, weights=step), 1.0)
        assert st.counters["clipped.update_norm"] == (0 if it == 1 else 2)


def test_a_restarted_device_remembers_what_it_has_spent(digits, tmp_path):
    from edge_client.device import Device
    from edge_client.privacy import PRIVACY_FILE, keep_privacy_ledger
    from edge_client.trainers import build_trainer

    def device():
        cfg = DeviceConfig(device_id="d", station="s", update_stages=("clip:1", "noise:1"),
                           privacy_budget=20.0)
        trainer = build_trainer("mlp", input_shape=digits.sample_shape, num_classes=10,
                                lr=0.1, seed=0)
        return Device(cfg, trainer, num_classes=10, sample_shape=digits.sample_shape,
                      rng=np.random.default_rng(0))

    with pytest.raises(ConfigError, match="state_dir"):
        keep_privacy_ledger(device().upload, None)
    first = device()
    keep_privacy_ledger(first.upload, tmp_path)
    model = m.StationModel(fleet="default", sender="s", round=0, iteration=0,
                           weights=first.trainer.get_flat())
    for _ in range(3):
        first.upload.update(model, first.trainer.get_flat(), 8)  # three noised releases
    assert (tmp_path / PRIVACY_FILE).exists()
    again = device()  # the same device after a restart
    keep_privacy_ledger(again.upload, tmp_path)
    assert again.epsilon == first.epsilon == pytest.approx(gaussian_epsilon(1.0, 3, 1e-5))
    for torn in ('{"releases": {"d": "lots"}}', '{"releases": {"d": [[1.0, -5]]}}',
                 '{"releases": {"d": [[0.0, 3]]}}'):  # a negative count would refund budget
        (tmp_path / PRIVACY_FILE).write_text(torn)
        with pytest.raises(ConfigError, match="not a privacy ledger"):
            keep_privacy_ledger(device().upload, tmp_path)


# -- central DP at the station ----------------------------------------------------------


def test_a_noised_mean_clips_each_step_and_divides_by_the_members_asked():
    from aggregator.central_dp import NoisedMean

    quiet = NoisedMean(np.zeros(2, np.float32), bound=1.0, noise=0.0, size=4,
                       rng=np.random.default_rng(0))
    quiet.add(np.array([3.0, 4.0], np.float32), 8, key="a")  # norm 5: clipped to 1
    quiet.add(np.array([0.3, 0.4], np.float32), 8, key="b")
    np.testing.assert_allclose(quiet.result(), [0.225, 0.3], rtol=1e-6)  # / 4, not / 2
    assert quiet.contributors == ["a", "b"] and quiet.clipped == 1 and quiet.total == 16
    noisy = NoisedMean(np.zeros(50_000, np.float32), bound=0.5, noise=2.0, size=5,
                       rng=np.random.default_rng(0))
    noisy.add(np.zeros(50_000, np.float32), 1, key="a")
    assert noisy.result().std() == pytest.approx(2.0 * 0.5 / 5, rel=0.02)


def _dp_station():
    from test_pipeline import _station

    return _station(sync_period=100, central_dp_clip=1.0, central_dp_noise=1.5,
                    noise_seeded=True)


def test_a_station_with_central_dp_accounts_every_members_release(tmp_path):
    from edge_client.privacy import keep_privacy_ledger

    st = _dp_station()
    keep_privacy_ledger(st.dp, tmp_path)
    for it in range(3):
        for d in ("d0", "d1"):
            st.handle(m.DeviceUpdate(fleet="t", sender=d, round=0, iteration=it, station="s",
                                     weights=st.weights + np.float32(0.1), num_samples=8), 1.0)
    assert st.iteration == 3 and st.counters["dp_releases"] == 3
    spent = gaussian_epsilon(1.5, 3, 1e-5)
    assert st.dp.privacy.epsilon("d0") == st.dp.privacy.epsilon("d1") == pytest.approx(spent)
    assert st.privacy_summary() == {"epsilon_central": pytest.approx(spent)}
    again = _dp_station()  # restarted: the ledger comes back from the state directory
    keep_privacy_ledger(again.dp, tmp_path)
    assert again.dp.privacy.worst() == pytest.approx(spent)
    with pytest.raises(ConfigError, match="central_dp_clip"):
        StationConfig(fleet="t", station_id="s", devices=("a",), super_node_size=1,
                      central_dp_noise=1.0)
    with pytest.raises(ConfigError, match="fusion"):
        StationConfig(fleet="t", station_id="s", devices=("a",), super_node_size=1,
                      central_dp_clip=1.0,
                      central_dp_noise=1.0, fusion="median")


@pytest.mark.slow
def test_a_federation_with_central_dp_reports_its_epsilon(digits):
    from test_experiment import _spec

    settings = ExperimentConfig(name="t", factories=2, devices_per_factory=4, super_node=2,
                                sync_period=3, rounds=3).settings
    strategy = build_strategy("fedgs", settings)
    strategy = dataclasses.replace(strategy, station={
        **strategy.station, "central_dp_clip": 1.0, "central_dp_noise": 0.01})
    run = run_federation(digits, strategy, dataclasses.replace(_spec(digits), rounds=3))
    eps = [r["epsilon_central"] for r in run.rows]
    assert eps == sorted(eps) and eps[-1] > 0 and "epsilon_local" not in run.rows[-1]
    assert run.counters["dp_releases"] == 2 * 3 * 3  # stations x rounds x T
    # Clipped steps and a fixed divisor still train (at this noise, epsilon is huge).
    assert run.final_accuracy > 1.5 * run.rows[0]["accuracy"]


def _dp_experiment(tmp_path, strategies: str, dp: str, **expect: float):
    """The quick experiment, 2 rounds, with central DP ``dp`` (TOML lines): its runs."""
    from lab.experiment import load_experiment, run_experiment

    config = tmp_path / "dp.toml"
    config.write_text(open("experiments/quick.toml").read().replace("rounds = 6", "rounds = 2")
                      + f"strategies = {strategies}\ncentral_dp_clip = 1.0\n{dp}\n")
    cfg = load_experiment(config)
    assert {k: getattr(cfg, k) for k in expect} == expect
    return run_experiment(config, out=tmp_path / "out")[1]


def test_experiments_switch_privacy_on_and_report_its_epsilon(tmp_path):
    from lab.summary import result_rows

    runs = _dp_experiment(tmp_path, '["fedgs"]', "central_dp_noise = 5.0", central_dp_noise=5.0)
    row = result_rows(runs, 0.5)[0]
    assert 0 < row["epsilon"] == pytest.approx(runs[0].rows[-1]["epsilon_central"], abs=1e-3)
    assert "epsilon" not in result_rows([dataclasses.replace(
        runs[0], rows=[{k: v for k, v in runs[0].rows[-1].items()
                        if not k.startswith("epsilon")}])], 0.5)[0]


@pytest.mark.parametrize(("epsilon", "releases"), [(1.0, 1), (4.0, 30), (8.0, 1570)])
def test_a_budget_becomes_the_least_noise_that_keeps_it(epsilon, releases):
    z = noise_for_epsilon(epsilon, releases, 1e-5)
    assert gaussian_epsilon(z, releases, 1e-5) <= epsilon < gaussian_epsilon(0.995 * z,
                                                                            releases, 1e-5)
    with pytest.raises(ValueError, match="no noise"):
        noise_for_epsilon(0.0, releases, 1e-5)


def test_an_experiments_privacy_budget_sets_each_recipes_noise(tmp_path):
    from lab.experiment import ExperimentConfig, _strategy
    from lab.summary import result_rows

    cfg = ExperimentConfig(name="x", rounds=6, sync_period=3, central_dp_clip=1.0,
                           central_dp_epsilon=4.0)
    flat, hier = (_strategy(cfg, n).station["central_dp_noise"] for n in ("fedavg", "fedgs"))
    assert flat == noise_for_epsilon(4.0, 6, 1e-5)  # a release per round
    assert hier == noise_for_epsilon(4.0, 18, 1e-5)  # one per internal synchronisation
    with pytest.raises(ConfigError, match="central_dp_epsilon"):
        dataclasses.replace(cfg, central_dp_noise=1.0)
    runs = _dp_experiment(tmp_path, '["fedgs", "fedavg"]', "central_dp_epsilon = 4.0",
                          central_dp_epsilon=4.0)
    for row in result_rows(runs, 0.5):  # each device's spend, within the budget
        assert 0.5 < row["epsilon"] <= 4.0


def test_a_cloud_with_central_dp_accounts_each_stations_release():
    from aggregator.cloud import Cloud
    from aggregator.config import CloudConfig

    cloud = Cloud(CloudConfig(fleet="t", stations=("s0", "s1"), rounds=5, central_dp_clip=0.5,
                              central_dp_noise=2.0, noise_seeded=True),
                  initial_weights=np.zeros(4), num_classes=2)
    assert cloud.privacy_summary() == {"epsilon_cloud": 0.0}
    for s in ("s0", "s1"):
        cloud.handle(m.StationStats(fleet="t", sender=s, round=0, iteration=0,
                                    seen_counts=np.array([50, 50])), 0.0)
    for rnd in range(2):
        for s in ("s0", "s1"):
            cloud.handle(m.StationUpdate(fleet="t", sender=s, round=rnd, iteration=3,
                                         weights=cloud.weights + np.float32(10.0),  # clipped
                                         num_samples=8, seen_counts=np.array([50, 50])), 1.0)
    assert cloud.round == 2 and cloud.counters["dp_releases"] == 2
    assert cloud.counters["clipped.dp_step"] == 4
    assert cloud.privacy_summary()["epsilon_cloud"] == pytest.approx(
        gaussian_epsilon(2.0, 2, 1e-5))
    with pytest.raises(ConfigError, match="fusion"):
        CloudConfig(stations=("s0",), rounds=1, central_dp_clip=1.0, central_dp_noise=1.0,
                    fusion="krum")


def test_adaptive_clipping_follows_the_target_quantile_and_pays_for_its_count():
    from collections import Counter

    from aggregator.central_dp import CentralDP, CentralPrivacy

    dp = CentralDP(CentralPrivacy(central_dp_clip=10.0, central_dp_noise=1.0,
                                  central_dp_quantile=0.5, central_dp_count_noise=0.5,
                                  noise_seeded=True), seed=0)
    rng, counters = np.random.default_rng(3), Counter()
    for _ in range(150):  # 20 contributors a release, step norms spread around 1
        fold = dp.fold(np.zeros(16, np.float32), 20)
        for k in range(20):
            step = rng.normal(size=16).astype(np.float32)
            fold.add(step / np.linalg.norm(step) * np.float32(rng.uniform(0.5, 1.5)), 1,
                     key=f"d{k}")
        dp.release(fold, counters)
    assert 0.8 < dp.bound < 1.2  # from 10 to about the median norm, 1
    # Each release is two for every contributor: the noised sum and the noised count.
    assert dp.privacy.releases["d0"] == {1.0: 150, 0.5: 150}
    both = dp.privacy.epsilon("d0")
    assert both > gaussian_epsilon(1.0, 150, 1e-5) and both > gaussian_epsilon(0.5, 150, 1e-5)
    with pytest.raises(ConfigError, match="central_dp_quantile"):
        CentralPrivacy(central_dp_quantile=1.5).check_privacy("fedavg")


def test_a_restarted_station_keeps_its_adaptive_clip_bound(tmp_path):
    from test_pipeline import _station

    from aggregator.checkpoint import (
        CheckpointError,
        StationCheckpoint,
        load_checkpoint,
        save_checkpoint,
    )

    def station():
        return _station(sync_period=100, central_dp_clip=1.0, central_dp_noise=1.5,
                        central_dp_quantile=0.5, noise_seeded=True)

    st = station()
    for it in range(3):  # every step fits: the bound shrinks towards the median
        for d in ("d0", "d1"):
            st.handle(m.DeviceUpdate(fleet="t", sender=d, round=0, iteration=it, station="s",
                                     weights=st.weights + np.float32(1e-3), num_samples=8), 1.0)
    assert st.dp.bound < 1.0
    save_checkpoint(tmp_path / "s.npz", *st.snapshot())
    again = station()
    arrays, doc = load_checkpoint(tmp_path / "s.npz")
    again.restore(arrays, StationCheckpoint.from_doc(doc))
    assert again.dp.bound == st.dp.bound
    arrays, meta = st.snapshot()
    with pytest.raises(CheckpointError, match="clip bound"):
        station().restore(arrays, dataclasses.replace(meta, dp_bound=float("nan")))
    fixed = _dp_station()  # a fixed bound is not the checkpoint's to move
    fixed.restore(arrays, dataclasses.replace(meta, dp_bound=0.25))
    assert fixed.dp.bound == 1.0 and fixed.snapshot()[1].dp_bound is None


def test_safl_status_shows_what_privacy_has_spent_and_how_updates_travel():
    from aggregator.status import FleetStatus, format_status
    from edge_client.documents import (
        CloudSummary,
        StationSummary,
        decode_document,
        encode_document,
    )

    doc = StationSummary(station="st0", state="collecting", round=3, iteration=9, devices=2,
                         online=2, quorum=1, epsilon_local=4.73, epsilon_central=2.5,
                         update_stages="clip:1-noise:1-int8:256")
    cloud = CloudSummary(state="collecting", round=3, iteration=9, stations=("st0",),
                         epsilon_cloud=1.25)
    assert decode_document(encode_document(doc)) == doc  # what a monitor reads back
    text = format_status(FleetStatus(stations={"st0": doc}, cloud=cloud), "plant")
    assert "local DP epsilon up to 4.73" in text and "central DP epsilon up to 2.5" in text
    assert "updates as clip:1-noise:1-int8:256" in text
    assert "central DP epsilon up to 1.25 a station" in text
    plain = format_status(FleetStatus(stations={"st0": StationSummary(
        station="st0", state="collecting", round=3, iteration=9, devices=2, online=2,
        quorum=1)}), "plant")
    assert "epsilon" not in plain and "updates as" not in plain
