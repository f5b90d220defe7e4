"""``ServiceConfig``: the ``[service]`` table, metrics and checkpoints."""

from __future__ import annotations

import dataclasses

from .loading import check_range

__all__ = ["ServiceConfig"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServiceConfig:
    """How a service shows itself and keeps its state (the ``[service]`` table).

    ``metrics_port`` serves Prometheus metrics (0: off).  ``state_dir`` is where the
    cloud and stations checkpoint every round and resume from after a crash ("": no
    checkpoints, a restart starts over; systemd units point it at StateDirectory).
    ``emulate_step_s`` (devices only) holds each local step of 32 samples to at least that
    many seconds: a field rehearsal of slower boards on a faster machine (``lab/relay.py``).
    """

    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"  # address /metrics listens on
    state_dir: str = ""
    emulate_step_s: float = 0.0

    def __post_init__(self) -> None:
        check_range("metrics_port", self.metrics_port, 0, 65535)
        check_range("emulate_step_s", self.emulate_step_s, 0)
