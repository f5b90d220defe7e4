"""Benchmark: what a device's closed-form head statistics cost on the wire and at its
station, as the Gram's triangle (the baseline, every send before the factor) and as the
factor a send of few rows goes as (``edge_client/head_sums.py``).

On EfficientNet-Lite0's 1,280 features and 10 classes, for a send of ``k`` labelled frames
(19: a camera labelling 2 frames a second, sending every 10 station models of 0.94 s,
docs/scale.md), printed from one run on this machine:

- the encoded ``HeadStats`` bytes, each form, and their ratio;
- the device's CPU to make the send from its rows (their QR; or their Gram, packed);
- the station's CPU to decode, check and admit it (``HeadLedger.admit``), and, as the
  baseline, the way it was admitted before ``aggregator/kept_sums.py``: made whole in float64
  and added to the station's total and to what it owed upstream;
- the bytes a second into the factory broker at 1,000 such cameras.

    OMP_NUM_THREADS=1 python bench/head_stats.py   (a station's thread; CPU time)
"""

from __future__ import annotations

import time
from collections import Counter

import numpy as np

from aggregator.heads import HeadLedger
from aggregator.kept_sums import BATCH_ROWS
from edge_client import messages as m
from edge_client.codec import decode, encode
from edge_client.head_stats import HeadSpec, HeadStatsPath, augment

D, C = 1280, 10
CAMERAS, RATE = 1000, 2.0  # labelled frames a second each
SEND_S = 10 * 0.94  # head_stats_every station models of scale.md's iteration


def _send(spec: HeadSpec, rows: np.ndarray, y: np.ndarray, whole: bool):
    """A device's send of ``rows``: as it goes now, or (``whole``) as the Gram's triangle, as
    every send went before the factor (a station's sends still do)."""
    started = time.process_time()
    if whole:
        s = spec.zeros(np.float32)
        s.add_rows(augment(rows, spec.centre, spec.clip), y)
        gram, cross, counts = s.packed()
        msg = m.HeadStats(fleet="f", sender="d0", round=0, iteration=0, station="s",
                          gram=gram, cross=cross, counts=counts)
    else:
        path = HeadStatsPath(spec, 1, fleet="f", device="d0", station="s")
        path.take(rows, y)
        msg = path.first(True)[0]
    return msg, time.process_time() - started


def _admit(spec: HeadSpec, frame: bytes, repeats: int) -> float:
    """The station's CPU a message, decoded and admitted into a ledger already holding
    sums (its pages touched, as a running station's are)."""
    ledger = HeadLedger(spec, Counter(), "f", upstream=True)
    seen = np.full(C, 10**9, np.int64)
    for _ in range(BATCH_ROWS):  # a factor's batch filled and multiplied in
        ledger.admit(decode(frame, max_size=len(frame)).message, seen)
    started = time.process_time()
    for _ in range(repeats):
        ledger.admit(decode(frame, max_size=len(frame)).message, seen)
    return (time.process_time() - started) / repeats


def _admit_whole(spec: HeadSpec, frame: bytes, repeats: int) -> float:
    """The baseline: each message made whole in float64 and added to both sums."""
    total, pending = spec.zeros(), spec.zeros()
    started = None
    for i in range(repeats + 1):
        if i == 1:
            started = time.process_time()
        sums = spec.unpack(decode(frame, max_size=len(frame)).message)
        total.add(sums)
        pending.add(sums)
    assert started is not None
    return (time.process_time() - started) / repeats


def main() -> None:
    rng = np.random.default_rng(0)
    spec = HeadSpec("lda", D, C, np.zeros(D, np.float32), 101.9)
    print(f"{'frames a send':>14} {'form':>9} {'bytes':>11} {'of the triangle':>16} "
          f"{'device ms':>10} {'station ms':>11} {'whole, before':>14} "
          f"{'MB/s at 1,000 cameras':>22}")
    for k in (5, 19, 64, 65, 640):
        rows = rng.normal(0, 3.0, (k, D)).astype(np.float32)
        y = rng.integers(0, C, k)
        sizes = {}
        for whole in (True, False):
            msg, made = _send(spec, rows, y, whole)
            form = "factor" if msg.factor.size else "triangle"
            if not whole and form == "triangle":
                continue  # past half the Gram's side: the triangle, as above
            frame = encode(msg)
            sizes[whole] = len(frame)
            admit, before = _admit(spec, frame, 30), _admit_whole(spec, frame, 30)
            rate = CAMERAS * len(frame) / max(SEND_S, k / RATE) / 1e6
            print(f"{k:>14} {form:>9} {len(frame):>11,} {len(frame) / sizes[True]:>16.3f} "
                  f"{made * 1e3:>10.1f} {admit * 1e3:>11.2f} {before * 1e3:>14.2f} "
                  f"{rate:>22.1f}")


if __name__ == "__main__":
    main()
