"""A two-node Ray cluster on loopback, for ``tests/test_ray_cluster.py``; run inside a private
network namespace (``unshare -n``): ``python tests/ray_cluster.py WORKDIR``.

One CPU a node, so a run's two factories need both nodes.  It runs a federation on the Ray
engine (compared with the local engine, and where each factory ran), an experiment through
``safl experiment --ray`` (compared with a local one), and a federation whose worker node is
killed mid-run.  It prints one JSON line of what it saw, and stops both nodes whatever
happens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

os.environ["RAY_AUTH_MODE"] = "disabled"  # before Ray is imported (LoopbackCluster says why)

from edge_client.errors import SaflError  # noqa: E402
from lab.experiment import _dataset, _fleet, _strategy, load_experiment, load_simulation  # noqa: E402
from lab.ray_engine import LoopbackCluster  # noqa: E402
from lab.simulation import RunResult, run_federation  # noqa: E402

EXPERIMENT = """
[experiment]
name = "cluster"
dataset = "digits"
factories = 2
devices_per_factory = 4
super_node = 2
rand_per_group = 1
sync_period = 2
rounds = {rounds}
eval_samples = 200
seeds = 2
strategies = ["fedgs", "safl_fedgs"]

[simulation]
engine = "{engine}"
cpus_per_factory = 1
"""


def _federation(cluster: LoopbackCluster, rounds: int, engine: str) -> RunResult:
    path = cluster.work / f"fleet-{rounds}-{engine}.toml"
    path.write_text(EXPERIMENT.format(rounds=rounds, engine=engine))
    cfg, data = load_experiment(path), _dataset("digits")
    return run_federation(data, _strategy(cfg, "safl_fedgs"), _fleet(cfg, data, 3, "none"),
                          engine=load_simulation(path, cluster.address))


def _rows(result: RunResult) -> str:
    """A run's rows as text, where a NaN (a figure not measured) equals a NaN."""
    return json.dumps([{k: v for k, v in r.items() if k != "wall_s"} for r in result.rows])


def _runs(folder: Path) -> str:
    return json.dumps({p.name: [{k: v for k, v in r.items() if k != "wall_s"}
                                for r in json.loads(p.read_text())["rows"]]
                       for p in (folder / "runs").glob("*.json")}, sort_keys=True)


def _experiment(cluster: LoopbackCluster) -> dict:
    config = cluster.work / "experiment.toml"
    config.write_text(EXPERIMENT.format(rounds=3, engine="local"))
    base = [sys.executable, "-m", "safl", "experiment", str(config), "--out"]
    t0 = time.monotonic()
    cli = subprocess.run([*base, str(cluster.work / "exp"), "--ray", cluster.address],
                         capture_output=True, text=True, timeout=600)
    wall = round(time.monotonic() - t0, 1)
    # Locally in two processes: one thread a run, as each Ray task has (a BLAS on two
    # threads sums in another order, and the last bits of a float may differ).
    local = subprocess.run([*base, str(cluster.work / "exp-local"), "--jobs", "2"],
                           capture_output=True, text=True, timeout=600)
    same = local.returncode == 0 and _runs(cluster.work / "exp") == _runs(
        cluster.work / "exp-local")
    return {"rc": cli.returncode, "same_as_local": same, "wall_s": wall,
            "runs": sorted(p.name for p in (cluster.work / "exp" / "runs").glob("*.json")),
            "stderr_tail": cli.stderr[-600:]}


def _killed_mid_run(cluster: LoopbackCluster) -> dict:
    """A long federation with a factory on each node; the worker node dies 6 s in."""
    killed: list[float] = []

    def kill_soon() -> None:
        time.sleep(6.0)
        cluster.kill(1)
        killed.append(time.monotonic())

    threading.Thread(target=kill_soon, daemon=True).start()
    try:
        _federation(cluster, 100000, "ray")
        return {"error": None}
    except SaflError as exc:
        return {"error": str(exc),
                "after_kill_s": round(time.monotonic() - killed[0], 1) if killed else None}


def main(cluster: LoopbackCluster) -> dict:
    started = time.monotonic()
    cluster.wait()
    import ray
    nodes = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    seen: dict = {"cluster": {"nodes": len(nodes), "addresses": sorted(set(nodes.values())),
                              "ready_s": round(time.monotonic() - started, 1)}}
    here, there = _federation(cluster, 3, "local"), _federation(cluster, 3, "ray")
    seen["federation"] = {
        "placement": there.nodes, "cluster_nodes": sorted(nodes),
        "worker_node": cluster.node_id(1), "same_rows": _rows(here) == _rows(there),
        "same_counters": here.counters == there.counters, "accuracy": there.final_accuracy}
    seen["experiment"] = _experiment(cluster)
    seen["killed"] = _killed_mid_run(cluster)
    return seen


if __name__ == "__main__":
    cluster = LoopbackCluster(Path(sys.argv[1]), nodes=2, cpus=1)
    try:
        report = main(cluster)
    finally:
        cluster.stop()
    print(json.dumps(report))
