"""What every role (device, station, cloud) shares: the protocol, rejection counting, and
explicit states.

A role never raises on bad input: it counts it under ``rejected.<reason>``, logs
it at most once a minute per sender and reason, and leaves its accepted state
untouched.  A role with states names them in a :class:`RoleState` enum and moves between
them only through :meth:`RoleBase.move` and its transition table, so a move the table
lacks is refused (``rejected.bad_transition``) with the role, the state and the event.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from typing import ClassVar, Protocol

from . import messages as m
from .admission import LogLimiter
from .errors import SaflError
from .messages import NamedEnum

__all__ = ["Role", "RoleBase", "RoleState", "TransitionError"]


class Role(Protocol):
    def subscriptions(self) -> list[str]: ...
    def start(self, now: float) -> list[m.Message]: ...
    def handle(self, message: m.Message, now: float) -> list[m.Message]: ...
    def tick(self, now: float) -> list[m.Message]: ...


class RoleState(NamedEnum):
    """A role's state: an enum member that prints, formats and serialises as its name."""


class TransitionError(SaflError):
    """A role was asked to move between two states its transition table does not join."""

    reason = "bad_transition"


class RoleBase:
    """Counters, logging and the error boundary of ``handle``; subclasses write ``_handle``.

    A role with states sets ``TRANSITIONS`` (state -> the states it may move to) and
    ``state``, and changes ``state`` only with :meth:`move`.
    """

    TRANSITIONS: ClassVar[Mapping[RoleState, frozenset[RoleState]]] = {}
    state: RoleState

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

    def move(self, new: RoleState, event: str) -> None:
        """Go to ``new`` because of ``event``, if the transition table allows it."""
        if new not in self.TRANSITIONS.get(self.state, frozenset()):
            raise TransitionError(f"{type(self).__name__.lower()} {self.id} in state "
                                  f"{self.state.value} cannot go to {new.value} on {event}")
        self.state = new

    def _reject(self, reason: str, detail: str) -> list[m.Message]:
        self.counters[f"rejected.{reason}"] += 1
        if self._limiter.allow(self._sender, reason):
            logging.getLogger(type(self).__module__).warning(
                "%s %s dropped a message from %s (%s): %s", type(self).__name__.lower(),
                self.id, self._sender or "?", reason, detail)
        return []
