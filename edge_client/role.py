"""What every role (device, station, cloud) shares: the protocol and rejection counting.

A role never raises on bad input: it logs one line, counts it under
``rejected.<reason>`` and leaves its accepted state untouched.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Protocol

from . import messages as m
from .errors import SaflError

__all__ = ["Role", "RoleBase"]


class Role(Protocol):
    def subscriptions(self) -> list[str]: ...
    def start(self, now: float) -> list[m.Message]: ...
    def handle(self, message: m.Message, now: float) -> list[m.Message]: ...
    def tick(self, now: float) -> list[m.Message]: ...


class RoleBase:
    """Counters, logging and the error boundary of ``handle``; subclasses write ``_handle``."""

    def __init__(self) -> None:
        self.counters: Counter[str] = Counter()

    @property
    def id(self) -> str:
        raise NotImplementedError

    def start(self, now: float) -> list[m.Message]:
        return []

    def tick(self, now: float) -> list[m.Message]:
        return []

    def handle(self, message: m.Message, now: float) -> list[m.Message]:
        """React to one message; bad input is counted and dropped, never raised."""
        try:
            return self._handle(message, now)
        except SaflError as exc:
            return self._reject(type(exc).__name__, str(exc))

    def _handle(self, message: m.Message, now: float) -> list[m.Message]:
        raise NotImplementedError

    def _reject(self, reason: str, detail: str) -> list[m.Message]:
        self.counters[f"rejected.{reason}"] += 1
        logging.getLogger(type(self).__module__).warning(
            "%s %s dropped a message (%s): %s", type(self).__name__.lower(), self.id, reason,
            detail)
        return []
