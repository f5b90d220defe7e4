"""``safl demo``: SAFL+FedGS against plain FedAvg (and FedGS alone) on one non-i.i.d. fleet.

Both strategies get the same partitions, initial weights, seeds and compute per
round: FedGS takes ``T`` one-step iterations per round on a super node of ``L``
devices; FedAvg takes one iteration of ``T`` local steps on ``L`` random devices.
"""

from __future__ import annotations

import logging
import sys
from datetime import datetime
from pathlib import Path

import numpy as np

from edge_client.config import check_range

from .datasets import assign_groups, dirichlet_label_skew, load_default
from .report import Progress, format_table, plot_accuracy, summary_rows, write_metrics
from .simulation import FleetSpec, RunResult, Strategy, run_federation

__all__ = ["demo_strategies", "run_demo"]

log = logging.getLogger(__name__)


def demo_strategies(super_node_size: int = 4, sync_period: int = 5) -> list[Strategy]:
    """The recipes the demo compares, all built on the same roles.

    ``fedgs`` is SAFL+FedGS with SAFL switched off (``mix = 1``, no gate), so the
    table separates what GBP-CS selection brings from what SAFL adds.
    """
    fedgs_station = {"super_node_size": super_node_size, "rand_per_group": 1,
                     "selector": "gbp_cs", "sync_period": sync_period}
    return [
        Strategy("safl+fedgs", device={"mix": 0.5, "temperature": 25.0, "nu": 0.5},
                 station=fedgs_station),
        Strategy("fedgs", device={"mix": 1.0, "nu": 0.0}, station=fedgs_station),
        Strategy("fedavg",
                 device={"mix": 1.0, "nu": 0.0, "local_steps": sync_period},
                 station={"super_node_size": super_node_size, "rand_per_group": 0,
                          "selector": "random", "sync_period": 1}),
    ]


def run_demo(*, rounds: int = 100, out: Path | None = None, seed: int = 0, stations: int = 2,
             devices_per_station: int = 6, alpha: float = 0.3, lr: float = 0.1) -> list[RunResult]:
    """Run the demo, print its table, write metrics (CSV, JSON) and ``accuracy.png``."""
    check_range("rounds", rounds, 1)
    data, note = load_default()
    print(f"dataset: {note}", file=sys.stderr)
    rng = np.random.default_rng(seed)
    n_dev = stations * devices_per_station
    spec = FleetSpec(partitions=tuple(dirichlet_label_skew(data.y_train, n_dev, alpha, rng)),
                     groups=tuple(assign_groups(n_dev, stations, rng)), rounds=rounds, lr=lr,
                     seed=seed)
    print(f"fleet: {stations} stations x {devices_per_station} devices, Dirichlet({alpha}) label "
          f"skew, MLP on numpy, {rounds} rounds", file=sys.stderr)
    results = [run_federation(data, s, spec, Progress(s.name, rounds)) for s in demo_strategies()]
    out = out or Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S")
    csv_path, json_path = write_metrics(results, out)
    png = plot_accuracy(results, out / "accuracy.png",
                        f"{data.name}: {stations}x{devices_per_station} devices, "
                        f"Dirichlet({alpha})")
    print(format_table(summary_rows(results)))
    print(f"\nwrote {csv_path}, {json_path} and {png}")
    return results
