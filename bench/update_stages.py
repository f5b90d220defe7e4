"""Benchmark: what each update stage costs a device and a station, beside the SGD step.

For the small CNN (114,058 parameters) and the FEMNIST CNN (6.6M), times each pipeline of
``edge_client/pipeline.py`` encoding a realistic step (the difference of two training states'
weights, normal with the step's scale) on the device, error feedback included, and decoding
it at the station, with the bytes it puts on the wire against float32's.  The baseline,
measured in the same run, is one batch-32 torch SGD step of the same model on this CPU: a
stage that costs a small fraction of a step costs the device nothing it would notice.
Printed, never asserted.

Run: ``python bench/update_stages.py [--repeats 20]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from edge_client import messages as m
from edge_client.pipeline import UpdatePipeline

PIPELINES = ((), ("float16",), ("int8:256",), ("topk:0.1", "int8:256"),
             ("topk:0.01", "int8:256"), ("clip:1", "topk:0.1", "float16"))


def _timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _sgd_step(model: str, repeats: int) -> tuple[float, int]:
    import torch

    from edge_client.trainers import build_trainer
    torch.set_num_threads(1)
    trainer = build_trainer(model, backend="torch", input_shape=(1, 28, 28), num_classes=10,
                            lr=0.05)
    rng = np.random.default_rng(0)
    x = rng.random((32, 784), dtype=np.float32)
    y = rng.integers(0, 10, 32)
    trainer.train_step(x, y)
    return _timed(lambda: trainer.train_step(x, y), repeats), trainer.num_params


def _payload(pipe: UpdatePipeline, step: np.ndarray, rng: np.random.Generator) -> int:
    if not pipe.active:
        return step.nbytes
    enc, _ = pipe.encode(step, None, rng)
    msg = m.DeviceUpdate(fleet="f", sender="d", round=0, iteration=0, station="s",
                         num_samples=1, encoding=pipe.id, weights=enc.values,
                         indices=enc.indices, half=enc.half, codes=enc.codes, scales=enc.scales)
    return m.payload_nbytes(msg)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    print("one thread; medians of", args.repeats, "repeats")
    print(f"{'model':12s} {'stages':28s} {'encode ms':>10s} {'decode ms':>10s} "
          f"{'x SGD step':>10s} {'bytes':>10s} {'x float32':>9s}")
    for model in ("small_cnn", "femnist_cnn"):
        step_s, n = _sgd_step(model, args.repeats)
        step = rng.normal(0, 1e-3, n).astype(np.float32)
        print(f"{model:12s} {'(batch-32 SGD step)':28s} {step_s * 1e3:10.2f}")
        for stages in PIPELINES:
            pipe = UpdatePipeline(stages)
            residual = np.zeros(n, np.float32) if pipe.lossy else None
            enc_s = _timed(lambda: pipe.encode(step, residual, rng), args.repeats)  # noqa: B023
            if pipe.active:
                enc, _ = pipe.encode(step, residual, rng)
                dec_s = _timed(lambda: pipe.decode(enc, n), args.repeats)  # noqa: B023
            else:
                enc_s = dec_s = 0.0
            size = _payload(pipe, step, rng)
            print(f"{'':12s} {pipe.id:28s} {enc_s * 1e3:10.2f} {dec_s * 1e3:10.2f} "
                  f"{(enc_s + dec_s) / step_s:10.2f} {size:10d} {size / (4 * n):9.3f}")


if __name__ == "__main__":
    main()
