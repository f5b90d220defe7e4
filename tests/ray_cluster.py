"""A two-node Ray cluster on loopback, for ``tests/test_ray_cluster.py``; run inside a private
network namespace (``unshare -n``), where 127.0.0.1 is the only address Ray can register.

Usage: ``python tests/ray_cluster.py WORKDIR``.  It brings ``lo`` up, starts a head raylet
and a worker raylet (one CPU each, so a run's two factories need both nodes), then:
a federation on the Ray engine (compared with the local engine, and where each factory ran),
an experiment through ``safl experiment --ray``, and a federation whose worker node is killed
mid-run.  It prints one JSON line of what it saw, and stops both nodes whatever happens.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

PORT = 6391
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


def _node(args: list[str], log: Path) -> subprocess.Popen:
    """A raylet started in its own session, so killing its group takes its workers too."""
    ray = Path(sys.executable).with_name("ray")
    return subprocess.Popen([str(ray), "start", "--block", "--node-ip-address", "127.0.0.1",
                             "--num-cpus", "1", "--disable-usage-stats", *args],
                            stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _federation(work: Path, rounds: int, engine: str):
    from lab.experiment import _dataset, _fleet, _strategy, load_experiment, load_simulation
    from lab.simulation import run_federation

    path = work / f"fleet-{rounds}-{engine}.toml"
    path.write_text(EXPERIMENT.format(rounds=rounds, engine=engine))
    cfg, data = load_experiment(path), _dataset("digits")
    sim = load_simulation(path, f"127.0.0.1:{PORT}")
    return run_federation(data, _strategy(cfg, "safl_fedgs"), _fleet(cfg, data, 3, "none"),
                          engine=sim)


def main(work: Path) -> dict:
    import ray

    seen: dict = {}
    started = time.monotonic()
    ray.init(address=f"127.0.0.1:{PORT}", logging_level="ERROR")
    for _ in range(100):
        if len([n for n in ray.nodes() if n["Alive"]]) == 2:
            break
        time.sleep(0.1)
    nodes = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    seen["cluster"] = {"nodes": len(nodes), "addresses": sorted(set(nodes.values())),
                       "ready_s": round(time.monotonic() - started, 1)}

    here, there = _federation(work, 3, "local"), _federation(work, 3, "ray")
    def rows(result) -> str:  # NaN (a figure not measured) compares equal as text
        return json.dumps([{k: v for k, v in r.items() if k != "wall_s"} for r in result.rows])

    worker = [n["NodeID"] for n in ray.nodes() if "worker_node" in n["Resources"]]
    seen["federation"] = {
        "placement": there.nodes, "cluster_nodes": sorted(nodes), "worker_node": worker,
        "same_rows": rows(here) == rows(there),
        "same_counters": here.counters == there.counters,
        "accuracy": there.final_accuracy}

    config = work / "experiment.toml"
    config.write_text(EXPERIMENT.format(rounds=3, engine="local"))
    t0 = time.monotonic()
    cli = subprocess.run([sys.executable, "-m", "safl", "experiment", str(config), "--out",
                          str(work / "exp"), "--ray", f"127.0.0.1:{PORT}"],
                         capture_output=True, text=True, timeout=600)
    wall = round(time.monotonic() - t0, 1)
    # Locally in two processes: one thread a run, as each Ray task has (a BLAS on two
    # threads sums in another order, and the last bits of a float may differ).
    local = subprocess.run([sys.executable, "-m", "safl", "experiment", str(config), "--out",
                            str(work / "exp-local"), "--jobs", "2"],
                           capture_output=True, text=True, timeout=600)

    def runs(folder: str) -> dict:
        return {p.name: [{k: v for k, v in r.items() if k != "wall_s"}
                         for r in json.loads(p.read_text())["rows"]]
                for p in (work / folder / "runs").glob("*.json")}

    same = local.returncode == 0 and (json.dumps(runs("exp"), sort_keys=True)
                                      == json.dumps(runs("exp-local"), sort_keys=True))
    seen["experiment"] = {"rc": cli.returncode, "same_as_local": same, "wall_s": wall,
                          "runs": sorted(runs("exp")), "stderr_tail": cli.stderr[-600:]}
    return seen


def kill_mid_run(work: Path, worker: subprocess.Popen) -> dict:
    """A long federation with a factory on each node; the worker node dies in round 2 or so."""
    from edge_client.errors import SaflError

    def kill_soon() -> None:
        time.sleep(6.0)
        _kill(worker)
        killed.append(time.monotonic())

    killed: list[float] = []
    threading.Thread(target=kill_soon, daemon=True).start()
    try:
        _federation(work, 100000, "ray")
        return {"error": None}
    except SaflError as exc:
        return {"error": str(exc), "after_kill_s": round(time.monotonic() - killed[0], 1)
                if killed else None}


if __name__ == "__main__":
    work = Path(sys.argv[1])
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    # A cluster alone in its network namespace: the token files of other Ray instances on
    # this machine (a shared home) must not be mixed up with this one's.
    os.environ["RAY_AUTH_MODE"] = "disabled"
    head = _node(["--head", "--port", str(PORT), "--include-dashboard", "false",
                  "--resources", '{"head_node": 1}'], work / "head.log")
    time.sleep(3)
    worker = _node(["--address", f"127.0.0.1:{PORT}", "--resources", '{"worker_node": 1}'],
                   work / "worker.log")
    try:
        report = main(work)
        report["killed"] = kill_mid_run(work, worker)
    finally:
        _kill(worker)
        _kill(head)
    print(json.dumps(report))
