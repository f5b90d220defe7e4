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
    ``body_threads`` (devices with a body) is the threads its ONNX Runtime session runs on
    (0: ONNX Runtime's own choice, one a core).
    """

    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"  # address /metrics listens on
    state_dir: str = ""
    emulate_step_s: float = 0.0
    # 1 where a host runs many device services, or its cores are another service's: each
    # session's pool of a thread a core waits for work by spinning, and 250 sessions in one
    # process idle at a whole core (50: a tenth), against nothing with one thread each.
    body_threads: int = 0

    def __post_init__(self) -> None:
        check_range("metrics_port", self.metrics_port, 0, 65535)
        check_range("emulate_step_s", self.emulate_step_s, 0)
        check_range("body_threads", self.body_threads, 0)
