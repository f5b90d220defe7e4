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

from .clock import ClockConfig, LinkSpec, check_batched_steps, parse_mix
from .factory import Factory, FactoryPlan

__all__ = ["SimulationConfig", "Factories", "InProcess", "ENGINES"]

ENGINES = ("local", "ray")
_LINK_FIELDS = ("latency_ms", "jitter_ms", "bandwidth_mbps", "loss")  # LinkSpec's order
_LINK_KEYS = tuple(f"{side}_{k}" for side in ("device", "cloud") for k in _LINK_FIELDS)


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
    # Virtual time (lab/clock.py, docs/experiments.md "Virtual time"): the devices' boards by
    # fraction ("pi4-numpy=0.4"; empty: no clock, every message arrives at once), each
    # device's link to its station and each station's to the cloud (one-way latency, jitter,
    # bandwidth, loss per TCP segment), and devices (0-based) made slow_factor times slower.
    profiles: tuple[str, ...] = ()
    device_latency_ms: float = 0.0
    device_jitter_ms: float = 0.0
    device_bandwidth_mbps: float = 0.0
    device_loss: float = 0.0
    cloud_latency_ms: float = 0.0
    cloud_jitter_ms: float = 0.0
    cloud_bandwidth_mbps: float = 0.0
    cloud_loss: float = 0.0
    slow_devices: tuple[int, ...] = ()
    slow_factor: float = 1.0
    # Milliseconds of a role's own time per message it handles (ClockConfig.handling_ms).
    handling_ms: float = 0.0

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
        if self.profiles:
            check_batched_steps(self.batched_steps, True)
            self.clock(0)  # names a bad profile or link key now, not at the first run
        elif self.slow_devices or self.handling_ms or any(getattr(self, k) for k in _LINK_KEYS):
            raise ConfigError("profiles", "links and slow devices need a clock: name the "
                              "devices' profiles (e.g. profiles = [\"pi4-numpy\"])")

    def clock(self, seed: int) -> ClockConfig | None:
        """The virtual clock of a run with ``seed`` (None: no clock)."""
        if not self.profiles:
            return None
        def link(side: str) -> LinkSpec:
            try:
                return LinkSpec(*(getattr(self, f"{side}_{k}") for k in _LINK_FIELDS))
            except ConfigError as exc:  # LinkSpec's rule, named as this table names the key
                raise ConfigError(f"{side}_{exc.key}", str(exc).split(": ", 1)[1]) from None
        return ClockConfig(profiles=parse_mix(self.profiles), device_link=link("device"),
                           cloud_link=link("cloud"), slow_devices=self.slow_devices,
                           slow_factor=self.slow_factor, handling_ms=self.handling_ms,
                           seed=seed)

    @property
    def cache_tag(self) -> str:
        """What a run's cache key adds for settings that change its numbers (empty for the
        defaults, so runs cached before keep their keys)."""
        clock = self.clock(0)
        return (f"|torch-{self.torch_device}" if self.torch_device != "auto" else "") + (
            "|batched-steps" if self.batched_steps else "") + (clock.tag if clock else "")


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
