"""Benchmark: what a frozen pretrained body costs a device, beside the model it replaces.

A camera device with a body embeds each arriving frame once (``edge_client/body.py``) and
trains a small head; without one it trains the small CNN on the frames themselves.  This
prints, from one run on this machine, for EfficientNet-Lite0 at 3x64x64 (exported to the
cache, as ``safl experiment`` does):

- the body's forward per frame on ONNX Runtime (one thread) one frame at a time, as a camera
  delivers them, and in batches of 64 (the lab's embedding), and on torch (one thread, CPU);
- the heads' SGD step (batch 32, numpy) beside the small CNN's on the frames (torch, one
  thread): the baseline;
- what a buffered sample costs (an embedding against a frame), and what an upload costs
  (the head's parameters against the small CNN's);
- what the closed-form head's extras cost on 1,280 features: scoring a frame for unknown
  parts (``edge_client/novelty.py``), the personal head's eigendecomposition (made off the
  prediction path: ``edge_client/personal_head.py``), and the bytes of a detector and of a
  histogram of scores.

    python bench/body.py
"""

from __future__ import annotations

import math
import time

import numpy as np


def _per_call(fn, n: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n


def main() -> None:
    import torch

    from edge_client.body import default_body_dir, open_exported
    from edge_client.novelty import BINS
    from edge_client.trainers import build_trainer
    from edge_client.trainers.bodies import build_body_module
    from safl.bodies import ensure_body

    torch.set_num_threads(1)
    shape = (3, 64, 64)
    ensure_body("efficientnet-lite0", shape)
    body = open_exported(default_body_dir("efficientnet-lite0", shape), threads=1)
    rng = np.random.default_rng(0)
    frames = rng.random((64, *shape), dtype=np.float32)
    one = _per_call(lambda: body.embed(frames[:1]), 50)
    batched = _per_call(lambda: body.embed(frames), 5) / 64
    module = build_body_module("efficientnet-lite0", shape)
    with torch.no_grad():
        eager = _per_call(lambda: module(torch.from_numpy(frames)), 3) / 64
    y = rng.integers(0, 10, 32)
    cnn = build_trainer("small_cnn", backend="torch", input_shape=shape, num_classes=10,
                        lr=0.1, device="cpu")
    cnn_step = _per_call(lambda: cnn.train_step(frames[:32], y), 10)
    heads = {name: build_trainer(name, backend="numpy", input_shape=(1280,), num_classes=10,
                                 lr=0.1, hidden=32) for name in ("linear", "mlp")}
    x = body.embed(frames[:32])
    print(f"EfficientNet-Lite0 body at {shape}, one thread; baseline: the small CNN's step on "
          f"the frames (torch, batch 32) = {cnn_step * 1e3:.2f} ms\n")
    print(f"{'what':<44} {'ms':>8} {'x baseline':>11}")
    rows = [("body, ONNX Runtime, a frame at a time", one),
            ("body, ONNX Runtime, per frame in batches of 64", batched),
            ("body, torch eager (CPU), per frame in 64", eager),
            ("linear head step (numpy, batch 32)",
             _per_call(lambda: heads["linear"].train_step(x, y), 200)),
            ("mlp head step (numpy, 32 hidden, batch 32)",
             _per_call(lambda: heads["mlp"].train_step(x, y), 200)),
            ("small CNN step on frames (torch, batch 32)", cnn_step)]
    detector, gram = _extras(body.embed(frames), rng)
    rows += [("unknown-part score, per frame in 32", _per_call(
                  lambda: detector.scores(x), 20) / 32),
             ("personal head's decomposition (1,281 x 1,281)", _per_call(
                  lambda: np.linalg.eigh(gram), 2))]
    for what, seconds in rows:
        print(f"{what:<44} {seconds * 1e3:>8.3f} {seconds / cnn_step:>11.3f}")
    print(f"\n{'bytes':<44} {'value':>10} {'x frame/CNN':>12}")
    sample, frame = body.bytes_per_sample, 4 * math.prod(shape)  # float32
    print(f"{'a buffered sample: embedding (float32)':<44} {sample:>10,} {sample / frame:>12.3f}")
    print(f"{'a buffered sample: frame (float32)':<44} {frame:>10,} {1.0:>12.3f}")
    for name, head in heads.items():
        print(f"{'an upload: ' + name + ' head':<44} {4 * head.num_params:>10,} "
              f"{head.num_params / cnn.num_params:>12.3f}")
    print(f"{'an upload: small CNN at 3x64x64':<44} {4 * cnn.num_params:>10,} {1.0:>12.3f}")
    packed = 4 * detector.packed().size
    print(f"{'a detector (to every device, as sums double)':<44} {packed:>10,} "
          f"{packed / (4 * cnn.num_params):>12.3f}")
    print(f"{'a histogram of scores (with statistics)':<44} {8 * BINS:>10,} "
          f"{8 * BINS / (4 * cnn.num_params):>12.3f}")


def _extras(embedded: np.ndarray, rng: np.random.Generator):
    """A detector and a Gram from 4,000 rows about the embeddings (their costs depend on the
    width alone)."""
    from edge_client.head_stats import HeadSums, augment
    from edge_client.novelty import solve_detector

    rows = embedded[rng.integers(0, len(embedded), 4000)]
    rows = rows + rng.normal(0, 0.1, rows.shape).astype(np.float32)
    s = HeadSums.zeros(rows.shape[1], 10)
    s.add_rows(augment(rows, np.zeros(rows.shape[1], np.float32), 1e6), rng.integers(0, 10, 4000))
    return solve_detector(s), s.gram


if __name__ == "__main__":
    main()
