"""Benchmark: the path a model vector takes from a device's trainer to a station's hands.

Stages, for the MLP (101,770 float32 parameters, numpy trainer) and, where torch is
installed, the small CNN (torch trainer):

- upload: ``get_flat`` from the trainer, the ``DeviceUpdate``, the frame, its chunks;
- receipt: the station reassembles the chunks and decodes the frame into a message;
- model in: a device loads a received (read-only) station model into its trainer;
- gate: the upload gate's second evaluation, of the aggregate, on 128 held-out samples
  (before: swap the aggregate into the trainer and back; after: evaluate it as given).

Each stage is timed (median of ``--reps``) and its peak of traced memory is given in model
vectors (peak bytes / 4 n): how many full-length copies are alive at once.  The baseline is
``BASELINE`` (a temporary git worktree) measured in the same run, and every figure is also a
ratio to it.  Printed, never asserted.  Run: ``python bench/weight_path.py`` from a checkout.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from baseline import ROOT, checkout, probe

BASELINE = "b1e3f5b"  # main before the weight path lost its avoidable copies (issue 13)

_PROBE = r'''
import inspect, json, statistics, sys, time, tracemalloc
import numpy as np
from edge_client import messages as m
from edge_client.codec import decode, encode, split
from edge_client.reassembly import Reassembler
from edge_client.trainers import build_trainer

reps = int(sys.argv[1])
out = {}
models = [("mlp", "numpy", (28, 28))]
try:
    import torch
    torch.set_num_threads(1)
    models.append(("small_cnn", "torch", (1, 28, 28)))
except ImportError:
    pass
for model, backend, shape in models:
    t = build_trainer(model, backend=backend, input_shape=shape, num_classes=10, lr=0.1,
                      seed=0)
    n = t.num_params
    rng = np.random.default_rng(0)
    hx = rng.random((128, *shape), dtype=np.float32)
    hy = rng.integers(0, 10, 128)
    incoming = m.StationModel(fleet="f", sender="s", round=0, iteration=0,
                              weights=rng.standard_normal(n).astype(np.float32))
    given = "weights" in inspect.signature(t.evaluate).parameters

    def upload():
        msg = m.DeviceUpdate(fleet="f", sender="d", round=0, iteration=0, station="s",
                             weights=t.get_flat(), num_samples=32)
        return split(encode(msg, layout_hash="ab"), 256 * 1024)

    chunks = upload()

    def receipt():
        r = Reassembler(max_size=1 << 30, memory_cap=1 << 30, timeout=60.0)
        for c in chunks:
            frame = r.add("t", c, 0.0)
        return decode(frame, max_size=1 << 30).message

    def model_in():
        t.set_flat(incoming.weights)

    def gate():
        if given:
            return t.evaluate(hx, hy, weights=incoming.weights)
        z = t.get_flat()
        t.set_flat(incoming.weights)
        acc = t.evaluate(hx, hy)
        t.set_flat(z)
        return acc

    for name, fn in (("upload", upload), ("receipt", receipt), ("model in", model_in),
                     ("gate", gate)):
        for _ in range(5):
            fn()
        times = []
        for _ in range(reps):
            s = time.perf_counter()
            fn()
            times.append(time.perf_counter() - s)
        tracemalloc.start()
        fn()
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        out[f"{model} {name}"] = [statistics.median(times), peak / (4 * n)]
print(json.dumps(out))
'''


def _measure(tree: Path, reps: int) -> dict[str, list[float]]:
    return json.loads(probe(tree, _PROBE, str(reps)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    with checkout(BASELINE) as tree:
        old = _measure(tree, args.reps)
    new = _measure(ROOT, args.reps)
    print(f"{'stage':<22} {'baseline ms':>12} {'now ms':>9} {'ratio':>6}   "
          f"{'peak copies: baseline':>22} {'now':>5}")
    for key in old:
        (t0, p0), (t1, p1) = old[key], new[key]
        print(f"{key:<22} {1e3 * t0:>12.3f} {1e3 * t1:>9.3f} {t1 / t0:>6.2f}   "
              f"{p0:>22.1f} {p1:>5.1f}")


if __name__ == "__main__":
    main()
