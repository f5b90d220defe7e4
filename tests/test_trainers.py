"""Trainers on flat vectors: numpy gradients, the shared layout with torch, FedProx."""

from __future__ import annotations

import numpy as np
import pytest

from edge_client.errors import ConfigError, ShapeError
from edge_client.trainers import build_trainer, proximal_step


def _mlp(backend="numpy", seed=0, lr=0.1):
    return build_trainer("mlp", backend=backend, input_shape=(8, 8), num_classes=10, lr=lr,
                         seed=seed)


def test_numpy_mlp_gradient_matches_finite_differences(rng):
    tr = build_trainer("mlp", input_shape=(5,), num_classes=3, lr=1.0, seed=3)
    x, y = rng.normal(size=(7, 5)).astype(np.float32), rng.integers(0, 3, 7)
    w0 = tr.get_flat().astype(np.float64)
    tr.train_step(x, y)
    grad = w0 - tr.get_flat()  # lr = 1
    for i in rng.choice(w0.size, 12, replace=False):
        h = 1e-3
        losses = []
        for s in (h, -h):
            w = w0.copy()
            w[i] += s
            tr.set_flat(w.astype(np.float32))
            losses.append(tr.evaluate(x, y)[0])
        assert grad[i] == pytest.approx((losses[0] - losses[1]) / (2 * h), abs=2e-3)


def test_training_lowers_the_loss_on_real_digits(digits):
    tr = _mlp()
    before = tr.evaluate(digits.x_test, digits.y_test)
    for i in range(0, 1200, 32):
        tr.train_step(digits.x_train[i:i + 32], digits.y_train[i:i + 32])
    after = tr.evaluate(digits.x_test, digits.y_test)
    assert after[0] < before[0] and after[1] > 0.8


def test_numpy_and_torch_share_the_flat_layout(digits):
    pytest.importorskip("torch")
    a, b = _mlp("numpy", seed=1), _mlp("torch", seed=2)
    assert a.layout == b.layout
    b.set_flat(a.get_flat())
    x = digits.x_test[:64]
    assert np.abs(a.logits(x) - b.logits(x)).max() <= 1e-4
    a.train_step(digits.x_train[:32], digits.y_train[:32])
    b.train_step(digits.x_train[:32], digits.y_train[:32])
    assert np.abs(a.get_flat() - b.get_flat()).max() <= 1e-5


def test_torch_cnn_trains_through_flat_vectors(digits):
    pytest.importorskip("torch")
    tr = build_trainer("small_cnn", backend="torch", input_shape=(8, 8), num_classes=10, lr=0.1)
    flat = tr.get_flat()
    assert flat.dtype == np.float32 and flat.size == tr.num_params
    loss0 = tr.train_step(digits.x_train[:32], digits.y_train[:32])
    assert not np.array_equal(flat, tr.get_flat()) and np.isfinite(loss0)
    tr.set_flat(flat)
    assert np.array_equal(tr.get_flat(), flat)


@pytest.mark.parametrize("model, backend", [("mlp", "numpy"), ("softmax", "numpy"),
                                            ("mlp", "torch"), ("small_cnn", "torch")])
def test_trainers_evaluate_a_given_vector_without_swapping(digits, model, backend,
                                                           evaluates_as_if_loaded):
    if backend == "torch":
        pytest.importorskip("torch")
    tr = build_trainer(model, backend=backend, input_shape=(8, 8), num_classes=10, lr=0.1)
    evaluates_as_if_loaded(tr, digits.x_test[:200], digits.y_test[:200])


def test_a_numpy_cnn_evaluates_and_predicts_in_bounded_memory():
    """The upload gate and the device-local accuracy score 256 held-out samples, and a
    replaying device predicts up to 256 drained ones.  In one pass small_cnn's im2col
    columns for them took 100 MB (a 90 MB device peaked at 234 MB; the emulated Pi's demo
    device reached its 200 MB bound); chunked, a pass holds at most EVAL_WORKSPACE of them,
    and the figures are the same."""
    import tracemalloc

    from edge_client.inference import predict
    from edge_client.trainers.numpy_cnn import EVAL_WORKSPACE

    trainer = build_trainer("small_cnn", backend="numpy", input_shape=(1, 28, 28),
                            num_classes=10, lr=0.1, seed=0)
    rng = np.random.default_rng(0)
    x, y = rng.random((256, 1, 28, 28), dtype=np.float32), rng.integers(0, 10, 256)
    whole = np.concatenate([trainer.logits(x[i:i + 1]) for i in range(256)])
    peaks = []
    for call in (lambda: trainer.evaluate(x, y), lambda: predict(trainer, x, trainer.get_flat())):
        tracemalloc.start()
        try:
            out = call()
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
        if len(peaks) == 1:
            loss, acc = out
        else:
            assert np.array_equal(out[0], whole.argmax(1))
    # columns, a layer's output and the logits
    assert max(peaks) < 2 * EVAL_WORKSPACE, peaks
    assert acc == float((whole.argmax(1) == y).mean())
    shifted = whole - whole.max(axis=1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    assert loss == pytest.approx(-logp[np.arange(256), y].mean(), rel=1e-5)


def test_set_flat_refuses_wrong_length_and_nan():
    tr = _mlp()
    before = tr.get_flat()
    with pytest.raises(ShapeError):
        tr.set_flat(np.zeros(before.size + 1, np.float32))
    bad = before.copy()
    bad[3] = np.nan
    with pytest.raises(ShapeError):
        tr.set_flat(bad)
    assert np.array_equal(tr.get_flat(), before)
    with pytest.raises(ShapeError):
        tr.train_step(np.zeros((2, 7), np.float32), np.array([0, 1]))


def test_unknown_model_or_backend_names_the_key():
    with pytest.raises(ConfigError, match="model"):
        build_trainer("resnet", input_shape=(4,), num_classes=2, lr=0.1)
    with pytest.raises(ConfigError, match="backend"):
        build_trainer("mlp", backend="jax", input_shape=(4,), num_classes=2, lr=0.1)


def test_proximal_step_pulls_towards_the_anchor():
    before, after, anchor = np.array([2.0]), np.array([1.5]), np.array([0.0])
    assert proximal_step(before, after, anchor, lr=0.1, mu=1.0)[0] == pytest.approx(1.3)
    assert proximal_step(before, after, anchor, lr=0.1, mu=0.0)[0] == pytest.approx(1.5)


def _torch():
    return pytest.importorskip("torch")


def test_device_names_are_checked_before_training():
    torch = _torch()
    from edge_client.config import ModelConfig
    with pytest.raises(ConfigError, match="'device'"):
        ModelConfig(backend="torch", device="gpu")
    with pytest.raises(ConfigError, match="'device'.*needs backend"):
        ModelConfig(backend="numpy", device="cuda")
    auto = build_trainer("mlp", backend="torch", input_shape=(8, 8), num_classes=10, lr=0.1)
    assert auto.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA device"):
            build_trainer("mlp", backend="torch", input_shape=(8, 8), num_classes=10, lr=0.1,
                          device="cuda")


# Measured on an H200 (torch 2.11, cuDNN's default TF32 convolutions) after 5 SGD steps: the
# MLP's weights agree to 1.5e-8, the small CNN's to 3.2e-4 (2.3e-6 with TF32 off), losses and
# accuracy to 5e-5.  The tolerances leave about 3x room.
CUDA_WEIGHTS_TOLERANCE = 1e-3
CUDA_METRICS_TOLERANCE = 2e-4


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.skipif(not _has_cuda(),
                    reason="needs torch with a CUDA device (runs on the GPU machine, not in CI)")
@pytest.mark.parametrize("model, shape", [("mlp", (28, 28)), ("small_cnn", (1, 28, 28))])
def test_cuda_training_matches_cpu(model, shape):
    rng = np.random.default_rng(0)
    x = rng.random((32, *shape), dtype=np.float32)
    y = rng.integers(0, 10, 32)
    cpu, gpu = (build_trainer(model, backend="torch", input_shape=shape, num_classes=10,
                              lr=0.05, seed=3, device=d) for d in ("cpu", "cuda"))
    assert gpu.device.type == "cuda"
    np.testing.assert_array_equal(cpu.get_flat(), gpu.get_flat())  # same initial weights
    for _ in range(5):
        loss_cpu, loss_gpu = cpu.train_step(x, y), gpu.train_step(x, y)
        assert abs(loss_cpu - loss_gpu) < CUDA_METRICS_TOLERANCE
    np.testing.assert_allclose(gpu.get_flat(), cpu.get_flat(), atol=CUDA_WEIGHTS_TOLERANCE)
    np.testing.assert_allclose(gpu.evaluate(x, y), cpu.evaluate(x, y),
                               atol=CUDA_METRICS_TOLERANCE)
    w = cpu.get_flat()
    gpu.set_flat(w)  # flat float32 vectors cross between devices unchanged
    np.testing.assert_array_equal(gpu.get_flat(), w)


def _members(shape, rng, sizes=([32], [32, 32], [20], [], [32, 7])):
    """Members of a super node: each its own start, batches of differing sizes and counts."""
    return [[(rng.random((b, *shape), dtype=np.float32), rng.integers(0, 10, b)) for b in bs]
            for bs in sizes]


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.skipif(
        not _has_cuda(), reason="needs torch with a CUDA device (runs on the GPU machine, "
        "not in CI)"))])
@pytest.mark.parametrize("model, shape", [("mlp", (28, 28)), ("small_cnn", (1, 28, 28))])
def test_members_step_in_one_batched_call_as_one_by_one(model, shape, device):
    pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    trainer = build_trainer(model, backend="torch", input_shape=shape, num_classes=10,
                            lr=0.05, seed=3, device=device)
    base = trainer.get_flat()
    # SAFL's annealed merges give each member a different start.
    starts = [base + rng.normal(0, 0.01, base.size).astype(np.float32) for _ in range(5)]
    batches, lrs = _members(shape, rng), [0.05, 0.05, 0.02, 0.05, 0.1]
    batched = trainer.train_members(starts, batches, lrs)
    np.testing.assert_array_equal(trainer.get_flat(), base)  # its own weights untouched
    for start, steps, lr, got in zip(starts, batches, lrs, batched, strict=True):
        trainer.set_flat(start)
        trainer.lr = lr
        for x, y in steps:
            trainer.train_step(x, y)
        moved = float(np.abs(trainer.get_flat() - start).max())
        assert moved > 1e-3 or not steps
        np.testing.assert_allclose(got, trainer.get_flat(), atol=1e-6 if device == "cpu"
                                   else CUDA_WEIGHTS_TOLERANCE)
