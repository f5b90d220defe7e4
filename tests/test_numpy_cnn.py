"""The numpy backend's CNNs against torch's: layout, forward, gradients, a mixed fleet."""

from __future__ import annotations

import numpy as np
import pytest

from edge_client.trainers import build_trainer, layout_hash

torch = pytest.importorskip("torch")

CASES = [("small_cnn", (1, 28, 28)), ("camera_cnn", (3, 32, 32)), ("femnist_cnn", (1, 12, 12)),
         ("small_cnn", (1, 9, 11))]  # odd sizes: pooling floors as torch's does


def _pair(model, shape, seed=0):
    npy = build_trainer(model, backend="numpy", input_shape=shape, num_classes=10, lr=0.1,
                        seed=seed)
    tor = build_trainer(model, backend="torch", input_shape=shape, num_classes=10, lr=0.1,
                        seed=seed, device="cpu")
    npy.set_flat(tor.get_flat())
    return npy, tor


def _blank(x):
    """``x`` with the blank backgrounds of real images: two samples all zero, the rest zero
    outside their centre.  There every pooling window ties and many maxima are not
    positive: the pool taken before the ReLU must pass those windows no gradient."""
    x = x.copy()
    x[:2] = 0.0
    h, w = x.shape[-2:]
    x[2:, ..., : h // 3, :] = 0.0
    x[2:, ..., :, : w // 3] = 0.0
    return x


@pytest.mark.parametrize("blank", [False, True], ids=["noise", "blank-backgrounds"])
@pytest.mark.parametrize("model, shape", CASES)
def test_numpy_cnn_matches_torch_output_and_gradient_of_every_layer(model, shape, blank):
    npy, tor = _pair(model, shape)
    assert layout_hash(npy.layout) == layout_hash(tor.layout)  # one fleet, whatever backend
    rng = np.random.default_rng(1)
    x = rng.normal(size=(6, *shape)).astype(np.float32)
    x = _blank(x) if blank else x
    y = rng.integers(0, 10, 6)
    np.testing.assert_allclose(npy.logits(x), tor.logits(x), atol=1e-5, rtol=1e-5)
    loss, grads = npy.gradients(x, y)
    module = tor.module
    module.zero_grad()
    out = torch.nn.functional.cross_entropy(module(torch.from_numpy(x)), torch.from_numpy(y))
    out.backward()
    assert loss == pytest.approx(float(out.detach()), rel=1e-5)
    for (name, p), g in zip(module.named_parameters(), grads, strict=True):
        np.testing.assert_allclose(g, p.grad.numpy(), atol=1e-5, rtol=1e-4, err_msg=name)


def test_numpy_cnn_trains_and_evaluates_a_given_vector(digits, evaluates_as_if_loaded):
    tr = build_trainer("small_cnn", backend="numpy", input_shape=(1, 8, 8), num_classes=10,
                       lr=0.1, seed=0)
    x, y = digits.x_train[:256].reshape(-1, 1, 8, 8), digits.y_train[:256]
    first = tr.train_step(x[:32], y[:32])
    for i in range(1, 8):
        tr.train_step(x[32 * i:32 * (i + 1)], y[32 * i:32 * (i + 1)])
    assert tr.evaluate(x, y)[0] < first
    evaluates_as_if_loaded(tr, digits.x_test[:200].reshape(-1, 1, 8, 8), digits.y_test[:200])


@pytest.mark.slow
def test_a_mixed_numpy_torch_cnn_fleet_learns_as_a_torch_only_one(digits):
    from lab.datasets import assign_groups, dirichlet_label_skew
    from lab.simulation import FleetSpec, Strategy, run_federation

    strategy = Strategy("fedgs", device={"mix": 1.0},
                        station={"super_node_size": 2, "rand_per_group": 1, "sync_period": 3})
    finals = {}
    # The first backend draws the initial weights: both fleets start from torch's.
    for backends in (("torch",), ("torch", "numpy")):
        for seed in range(3):
            rng = np.random.default_rng(seed)
            spec = FleetSpec(partitions=tuple(dirichlet_label_skew(digits.y_train, 6, 1.0, rng)),
                             groups=tuple(assign_groups(6, 2, rng)), rounds=40, lr=0.4,
                             model="small_cnn", backends=backends, seed=seed,
                             arrivals_per_step=32, initial_samples=64)
            rows = run_federation(digits, strategy, spec).rows
            finals.setdefault(backends, []).append(np.mean([r["accuracy"] for r in rows[-3:]]))
    torch_only, mixed = (np.array(finals[b]) for b in (("torch",), ("torch", "numpy")))
    spread = max(torch_only.std(ddof=1), mixed.std(ddof=1))
    print(f"\ntorch-only {torch_only.round(4)}, mixed {mixed.round(4)}, spread {spread:.4f}")
    assert torch_only.mean() > 0.8 and mixed.mean() > 0.8
    assert abs(mixed.mean() - torch_only.mean()) <= max(spread, 0.01)


@pytest.mark.parametrize("model, shape", [("small_cnn", (1, 28, 28)), ("camera_cnn", (3, 32, 32))])
def test_a_numpy_cnn_exports_to_onnx_that_predicts_as_it_does(model, shape, tmp_path):
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    from edge_client.trainers.onnx_export import export_onnx

    tr = build_trainer(model, backend="numpy", input_shape=shape, num_classes=10, lr=0.1,
                       seed=2)
    x = np.random.default_rng(3).random((5, *shape), dtype=np.float32)
    out = export_onnx(tr, tr.get_flat(), tmp_path / "m.onnx", input_shape=shape,
                      num_classes=10, model_round=1, model_name=model)
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    got = session.run(None, {"input": x})[0]
    np.testing.assert_allclose(got, tr.logits(x), atol=1e-5, rtol=1e-4)
