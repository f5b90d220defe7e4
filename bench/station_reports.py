"""Benchmark: what one device report (``DeviceStats``) costs a station as its roster grows.

A station checks every report as a claim; the seen-count bound needs the median of the
other devices' accepted totals.  Waiting devices repeat their report every ``hello_interval``
(2 s), so a station of N devices is asked N/2 times a second before it starts, and as often
again after a broker restart.  For each N it feeds a real :class:`~aggregator.station.Station`
N reports, then N repeats, and prints the microseconds a report, against the baseline of the
same run: the median as it was first computed, every other device's histogram summed on each
report (``per_report_baseline_us``), whose cost grew with N and passed a core's worth of
hellos at 4,000 devices.

Run: ``python bench/station_reports.py [--sizes 250,1000,4000]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aggregator.config import StationConfig  # noqa: E402
from aggregator.station import Station  # noqa: E402
from aggregator.trust import claimed_total  # noqa: E402
from edge_client import messages as m  # noqa: E402


def report(device: str) -> m.DeviceStats:
    counts = np.zeros(10, np.int64)
    counts[int(device[1:]) % 10] = 32
    return m.DeviceStats(fleet="b", sender=device, round=0, iteration=0, station="s",
                         seen_counts=counts, next_batch_counts=counts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="250,1000,4000")
    args = parser.parse_args()
    for n in (int(v) for v in args.sizes.split(",")):
        ids = tuple(f"d{i:05d}" for i in range(n))
        st = Station(StationConfig(fleet="b", station_id="s", devices=ids, super_node_size=4),
                     num_params=12810, num_classes=10, rng=np.random.default_rng(0))
        st.start(0.0)
        reports = [report(d) for d in ids]
        began = time.perf_counter()
        for r in reports:
            st.handle(r, 0.1)
        first = (time.perf_counter() - began) / n
        began = time.perf_counter()
        for r in reports:
            st.handle(r, 0.2)
        repeat = (time.perf_counter() - began) / n
        began = time.perf_counter()
        for r in reports[:200]:  # the baseline: the others' totals summed afresh each time
            np.median([claimed_total(s.seen_counts) for d, s in st.stats.items()
                       if d != r.sender])
        baseline = (time.perf_counter() - began) / 200
        print(json.dumps({"devices": n, "per_report_us": round(first * 1e6, 1),
                          "per_repeat_us": round(repeat * 1e6, 1),
                          "per_report_baseline_us": round((repeat + baseline) * 1e6, 1),
                          "speedup": round((repeat + baseline) / repeat, 1),
                          "hellos_core_share": round(n / 2 * repeat, 3)}), flush=True)


if __name__ == "__main__":
    main()
