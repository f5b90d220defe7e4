"""Experiments: recipes, partitions, shared trainers, the runner and its claims report."""

from __future__ import annotations

import csv
import dataclasses

import numpy as np
import pytest

from edge_client.config import DeviceConfig
from edge_client.errors import ConfigError
from lab.claims import assess_claims, verdict
from lab.datasets import assign_groups, dirichlet_label_skew, safl_split
from lab.experiment import DEFAULT_STRATEGIES, ExperimentConfig
from lab.simulation import FleetSpec, RunResult, plan_fleet, run_federation
from lab.strategies import build_strategy
from lab.summary import per_run, samples_to
from safl.cli import main

SETTINGS = ExperimentConfig(name="t", factories=2, devices_per_factory=4, super_node=2,
                            sync_period=3, rounds=2).settings


def _spec(digits, **kw):
    rng = np.random.default_rng(0)
    return FleetSpec(partitions=tuple(dirichlet_label_skew(digits.y_train, 8, 0.5, rng)),
                     groups=tuple(assign_groups(8, 2, rng)), rounds=2, lr=0.1,
                     arrivals_per_step=48, initial_samples=96, **kw)


def test_safl_split_gives_multi_and_single_class_devices(digits):
    parts = safl_split(digits.y_train, 10, np.random.default_rng(0), classes_per_multi=5)
    held = [set(digits.y_train[p].tolist()) for p in parts]
    assert [len(h) for h in held] == [5] * 5 + [1] * 5
    assert set(range(5)) <= set().union(*held)  # single-class devices take classes in turn
    assert sum(len(p) for p in parts) <= len(digits.y_train)
    assert len(np.unique(np.concatenate(parts))) == sum(len(p) for p in parts)  # no overlap


def test_recipes_have_equal_compute_per_round(digits):
    spec = _spec(digits)
    steps = {}
    for name in ("fedgs", "fedavg", "safl", "fedyogi"):
        strategy = build_strategy(name, SETTINGS)
        plan = plan_fleet(strategy, spec)
        assert len(plan.stations) == (1 if strategy.flat else 2)
        steps[name] = run_federation(digits, strategy, spec).counters["steps"]
    # hierarchical: rounds x T x L x M one-step iterations; flat: rounds x (L x M) x T steps
    assert steps["fedgs"] == 2 * 3 * 2 * 2
    assert steps["fedavg"] == steps["safl"] == steps["fedyogi"] == 2 * 4 * 1
    with pytest.raises(ConfigError, match="strategies"):
        build_strategy("fedsgd", SETTINGS)


def test_an_lr_decay_reaches_every_recipe_in_its_own_iterations():
    decayed = dataclasses.replace(SETTINGS, lr_decay_rounds=2.5, lr_decay=0.2)
    for name in ("fedgs", "safl_fedgs", "fedavg", "fedavgm"):
        strategy = build_strategy(name, decayed)
        per_round = 1 if strategy.flat else decayed.sync_period
        assert strategy.device["lr_decay_at"] == round(2.5 * per_round)
        assert strategy.device["lr_decay"] == 0.2
        assert "lr_decay_at" not in build_strategy(name, SETTINGS).device
    # A negative decay round is refused by name where the device reads it, not clamped.
    wrong = build_strategy("fedgs", dataclasses.replace(SETTINGS, lr_decay_rounds=-1.0)).device
    with pytest.raises(ConfigError, match="lr_decay_at"):
        DeviceConfig(device_id="d", station="s", lr_decay_at=wrong["lr_decay_at"])


def test_the_hierarchical_recipes_take_every_registered_server_optimizer():
    from aggregator.config import CloudConfig
    from aggregator.server_optimizers import SERVER_OPTIMIZERS

    for kind in SERVER_OPTIMIZERS:
        cfg = ExperimentConfig(name="t", factories=2, devices_per_factory=4, super_node=2,
                               sync_period=3, rounds=2, cloud_optimizer=kind)
        cloud = build_strategy("fedgs", cfg.settings).cloud
        assert cloud.get("server_optimizer", "none") == kind
        CloudConfig(stations=("s0",), rounds=1, **cloud)  # the cloud takes what it built
    with pytest.raises(ConfigError, match="cloud_optimizer"):
        ExperimentConfig(name="t", cloud_optimizer="sgd")


def test_shared_trainers_change_nothing_but_memory(digits):
    strategy = build_strategy("safl_fedgs", SETTINGS)
    alone = run_federation(digits, strategy, _spec(digits))
    shared = run_federation(digits, strategy, _spec(digits, share_trainers=True))
    assert [r["accuracy"] for r in shared.rows] == [r["accuracy"] for r in alone.rows]
    assert shared.counters == alone.counters


def _curve(name: str, accs: list[float], uploads: int = 100) -> RunResult:
    rows = [{"strategy": name, "round": i, "samples": 1000 * i, "accuracy": a, "loss": 0.0,
             "local_mean": a, "local_worst10": a - 0.1, "uploads": uploads, "skips": 0}
            for i, a in enumerate(accs)]
    return RunResult(name, rows, {}, 0.0)


def test_a_target_counts_only_when_it_is_held():
    rows = _curve("x", [0.1, 0.6, 0.4, 0.55, 0.7, 0.8]).rows
    assert samples_to(rows, 0.5) == 3000  # 0.6 at 1000 fell back: not reached there
    assert samples_to(rows, 0.9) is None


def test_verdicts_weigh_the_effect_against_the_seed_spread():
    assert verdict(5.0, 1.0, 3.5) == "reproduced"
    assert verdict(1.0, 2.0, 0.0) == "inconclusive"  # within the spread
    assert verdict(1.0, 0.5, 3.5) == "not reproduced"  # reliably smaller than claimed
    assert verdict(-3.0, 1.0, 0.0) == "not reproduced"
    assert verdict(9.0, float("nan"), 3.5) == "inconclusive"  # one seed: no spread


def test_claims_are_judged_from_paired_seeds():
    def seeds(name, finals, **kw):
        return [_curve(name, [0.1, 0.3, f, f, f], **kw) for f in finals]

    results = [*seeds("fedgs", [0.80, 0.82, 0.81]), *seeds("fedavg", [0.70, 0.73, 0.70]),
               *seeds("fedgs_random", [0.81, 0.80, 0.82]),
               *seeds("safl", [0.75, 0.74, 0.76], uploads=100),
               *seeds("safl_gated", [0.748, 0.741, 0.757], uploads=60)]
    by_text = {c.claim: c.verdict for c in assess_claims(results, 0.5)}
    assert by_text["FedGS: +3.5 points accuracy over the baselines on average"] == "reproduced"
    assert by_text["GBP-CS beats random super nodes (FedGS ablation)"] == "inconclusive"
    assert by_text["SAFL: >50% accuracy improvement over FedAvg on non-i.i.d. data"] == \
        "not reproduced"  # +6%, reliably
    assert by_text["SAFL upload gating: fewer uploads at similar accuracy (within 1 point)"] \
        == "reproduced"
    one_seed = assess_claims([results[0], results[3]], 0.5)
    assert {c.verdict for c in one_seed} == {"inconclusive"}


@pytest.mark.slow
def test_quick_experiment_writes_results_and_report(tmp_path, capsys):
    report = tmp_path / "results.md"
    assert main(["experiment", "experiments/quick.toml", "--out", str(tmp_path / "run"),
                 "--report", str(report)]) == 0
    rows = list(csv.DictReader(open(tmp_path / "run" / "results.csv")))
    assert [r["strategy"] for r in rows] == list(DEFAULT_STRATEGIES)
    for name in ("metrics.csv", "accuracy.png", "accuracy_vs_bytes.png", "config.toml"):
        assert (tmp_path / "run" / name).stat().st_size > 0
    page = (tmp_path / "run" / "report.html").read_text()
    # accuracy against samples and bytes; per strategy its devices (too little held out on
    # digits to score them: their uploads and refusals only)
    assert page.count("data:image/png;base64,") == 2 + len(DEFAULT_STRATEGIES)
    devices = list(csv.DictReader(open(tmp_path / "run" / "devices.csv")))
    assert {r["strategy"] for r in devices} == set(DEFAULT_STRATEGIES)
    text = report.read_text()
    assert "safl experiment experiments/quick.toml" in text and "| claim | verdict |" in text
    assert "FedGS: +3.5 points" in text


def test_a_field_tests_folder_makes_a_report_and_a_wrong_one_says_what_it_lacks(tmp_path):
    from lab.run_report import write_run_report

    (tmp_path / "metrics.csv").write_text("round,iteration,wall_s,loss,accuracy\n"
                                          "1,3,1.0,2.1,0.31\n2,6,2.0,1.7,0.52\n")
    (tmp_path / "cloud.toml").write_text('[cloud]\nrounds = 2\n')
    page = write_run_report(tmp_path).read_text()
    assert page.count("data:image/png;base64,") == 1 and "No devices.csv" in page
    assert "rounds = 2" in page and (tmp_path / "report_accuracy.png").stat().st_size > 0
    (tmp_path / "devices.csv").write_text(
        "t,round,device,station,local_accuracy,prequential_accuracy,uploads,refused\n"
        "1764669600.5,1,d<0>,s,0.2,,3,0\n1764669602.5,2,d<0>,s,0.4,0.5,5,1\n")
    page = write_run_report(tmp_path).read_text()
    assert page.count("data:image/png;base64,") == 3  # and the device's accuracy, uploads
    (tmp_path / "fleet.json").write_text('{"stations": [], "devices": [{"id": "d<0>"}]}')
    assert "d&lt;0&gt;" in write_run_report(tmp_path).read_text()  # text, never markup
    (tmp_path / "metrics.csv").write_text("round\n1\n")
    with pytest.raises(ConfigError, match="RUN_DIR"):
        write_run_report(tmp_path)


def test_bad_experiment_configs_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match="partition"):
        ExperimentConfig(name="x", partition="iid")
    with pytest.raises(ConfigError, match="strategies"):
        ExperimentConfig(name="x", strategies=("fedsgd",))
    with pytest.raises(ConfigError, match="super_node"):
        dataclasses.replace(ExperimentConfig(name="x"), super_node=50)


@pytest.mark.slow
def test_parallel_jobs_give_the_same_results(tmp_path):
    from lab.experiment import run_experiment
    from lab.summary import result_rows

    config = tmp_path / "two.toml"
    config.write_text(open("experiments/quick.toml").read()
                      + 'strategies = ["fedgs", "safl"]\n')
    _, serial, _ = run_experiment(config, out=tmp_path / "serial", jobs=1)
    _, parallel, _ = run_experiment(config, out=tmp_path / "parallel", jobs=2)
    drop = ("wall_s",)
    assert [{k: v for k, v in r.items() if k not in drop} for r in result_rows(serial, 0.5)] == \
        [{k: v for k, v in r.items() if k not in drop} for r in result_rows(parallel, 0.5)]


def test_a_sweep_runs_its_grid_and_resumes_from_finished_runs(tmp_path, capsys):
    config = tmp_path / "sweep.toml"
    config.write_text(open("experiments/quick.toml").read().replace("rounds = 6", "rounds = 3")
                      + 'strategies = ["fedgs"]\n\n[sweep]\nlr = [0.05, 0.2]\n')
    assert main(["sweep", str(config), "--out", str(tmp_path / "s")]) == 0
    rows = list(csv.DictReader(open(tmp_path / "s" / "sweep.csv")))
    assert [(r["lr"], r["strategy"]) for r in rows] == [("0.05", "fedgs"), ("0.2", "fedgs")]
    assert rows[0]["accuracy"] != rows[1]["accuracy"]  # the setting reached the devices
    capsys.readouterr()
    assert main(["sweep", str(config), "--out", str(tmp_path / "s")]) == 0
    assert "2 runs, 2 reused" in capsys.readouterr().err
    assert list(csv.DictReader(open(tmp_path / "s" / "sweep.csv"))) == rows
    config.write_text(config.read_text().replace("[sweep]", "mix = 0.3\n[sweep]"))  # not FedGS's
    assert main(["sweep", str(config), "--out", str(tmp_path / "s")]) == 0
    assert "2 reused" in capsys.readouterr().err
    config.write_text(config.read_text().replace("alpha = 0.5", "alpha = 0.3"))  # fleet
    assert main(["sweep", str(config), "--out", str(tmp_path / "s")]) == 0
    assert "0 reused" in capsys.readouterr().err


def test_a_sweep_of_update_stages_reports_what_they_cost_and_save(tmp_path, capsys):
    config = tmp_path / "stages.toml"
    config.write_text(open("experiments/quick.toml").read().replace("rounds = 6", "rounds = 2")
                      + 'strategies = ["fedgs"]\nseeds = 2\n\n[sweep]\n'
                        'update_stages = [[], ["int8:256"]]\n')
    report = tmp_path / "results.md"
    report.write_text("# old head\n\n## other\n\nkept\n")
    assert main(["sweep", str(config), "--out", str(tmp_path / "s"), "--report", str(report)]) == 0
    plain, int8 = list(csv.DictReader(open(tmp_path / "s" / "sweep.csv")))
    assert (plain["update_stages"], int8["update_stages"]) == ("none", "int8:256")
    assert plain["fewer_bytes"] == "1.00x" and not plain["vs_first"]
    assert 3.5 < float(int8["fewer_bytes"].rstrip("x")) < 4  # the block scales and headers
    effect, spread = map(float, int8["vs_first"].split(" +- "))
    assert int8["within_spread"] == ("yes" if effect + spread >= 0 else "no")
    text = report.read_text()
    assert text.startswith("# Results") and "## other\n\nkept" in text  # the head is ours
    assert "## quick: sweep of update_stages" in text and "| int8:256 | fedgs |" in text
    assert "| 4x fewer bytes into stations at accuracy within the seed spread | " \
           "**not reached** |" in text
    capsys.readouterr()
    assert main(["sweep", str(config), "--out", str(tmp_path / "s"), "--report", str(report)]) == 0
    assert report.read_text() == text  # rewritten in place, from the finished runs


def test_sweep_cases_are_settings_that_are_not_a_grid(tmp_path):
    from lab.sweep import load_grid

    config = tmp_path / "cases.toml"
    config.write_text(open("experiments/quick.toml").read().replace("rounds = 6", "rounds = 2")
                      + 'strategies = ["fedgs", "fedavg"]\n\n[sweep]\nseed = [0]\ncases = [\n'
                        '  {},\n  {lr = 0.2, strategies = ["fedgs"]},\n]\n')
    assert load_grid(config) == [{"seed": 0}, {"lr": 0.2, "strategies": ("fedgs",), "seed": 0}]
    assert main(["sweep", str(config), "--out", str(tmp_path / "s")]) == 0
    rows = list(csv.DictReader(open(tmp_path / "s" / "sweep.csv")))
    # A case's own strategies run alone; a key a case leaves unset shows as "-".
    assert [(r["lr"], r["strategy"]) for r in rows] == [("-", "fedgs"), ("0.2", "fedgs"),
                                                        ("-", "fedavg")]
    assert rows[1]["vs_first"] and not rows[2]["vs_first"]
    config.write_text(config.read_text().replace("{},", "{learning_rate = 1},"))
    with pytest.raises(ConfigError, match="sweep.cases.learning_rate"):
        load_grid(config)


def test_a_report_rewrites_its_own_sections_and_keeps_the_others(tmp_path):
    from lab.results import REPORT_HEAD, write_report

    report = tmp_path / "results.md"
    write_report(report, ["## a\n\none\n", "## b\n\ntwo\n"])
    write_report(report, ["## c\n\nthree\n", "## a\n\nuno\n"])
    assert report.read_text() == REPORT_HEAD + "## a\n\nuno\n\n## b\n\ntwo\n\n## c\n\nthree\n"


def test_a_sweep_names_a_bad_key(tmp_path):
    from lab.sweep import load_grid
    config = tmp_path / "sweep.toml"
    config.write_text('[experiment]\nname = "x"\n[sweep]\nlearning_rate = [0.1]\n')
    with pytest.raises(ConfigError, match="sweep.learning_rate"):
        load_grid(config)


def test_a_samples_budget_sets_rounds_and_the_temperature_follows_the_run():
    cfg = ExperimentConfig(name="x", factories=4, devices_per_factory=10, super_node=5,
                           sync_period=10, batch_size=32, samples=1_000_000,
                           temperature_fraction=0.1)
    assert cfg.samples_per_round == 6400 and cfg.rounds == 157  # ceil(1M / 6400)
    assert cfg.temperature_rounds == pytest.approx(15.7)
    safl = build_strategy("safl_fedgs", cfg.settings)
    assert safl.device["temperature"] == pytest.approx(157.0)  # in iterations: x T
    assert safl.cloud["server_optimizer"] == "fedavgm"  # the hierarchical recipes' default
    plain = dataclasses.replace(cfg, cloud_optimizer="none")
    assert build_strategy("fedgs", plain.settings).cloud == {}
    with pytest.raises(ConfigError, match="cloud_optimizer"):
        dataclasses.replace(cfg, cloud_optimizer="adam")


def test_finished_runs_are_reused_and_can_be_reported_alone(tmp_path, capsys):
    from lab.experiment import run_experiment
    from lab.summary import result_rows

    one, two = tmp_path / "one.toml", tmp_path / "two.toml"
    text = open("experiments/quick.toml").read().replace("rounds = 6", "rounds = 2")
    one.write_text(text + 'strategies = ["fedgs"]\n')
    two.write_text(text + 'strategies = ["fedgs", "safl"]\n')
    _, first, _ = run_experiment(one, out=tmp_path / "out")
    _, report, _ = run_experiment(two, out=tmp_path / "out", finished_only=True)
    assert [r.strategy for r in report] == ["fedgs"] and "safl seed 0" in capsys.readouterr().err
    assert result_rows(report, 0.5) == result_rows(first, 0.5)  # reused, not retrained
    _, both, _ = run_experiment(two, out=tmp_path / "out")  # only safl runs
    assert [r.strategy for r in both] == ["fedgs", "safl"]
    assert both[0].wall_s == first[0].wall_s  # the cached run itself


def test_reports_tell_lost_replies_from_trimmed_claims():
    runs = [RunResult("fedgs", [], {"rejected.update_norm": 3, "rejected.bad_count": 1,
                                    "clipped.update_norm": 20, "clipped.seen_counts": 4}, 1.0),
            RunResult("fedgs", [], {"rejected.update_norm": 1, "received_updates": 99}, 1.0)]
    assert per_run(runs, "rejected.") == 2 and per_run(runs, "clipped.") == 12



def test_the_accuracy_at_a_sample_count_is_read_between_evaluations():
    from lab.simulation import RunResult
    from lab.summary import accuracy_at_samples, result_rows

    rows = [{"round": r, "samples": s, "accuracy": a, "local_mean": float("nan"),
             "local_worst10": float("nan"), "uploads": 0, "skips": 0, "bytes_device_up": 0,
             "bytes_station_up": 0}
            for r, (s, a) in enumerate([(0, 0.1), (10000, 0.5), (30000, 0.9)])]
    assert accuracy_at_samples(rows, 20000) == pytest.approx(0.7)
    assert accuracy_at_samples(rows, 10000) == pytest.approx(0.5)
    assert accuracy_at_samples(rows, 40000) != accuracy_at_samples(rows, 40000)  # NaN: past it
    runs = [RunResult("fedgs", rows, {}, 1.0), RunResult("fedgs", [
        {**r, "accuracy": r["accuracy"] + 0.1} for r in rows], {}, 1.0)]
    row = result_rows(runs, 0.8, at_samples=(20000,))[0]
    assert row["accuracy_at_20k"] == pytest.approx(0.75) and row["accuracy_at_20k_sd"] > 0
