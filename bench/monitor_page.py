"""Benchmark: the monitor's page at fleet sizes, against what it served before paging.

For N devices, each with a ten-minute series (600 points), it builds the monitor's history,
then measures what a page load costs: the bytes and the server's milliseconds of one
``/api/fleet`` (a page of rows, the ten lowest series) against the whole fleet's JSON (every
row and series: what the page fetched every two seconds before).  A real browser's
rendering of the paged JSON is checked in tests/test_monitor.py (headless Chromium runs on
virtual time there, so it gives no time).

Run: ``python bench/monitor_page.py [--sizes 100,1000,5000]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter, deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aggregator.monitor import MAX_POINTS, FleetHistory, MonitorServer  # noqa: E402
from edge_client import messages as m  # noqa: E402
from edge_client.documents import DeviceSummary  # noqa: E402
from edge_client.states import DeviceState  # noqa: E402


def history(n: int) -> FleetHistory:
    h = FleetHistory("bench")
    for i in range(n):
        did = f"d{i:05d}"
        h.status.presence[(m.Participant.DEVICE, did)] = i % 50 != 0
        doc = DeviceSummary(device=did, station=f"st{i % 4}", state=DeviceState.READY, round=9,
                            iteration=45, local_accuracy=0.5 + (i % 97) / 200,
                            prequential_accuracy=0.7, counters={"uploads": 40},
                            transport={"bytes_out": 10**6, "bytes_in": 5 * 10**6})
        h.status.take(doc)
        h.take(doc)
        h.device_accuracy[did] = deque(((t * 1.0, 0.8, 0.7) for t in range(MAX_POINTS)),
                                       maxlen=MAX_POINTS)
    return h


def whole(h: FleetHistory) -> bytes:
    """Every row and every series: the page's JSON before it paged."""
    doc = h.snapshot(Counter(), page=None)
    doc["device_accuracy"] = {d: list(v) for d, v in sorted(h.device_accuracy.items())}
    return json.dumps(doc).encode()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="100,1000,5000")
    args = parser.parse_args()
    for n in (int(v) for v in args.sizes.split(",")):
        h = history(n)
        server = MonitorServer(h, port=0)
        try:
            began = time.perf_counter()
            _, _, body = server.answer("/api/fleet")
            served_ms = (time.perf_counter() - began) * 1e3
            began = time.perf_counter()
            before = whole(h)
            before_ms = (time.perf_counter() - began) * 1e3
        finally:
            server.close()
        print(json.dumps({"devices": n, "page_kb": round(len(body) / 1e3, 1),
                          "page_server_ms": round(served_ms, 1),
                          "whole_fleet_kb": round(len(before) / 1e3, 1),
                          "whole_fleet_server_ms": round(before_ms, 1),
                          "bytes_ratio": round(len(before) / len(body), 1)}),
              flush=True)


if __name__ == "__main__":
    main()
