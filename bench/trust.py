"""Benchmark: what the replay test adds to each update a station accepts.

For a numpy MLP's 101,770 parameters and for 1,000,000, the time of
:meth:`~aggregator.trust.ReplayGuard.check` on an update (its count sketch, the distances to
the device's 4 recent sketches; ``w^m``'s sketch is taken once per iteration and shared by
the super node) beside :meth:`~aggregator.trust.NormGuard.check` (the distance guard every
update already pays), in the same process on one BLAS thread, best of 7 rounds of 50.
Printed as a ratio, never asserted.  Run: ``python bench/trust.py``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aggregator.selection import blas_threads  # noqa: E402
from aggregator.trust import NormGuard, ReplayGuard  # noqa: E402


def _best(f, reps: int = 50, rounds: int = 7) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for k in range(reps):
            f(k)
        times.append((time.perf_counter() - start) / reps)
    return min(times)


def _measure(n: int) -> tuple[float, float]:
    rng = np.random.default_rng(0)
    w = rng.standard_normal(n).astype(np.float32)
    updates = [w - np.float32(0.01) * rng.standard_normal(n).astype(np.float32)
               for _ in range(8)]
    replay = ReplayGuard(n, seed=0)
    guard = NormGuard(bound=0.0, factor=0.0, initial=0.0)
    # From the second pass on each device repeats itself: refused, at the same cost.
    t_replay = _best(lambda k: replay.check(f"d{k % 8}", updates[k % 8], w))
    return t_replay, _best(lambda k: guard.check(updates[k % 8], w))


def main() -> None:
    print("params     replay check  distance guard  ratio")
    for n in (101_770, 1_000_000):
        t_replay, t_guard = _measure(n)
        print(f"{n:<10,} {t_replay * 1e3:9.3f} ms  {t_guard * 1e3:11.3f} ms  "
              f"{t_replay / t_guard:5.2f}x")


if __name__ == "__main__":
    with blas_threads(1):
        main()
