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
    """

    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"
    state_dir: str = ""

    def __post_init__(self) -> None:
        check_range("metrics_port", self.metrics_port, 0, 65535)
