"""What every role (device, station, cloud) shares: the protocol, rejection counting, and
explicit states.

A role never raises on bad input: it counts it under ``rejected.<reason>``, logs
it at most once a minute per sender and reason, and leaves its accepted state
untouched.  A role names its states in a :class:`RoleState` enum and the events that move it
in a :class:`RoleEvent` enum, and its ``TRANSITIONS`` table maps (state, event) to the next
state, as h11 does.  A role looks the event up (:meth:`RoleBase.next_state`) before it
changes anything: an event the table lacks is refused (``rejected.bad_transition``, naming
the role, the state and the event) and leaves the role exactly as it was.
:func:`state_diagram` draws a table (``docs/states.md``).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from typing import Any, ClassVar, Generic, Protocol, TypeVar, cast

from . import messages as m
from .admission import LogLimiter
from .errors import SaflError
from .messages import NamedEnum

__all__ = ["Role", "RoleBase", "RoleState", "RoleEvent", "TransitionError", "state_diagram"]


class Role(Protocol):
    def subscriptions(self) -> list[str]: ...
    def start(self, now: float) -> list[m.Message]: ...
    def handle(self, message: m.Message, now: float) -> list[m.Message]: ...
    def tick(self, now: float) -> list[m.Message]: ...
    def wakeup(self) -> float | None: ...


class RoleState(NamedEnum):
    """A role's state: an enum member that prints, formats and serialises as its name."""


class RoleEvent(NamedEnum):
    """What happened to a role, as its transition table knows it."""


class TransitionError(SaflError):
    """An event the role's transition table has no move for, in the role's state."""

    reason = "bad_transition"


S = TypeVar("S", bound="RoleState")


class RoleBase(Generic[S]):
    """Counters, logging and the error boundary of ``handle``; subclasses write ``_handle``.

    A role with states sets ``INITIAL``, ``TRANSITIONS`` ((state, event) -> next state) and
    ``state``; it asks :meth:`next_state` before an event changes anything, and sets
    ``state`` to the answer once the event's work is done.
    """

    # (A class variable cannot name the role's own state type: its states are ``S``.)
    INITIAL: ClassVar[RoleState]
    TRANSITIONS: ClassVar[Mapping[tuple[Any, RoleEvent], Any]] = {}
    state: S

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

    def wakeup(self) -> float | None:
        """The earliest time ``tick`` has work (a deadline, a repeat), or None: a simulator in
        virtual time ticks the role then, and a service's loop need not ask."""
        return None

    def handle(self, message: m.Message, now: float) -> list[m.Message]:
        """React to one message; bad input is counted and dropped, never raised."""
        self._sender = message.sender
        try:
            return self._handle(message, now)
        except SaflError as exc:
            return self._reject(getattr(exc, "reason", type(exc).__name__), str(exc))

    def _handle(self, message: m.Message, now: float) -> list[m.Message]:
        raise NotImplementedError

    def next_state(self, *events: RoleEvent) -> S:
        """The state ``events``, one after another, take the role to from its own; a
        :class:`TransitionError` naming the role, the state and the event where the table
        has no such move.  It changes nothing, so a role asks before an event's work (the
        whole way, where one event leads into another) and is unchanged if refused."""
        state: RoleState = self.state
        for event in events:
            new = self.TRANSITIONS.get((state, event))
            if new is None:
                raise TransitionError(f"{type(self).__name__.lower()} {self.id} in state "
                                      f"{state.value} has no move on {event.value}")
            state = new
        return cast(S, state)

    def _reject(self, reason: str, detail: str) -> list[m.Message]:
        self.counters[f"rejected.{reason}"] += 1
        if self._limiter.allow(self._sender, reason):
            logging.getLogger(type(self).__module__).warning(
                "%s %s dropped a message from %s (%s): %s", type(self).__name__.lower(),
                self.id, self._sender or "?", reason, detail)
        return []


def state_diagram(role: type[RoleBase[Any]]) -> str:
    """``role``'s transition table as a Mermaid state diagram (``docs/states.md``)."""
    lines = ["stateDiagram-v2", f"    [*] --> {role.INITIAL.value}"]
    for (state, event), new in role.TRANSITIONS.items():
        lines.append(f"    {state.value} --> {new.value}: {event.value}")
    return "\n".join(lines)
