"""The Ray engine on a Ray instance in this process: a federation is the same bit for bit as
on the local engine, an experiment's runs as Ray tasks write what local runs write, Ray is
never imported unless asked for, and what cannot be placed is a clear error.  Two raylets
and a node killed mid-run: ``tests/test_ray_cluster.py``."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from edge_client.errors import ConfigError, SaflError
from lab.engine import SimulationConfig
from lab.experiment import _dataset, _fleet, _strategy, load_experiment, run_experiment
from lab.simulation import run_federation

ray = pytest.importorskip("ray", reason="the ray extra is not installed")

SMALL = """
[experiment]
name = "ray-small"
dataset = "digits"
factories = 3
devices_per_factory = 4
super_node = 2
rand_per_group = 1
sync_period = 2
rounds = 4
eval_samples = 200
prequential_every = 4
seeds = 2
strategies = ["fedgs", "safl_fedgs", "fedavg"]
"""


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray node.  Ray waits a fixed 30 s for its raylet to register; make test runs
    this tier at nice 19 beside the camera tests, and once in a clean-clone run both of this
    module's starts ran past it ("The current node timed out during startup"): a second
    start is given where the first ran out of time."""
    for attempt in (1, 2):
        try:
            ray.init(address="local", num_cpus=2, include_dashboard=False,
                     logging_level="ERROR")
            break
        except Exception as exc:  # Ray raises a bare Exception for this
            ray.shutdown()
            if attempt == 2 or "timed out during startup" not in str(exc):
                raise
            print(f"ray.init: {exc}; starting the node again", file=sys.stderr)
    yield
    ray.shutdown()


def _same(a, b) -> bool:
    """Equal, where a NaN (a figure not measured) equals a NaN."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _without_wall(rows):
    return [{k: v for k, v in row.items() if k != "wall_s"} for row in rows]


@pytest.mark.slow
@pytest.mark.parametrize("transfer", ["frames", "objects"])
def test_a_federation_is_the_same_on_ray_as_here(tmp_path, local_ray, transfer, monkeypatch):
    import lab.ray_engine
    monkeypatch.setattr(lab.ray_engine, "TRANSFER", transfer)
    path = tmp_path / "small.toml"
    path.write_text(SMALL)
    cfg = load_experiment(path)
    data = _dataset(cfg.dataset)
    on_ray = SimulationConfig(engine="ray")
    for name, attack in (("fedgs", "scale"), ("safl_fedgs", "none"), ("fedavg", "nan")):
        here = run_federation(data, _strategy(cfg, name), _fleet(cfg, data, 1, attack))
        there = run_federation(data, _strategy(cfg, name), _fleet(cfg, data, 1, attack),
                               engine=on_ray)
        assert _same(_without_wall(here.rows), _without_wall(there.rows)), name
        assert here.counters == there.counters and here.p_real == there.p_real
        assert _same(here.devices, there.devices)
        assert here.counters["rejected.update_norm" if attack == "scale" else "steps"] > 0
        assert here.nodes == [] and len(there.nodes) == (1 if name == "fedavg" else 3)
        assert len(here.rows) == cfg.rounds + 1 and here.devices


@pytest.mark.slow
def test_a_clocked_federation_is_the_same_on_ray_as_here(tmp_path, local_ray):
    # Each factory's virtual clock runs in its actor; arrivals cross to the driver with the
    # outbox, so the cloud's deadlines fire at the same virtual times on either engine.
    import dataclasses
    path = tmp_path / "small.toml"
    path.write_text(SMALL)
    cfg = load_experiment(path)
    data = _dataset(cfg.dataset)
    clocked = SimulationConfig(profiles=("pi4-numpy=0.5", "jetson-orin-cuda=0.5"),
                               device_latency_ms=20, device_loss=0.02, cloud_latency_ms=50,
                               slow_devices=(0,), slow_factor=30)
    spec = dataclasses.replace(_fleet(cfg, data, 1, "none"), clock=clocked.clock(1))
    here = run_federation(data, _strategy(cfg, "fedgs"), spec)
    there = run_federation(data, _strategy(cfg, "fedgs"), spec,
                           engine=dataclasses.replace(clocked, engine="ray"))
    assert _same(_without_wall(here.rows), _without_wall(there.rows))
    assert here.counters == there.counters and here.rows[-1]["virtual_s"] > 0


@pytest.mark.slow
def test_an_experiment_as_ray_tasks_writes_what_a_local_one_writes(tmp_path, local_ray):
    path = tmp_path / "small.toml"
    path.write_text(SMALL)
    # One thread a run on both sides, as each Ray task has (tests/ray_cluster.py says why).
    _, local, _ = run_experiment(path, out=tmp_path / "local", jobs=2)
    _, remote, _ = run_experiment(path, out=tmp_path / "ray", ray="local")
    assert [(r.strategy, len(r.rows)) for r in local] == [(r.strategy, len(r.rows))
                                                          for r in remote]
    for a, b in zip(local, remote, strict=True):
        assert _same(_without_wall(a.rows), _without_wall(b.rows)) and a.counters == b.counters
    for run in sorted((tmp_path / "local" / "runs").glob("*.json")):
        here = json.loads(run.read_text())
        there = json.loads((tmp_path / "ray" / "runs" / run.name).read_text())
        assert here["key"] == there["key"]  # the same cache: either reuses the other's runs
        assert _same(_without_wall(here["rows"]), _without_wall(there["rows"]))
    for name in ("results.csv", "metrics.csv", "devices.csv", "report.html", "accuracy.png"):
        assert (tmp_path / "ray" / name).exists(), name


@pytest.mark.slow
def test_factories_the_cluster_cannot_place_are_a_clear_error(tmp_path, local_ray, digits):
    path = tmp_path / "small.toml"
    path.write_text(SMALL)
    cfg = load_experiment(path)
    # More CPUs than the cluster has; a fractional GPU on a cluster without one.
    for greedy, wants in (({"cpus_per_factory": 64}, "64 CPU and 0 GPU"),
                          ({"gpus_per_factory": 0.5}, "0.6666 CPU and 0.5 GPU")):
        sim = SimulationConfig(engine="ray", placement_timeout=2, **greedy)
        with pytest.raises(SaflError, match=f"placed 0 of 3 factories .*{wants}.*2 CPUs "
                           "and 0 GPUs"):
            run_federation(digits, _strategy(cfg, "fedgs"), _fleet(cfg, digits, 0, "none"),
                           engine=sim)


def test_the_simulation_table_is_checked(tmp_path):
    for bad, key in (('engine = "spark"', "engine"), ("cpus_per_factory = -1",
                                                     "cpus_per_factory"),
                     ("gpus_per_run = -0.5", "gpus_per_run"), ("threads = 4", "threads")):
        path = tmp_path / "bad.toml"
        path.write_text(SMALL + f"\n[simulation]\n{bad}\n")
        with pytest.raises(ConfigError, match=key):
            run_experiment(path, out=tmp_path / "out")


def test_a_ray_instance_per_job_is_refused(tmp_path):
    path = tmp_path / "small.toml"
    path.write_text(SMALL + '\n[simulation]\nengine = "ray"\n')
    with pytest.raises(ConfigError, match="address.*ray start --head"):
        run_experiment(path, out=tmp_path / "out", jobs=2)


def test_ray_is_not_imported_unless_asked_for(tmp_path):
    path = tmp_path / "small.toml"
    path.write_text(SMALL.replace("seeds = 2", "seeds = 1").replace("rounds = 4", "rounds = 1"))
    code = ("import sys; from lab.experiment import run_experiment; "
            f"run_experiment({str(path)!r}, out={str(tmp_path / 'out')!r}); "
            "print('ray' in sys.modules, 'lab.ray_engine' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).parent.parent)
    assert out.stdout.split()[-2:] == ["False", "False"]
