"""Benchmark: fusion of many updates, and a station's memory while it collects them.

1. ``fedavg`` of N small-CNN updates (114,314 float32 parameters; N = 100, 300, 1,000),
   timed (median of ``--reps``) beside a single-pass float32 weighted sum written inline
   (``acc += w * z``), in the same process; its peak of traced memory above its inputs, as
   a fraction of the inputs; and its largest difference from a float64 weighted mean.
2. A real :class:`~aggregator.station.Station` with 1,000 devices in one super node takes
   1,000 updates, their frames queued as the MQTT transport receives them, each decoded and
   handled in turn and its frame then dropped.  The figure is the process's peak RSS above
   where it stood before the frames existed, against one model plus the frames (the
   issue's bound: within 1.2x), and what the station holds beyond its inputs, in models.

Both run at ``BASELINE`` (a temporary git worktree) and at this checkout, each in a fresh
process on one BLAS thread.  Printed, never asserted.  Run: ``python bench/fusion.py``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from baseline import ROOT, checkout, probe

BASELINE = "9ed31b9"  # main before fusion streamed (issue 14)
PARAMS = 114_314  # the small CNN

_FUSION = r'''
import json, statistics, sys, time, tracemalloc
import numpy as np
from aggregator.fusion import fedavg
params, reps = int(sys.argv[1]), int(sys.argv[2])
rng = np.random.default_rng(0)
out = {}
for n in (100, 300, 1000):
    models = [rng.standard_normal(params).astype(np.float32) * 0.1 for _ in range(n)]
    counts = rng.integers(1, 321, n)

    def inline():
        acc = np.zeros(params, np.float32)
        for z, w in zip(models, counts):
            acc += np.float32(w) * z
        return acc / np.float32(counts.sum())

    exact = np.zeros(params)
    for z, w in zip(models, counts):
        exact += w * z.astype(np.float64)
    exact /= counts.sum()
    times = {"fedavg": [], "inline": []}
    for _ in range(reps):
        for name, fn in (("fedavg", lambda: fedavg(models, counts)), ("inline", inline)):
            s = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - s)
    tracemalloc.start()
    fused = fedavg(models, counts)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    out[n] = {"fedavg_s": statistics.median(times["fedavg"]),
              "inline_s": statistics.median(times["inline"]),
              "peak_extra": peak / (n * params * 4),
              "error": float(np.abs(fused - exact).max())}
print(json.dumps(out))
'''

_STATION = r'''
import json, resource, sys
import numpy as np
from aggregator.config import StationConfig
from aggregator.station import Station
from edge_client import messages as m
from edge_client.codec import decode, encode
params, n = int(sys.argv[1]), int(sys.argv[2])

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

cfg = StationConfig(fleet="f", station_id="s", devices=tuple(f"d{k}" for k in range(n)),
                    super_node_size=n, rand_per_group=0, selector="random", sync_period=10,
                    iteration_timeout=1e9, update_norm_factor=0.0)
st = Station(cfg, num_params=params, num_classes=10, rng=np.random.default_rng(0))
for k in range(n):
    st.handle(m.DeviceStats(fleet="f", sender=f"d{k}", round=0, iteration=0, station="s",
                            seen_counts=np.full(10, 32), next_batch_counts=np.full(10, 3)), 0.0)
st.handle(m.GlobalModel(fleet="f", sender="cloud", round=0, iteration=0,
                        weights=np.zeros(params, np.float32), p_real=np.full(10, 0.1)), 0.0)
assert len(st.members) == n
weights = np.random.default_rng(0).standard_normal(params).astype(np.float32) * 0.01
before = rss()
# The transport's queue: every reply's frame, as paho hands it over; each is dropped once
# handled, as the transport drops it.
frames = [encode(m.DeviceUpdate(fleet="f", sender=f"d{k}", round=0, iteration=0, station="s",
                                weights=weights, num_samples=32)) for k in range(n)]
queued = rss()
for k in range(n):
    st.handle(decode(frames[k], max_size=1 << 30).message, 0.0)
    frames[k] = None
# The high-water mark, inside fusion too (nothing before the frames came near it).
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
assert st.iteration == 1, "the iteration did not close"
print(json.dumps({"peak": peak - before, "own": peak - queued, "queued": queued - before,
                  "model": params * 4}))
'''


def _measure(tree: Path, reps: int, replies: int) -> tuple[dict, dict]:
    fusion = json.loads(probe(tree, _FUSION, str(PARAMS), str(reps)))
    station = json.loads(probe(tree, _STATION, str(PARAMS), str(replies)))
    return fusion, station


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--replies", type=int, default=1000)
    args = ap.parse_args()
    with checkout(BASELINE) as tree:
        runs = {"baseline": _measure(tree, args.reps, args.replies)}
    runs["now"] = _measure(ROOT, args.reps, args.replies)
    print(f"fedavg of N small-CNN updates ({PARAMS:,} float32 parameters); 'inline' is a "
          "single-pass float32 weighted sum in the same process; baseline = " + BASELINE)
    print(f"{'':<9} {'N':>5} {'fedavg ms':>10} {'inline ms':>10} {'ratio':>6} "
          f"{'peak extra / inputs':>20} {'max |err| vs f64':>17}")
    for name, (fusion, _) in runs.items():
        for n, r in fusion.items():
            print(f"{name:<9} {n:>5} {1e3 * r['fedavg_s']:>10.1f} {1e3 * r['inline_s']:>10.1f} "
                  f"{r['fedavg_s'] / r['inline_s']:>6.2f} {r['peak_extra']:>20.3f} "
                  f"{r['error']:>17.1e}")
    print(f"\nstation collecting {args.replies} replies whose frames are queued")
    print(f"{'':<9} {'RSS peak MB':>12} {'one model + frames MB':>22} {'ratio':>6} "
          f"{'held beyond the frames, in models':>34}")
    for name, (_, s) in runs.items():
        budget = s["model"] + s["queued"]
        print(f"{name:<9} {s['peak'] / 2**20:>12.1f} {budget / 2**20:>22.1f} "
              f"{s['peak'] / budget:>6.2f} {s['own'] / s['model']:>34.1f}")


if __name__ == "__main__":
    main()
