"""``safl sweep``: an experiment's strategies over a grid of its settings, to choose defaults.

The experiment file gains a ``[sweep]`` table mapping ``[experiment]`` keys to lists of
values; every combination runs each strategy over the experiment's seeds, in parallel
jobs, and ``sweep.csv`` gets one row per (setting, strategy) with the mean and spread over
seeds of the figures :func:`lab.experiment.run_summary` defines, and the paired effect
of each setting against the first one with the bytes into the stations (so a sweep of
``update_stages`` or privacy settings answers "what does it cost, what does it save");
``--report`` puts the table in ``docs/results.md`` as a section.  Finished runs are kept
per setting, so an interrupted sweep resumes.  ``cases``, a list of tables, gives settings
that are not a grid (one mechanism at several budgets, another at others): each case is
crossed with the other keys' combinations, and may name its own ``strategies``.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from edge_client.config import read_toml
from edge_client.errors import ConfigError

from .claims import markdown_section, paired_points, sweep_claims
from .engine import SimulationConfig
from .experiment import (
    ExperimentConfig,
    RunTask,
    _RunCache,
    load_experiment,
    load_simulation,
    run_tasks,
)
from .report import format_table, write_csv
from .results import write_report
from .simulation import RunResult
from .summary import epsilon_column, mean_sd, per_run, run_summary

__all__ = ["run_sweep", "load_grid"]


def _value(v: Any) -> Any:
    # A list-valued key (update_stages) takes tuples, as the [experiment] table gives them.
    return tuple(v) if isinstance(v, list) else v


def load_grid(path: Path) -> list[dict[str, Any]]:
    """Every combination of the ``[sweep]`` table's values (each ``case`` crossed with the
    rest), as ``[experiment]`` overrides."""
    table = dict(read_toml(path, "sweep").get("sweep", {}))
    cases = table.pop("cases", [{}])
    known = {f.name for f in dataclasses.fields(ExperimentConfig)}
    if not isinstance(cases, list) or not cases or not all(isinstance(c, dict) for c in cases):
        raise ConfigError("sweep.cases", "must be a non-empty list of tables of settings")
    for key in [k for case in cases for k in case]:
        if key not in known:
            raise ConfigError(f"sweep.cases.{key}", "is not an [experiment] key")
    for key, values in table.items():
        if key not in known:
            raise ConfigError(f"sweep.{key}", "is not an [experiment] key")
        if not isinstance(values, list) or not values:
            raise ConfigError(f"sweep.{key}", "must be a non-empty list of values")
    keys = list(table)
    values = [[_value(v) for v in table[k]] for k in keys]
    return [{**{k: _value(v) for k, v in case.items()}, **dict(zip(keys, combo, strict=True))}
            for case in cases for combo in itertools.product(*values)]


def _text(v: Any) -> str:
    """A grid value as the tables and folders show it: a list joined by ``+``."""
    return ("+".join(map(str, v)) or "none") if isinstance(v, tuple) else str(v)


def _label(point: dict[str, Any]) -> str:
    """A grid point's folder name: ``lr=0.1_update_stages=topk:0.1+int8:256``."""
    return "_".join(f"{k}={_text(v)}" for k, v in point.items() if k != "strategies") or "base"


def _runs(base: ExperimentConfig, points: list[dict[str, Any]], out: Path, jobs: int,
          engine: SimulationConfig, ray: str | None) -> dict[tuple[str, str, int], RunResult]:
    """Every run of the grid, finished ones from their cache, the rest in ``jobs`` workers
    (or as Ray tasks on the cluster at ``ray``)."""
    threads = int(engine.cpus_per_run) if ray else (os.cpu_count() or 1) // jobs
    tasks, caches, results = [], {}, {}
    for point in points:
        cfg = dataclasses.replace(base, **point)
        caches[_label(point)] = cache = _RunCache(out / _label(point), cfg, False, engine)
        for name in cfg.strategies:
            for seed in range(cfg.seed, cfg.seed + cfg.seeds):
                key = (_label(point), name, seed)
                results[key] = cache.get(name, seed, "none")
                if results[key] is None:
                    tasks.append((key, RunTask(cfg, name, seed, threads=max(1, threads),
                                                engine=engine)))
    print(f"sweep {base.name}: {len(points)} settings, {len(results)} runs, "
          f"{len(results) - len(tasks)} reused, "
          + (f"as Ray tasks on {ray}" if ray else f"{jobs} job(s)"), file=sys.stderr)
    keys = {id(task): key for key, task in tasks}

    def finished(task: RunTask, r: RunResult) -> None:
        key = keys[id(task)]
        results[key] = r
        caches[key[0]].put(r, key[2], "none")
        print(f"{key[0]} {key[1]} seed {key[2]}: {r.rows[-1]['accuracy']:.4f} "
              f"({r.wall_s:.0f} s)", file=sys.stderr)

    run_tasks([task for _, task in tasks], jobs, ray, finished)
    return {key: r for key, r in results.items() if r is not None}  # every run, by now


def _bytes_in(r: RunResult) -> float:
    """Bytes the devices sent their stations over the run."""
    return float(r.rows[-1]["bytes_device_up"])


def _row(point: dict[str, Any], runs: list[RunResult],
         first: tuple[list[float], float] | None, target: float) -> dict[str, Any]:
    """One setting's figures for one strategy, beside the same strategy at the first
    setting (``first``: its accuracy per seed and mean bytes into the stations; None for
    the first setting itself): the paired per-seed accuracy effect (points, mean and sd)
    and how many times fewer bytes went into the stations."""
    sums = [run_summary(r, target) for r in runs]
    row: dict[str, Any] = {**{k: _text(v) for k, v in point.items()},
                           "strategy": runs[0].strategy}
    for figure in ("accuracy", "local_q1", "worst10_q1", "local_end"):
        row[figure], row[f"{figure}_sd"] = mean_sd([float(s[figure]) for s in sums])
    mb = float(np.mean([_bytes_in(r) for r in runs]))
    if first is not None:
        effect, spread = paired_points([s["accuracy"] for s in sums], first[0])
        row["vs_first"] = f"{effect:+.2f} +- {spread:.2f}"
        row["within_spread"] = "yes" if effect + spread >= 0 else "no"
    row["mb_into_stations"] = round(mb / 1e6, 1)
    row["fewer_bytes"] = f"{(first[1] if first else mb) / mb:.2f}x" if mb else "-"
    row["refused"], row["clipped"] = per_run(runs, "rejected."), per_run(runs, "clipped.")
    return {**row, **epsilon_column(runs)}


def run_sweep(path: Path, *, out: Path | None = None, jobs: int = 1,
              report: Path | None = None, ray: str | None = None) -> list[dict[str, Any]]:
    """Run the grid of ``path``; returns (and writes to ``sweep.csv``, and as a section of
    ``report`` if given) the summary rows."""
    base = load_experiment(path)
    points = load_grid(path)
    out = Path(out or Path("runs") / f"{base.name}-sweep")
    done = _runs(base, points, out, jobs, load_simulation(path, ray), ray)
    rows = []
    columns = list(dict.fromkeys(k for point in points for k in point if k != "strategies"))
    for name in base.strategies:
        seeds = range(base.seed, base.seed + base.seeds)
        first = None
        for point in points:
            if (_label(point), name, base.seed) not in done:
                continue  # a case with strategies of its own
            runs = [done[(_label(point), name, s)] for s in seeds]
            shown = {k: point.get(k, "-") for k in columns}
            rows.append(_row(shown, runs, first, base.target_accuracy))
            if first is None:
                first = ([run_summary(r, base.target_accuracy)["accuracy"] for r in runs],
                         float(np.mean([_bytes_in(r) for r in runs])))
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "sweep.csv", rows)
    print(format_table(rows))
    print(f"wrote {out / 'sweep.csv'}")
    if report:
        settings = {k: v for k, v in vars(base).items()
                    if k not in ("name", "strategies", "attacks", *columns)}
        section = markdown_section(f"{base.name}: sweep of {', '.join(columns)}",
                                   f"safl sweep {path} --jobs {jobs}", settings, rows,
                                   sweep_claims(rows))
        write_report(report, [section])
    return rows
