"""The Ray engine: a federation's factories as Ray actors on a cluster's nodes, and an
experiment's runs as Ray tasks.

Imported only when a run asks for Ray (``[simulation] engine = "ray"``, ``--ray``); Ray is
the optional ``ray`` extra.  Every node must have safl-edge (and the run's backend)
installed, as each factory builds its roles there.  The driver keeps the cloud; a factory's
actor keeps its station, devices and their streams (its devices' samples are all that is
sent to its node).  The global model goes to the factories and their stations' reports come
back as the wire's frames (:data:`TRANSFER`; ``bench/fleet_scale.py`` measures both ways).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from edge_client import codec
from edge_client import messages as m
from edge_client.errors import SaflError

from .engine import SimulationConfig
from .factory import Factory, FactoryPlan, trainer_maker

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # nothing leaves the machine at run time
try:
    import ray
    import ray.exceptions
except ImportError as exc:  # pragma: no cover - exercised where the extra is missing
    raise SaflError("the Ray engine needs Ray: pip install 'safl-edge[ray]'") from exc

__all__ = ["RayFactories", "LoopbackCluster", "connect", "run_tasks", "TRANSFER"]

# How messages cross between the driver and the factories' actors: "frames" (the wire's
# encoding, bytes) or "objects" (the frozen messages, which Ray pickles with their arrays
# out of band).  Frames were the faster at 1,000 devices (bench/fleet_scale.py).
TRANSFER = "frames"
_MAX_FRAME = 1 << 31


def connect(address: str) -> None:
    """Join the cluster at ``address`` ("auto", "HOST:PORT"), or start a Ray instance in
    this process ("local"); once per process."""
    if ray.is_initialized():
        return
    try:
        if address == "local":
            ray.init(address="local", include_dashboard=False, logging_level=logging.WARNING)
        else:
            ray.init(address=address, logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise SaflError(f"cannot reach a Ray cluster at {address!r}: {exc} (start one with "
                        "`ray start --head`, or use address 'local')") from exc


def _pack(value: Any, transfer: str) -> Any:
    """A message, or an outbox of them, as it crosses to or from an actor."""
    if transfer != "frames":
        return value
    if isinstance(value, m.Message):
        return codec.encode(value)
    if isinstance(value, list) and value and isinstance(value[0], tuple) \
            and isinstance(value[0][1], m.Message):  # an outbox: (topic, message, arrival)
        return [(topic, codec.encode(msg), *rest) for topic, msg, *rest in value]
    return value


def _unpack(value: Any, transfer: str) -> Any:
    if transfer != "frames":
        return value
    if isinstance(value, bytes):
        return codec.decode(value, max_size=_MAX_FRAME).message
    if isinstance(value, list) and value and isinstance(value[0], tuple) \
            and isinstance(value[0][1], bytes):
        return [(topic, codec.decode(frame, max_size=_MAX_FRAME).message, *rest)
                for topic, frame, *rest in value]
    return value


class _FactoryActor:
    """A factory in a Ray worker: its roles built here, from its plan."""

    def __init__(self, plan: FactoryPlan, threads: int, transfer: str) -> None:
        if "torch" in plan.spec.backends:
            import torch
            torch.set_num_threads(max(1, threads))
        make = trainer_maker(plan.spec, plan.sample_shape, plan.num_classes)
        self.factory = Factory(plan, lambda backend: make(backend, plan.layout))
        self.transfer = transfer

    def where(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def call(self, method: str, *args: Any) -> Any:
        args = tuple(_unpack(a, self.transfer) for a in args)
        return _pack(getattr(self.factory, method)(*args), self.transfer)


class RayFactories:
    """The run's factories, one actor each, spread over the cluster's nodes."""

    def __init__(self, plans: list[FactoryPlan], sim: SimulationConfig,
                 transfer: str | None = None) -> None:
        connect(sim.address)
        self.sim, self.transfer = sim, transfer or TRANSFER
        self.stations = [p.station["station_id"] for p in plans]
        cpus = _cpus_per_factory(sim, len(plans))
        actor = ray.remote(_FactoryActor).options(
            num_cpus=cpus, num_gpus=sim.gpus_per_factory, scheduling_strategy="SPREAD",
            max_restarts=0)
        self.actors: list[Any] = [actor.remote(ray.put(plan), max(1, int(cpus)),
                                               self.transfer) for plan in plans]
        self.nodes: list[str] = []
        where = [a.where.remote() for a in self.actors]
        placed, waiting = ray.wait(where, num_returns=len(plans), timeout=sim.placement_timeout)
        if waiting:
            self.close()
            have = ray.cluster_resources()
            raise SaflError(
                f"the Ray cluster placed {len(placed)} of {len(plans)} factories in "
                f"{sim.placement_timeout:.0f} s: each asks for {cpus:g} CPU and "
                f"{sim.gpus_per_factory:g} GPU, the cluster has {have.get('CPU', 0):g} CPUs "
                f"and {have.get('GPU', 0):g} GPUs ([simulation] cpus_per_factory, "
                "gpus_per_factory)")
        self.nodes = self._gather(where, "start")

    def call(self, method: str, *args: Any) -> list[Any]:
        # One copy of a global model in the object store, whichever factories read it.
        shared = [ray.put(_pack(a, self.transfer)) if isinstance(a, m.Message) else a
                  for a in args]
        answers = self._gather([a.call.remote(method, *shared) for a in self.actors], method)
        return [_unpack(x, self.transfer) for x in answers]

    def _gather(self, refs: list[Any], method: str) -> list[Any]:
        """Every factory's answer, or a :class:`SaflError` naming the factory that failed:
        its node died, its worker crashed, or it did not answer within ``round_timeout``."""
        try:
            return ray.get(refs, timeout=self.sim.round_timeout)
        except ray.exceptions.GetTimeoutError as exc:
            raise SaflError(f"the factories did not finish {method!r} within "
                            f"{self.sim.round_timeout:.0f} s ([simulation] round_timeout)"
                            ) from exc
        except ray.exceptions.RayError as exc:
            raise self._failure(refs, method, exc) from exc

    def _failure(self, refs: list[Any], method: str, exc: Exception) -> Exception:
        for k, ref in enumerate(refs):
            ready, _ = ray.wait([ref], timeout=0)
            try:
                ray.get(ready)
            except ray.exceptions.RayTaskError as err:
                cause = err.cause if isinstance(err.cause, SaflError) else None
                return cause or SaflError(f"factory {self.stations[k]} failed in {method}: "
                                          f"{err}")
            except ray.exceptions.RayError as err:
                # An actor lost before it said where it runs (its node killed while the fleet
                # started) is named by the nodes the cluster has lost.
                node = self.nodes[k] if k < len(self.nodes) else _lost_nodes()
                return SaflError(f"factory {self.stations[k]} was lost in {method} (its actor "
                                 f"on node {node} died: {type(err).__name__}); the run stops "
                                 "and nothing of it is kept")
        return SaflError(f"the factories failed in {method}: {exc}")

    def close(self) -> None:
        for actor in self.actors:
            ray.kill(actor)


def _lost_nodes() -> str:
    """The nodes the cluster holds as dead, by id ("?" where it knows of none yet)."""
    dead = [n["NodeID"] for n in ray.nodes() if not n.get("Alive", True)]
    return ", ".join(dead) if dead else "?"


def _cpus_per_factory(sim: SimulationConfig, factories: int) -> float:
    """What each factory asks for: as configured, or an even share of the cluster's CPUs
    (at most one), so that every factory of the run can be placed at once."""
    if sim.cpus_per_factory:
        return sim.cpus_per_factory
    total = ray.cluster_resources().get("CPU", 1.0)
    return math.floor(1e4 * min(1.0, total / max(1, factories))) / 1e4  # Ray's granularity


def run_tasks(tasks: Iterable[Any], run: Callable[[Any], Any], sim: SimulationConfig,
              finished: Callable[[Any, Any], None]) -> None:
    """Run ``run(task)`` for each task as a Ray task declaring ``sim``'s CPUs and GPUs per
    run, calling ``finished(task, result)`` as each ends.  A run is a pure function of its
    task, so one whose node dies is run again elsewhere (Ray's retries on system failures)
    and gives the same result; an error in the run itself is raised here."""
    connect(sim.address)
    remote = ray.remote(run).options(num_cpus=sim.cpus_per_run, num_gpus=sim.gpus_per_run,
                                     max_retries=3)
    pending = {remote.remote(task): task for task in tasks}
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1)
        for ref in done:
            task = pending.pop(ref)
            try:
                result = ray.get(ref)
            except ray.exceptions.RayTaskError as err:
                raise (err.cause if isinstance(err.cause, Exception) else err) from None
            except ray.exceptions.RayError as err:
                raise SaflError(f"run {getattr(task, 'key', task)} was lost "
                                f"({type(err).__name__}) after Ray's retries") from err
            finished(task, result)


class LoopbackCluster:
    """A Ray cluster of ``nodes`` raylets on this machine, for trying the engine and for its
    tests and benchmarks.  Run it inside a private network namespace (``unshare -n``, which
    this brings ``lo`` up in): Ray registers a node under the machine's own address even when
    told 127.0.0.1, and there 127.0.0.1 is the only address it has.  Each node is started in
    its own session, so :meth:`kill` takes its raylet and workers down at once, as a lost
    machine would be."""

    def __init__(self, work: Path, *, nodes: int = 2, cpus: float = 1, port: int = 6391):
        # Alone in its namespace it needs no tokens, and its nodes and this process must
        # agree; Ray reads the mode when it is imported, so it is set before (a token file
        # another Ray instance left in ~/.ray made a driver without it declared dead).
        if os.environ.get("RAY_AUTH_MODE") != "disabled":
            raise SaflError("a LoopbackCluster needs RAY_AUTH_MODE=disabled in the "
                            "environment before Ray is imported")
        self.work, self.port = work, port
        self.address = f"127.0.0.1:{port}"
        subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
        self.nodes = [self._node(0, ["--head", "--port", str(port), "--include-dashboard",
                                     "false"], cpus)]
        time.sleep(3)  # the head's GCS before any worker dials it
        self.nodes += [self._node(k, ["--address", self.address], cpus)
                       for k in range(1, nodes)]

    def _node(self, k: int, args: list[str], cpus: float) -> subprocess.Popen[bytes]:
        ray_cli = Path(sys.executable).with_name("ray")
        log = (self.work / f"node{k}.log").open("w")
        return subprocess.Popen(
            [str(ray_cli), "start", "--block", "--node-ip-address", "127.0.0.1", "--num-cpus",
             f"{cpus:g}", "--disable-usage-stats", "--resources", f'{{"node{k}": 1}}', *args],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait(self, timeout: float = 60.0) -> None:
        """Until every node has joined (this process connected to the cluster)."""
        connect(self.address)
        deadline = time.monotonic() + timeout
        while len([n for n in ray.nodes() if n["Alive"]]) < len(self.nodes):
            if time.monotonic() > deadline:
                raise SaflError(f"the cluster has not got its {len(self.nodes)} nodes in "
                                f"{timeout:.0f} s; logs in {self.work}")
            time.sleep(0.1)

    def node_id(self, k: int) -> str:
        """Ray's id of node ``k`` (0: the head)."""
        return next(n["NodeID"] for n in ray.nodes() if f"node{k}" in n["Resources"])

    def rss_mb(self, k: int) -> float:
        """Resident memory of node ``k``: its raylet, its workers (the factories' actors),
        and on the head the GCS."""
        import psutil  # type: ignore[import-untyped]  # a dependency of Ray's

        try:
            top = psutil.Process(self.nodes[k].pid)
            procs = [top, *top.children(recursive=True)]
        except psutil.NoSuchProcess:
            return 0.0
        total = 0
        for proc in procs:
            try:
                total += proc.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return total / 2**20

    def kill(self, k: int) -> None:
        """Node ``k`` and everything it runs, at once (SIGKILL)."""
        try:
            os.killpg(self.nodes[k].pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.nodes[k].wait()

    def stop(self) -> None:
        if ray.is_initialized():
            ray.shutdown()
        for k in reversed(range(len(self.nodes))):
            self.kill(k)
