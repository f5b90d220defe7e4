"""``safl sweep``: an experiment's strategies over a grid of its settings, to choose defaults.

The experiment file gains a ``[sweep]`` table mapping ``[experiment]`` keys to lists of
values; every combination runs each strategy over the experiment's seeds, in parallel
jobs, and ``sweep.csv`` gets one row per (setting, strategy) with the mean and spread over
seeds of the figures :func:`lab.experiment.run_summary` defines.  Finished runs are
kept per setting, so an interrupted sweep resumes.
"""

from __future__ import annotations

import csv
import dataclasses
import itertools
import os
import sys
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from edge_client.config import read_toml
from edge_client.errors import ConfigError

from .experiment import ExperimentConfig, RunTask, _RunCache, load_experiment, run_task
from .report import format_table
from .summary import mean_sd, run_summary

__all__ = ["run_sweep", "load_grid"]


def load_grid(path: Path) -> list[dict[str, Any]]:
    """Every combination of the ``[sweep]`` table's values, as ``[experiment]`` overrides."""
    table = read_toml(path, "sweep").get("sweep", {})
    known = {f.name for f in dataclasses.fields(ExperimentConfig)}
    for key, values in table.items():
        if key not in known:
            raise ConfigError(f"sweep.{key}", "is not an [experiment] key")
        if not isinstance(values, list) or not values:
            raise ConfigError(f"sweep.{key}", "must be a non-empty list of values")
    keys = list(table)
    return [dict(zip(keys, combo, strict=True)) for combo in
            itertools.product(*(table[k] for k in keys))]


def _label(point: dict[str, Any]) -> str:
    return "_".join(f"{k}={v}" for k, v in point.items()) or "base"


def run_sweep(path: Path, *, out: Path | None = None, jobs: int = 1) -> list[dict[str, Any]]:
    """Run the grid of ``path``; returns (and writes to ``sweep.csv``) the summary rows."""
    base = load_experiment(path)
    points = load_grid(path)
    out = Path(out or Path("runs") / f"{base.name}-sweep")
    threads = max(1, (os.cpu_count() or 1) // jobs)
    tasks, caches, results = [], {}, {}
    for point in points:
        cfg = dataclasses.replace(base, **point)
        caches[_label(point)] = cache = _RunCache(out / _label(point), cfg, False)
        for name in cfg.strategies:
            for seed in range(cfg.seed, cfg.seed + cfg.seeds):
                key = (_label(point), name, seed)
                results[key] = cache.get(name, seed, "none")
                if results[key] is None:
                    tasks.append((key, RunTask(cfg, name, seed, threads=threads)))
    print(f"sweep {base.name}: {len(points)} settings, {len(results)} runs, "
          f"{len(results) - len(tasks)} reused, {jobs} job(s)", file=sys.stderr)
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(run_task, task): key for key, task in tasks}
        for future in as_completed(futures):
            key = futures[future]
            results[key] = r = future.result()
            caches[key[0]].put(r, key[2], "none")
            print(f"{key[0]} {key[1]} seed {key[2]}: {r.rows[-1]['accuracy']:.4f} "
                  f"({r.wall_s:.0f} s)", file=sys.stderr)
    done = {key: r for key, r in results.items() if r is not None}  # every run, by now
    rows = []
    for point in points:
        cfg = dataclasses.replace(base, **point)
        for name in cfg.strategies:
            runs = [run_summary(done[(_label(point), name, s)], cfg.target_accuracy)
                    for s in range(cfg.seed, cfg.seed + cfg.seeds)]
            row: dict[str, Any] = {**point, "strategy": name}
            for figure in ("accuracy", "local_q1", "worst10_q1", "local_end"):
                row[figure], row[f"{figure}_sd"] = mean_sd([float(r[figure]) for r in runs])
            rows.append(row)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "sweep.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
        writer.writeheader()
        writer.writerows(rows)
    print(format_table(rows))
    print(f"wrote {out / 'sweep.csv'}")
    return rows
