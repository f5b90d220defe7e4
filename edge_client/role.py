"""What every role (device, station, cloud) shares: the protocol and rejection counting.

A role never raises on bad input: it counts it under ``rejected.<reason>``, logs
it at most once a minute per sender and reason, and leaves its accepted state
untouched.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Protocol

from . import messages as m
from .admission import LogLimiter
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
        self._limiter = LogLimiter()
        self._sender = ""  # of the message being handled, for rate-limited logging

    @property
    def id(self) -> str:
        raise NotImplementedError

    def start(self, now: float) -> list[m.Message]:
        return []

    def tick(self, now: float) -> list[m.Message]:
        return []

    def handle(self, message: m.Message, now: float) -> list[m.Message]:
        """React to one message; bad input is counted and dropped, never raised."""
        self._sender = message.sender
        try:
            return self._handle(message, now)
        except SaflError as exc:
            return self._reject(getattr(exc, "reason", type(exc).__name__), str(exc))

    def _handle(self, message: m.Message, now: float) -> list[m.Message]:
        raise NotImplementedError

    def _reject(self, reason: str, detail: str) -> list[m.Message]:
        self.counters[f"rejected.{reason}"] += 1
        if self._limiter.allow(self._sender, reason):
            logging.getLogger(type(self).__module__).warning(
                "%s %s dropped a message from %s (%s): %s", type(self).__name__.lower(),
                self.id, self._sender or "?", reason, detail)
        return []
