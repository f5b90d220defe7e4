"""Shared fixtures: small real data and deterministic generators; the suite's order.

``make test`` runs the suite on several workers (pytest-xdist, ``--dist loadgroup``): the
soak first, then the rest of the slow tier, longest first where known, so that the soak
and the fleets start at once and the quick tests fill the gaps beside them instead of
waiting at the end.  The ``solo`` tests run in a second session at the same time, four at a
time, at a higher priority than the first (which runs under ``nice 19``)."""

from __future__ import annotations

import os

# One math thread a process, before numpy or torch is imported: the suite runs several
# workers and their fleets' processes on two cores, where OpenMP's and OpenBLAS's spinning
# pools cost 4x the CPU for the same result (a 6-federation CNN test: 45 s of CPU against
# 10.5).  Set them to run otherwise.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from edge_client.errors import ShapeError  # noqa: E402

# Tests whose verdict depends on wall-clock throughput: the live cameras, learning from
# labels as they come, get the cores when they want them (marked ``solo``: ``make test`` runs
# them in their own session, four at a time, since each uses a tenth of a core, beside the
# rest under nice 19; beside the rest at the same priority a camera line read its frames
# late, joined its labels to the wrong ones and stayed at chance); the soak and the doc it shares
# deploy.md's users and brokers with run one after the other on one worker (xdist_group).
SOLO = ("test_camera_line_doc", "test_camera_e2e")
LIVE = {"test_soak_tls": "live", "test_deploy_doc": "live"}
# The slow tests that take longest (measured with --durations): first of the rest.
LONGEST = ("test_fleet_load", "test_numpy_cnn", "test_cli", "test_ray", "test_ray_cluster",
           "test_operations", "test_mqtt", "test_monitor", "test_faults")


def _module(item) -> str:
    return item.module.__name__.rsplit(".", 1)[-1] if item.module else ""


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if _module(item) in LIVE:
            item.add_marker(pytest.mark.xdist_group(LIVE[_module(item)]))
        if _module(item) in SOLO:
            item.add_marker(pytest.mark.solo)

    def rank(item) -> tuple[int, int, int]:
        module = _module(item)
        known = LONGEST.index(module) if module in LONGEST else len(LONGEST)
        return (module not in LIVE, not item.get_closest_marker("slow"), known)
    items.sort(key=rank)  # stable: a module's tests keep their order


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


@pytest.fixture(scope="session")
def digits():
    """scikit-learn's bundled 8x8 digits (real data, no download)."""
    from lab.datasets import load_dataset

    return load_dataset("digits")


@pytest.fixture(scope="session")
def exported(tmp_path_factory):
    """Export zoo models once per session: ``exported(name, **kw) -> folder``."""
    pytest.importorskip("torch")
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    from models.export import export_model

    cache = {}

    def get(name, **kw):
        key = (name, tuple(sorted(kw.items())))
        if key not in cache:
            folder = tmp_path_factory.mktemp(f"art_{name}")
            export_model(name, folder, force=True, **kw)
            cache[key] = folder
        return cache[key]

    return get


@pytest.fixture
def evaluates_as_if_loaded():
    """Checks that a trainer evaluates a given vector as if it were loaded, and keeps its own
    parameters (the upload gate's evaluation of the aggregate)."""
    return _evaluates_as_if_loaded


def _evaluates_as_if_loaded(tr, x, y):
    own = tr.get_flat()
    other = np.random.default_rng(7).normal(0, 0.1, own.size).astype(np.float32)
    other.flags.writeable = False  # as a received message's weights are
    given = tr.evaluate(x, y, weights=other)
    assert np.array_equal(tr.get_flat(), own)  # nothing was swapped in
    tr.set_flat(other)
    loaded = tr.evaluate(x, y)
    assert given[1] == loaded[1] and given[0] == pytest.approx(loaded[0], rel=1e-5)
    assert given != tr.evaluate(x, y, weights=own)
    with pytest.raises(ShapeError):
        tr.evaluate(x, y, weights=own[:-1])
