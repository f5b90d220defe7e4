"""``safl experiment``: strategies side by side on one fleet, with results and a report.

Every strategy gets the same partitions, initial weights and seeds (one :class:`FleetSpec`)
and runs on the in-process bus through the real roles.  Outputs: ``results.csv`` (one row
per strategy), ``metrics.csv`` (per round), ``accuracy.png`` (accuracy vs round),
``accuracy_vs_bytes.png`` and ``results.md`` with the paper claims checked.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import logging
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edge_client.config import check_range, load_config
from edge_client.errors import ConfigError

from .attacks import ATTACKS
from .datasets import (
    Dataset,
    assign_groups,
    dirichlet_label_skew,
    load_dataset,
    safl_split,
)
from .report import Progress, format_table, plot_accuracy, write_metrics
from .simulation import FleetSpec, RunResult, run_federation
from .strategies import RECIPES, RecipeSettings, build_strategy

__all__ = ["ExperimentConfig", "run_experiment", "load_experiment", "result_rows",
           "merge_seeds", "FULL_SCALE"]

log = logging.getLogger(__name__)

# SPEC §5, the FedGS reference settings (FEMNIST-style CNN on Fashion-MNIST here).
FULL_SCALE = {"factories": 10, "devices_per_factory": 36, "super_node": 10,
              "rand_per_group": 2, "sync_period": 50, "rounds": 500, "lr": 0.01,
              "batch_size": 32, "model": "femnist_cnn", "backend": "torch"}


# The robustness recipes are for attack studies; a plain experiment runs the papers' set.
DEFAULT_STRATEGIES = tuple(r for r in RECIPES if r not in (
    "median", "trimmed_mean", "krum", "multi_krum", "fedavg_unguarded"))


@dataclass(frozen=True, kw_only=True)
class ExperimentConfig:
    """The ``[experiment]`` table of an experiment file."""

    name: str
    dataset: str = "fashion-mnist"
    partition: str = "dirichlet"  # or "safl" (several classes vs one class per device)
    alpha: float = 0.5
    multi_fraction: float = 0.5
    classes_per_multi: int = 5
    factories: int = 4
    devices_per_factory: int = 10
    super_node: int = 5
    rand_per_group: int = 1
    sync_period: int = 10
    rounds: int = 30
    lr: float = 0.05
    batch_size: int = 32
    model: str = "mlp"
    backend: str = "numpy"
    arrivals_per_step: int = 48
    initial_samples: int = 64
    buffer_capacity: int = 1024
    eval_samples: int = 2000
    target_accuracy: float = 0.7
    temperature_rounds: float = 10.0
    mix: float = 0.5
    nu: float = 0.5
    prox_mu: float = 0.01
    server_lr: float = 0.03
    momentum: float = 0.9
    seed: int = 0
    seeds: int = 1  # runs per strategy, seeds seed, seed+1, ...: tables give mean and sd
    # What the compromised devices send (aggregator.attacks): one report section per attack.
    attacks: tuple[str, ...] = ("none",)
    attackers: int = 1  # how many devices are compromised under an attack
    strategies: tuple[str, ...] = DEFAULT_STRATEGIES

    def __post_init__(self) -> None:
        if self.partition not in ("dirichlet", "safl"):
            raise ConfigError("partition", "must be 'dirichlet' or 'safl'")
        for key in ("factories", "devices_per_factory", "super_node", "sync_period", "rounds",
                    "batch_size", "arrivals_per_step", "eval_samples"):
            check_range(key, getattr(self, key), 1)
        check_range("super_node", self.super_node, 1, self.devices_per_factory)
        check_range("rand_per_group", self.rand_per_group, 0, self.super_node)
        check_range("target_accuracy", self.target_accuracy, 0, 1)
        if not self.attacks or any(a not in ATTACKS for a in self.attacks):
            raise ConfigError("attacks", f"must list some of {ATTACKS}")
        check_range("seeds", self.seeds, 1)
        check_range("attackers", self.attackers, 0, self.factories * self.devices_per_factory)
        unknown = [s for s in self.strategies if s not in RECIPES]
        if unknown or not self.strategies:
            raise ConfigError("strategies", f"unknown {unknown}; known: {sorted(RECIPES)}")

    @property
    def settings(self) -> RecipeSettings:
        return RecipeSettings(factories=self.factories, super_node=self.super_node,
                              rand_per_group=self.rand_per_group, sync_period=self.sync_period,
                              temperature_rounds=self.temperature_rounds, mix=self.mix,
                              nu=self.nu, prox_mu=self.prox_mu, server_lr=self.server_lr,
                              momentum=self.momentum)


def _fleet(cfg: ExperimentConfig, data: Dataset, seed: int, attack: str) -> FleetSpec:
    rng = np.random.default_rng(seed)
    n = cfg.factories * cfg.devices_per_factory
    if cfg.partition == "dirichlet":
        parts = dirichlet_label_skew(data.y_train, n, cfg.alpha, rng, min_size=cfg.batch_size)
    else:
        parts = safl_split(data.y_train, n, rng, multi_fraction=cfg.multi_fraction,
                           classes_per_multi=cfg.classes_per_multi)
    return FleetSpec(partitions=tuple(parts), groups=tuple(assign_groups(n, cfg.factories, rng)),
                     rounds=cfg.rounds, model=cfg.model, backends=(cfg.backend,), lr=cfg.lr,
                     seed=seed, arrivals_per_step=cfg.arrivals_per_step,
                     initial_samples=cfg.initial_samples, eval_samples=cfg.eval_samples,
                     share_trainers=True, attack=attack,
                     attackers=tuple(range(cfg.attackers)) if attack != "none" else ())


def _strategy(cfg: ExperimentConfig, name: str):
    s = build_strategy(name, cfg.settings)
    device = {"batch_size": cfg.batch_size, "buffer_capacity": cfg.buffer_capacity, **s.device}
    return dataclasses.replace(s, device=device)


@functools.lru_cache(maxsize=2)
def _dataset(name: str) -> Dataset:
    return load_dataset(name)  # once per process, not once per strategy


def _run_one(args: tuple[ExperimentConfig, str, int, str, bool]) -> RunResult:
    cfg, name, seed, attack, show = args
    data = _dataset(cfg.dataset)
    return run_federation(data, _strategy(cfg, name), _fleet(cfg, data, seed, attack),
                          Progress(name, cfg.rounds) if show else None)


def merge_seeds(results: list[RunResult]) -> list[RunResult]:
    """One result per strategy: accuracy and loss averaged over its seeds per round, with
    ``accuracy_sd`` (sample standard deviation) beside them."""
    by: dict[str, list[RunResult]] = {}
    for r in results:
        by.setdefault(r.strategy, []).append(r)
    merged = []
    for name, runs in by.items():
        if len(runs) == 1:
            merged.append(runs[0])
            continue
        rows = []
        for i, row in enumerate(runs[0].rows):
            acc = [r.rows[i]["accuracy"] for r in runs]
            rows.append({**row, "accuracy": float(np.mean(acc)),
                         "accuracy_sd": float(np.std(acc, ddof=1)),
                         "loss": float(np.mean([r.rows[i]["loss"] for r in runs]))})
        counters: dict[str, int] = {}
        for r in runs:
            for key, value in r.counters.items():
                counters[key] = counters.get(key, 0) + value
        merged.append(RunResult(name, rows, counters, sum(r.wall_s for r in runs)))
    return merged


def _rounds_to(rows: list[dict[str, Any]], target: float) -> int | None:
    return next((r["round"] for r in rows if r["accuracy"] >= target), None)


def result_rows(results: list[RunResult], target: float) -> list[dict[str, Any]]:
    """One row per strategy for ``results.csv``."""
    out = []
    for r in results:
        last = r.rows[-1]
        refused = sum(v for k, v in r.counters.items() if k.startswith(("rejected.", "clipped.")))
        out.append({"strategy": r.strategy, "final_accuracy": round(r.final_accuracy, 4),
                    **({"final_sd": round(last["accuracy_sd"], 4)} if "accuracy_sd" in last
                       else {}),
                    "best_accuracy": round(r.best_accuracy, 4),
                    f"rounds_to_{target:g}": _rounds_to(r.rows, target),
                    "uploads": last["uploads"], "skips": last["skips"],
                    "mb_up": round((last["bytes_device_up"] + last["bytes_station_up"]) / 1e6, 1),
                    "mb_down": round((last["bytes_device_down"] + last["bytes_station_down"])
                                     / 1e6, 1),
                    "refused": refused, "wall_s": round(r.wall_s, 1)})
    return out


def _plot_vs_bytes(results: list[RunResult], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in results:
        mb = [(row["bytes_device_up"] + row["bytes_station_up"]) / 1e6 for row in r.rows]
        ax.plot(mb, [row["accuracy"] for row in r.rows], label=r.strategy)
    ax.set_xscale("symlog")
    ax.set_xlabel("MB uploaded (devices to stations, and stations to cloud)")
    ax.set_ylabel("test accuracy")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def load_experiment(path: str | Path, full: bool = False) -> ExperimentConfig:
    """The ``[experiment]`` table of ``path`` (with the papers' unscaled values if ``full``)."""
    return load_config(ExperimentConfig, "experiment", path, dict(FULL_SCALE) if full else {})


def run_experiment(path: str | Path, *, out: Path | None = None, jobs: int = 1,
                   full: bool = False, attack: str | None = None,
                   ) -> tuple[ExperimentConfig, list[RunResult], Path]:
    """Run every strategy of an experiment file (over its seeds, under one ``attack``, by
    default its first); returns the config, one merged result per strategy, the folder."""
    cfg = load_experiment(path, full)
    attack = attack or cfg.attacks[0]
    label = cfg.name + ("" if attack == "none" else f" under attack '{attack}'")
    out = Path(out or Path("runs") / f"{cfg.name}{'-full' if full else ''}")
    out.mkdir(parents=True, exist_ok=True)
    print(f"experiment {label}: {len(cfg.strategies)} strategies x {cfg.seeds} seed(s), "
          f"{cfg.factories} factories x {cfg.devices_per_factory} devices, {cfg.rounds} rounds, "
          f"{cfg.model} on {cfg.dataset}, {jobs} job(s)", file=sys.stderr)
    tasks = [(cfg, name, cfg.seed + k, attack, jobs == 1)
             for name in cfg.strategies for k in range(cfg.seeds)]
    if jobs == 1:
        results = [_run_one(t) for t in tasks]
    else:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            results = []
            for r in pool.map(_run_one, tasks):
                print(f"{r.strategy:<14} final {r.final_accuracy:.4f} ({r.wall_s:.0f} s)",
                      file=sys.stderr)
                results.append(r)
    results = merge_seeds(results)
    rows = result_rows(results, cfg.target_accuracy)
    with open(out / "results.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    write_metrics(results, out)
    title = f"{label}: {cfg.dataset}, {cfg.partition}"
    plot_accuracy(results, out / "accuracy.png", title)
    _plot_vs_bytes(results, out / "accuracy_vs_bytes.png", title)
    (out / "config.toml").write_text(Path(path).read_text())
    print(format_table(rows))
    return cfg, results, out


def default_jobs() -> int:
    return max(1, min(2, os.cpu_count() or 1))

