"""A whole fleet as separate OS processes over a broker, from the simulation's own plan.

``launch_fleet`` writes one TOML file per role (from :func:`plan_fleet`, the same
values the in-process simulation uses), each device's partition as ``.npz`` (replayed
at the federation's pace), and the test set for the cloud to score; it then starts
``safl cloud``, ``safl station`` and ``safl device`` processes and waits for the cloud.
"""

from __future__ import annotations

import csv
import io
import logging
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edge_client.body import load_body_manifest
from edge_client.config import toml_text
from edge_client.errors import SaflError

from .clock import PROFILES
from .datasets import Dataset
from .fleet import PREQUENTIAL_PROMOTE
from .simulation import FleetSpec, Strategy, plan_fleet, public_settings

__all__ = ["write_fleet", "launch_fleet", "fleet_commands", "Fleet"]

log = logging.getLogger(__name__)

LINGER_S = 30.0  # how long the others may take to end once the cloud has



def write_fleet(run_dir: Path, data: Dataset, strategy: Strategy, spec: FleetSpec,
                broker_url: str, credentials: Callable[[str], tuple[str, str]] | None = None,
                broker_extra: dict[str, Any] | None = None) -> dict[str, Path]:
    """Write every role's TOML file and data; returns role id -> config path."""
    plan = plan_fleet(strategy, spec)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "data").mkdir(exist_ok=True)
    test = run_dir / "data" / "test.npz"
    np.savez(test, x=data.x_test[:spec.eval_samples], y=data.y_test[:spec.eval_samples])

    def model(backend: str) -> dict[str, Any]:
        body = {"body": spec.body, "body_dir": spec.body_dir,
                "input_shape": load_body_manifest(spec.body_dir).input_shape,
                **({"train_body_blocks": spec.tail.blocks} if spec.tail else {})} \
            if spec.body_dir else {}
        return {"name": spec.model, "backend": backend, "input_shape": data.sample_shape,
                **({"hidden": spec.hidden} if spec.hidden != 128 else {}), **body,
                "num_classes": data.num_classes, "seed": spec.seed,
                "artifacts": spec.artifacts or ""}

    def broker(user: str) -> dict[str, Any]:
        name, password = credentials(user) if credentials else ("", "")
        return {"url": broker_url, "username": name, "password": password,
                **(broker_extra or {})}

    paths = {}
    service = {"state_dir": str(run_dir / "state")}  # the aggregators resume after a crash
    cloud = run_dir / "cloud.toml"
    cloud.write_text(toml_text({"cloud": plan.cloud, "model": model(spec.backends[0]),
                                "broker": broker("cloud"), "service": service}))
    paths["cloud"] = cloud
    for values in plan.stations:
        path = run_dir / f"{values['station_id']}.toml"
        path.write_text(toml_text({"station": values, "model": model(spec.backends[0]),
                                   "broker": broker(values["station_id"]),
                                   "service": service}))
        paths[values["station_id"]] = path
    for values in plan.devices:
        k, did = values["_k"], values["device_id"]
        part = run_dir / "data" / f"{did}.npz"
        idx = spec.partitions[k]
        np.savez(part, x=data.x_train[idx], y=data.y_train[idx])
        source = {"kind": "replay", "path": str(part), "loop": True,
                  "seed": plan.replay_seeds[k], "per_iteration": plan.stream_rates[k],
                  "initial": spec.initial_samples}
        path = run_dir / f"{did}.toml"
        path.write_text(toml_text({"device": public_settings(values),
                                   "model": model(values["_backend"]),
                                   "source": source, "broker": broker(did),
                                   **_rehearsed(spec, values, data.sample_shape)}))
        paths[did] = path
    paths["_test"] = test
    return paths


def _rehearsed(spec: FleetSpec, values: dict[str, Any],
               shape: tuple[int, ...] = ()) -> dict[str, Any]:
    """A clocked fleet's device trains at its profile's pace (slowed as the clock slows it)
    and predicts as the simulated one does (one sample in ``prequential_every``, kept on the
    board), so that the processes rehearse the fleet the simulation priced."""
    if spec.clock is None:
        return {}
    step_s = PROFILES[values["_profile"]].step_seconds(spec.priced_model, shape)
    if values["_k"] in spec.clock.slow_devices:
        step_s *= spec.clock.slow_factor
    return {"service": {"emulate_step_s": step_s},
            "inference": {"enabled": spec.prequential_every > 0,
                          "every": max(1, spec.prequential_every), "publish": False,
                          "promote": PREQUENTIAL_PROMOTE}}


@dataclass
class Fleet:
    """The running processes of a launched fleet, for fault injection."""

    procs: dict[str, subprocess.Popen]
    restart: Callable[[str], None]
    logs: Path

    metrics: Path  # the cloud's metrics.csv

    def rows(self) -> list[dict[str, Any]]:
        """The rounds the cloud has finished, from its ``metrics.csv`` (a row still being
        written is left out)."""
        try:
            text = self.metrics.read_text()
        except FileNotFoundError:
            return []
        text = text[:text.rfind("\n") + 1]
        return [{k: float(v) if k in ("accuracy", "loss", "wall_s") else int(v)
                 for k, v in row.items()} for row in csv.DictReader(io.StringIO(text))]

    @property
    def last_round(self) -> int:
        """The last round the cloud finished (-1: none yet)."""
        rows = self.rows()
        return rows[-1]["round"] if rows else -1


def fleet_commands(paths: dict[str, Path], broker: str | None = None,
                   program: tuple[str, ...] = ("safl",)) -> dict[str, list[str]]:
    """The command line of every role of a written fleet, cloud first (``broker``, if given,
    overrides the URL in the files)."""
    argv = {"cloud": [*program, "-v", "cloud", "--config", str(paths["cloud"]), "--eval",
                      str(paths["_test"]), "--out", str(paths["cloud"].parent)]}
    for name, path in paths.items():
        if name not in ("cloud", "_test"):
            role = "station" if name.startswith("st") else "device"
            argv[name] = [*program, "-v", role, "--config", str(path)]
    for line in argv.values():
        line += ["--broker", broker] if broker else []
    return argv


def launch_fleet(run_dir: Path, data: Dataset, strategy: Strategy, spec: FleetSpec,
                 broker_url: str, *, credentials: Callable[[str], tuple[str, str]] | None = None,
                 broker_extra: dict[str, Any] | None = None, timeout: float = 900.0,
                 progress: Callable[[int, float], None] | None = None,
                 during: Callable[[Fleet], None] | None = None,
                 commands: dict[str, list[str]] | None = None,
                 extra_args: dict[str, list[str]] | None = None,
                 ) -> list[dict[str, Any]]:
    """Run one strategy as separate processes; returns the cloud's per-round metrics.

    ``during`` is called every poll with a :class:`Fleet` (tests use it to inject
    faults: kill a process, restart it).  ``commands`` replaces the command line of
    named participants (tests run hostile devices that way); ``extra_args`` are added to
    named participants' command lines (each its own ``--metrics-port``, say).
    """
    paths = write_fleet(run_dir, data, strategy, spec, broker_url, credentials, broker_extra)
    # A launch is a new run: checkpoints and metrics of an earlier one in this folder go.
    shutil.rmtree(run_dir / "state", ignore_errors=True)
    (run_dir / "metrics.csv").unlink(missing_ok=True)
    logs = run_dir / "logs"
    logs.mkdir(exist_ok=True)
    procs: dict[str, subprocess.Popen] = {}
    argv = fleet_commands(paths, program=(sys.executable, "-m", "safl"))
    for name, command in (commands or {}).items():
        argv[name] = [*command, "--config", str(paths[name])]
    for name, args in (extra_args or {}).items():
        argv[name] += args

    def start(name: str) -> None:
        with open(logs / f"{name}.log", "a") as log:  # a restart appends
            procs[name] = subprocess.Popen(argv[name], stdout=log, stderr=subprocess.STDOUT)

    for name in argv:
        start(name)
    fleet = Fleet(procs, start, logs, run_dir / "metrics.csv")
    try:
        seen = _watch(fleet, timeout, during, progress)
    finally:
        _stop(procs)
    rows = fleet.rows()
    if progress is not None:
        for row in rows[seen:]:
            progress(row["round"], row.get("accuracy", float("nan")))
    return rows


def _watch(fleet: Fleet, timeout: float, during: Callable[[Fleet], None] | None,
           progress: Callable[[int, float], None] | None) -> int:
    """Poll the fleet until the cloud exits: a participant's error or the deadline stops the
    run; returns how many metric rows ``progress`` has seen."""
    procs, logs, seen = fleet.procs, fleet.logs, 0
    deadline = time.monotonic() + timeout
    while procs["cloud"].poll() is None:
        if time.monotonic() > deadline:
            raise SaflError(f"the fleet did not finish within {timeout:.0f} s; "
                            f"logs in {logs}")
        if during:
            during(fleet)
        dead = [n for n, p in procs.items() if p.poll() not in (None, 0, -9, -15)]
        if dead:
            raise SaflError(f"{', '.join(dead)} exited with an error; logs in {logs}")
        if progress:
            rows = fleet.rows()
            for row in rows[seen:]:
                progress(row["round"], row.get("accuracy", float("nan")))
            seen = len(rows)
        time.sleep(0.05)
    if procs["cloud"].returncode != 0:
        raise SaflError(f"the cloud exited with {procs['cloud'].returncode}; "
                        f"see {logs / 'cloud.log'}")
    # The cloud's last round ends the run; a participant that never heard the end (a device
    # whose final model was lost with a broker that kept no sessions, say) is stopped.
    for name, p in procs.items():
        try:
            p.wait(timeout=LINGER_S)
        except subprocess.TimeoutExpired:
            log.warning("%s still ran %.0f s after the cloud finished: stopped (see %s)", name,
                        LINGER_S, logs / f"{name}.log")
    return seen


def _stop(procs: dict[str, subprocess.Popen[bytes]], grace: float = 5.0) -> None:
    """Terminate what is still running, and kill what does not stop within ``grace`` s."""
    for p in procs.values():
        if p.poll() is None:
            p.terminate()
    for p in procs.values():
        try:
            p.wait(grace)
        except subprocess.TimeoutExpired:
            p.kill()
