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

__all__ = ["ExperimentConfig", "run_experiment", "result_rows", "FULL_SCALE"]

log = logging.getLogger(__name__)

# SPEC §5, the FedGS reference settings (FEMNIST-style CNN on Fashion-MNIST here).
FULL_SCALE = {"factories": 10, "devices_per_factory": 36, "super_node": 10,
              "rand_per_group": 2, "sync_period": 50, "rounds": 500, "lr": 0.01,
              "batch_size": 32, "model": "femnist_cnn", "backend": "torch"}


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
    strategies: tuple[str, ...] = tuple(RECIPES)

    def __post_init__(self) -> None:
        if self.partition not in ("dirichlet", "safl"):
            raise ConfigError("partition", "must be 'dirichlet' or 'safl'")
        for key in ("factories", "devices_per_factory", "super_node", "sync_period", "rounds",
                    "batch_size", "arrivals_per_step", "eval_samples"):
            check_range(key, getattr(self, key), 1)
        check_range("super_node", self.super_node, 1, self.devices_per_factory)
        check_range("rand_per_group", self.rand_per_group, 0, self.super_node)
        check_range("target_accuracy", self.target_accuracy, 0, 1)
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


def _fleet(cfg: ExperimentConfig, data: Dataset) -> FleetSpec:
    rng = np.random.default_rng(cfg.seed)
    n = cfg.factories * cfg.devices_per_factory
    if cfg.partition == "dirichlet":
        parts = dirichlet_label_skew(data.y_train, n, cfg.alpha, rng, min_size=cfg.batch_size)
    else:
        parts = safl_split(data.y_train, n, rng, multi_fraction=cfg.multi_fraction,
                           classes_per_multi=cfg.classes_per_multi)
    return FleetSpec(partitions=tuple(parts), groups=tuple(assign_groups(n, cfg.factories, rng)),
                     rounds=cfg.rounds, model=cfg.model, backends=(cfg.backend,), lr=cfg.lr,
                     seed=cfg.seed, arrivals_per_step=cfg.arrivals_per_step,
                     initial_samples=cfg.initial_samples, eval_samples=cfg.eval_samples,
                     share_trainers=True)


def _strategy(cfg: ExperimentConfig, name: str):
    s = build_strategy(name, cfg.settings)
    device = {"batch_size": cfg.batch_size, "buffer_capacity": cfg.buffer_capacity, **s.device}
    return dataclasses.replace(s, device=device)


@functools.lru_cache(maxsize=2)
def _dataset(name: str) -> Dataset:
    return load_dataset(name)  # once per process, not once per strategy


def _run_one(args: tuple[ExperimentConfig, str, bool]) -> RunResult:
    cfg, name, show = args
    data = _dataset(cfg.dataset)
    return run_federation(data, _strategy(cfg, name), _fleet(cfg, data),
                          Progress(name, cfg.rounds) if show else None)


def _rounds_to(rows: list[dict[str, Any]], target: float) -> int | None:
    return next((r["round"] for r in rows if r["accuracy"] >= target), None)


def result_rows(results: list[RunResult], target: float) -> list[dict[str, Any]]:
    """One row per strategy for ``results.csv``."""
    out = []
    for r in results:
        last = r.rows[-1]
        out.append({"strategy": r.strategy, "final_accuracy": round(r.final_accuracy, 4),
                    "best_accuracy": round(r.best_accuracy, 4),
                    f"rounds_to_{target:g}": _rounds_to(r.rows, target),
                    "uploads": last["uploads"], "skips": last["skips"],
                    "mb_up": round((last["bytes_device_up"] + last["bytes_station_up"]) / 1e6, 1),
                    "mb_down": round((last["bytes_device_down"] + last["bytes_station_down"])
                                     / 1e6, 1),
                    "wall_s": round(r.wall_s, 1)})
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


def run_experiment(path: str | Path, *, out: Path | None = None, jobs: int = 1,
                   full: bool = False) -> tuple[ExperimentConfig, list[RunResult], Path]:
    """Run every strategy of an experiment file; returns the results and the output folder."""
    overrides = dict(FULL_SCALE) if full else {}
    cfg = load_config(ExperimentConfig, "experiment", path, overrides)
    out = Path(out or Path("runs") / f"{cfg.name}{'-full' if full else ''}")
    out.mkdir(parents=True, exist_ok=True)
    print(f"experiment {cfg.name}: {len(cfg.strategies)} strategies, {cfg.factories} factories x "
          f"{cfg.devices_per_factory} devices, {cfg.rounds} rounds, {cfg.model} on "
          f"{cfg.dataset}, {jobs} job(s)", file=sys.stderr)
    tasks = [(cfg, name, jobs == 1) for name in cfg.strategies]
    if jobs == 1:
        results = [_run_one(t) for t in tasks]
    else:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            results = []
            for r in pool.map(_run_one, tasks):
                print(f"{r.strategy:<14} final {r.final_accuracy:.4f} ({r.wall_s:.0f} s)",
                      file=sys.stderr)
                results.append(r)
    rows = result_rows(results, cfg.target_accuracy)
    with open(out / "results.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    write_metrics(results, out)
    title = f"{cfg.name}: {cfg.dataset}, {cfg.partition}"
    plot_accuracy(results, out / "accuracy.png", title)
    _plot_vs_bytes(results, out / "accuracy_vs_bytes.png", title)
    (out / "config.toml").write_text(Path(path).read_text())
    print(format_table(rows))
    return cfg, results, out


def default_jobs() -> int:
    return max(1, min(2, os.cpu_count() or 1))

