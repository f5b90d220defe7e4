"""A load fleet: hundreds of device roles on the real MQTT transport, over TLS, against the
real brokers, station and cloud services of a ``safl provision`` fleet.

:func:`write_load_fleet` writes a fleet file of ``devices`` devices on ``stations``
stations and each device's samples; ``safl provision`` turns it into certificates, ACLs,
broker configs and role files as for any fleet.  :func:`run_load` starts Mosquitto per
broker, ``safl cloud`` and ``safl station`` as the units do, and the devices in a few
worker processes (``python -m lab.fleet_load worker``): each device is the device service
itself (:class:`~edge_client.service.DeviceService`: its role, its transport, its
provisioned file), on its own certificate and connection, so every hello, presence,
statistics, selection, chunked update and model is the real one.  What keeps a thousand of
them on two cores is the model: a linear head on 1,280-feature embeddings (an
efficientnet-lite0 body's, 12,810 parameters, 51 KB a model: what a camera fleet with a body
sends), trained on samples replayed at the federation's pace, with no body to run.

While it runs, it samples each process's CPU time and resident set from ``/proc``; at the
end it reads the station's and cloud's retained summaries (``safl status``'s view) and the
workers' own counters.  ``bench/fleet_load.py`` prints the figures ``docs/scale.md`` quotes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edge_client.errors import SaflError

from .load_body import BODY_NAME, LABELLED_PER_ITERATION, write_load_body
from .ports import free_port, wait_for_port
from .process_figures import process_figures, profile_parts, thread_cpu

__all__ = ["write_load_fleet", "run_load", "LoadFleet", "FEATURES", "CLASSES"]

FEATURES, CLASSES = 1280, 10
SAMPLES_PER_PART = 64  # each device replays one of CLASSES such parts, in a loop


def device_ids(devices: int, stations: int) -> dict[str, list[str]]:
    """Station id -> its devices' ids, dealt round-robin."""
    ids = [f"d{i:04d}" for i in range(devices)]
    return {f"st{s}": ids[s::stations] for s in range(stations)}


def write_load_fleet(folder: Path, devices: int, stations: int, *, head: str = "") -> Path:
    """The fleet file, and ``data/part<k>.npz``: part k holds classes k and k+1 (mod
    CLASSES), so that super nodes have label skew to balance.  With ``head`` (a ``[model]
    head_init``), the samples are "frames" of the load body (``lab/load_body.py``): with
    "auto" the head is solved from their statistics, with "random" none are sent."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    # Classes overlap (about 0.9 of a pair told apart): as on a real line, no device's
    # loss vanishes, and honest steps stay within the station's norm guard of each other.
    means = rng.normal(0.0, 0.05, (CLASSES, FEATURES)).astype(np.float32)
    (folder / "data").mkdir(exist_ok=True)
    shape = (1, 1, FEATURES) if head else (FEATURES,)
    for k in range(CLASSES):
        y = np.where(np.arange(SAMPLES_PER_PART) % 2 == 0, k, (k + 1) % CLASSES)
        x = means[y] + rng.normal(0.0, 1.0, (len(y), FEATURES)).astype(np.float32)
        np.savez(folder / "data" / f"part{k}.npz", x=x.astype(np.float32).reshape(-1, *shape),
                 y=y)
    model = [f"input_shape = [{', '.join(map(str, shape))}]"]
    if head:
        public = rng.normal(0.0, 1.0, (256, FEATURES))  # a draw of its own, not the fleet's
        where = write_load_body(folder / "body", FEATURES, public)
        # No unknown-part detector: each device would hold one (18 MB a device measured,
        # 18 GB for a thousand in this one host); docs/scale.md prices its traffic apart.
        model += [f'body = "{BODY_NAME}"', f'body_dir = "{where}"', f'head_init = "{head}"',
                  "unknown_share = 0.0"]
    ports = {"cloud": free_port(), **{sid: free_port() for sid in device_ids(1, stations)}}
    lines = ["[fleet]", 'name = "load"', 'cloud_host = "127.0.0.1"',
             f"cloud_port = {ports['cloud']}", 'cloud_bind = "127.0.0.1"', "metrics_port = 0",
             "", "[model]", 'name = "linear"', *model, f"num_classes = {CLASSES}", ""]
    for sid, ids in device_ids(devices, stations).items():
        lines += ["[[stations]]", f'id = "{sid}"', 'host = "127.0.0.1"',
                  f"port = {ports[sid]}", 'bind = "127.0.0.1"',
                  "devices = [" + ", ".join(f'"{d}"' for d in ids) + "]", ""]
    path = folder / "fleet.toml"
    path.write_text("\n".join(lines))
    return path


# -- the device workers ----------------------------------------------------------------------

def _raise_nofile() -> None:
    """Each connection is a socket, and paho's wake-up pair two more: a worker of 250
    devices needs some 750 descriptors, past a stock soft limit of 1,024 with the rest."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def run_worker(fleet: Path, data: Path, ids: list[str], report: Path) -> None:
    """Run ``ids``' device services in this process until SIGTERM, then write their counters
    to ``report``: one loop over all of them (each transport has its network thread)."""
    from edge_client.runner import StopFlag
    from edge_client.service import DEVICE_TABLES, DeviceService, load_role_file

    _raise_nofile()
    stop = StopFlag()
    entries = []
    for did in ids:
        k = int(did[1:])
        cfg = load_role_file(fleet / "devices" / did / "device.toml", DEVICE_TABLES, {
            # (a body fleet's files are provisioned for cameras: their keys go)
            "source": {"kind": "replay", "path": str(data / f"part{k % CLASSES}.npz"),
                       "loop": True, "per_iteration": 32.0, "initial": 32, "seed": k,
                       "label_topic": "", "grayscale": False, "resize": []},
            "inference": {"enabled": False, "publish": False},
            "service": {"state_dir": "", "body_threads": 1}})
        if cfg["model"].body != "none":  # cameras, labelling a few frames an iteration,
            # each ready every iteration (as the fleet without a body is, the station's
            # heaviest load): a camera's full batches (min_batch 32) at 2 frames would ready
            # one in sixteen, and the station would gather for them between iterations
            cfg["source"] = dataclasses.replace(cfg["source"],
                                                per_iteration=LABELLED_PER_ITERATION)
            cfg["device"] = dataclasses.replace(cfg["device"], min_batch=1)
        service = DeviceService(**cfg)
        runner, transport, hooks = service.build()
        entries.append((runner, transport, (*hooks, *service.summaries(runner,
                                                                       transport)["hooks"])))
    began = time.monotonic()
    connect_s = []
    for _, transport, _ in entries:
        at = time.monotonic()
        transport.connect()
        connect_s.append(time.monotonic() - at)
    for runner, _, _ in entries:
        runner.start()
    connected = time.monotonic() - began
    while not stop:
        busy = False
        for runner, transport, hooks in entries:
            busy = bool(transport.deliver()) or busy
            runner.tick()
            for hook in hooks:
                hook(runner.clock())
        if not busy:
            time.sleep(0.01)
    devices: Counter[str] = Counter()
    transports: Counter[str] = Counter()
    for runner, transport, _ in entries:
        devices.update(runner.role.counters)
        transports.update(transport.counters)
        transport.close()
    report.write_text(json.dumps({
        "devices": len(ids), "connect_all_s": connected,
        "connect_max_s": max(connect_s, default=0.0), "device": dict(devices),
        "transport": dict(transports),
        "answer_max_s": max((r.answer_max_s for r, _, _ in entries), default=0.0)}))


# -- the fleet around them -------------------------------------------------------------------

@dataclass
class LoadFleet:
    """The running fleet's processes, what they have cost so far, and their logs."""

    folder: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    commands: dict[str, list[str]] = field(default_factory=dict)  # those a fault restarts
    envs: dict[str, dict[str, str]] = field(default_factory=dict)  # and their environments
    peak_rss: dict[str, float] = field(default_factory=dict)

    def start(self, name: str, command: list[str], nofile: int | None = None,
              env: dict[str, str] | None = None) -> None:
        def limit() -> None:
            _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(nofile or hard, hard), hard))
        logs = self.folder / "logs"
        logs.mkdir(exist_ok=True)
        self.procs[name] = subprocess.Popen(
            command, stdout=open(logs / f"{name}.log", "a"), stderr=subprocess.STDOUT,
            preexec_fn=limit, env={**os.environ, **(env or {})})

    def sample(self) -> dict[str, float]:
        """CPU seconds so far per process; the resident sets' peaks are kept."""
        cpu = {}
        for name, proc in self.procs.items():
            cpu[name], rss = process_figures(proc.pid)
            self.peak_rss[name] = max(self.peak_rss.get(name, 0.0), rss)
        return cpu

    def dead(self) -> dict[str, int]:
        return {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}

    def log(self, name: str) -> str:
        return (self.folder / "logs" / f"{name}.log").read_text(errors="replace")

    def stop(self, names: list[str], grace: float = 30.0) -> None:
        for name in names:
            if self.procs[name].poll() is None:
                self.procs[name].send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for name in names:
            try:
                self.procs[name].wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.procs[name].kill()
                self.procs[name].wait()


def _station_env(settings: dict[str, Any]) -> dict[str, str]:
    return {f"SAFL_STATION_{k.upper()}": str(v) for k, v in settings.items()}


def worker_groups(ids: list[str], workers: int, first: list[str]) -> list[list[str]]:
    """Devices per worker: ``first`` alone in the first worker (the share a fault takes
    away at once), the rest dealt round-robin among the others."""
    if first:
        rest = [d for d in ids if d not in set(first)]
        return [first, *worker_groups(rest, max(1, workers - 1), [])]
    return [ids[w::workers] for w in range(workers)]


def start_fleet(folder: Path, devices: int, stations: int, *, workers: int,
                broker_nofile: int | None = None, first_worker: int = 0,
                station: dict[str, Any] | None = None, profile: bool = False,
                head: str = "") -> tuple[LoadFleet, dict[str, Any]]:
    """Provision, then start the brokers, the cloud, the stations and the device workers;
    returns the fleet and the provisioning figures."""
    from aggregator.fleet_file import load_fleet_file
    from aggregator.provision import provision

    fleet_path = write_load_fleet(folder, devices, stations, head=head)
    out = folder / "fleet"
    began = time.monotonic()
    provision(fleet_path, out)
    provisioned = {"provision_s": round(time.monotonic() - began, 2),
                   "provision_mb": round(sum(p.stat().st_size for p in out.rglob("*")
                                                 if p.is_file()) / 1e6, 1)}
    ff = load_fleet_file(fleet_path)
    fleet = LoadFleet(folder)
    root = os.geteuid() == 0
    confs = {"broker.cloud": (out / "cloud" / "broker" / "mosquitto.conf", ff.cloud_port)}
    for s in ff.stations:
        confs[f"broker.{s.id}"] = (out / "stations" / s.id / "broker" / "mosquitto.conf",
                                   s.port)
    for name, (conf, port) in confs.items():
        if root and "user root" not in conf.read_text():  # mosquitto drops to its own user
            conf.write_text(conf.read_text() + "user root\n")
        fleet.commands[name] = ["mosquitto", "-c", str(conf)]
        fleet.start(name, fleet.commands[name], nofile=broker_nofile)
        wait_for_port(port, fleet.procs[name])
    time.sleep(1.0)  # the bridges connect
    fleet.start("cloud", [sys.executable, "-m", "safl", "cloud", "--config",
                          str(out / "cloud" / "cloud.toml"), "--rounds", "100000",
                          "--out", str(folder / "cloud-out"), "--state-dir",
                          str(folder / "state")])
    for s in ff.stations:
        profiled = ["-m", "cProfile", "-o", str(folder / f"{s.id}.prof")] if profile else []
        fleet.commands[s.id] = [sys.executable, *profiled, "-m", "safl", "station", "--config",
                                str(out / "stations" / s.id / "station.toml"),
                                "--state-dir", str(folder / "state")]
        fleet.envs[s.id] = _station_env(station or {})
        fleet.start(s.id, fleet.commands[s.id], env=fleet.envs[s.id])
    ids = sorted(d for s in ff.stations for d in s.devices)
    first = ff.stations[0].devices[:first_worker]
    for w, group in enumerate(worker_groups(ids, workers, list(first))):
        fleet.start(f"worker{w}", [sys.executable, "-m", "lab.fleet_load", "worker",
                                   str(out), str(folder / "data"),
                                   str(folder / f"worker{w}.json"), *group])
    return fleet, provisioned


def _sum_transport(summaries: Any) -> Counter[str]:
    total: Counter[str] = Counter()
    for summary in summaries:
        total.update({k: v for k, v in summary.transport.items() if isinstance(v, int)})
    return total


def station_summaries(folder: Path, stations: list[str], wait: float = 1.0) -> dict[str, Any]:
    """The stations' and the cloud's retained summaries, as ``safl status`` reads them."""
    from aggregator.status import fleet_status
    from edge_client.config import BrokerConfig, load_config

    monitor = folder / "fleet" / "monitor"
    out: dict[str, Any] = {}
    for sid in stations:
        cfg = load_config(BrokerConfig, "broker", monitor / f"status-{sid}.toml")
        view = fleet_status(cfg, "load", wait=wait)
        out[sid] = view.stations.get(sid)
        # What its devices say they sent and received (their summaries' transport counts)
        out["devices." + sid] = {"seen": len(view.devices),
                                 **_sum_transport(view.devices.values())}
    cfg = load_config(BrokerConfig, "broker", monitor / "status-cloud.toml")
    out["cloud"] = fleet_status(cfg, "load", wait=1.0).cloud
    return out


def _snapshot(fleet: LoadFleet, folder: Path, stations: list[str],
              devices: int) -> dict[str, Any]:
    # Long enough for every device's retained summary to arrive (1,000 took over a second).
    return {"t": time.monotonic(), "cpu": fleet.sample(),
            "threads": {s: thread_cpu(fleet.procs[s].pid) for s in stations},
            "status": station_summaries(folder, stations, wait=1.0 + devices / 300)}


def _iterations(status: dict[str, Any], sid: str) -> int:
    summary = status[sid]
    return 0 if summary is None else int(summary.iteration)


FAULTS = ("broker", "station", "drop")
DROP_SHARE = 0.1  # of the devices, gone at once in the "drop" fault


def _online(status: dict[str, Any], sid: str) -> int:
    return 0 if status[sid] is None else int(status[sid].online)


def _until(fleet: LoadFleet, folder: Path, sids: list[str], rule: Any, timeout: float,
           allowed: tuple[str, ...] = ()) -> tuple[float, dict[str, Any]]:
    """Seconds until ``rule(status)`` holds, polling the retained summaries each second."""
    began = time.monotonic()
    while True:
        dead = {n: c for n, c in fleet.dead().items() if n not in allowed}
        if dead:
            raise RuntimeError(f"died: {dead}: " + "; ".join(fleet.log(n)[-1500:]
                                                            for n in dead))
        try:
            status = station_summaries(folder, sids)
        except SaflError as exc:  # the broker restarting: not back yet
            status = {"unreachable": str(exc)}
        if "unreachable" not in status and rule(status):
            return time.monotonic() - began, status
        if time.monotonic() - began > timeout:
            raise RuntimeError(f"not recovered in {timeout:.0f} s: {status}")
        time.sleep(1.0)


def inject(fleet: LoadFleet, folder: Path, sids: list[str], fault: str, roster: int,
           broker_nofile: int | None = None, timeout: float = 300.0) -> dict[str, Any]:
    """One fault on the first station, then the seconds until its federation is whole
    again: every device online (but those a ``drop`` took) and 3 iterations more."""
    sid = sids[0]
    before = station_summaries(folder, sids)[sid]
    began = time.monotonic()
    allowed: tuple[str, ...] = ()
    want = roster
    if fault == "broker":  # a restart, as systemd does one: its sessions kept on disk
        name = f"broker.{sid}"
        fleet.stop([name], grace=10.0)
        fleet.start(name, fleet.commands[name], nofile=broker_nofile)
    elif fault == "station":  # killed, restarted from its checkpoint
        fleet.procs[sid].kill()
        fleet.procs[sid].wait()
        fleet.start(sid, fleet.commands[sid], env=fleet.envs.get(sid))
    elif fault == "drop":  # a tenth of the devices lose power together
        fleet.procs["worker0"].kill()
        want, allowed = roster - round(roster * DROP_SHARE), ("worker0",)
    else:
        raise ValueError(f"fault {fault!r}: one of {FAULTS}")
    took, after = _until(fleet, folder, sids, lambda st: st[sid] is not None
                         and _online(st, sid) == want
                         and st[sid].iteration >= before.iteration + 3, timeout, allowed)
    return {"fault": fault, "recovered_s": round(time.monotonic() - began, 1),
            "round_before": before.round, "round_after": after[sid].round,
            "iteration_before": before.iteration, "iteration_after": after[sid].iteration,
            "online_after": _online(after, sid), "station": dict(after[sid].counters)}


def run_load(folder: Path, devices: int, stations: int = 1, *, workers: int = 0,
             seconds: float = 60.0, warmup: int = 3, broker_nofile: int | None = None,
             station: dict[str, Any] | None = None, start_timeout: float = 300.0,
             faults: tuple[str, ...] = (), profile: bool = False,
             head: str = "") -> dict[str, Any]:
    """Run the load fleet: past ``warmup`` iterations on every station, measure for
    ``seconds``, then inject ``faults`` one after the other; returns the figures
    (``bench/fleet_load.py`` prints them)."""
    workers = workers or max(1, min(8, -(-devices // 250)))
    drop = round(devices / stations * DROP_SHARE) if "drop" in faults else 0
    if drop:  # the dropped devices in a worker of their own, of the first station's
        workers += 1
    fleet, figures = start_fleet(folder, devices, stations, workers=workers,
                                 broker_nofile=broker_nofile, station=station,
                                 first_worker=drop, profile=profile, head=head)
    sids = list(device_ids(1, stations))
    rosters = device_ids(devices, stations)
    began = time.monotonic()
    try:
        while True:
            dead = fleet.dead()
            if dead:
                raise RuntimeError(f"died: {dead}: " + "; ".join(
                    fleet.log(n)[-1500:] for n in dead))
            first = _snapshot(fleet, folder, sids, devices)
            # Every device joined too: a station goes on with the devices it has, and a body
            # fleet's thousand cameras join for longer than three iterations take.
            if all(_iterations(first["status"], s) >= warmup
                   and _online(first["status"], s) == len(rosters[s]) for s in sids):
                break
            if time.monotonic() - began > start_timeout:
                raise RuntimeError(f"stations not past {warmup} iterations with every device "
                                   f"online in {start_timeout:.0f} s: {first['status']}")
            time.sleep(2.0)
        figures["start_s"] = round(first["t"] - began, 1)
        end = first["t"] + seconds
        while time.monotonic() < end:
            time.sleep(1.0)
            fleet.sample()
        last = _snapshot(fleet, folder, sids, devices)
        roster = len(rosters[sids[0]])
        figures["faults"] = [inject(fleet, folder, sids, f, roster, broker_nofile)
                             for f in faults]
    finally:
        names = list(fleet.procs)
        fleet.stop([n for n in names if n.startswith("worker")])
        fleet.stop([n for n in names if not n.startswith(("worker", "broker"))])
        fleet.stop([n for n in names if n.startswith("broker")])
    figures.update(devices=devices, stations=stations, workers=workers,
                   peak_rss_mb={n: round(v, 1) for n, v in fleet.peak_rss.items()})
    figures["window"] = {"first": first, "last": last}
    if profile and (folder / "st0.prof").exists():
        figures["station_parts"] = profile_parts(folder / "st0.prof")
    figures["workers_report"] = [json.loads((folder / f"worker{w}.json").read_text())
                                 for w in range(workers)
                                 if (folder / f"worker{w}.json").exists()]
    return figures


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    run_worker(Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[5:], Path(sys.argv[4]))
