"""A real two-node Ray cluster on this machine (``tests/ray_cluster.py``, in a private
network namespace so that every byte stays on loopback): a federation's factories land on
both nodes and give what the local engine gives, an experiment runs there through
``safl experiment --ray``, and a node killed mid-run is a clear error, not a hang."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="the ray extra is not installed")


def _namespaces() -> str | None:
    """Why a private network namespace cannot be had here, or None."""
    if not shutil.which("unshare") or not shutil.which("ip"):
        return "unshare or ip (util-linux, iproute2) is not installed"
    probe = subprocess.run(["unshare", "-n", "ip", "link", "set", "lo", "up"],
                           capture_output=True, text=True)
    return None if probe.returncode == 0 else f"unshare -n is not permitted: {probe.stderr}"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_two_node_cluster_runs_federations_and_experiments(tmp_path):
    why = _namespaces()
    if why:
        pytest.skip(why)
    script = Path(__file__).with_name("ray_cluster.py")
    out = subprocess.run(["unshare", "-n", sys.executable, str(script), str(tmp_path)],
                         capture_output=True, text=True, timeout=540)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    print(json.dumps(seen, indent=1))  # the placement and timings, for the log
    assert seen["cluster"] == {**seen["cluster"], "nodes": 2, "addresses": ["127.0.0.1"]}
    fed = seen["federation"]
    # One CPU a node and one a factory: the two factories must be on different nodes.
    assert sorted(fed["placement"]) == fed["cluster_nodes"]
    assert fed["same_rows"] and fed["same_counters"]
    exp = seen["experiment"]
    assert exp["rc"] == 0 and exp["same_as_local"], exp["stderr_tail"]
    assert len(exp["runs"]) == 4
    killed = seen["killed"]
    assert killed["error"] and "was lost" in killed["error"], killed
    assert fed["worker_node"] in killed["error"]
    assert killed["after_kill_s"] < 60
