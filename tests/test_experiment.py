"""Experiments: recipes, partitions, shared trainers, the runner and its claims report."""

from __future__ import annotations

import csv
import dataclasses

import numpy as np
import pytest

from aggregator.claims import assess_claims
from aggregator.datasets import assign_groups, dirichlet_label_skew, safl_split
from aggregator.experiment import DEFAULT_STRATEGIES, ExperimentConfig
from aggregator.simulation import FleetSpec, plan_fleet, run_federation
from aggregator.strategies import build_strategy
from edge_client.cli import main
from edge_client.errors import ConfigError

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


def test_shared_trainers_change_nothing_but_memory(digits):
    strategy = build_strategy("safl_fedgs", SETTINGS)
    alone = run_federation(digits, strategy, _spec(digits))
    shared = run_federation(digits, strategy, _spec(digits, share_trainers=True))
    assert [r["accuracy"] for r in shared.rows] == [r["accuracy"] for r in alone.rows]
    assert shared.counters == alone.counters


def test_claims_are_judged_from_results():
    rows = [{"strategy": s, "final_accuracy": a, "rounds_to_0.5": r, "uploads": u}
            for s, a, r, u in (("fedgs", 0.80, 4, 100), ("fedavg", 0.70, 10, 50),
                               ("fedprox", 0.78, None, 50), ("safl", 0.75, 5, 50),
                               ("safl_gated", 0.745, 5, 30))]
    verdicts = [c.verdict for c in assess_claims(rows, 0.5, 20)]
    assert verdicts[0] == "reproduced"  # +10 and +2 points: mean +6
    assert verdicts[1] == "reproduced"  # 1 - 4/10 = 60%, 1 - 4/21 = 81%
    assert verdicts[2] == "reproduced"  # 10 / 5 = 2x
    assert verdicts[3] == "partly"  # +7%, the claim is +50%
    assert verdicts[4] == "reproduced"  # 40% fewer uploads, -0.5 points


@pytest.mark.slow
def test_quick_experiment_writes_results_and_report(tmp_path, capsys):
    report = tmp_path / "results.md"
    assert main(["experiment", "experiments/quick.toml", "--out", str(tmp_path / "run"),
                 "--report", str(report)]) == 0
    rows = list(csv.DictReader(open(tmp_path / "run" / "results.csv")))
    assert [r["strategy"] for r in rows] == list(DEFAULT_STRATEGIES)
    for name in ("metrics.csv", "accuracy.png", "accuracy_vs_bytes.png", "config.toml"):
        assert (tmp_path / "run" / name).stat().st_size > 0
    text = report.read_text()
    assert "safl experiment experiments/quick.toml" in text and "| claim | verdict |" in text
    assert "FedGS: +3.5 points" in text


def test_bad_experiment_configs_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match="partition"):
        ExperimentConfig(name="x", partition="iid")
    with pytest.raises(ConfigError, match="strategies"):
        ExperimentConfig(name="x", strategies=("fedsgd",))
    with pytest.raises(ConfigError, match="super_node"):
        dataclasses.replace(ExperimentConfig(name="x"), super_node=50)


@pytest.mark.slow
def test_parallel_jobs_give_the_same_results(tmp_path):
    from aggregator.experiment import result_rows, run_experiment

    config = tmp_path / "two.toml"
    config.write_text(open("experiments/quick.toml").read()
                      + 'strategies = ["fedgs", "safl"]\n')
    _, serial, _ = run_experiment(config, out=tmp_path / "serial", jobs=1)
    _, parallel, _ = run_experiment(config, out=tmp_path / "parallel", jobs=2)
    drop = ("wall_s",)
    assert [{k: v for k, v in r.items() if k not in drop} for r in result_rows(serial, 0.5)] == \
        [{k: v for k, v in r.items() if k not in drop} for r in result_rows(parallel, 0.5)]
