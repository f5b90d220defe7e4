"""Benchmark: what one device 30x slower than the rest costs a FedGS fleet, in virtual time.

The fleet is issue 35's: 12 devices in 2 factories on scikit-learn digits (Dirichlet 0.5),
FedGS with L = 3, T = 5 and 5 local steps, every device a ``pi4-torch`` (or ``--profile``)
board, 20 ms one way to the station and 50 ms to the cloud.  Per seed it runs the fleet
without a straggler, with device 0 ``--slow-factor`` times slower under the station's
default straggler deadline, and with the station waiting for every member
(``straggler_factor = 0``), and in buffered mode (FedBuff, ``buffer_size`` 1 and 3, run
for more rounds: theirs are shorter).  Printed per seed and as mean +- sd over the seeds:
virtual seconds per round and the round rate against the fleet without the straggler, and
the accuracy
each reached at the virtual time the fleet without it finished (accuracy per virtual
second).  The target (issue 35): at least 0.8x the round rate and accuracy per second.
Printed, never asserted (``tests/test_clock.py`` asserts the rate on the MLP).

Run: ``python bench/stragglers.py [--model small_cnn] [--backend torch] [--rounds 10]
[--seeds 3]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import numpy as np

from lab.clock import ClockConfig, LinkSpec
from lab.datasets import assign_groups, dirichlet_label_skew, load_dataset
from lab.simulation import FleetSpec, RunResult, Strategy, run_federation

FEDGS = Strategy("fedgs", device={"mix": 1.0, "local_steps": 5},
                 station={"super_node_size": 3, "rand_per_group": 1, "sync_period": 5})
# (label, slow devices, station settings, rounds as a multiple of --rounds): a buffered
# round is T folds of buffer_size answers, so it runs more of them to the same time.
CASES = (("no straggler", (), {}, 1), ("straggler", (0,), {}, 1),
         ("straggler, waited for", (0,), {"straggler_factor": 0.0}, 1),
         ("straggler, buffered K=1", (0,), {"mode": "buffered", "buffer_size": 1}, 3),
         ("straggler, buffered K=3", (0,), {"mode": "buffered", "buffer_size": 3}, 2))


def _accuracy_at(r: RunResult, t: float) -> float:
    """The global model's accuracy at virtual time ``t`` (its last evaluation by then)."""
    return [row["accuracy"] for row in r.rows if row["virtual_s"] <= t + 1e-9][-1]


def _sd(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="small_cnn")
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--profile", default="pi4-torch")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--slow-factor", type=float, default=30.0)
    args = ap.parse_args()
    started = time.perf_counter()
    digits = load_dataset("digits")
    figures: dict[str, dict[str, list[float]]] = {}
    for seed in range(args.seeds):
        rng = np.random.default_rng(seed)
        base = FleetSpec(partitions=tuple(dirichlet_label_skew(digits.y_train, 12, 0.5, rng)),
                         groups=tuple(assign_groups(12, 2, rng)), rounds=args.rounds, lr=0.1,
                         seed=seed, arrivals_per_step=16, initial_samples=32,
                         model=args.model, backends=(args.backend,))
        runs = {}
        for label, slow, station, longer in CASES:
            clock = ClockConfig(profiles=((args.profile, 1.0),),
                                device_link=LinkSpec(latency_ms=20),
                                cloud_link=LinkSpec(latency_ms=50), slow_devices=slow,
                                slow_factor=args.slow_factor, seed=seed)
            strategy = dataclasses.replace(FEDGS, station={**FEDGS.station, **station})
            runs[label] = run_federation(digits, strategy, dataclasses.replace(
                base, clock=clock, rounds=longer * args.rounds))
        end = runs["no straggler"].rows[-1]["virtual_s"]
        clean = end / args.rounds
        for label, r in runs.items():
            per_round = r.rows[-1]["virtual_s"] / (len(r.rows) - 1)
            f = figures.setdefault(label, {"s_per_round": [], "rate": [], "acc_at": [],
                                           "acc_ratio": []})
            f["s_per_round"].append(per_round)
            f["rate"].append(clean / per_round)
            f["acc_at"].append(_accuracy_at(r, end))
            f["acc_ratio"].append(_accuracy_at(r, end) / _accuracy_at(runs["no straggler"], end))
            missed = r.counters.get("replies_missed", 0)
            print(f"seed {seed} {label:<22} {per_round:7.3f} s/round ({clean / per_round:.2f}x), "
                  f"accuracy at {end:.1f} s {_accuracy_at(r, end):.4f}, final "
                  f"{r.final_accuracy:.4f}, {missed} replies missed, "
                  f"{r.counters.get('stragglers_benched', 0)} benched", flush=True)
    print(f"{args.model} ({args.backend}) on {args.profile}, {args.rounds} rounds, "
          f"{args.seeds} seeds, one device {args.slow_factor:g}x slower; mean +- sd:")
    for label, f in figures.items():
        print(f"  {label:<22} {statistics.mean(f['s_per_round']):.3f} s/round, round rate "
              f"{statistics.mean(f['rate']):.2f} +- {_sd(f['rate']):.2f}x, accuracy at the "
              f"clean fleet's end {statistics.mean(f['acc_at']):.4f} +- {_sd(f['acc_at']):.4f} "
              f"({statistics.mean(f['acc_ratio']):.2f}x)")
    print(json.dumps({k: {m: [round(x, 4) for x in v] for m, v in f.items()}
                      for k, f in figures.items()} | {"bench_s": round(time.perf_counter()
                                                                         - started, 1)}))


if __name__ == "__main__":
    main()
