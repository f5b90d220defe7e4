"""Where a simulation runs: the ``[simulation]`` table, and the factories it runs on.

``engine = "local"`` (the default) runs every factory in this process; ``engine = "ray"``
runs each in a Ray actor on whatever nodes the cluster at ``address`` has
(``lab/ray_engine.py``, imported only then: Ray is an optional extra).  The driver, the cloud
and the recorder are the same for both (``lab/simulation.py``), and so are the results.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from edge_client.config import check_range
from edge_client.errors import ConfigError

from .factory import Factory, FactoryPlan

__all__ = ["SimulationConfig", "Factories", "InProcess", "open_factories", "ENGINES"]

ENGINES = ("local", "ray")


@dataclass(frozen=True)
class SimulationConfig:
    """The ``[simulation]`` table of an experiment file (``SAFL_SIMULATION_*`` variables and
    ``--ray`` override it)."""

    engine: str = "local"
    # A Ray cluster: "auto" (the one `ray start` began on this machine), "HOST:PORT", or
    # "local" (a Ray instance started for this run alone and stopped after it).
    address: str = "local"
    # What each factory's actor declares to Ray; 0: an even share of the cluster's CPUs,
    # at most one (every factory of a run must be placed at once, or the run cannot start).
    cpus_per_factory: float = 0.0
    gpus_per_factory: float = 0.0  # fractional: 0.25 puts four factories on a GPU
    cpus_per_run: float = 1.0  # what each (strategy, seed) task declares, under --ray
    gpus_per_run: float = 0.0
    # Seconds a factory may take over one round before the run stops with an error naming
    # it (a node that died is reported at once; this catches one that hangs), and seconds
    # the cluster has to place every factory before the run stops saying what it lacks.
    round_timeout: float = 3600.0
    placement_timeout: float = 120.0
    # Where the torch backend trains ("auto": CUDA where torch sees one; "cpu"; "cuda:N"),
    # and whether a super node's members step in one batched call (vmap over their
    # weights; float-close to one by one, not bit-equal, so runs are cached apart).
    torch_device: str = "auto"
    batched_steps: bool = False

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ConfigError("engine", f"must be one of {ENGINES}, got {self.engine!r}")
        if not self.address:
            raise ConfigError("address", "must be 'local', 'auto' or HOST:PORT")
        for key in ("cpus_per_factory", "cpus_per_run"):
            check_range(key, getattr(self, key), 0)
        for key in ("gpus_per_factory", "gpus_per_run"):
            check_range(key, getattr(self, key), 0)
        check_range("round_timeout", self.round_timeout, 1)
        check_range("placement_timeout", self.placement_timeout, 1)
        if self.torch_device not in ("auto", "cpu") and not self.torch_device.startswith("cuda"):
            raise ConfigError("torch_device", f"must be 'auto', 'cpu', 'cuda' or 'cuda:N', "
                              f"got {self.torch_device!r}")

    @property
    def cache_tag(self) -> str:
        """What a run's cache key adds for settings that change its numbers (empty for the
        defaults, so runs cached before keep their keys)."""
        return (f"|torch-{self.torch_device}" if self.torch_device != "auto" else "") + (
            "|batched-steps" if self.batched_steps else "")


class Factories(Protocol):
    """Every factory of a run, wherever it lives: ``call`` runs one of
    :class:`~lab.factory.Factory`'s methods on each, in the factories' order, and returns
    their answers in that order; ``nodes`` says where each runs."""

    nodes: list[str]

    def call(self, method: str, *args: Any) -> list[Any]: ...
    def close(self) -> None: ...


class InProcess:
    """The local engine: the factories are objects in this process (one trainer per
    backend for all of them, where the fleet shares trainers)."""

    def __init__(self, plans: list[FactoryPlan], trainer: Callable[[str], Any]) -> None:
        if plans and plans[0].spec.share_trainers:
            trainer = functools.cache(trainer)
        self.factories = [Factory(plan, trainer) for plan in plans]
        self.nodes: list[str] = []

    def call(self, method: str, *args: Any) -> list[Any]:
        return [getattr(f, method)(*args) for f in self.factories]

    def close(self) -> None:
        """Nothing runs elsewhere."""


def open_factories(plans: list[FactoryPlan], sim: SimulationConfig,
                   trainer: Callable[[str], Any]) -> Factories:
    """The run's factories on ``sim``'s engine (``trainer`` makes the local engine's)."""
    if sim.engine == "ray":
        from .ray_engine import RayFactories
        return RayFactories(plans, sim)
    return InProcess(plans, trainer)
