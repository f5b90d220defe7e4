"""Benchmark: the in-process simulator against the one this project had before (same run).

The workload is the reference experiment's: FedGS (GBP-CS, cloud FedAvgM) with the small CNN
on Fashion-MNIST at Dirichlet 0.1, 4 factories x 10 devices, L = 5, T = 10, batch 32: 6,400
samples trained per round.  The baseline is the simulator of commit ``BASELINE`` (checked out
into a temporary git worktree), configured as the reference experiment was then (evaluation
on 2,000 test images every round, torch on one thread); the current one evaluates the full
10,000-image test set every 8 rounds, as ``experiments/reference.toml`` does now.  Each runs
``--rounds`` rounds (a multiple of 8) in its own process; the figures are the steady-state
seconds per round (from the first evaluation to the last, so start-up and data loading are
left out and each simulator's evaluations are included at its own cadence), projected to the
157 rounds of a 1M-sample reference run, and their ratios.  Run it on a quiet machine: other
jobs on the cores distort every figure.  Printed, never asserted.

Run: ``python bench/simulator.py [--rounds 8]`` from a git checkout.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from baseline import ROOT, checkout, probe

BASELINE = "4d81892"  # main before the simulator work of issue 10
SAMPLES_PER_ROUND = 4 * 5 * 10 * 32

_OLD = """
import dataclasses, sys, time, torch
torch.set_num_threads(1)
from aggregator.experiment import load_experiment, _run_one
cfg = dataclasses.replace(load_experiment("experiments/reference.toml"), rounds={rounds},
                          strategies=("fedgs",))
r = _run_one((cfg, "fedgs", 0, "none", False))
print(r.rows[-1]["wall_s"] - r.rows[0]["wall_s"])
"""

_NEW = """
import dataclasses, sys, time
from lab.experiment import RunTask, load_experiment, run_task
cfg = dataclasses.replace(load_experiment("experiments/reference.toml"), samples=0,
                          rounds={rounds}, strategies=("fedgs",))
r = run_task(RunTask(cfg, "fedgs", 0, threads={threads}))
print(r.rows[-1]["wall_s"] - r.rows[0]["wall_s"])
"""


def _timed(code: str, cwd: Path) -> float:
    return float(probe(cwd, code))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=16)
    args = ap.parse_args()
    if args.rounds % 8:
        ap.error("--rounds must be a multiple of 8 (the current evaluation cadence)")
    per_run = 157 / args.rounds  # rounds of the 1M-sample reference run
    with checkout(BASELINE) as tree:
        started = time.perf_counter()
        old = _timed(_OLD.format(rounds=args.rounds), tree)
    new1 = _timed(_NEW.format(rounds=args.rounds, threads=1), ROOT)
    new2 = _timed(_NEW.format(rounds=args.rounds, threads=os.cpu_count() or 1), ROOT)
    rows = {"baseline (1 thread)": old, "current (1 thread)": new1,
            f"current ({os.cpu_count()} threads)": new2}
    print(f"FedGS, small CNN, Fashion-MNIST alpha 0.1, {args.rounds} rounds "
          f"({args.rounds * SAMPLES_PER_ROUND} samples) per run; baseline = {BASELINE}")
    print(f"{'simulator':<24} {'s/round':>8} {'s per 1M-sample run':>20} {'speed-up':>9}")
    for name, wall in rows.items():
        print(f"{name:<24} {wall / args.rounds:8.2f} {wall * per_run:20.0f} {old / wall:8.2f}x")
    two = (os.cpu_count() or 1) >= 2
    print(f"seeds in parallel (1 thread each) on {os.cpu_count()} cores: "
          f"{(os.cpu_count() or 1) * old / new1 if two else old / new1:.2f}x the baseline's "
          "throughput")
    print(json.dumps({"rounds": args.rounds, "wall_s": rows,
                      "bench_s": round(time.perf_counter() - started, 1)}))


if __name__ == "__main__":
    main()
