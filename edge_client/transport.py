"""The transport contract, and the in-process bus that implements it.

A transport connects, carries typed messages between topic publishers and subscribers,
and lets its owner wait for traffic.  The MQTT transport (``mqtt.py``) and
:class:`LocalBus` both implement :class:`Transport`, so the one serve loop
(``runner.py``) drives a service and a simulation alike and roles cannot tell them apart.
This module knows nothing of roles.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from typing import Protocol

from . import messages as m
from .errors import SaflError
from .topics import Routes

__all__ = ["Transport", "LocalBus", "Handler"]

Handler = Callable[[str, m.Message], None]


class Transport(Protocol):
    """What the serve loop needs of a transport.

    ``connect`` blocks until messages can flow, and announces the participant's presence
    where the transport has one (MQTT: a retained ``Presence`` and its Last Will; every
    role on the in-process bus is always there).  ``subscribe`` may come before
    ``connect``.  ``deliver`` hands every received message to its subscribers in
    subscription order, on the caller's thread, and returns how many it handed;
    ``wait(timeout)`` blocks until traffic may have arrived (at once where nothing arrives
    from outside).  ``close`` says goodbye and drops what is still queued.
    """

    def connect(self) -> None: ...
    def subscribe(self, topic_filter: str, handler: Handler) -> None: ...
    def publish(self, topic: str, message: m.Message) -> None: ...
    def deliver(self) -> int: ...
    def wait(self, timeout: float) -> None: ...
    def close(self, final: bool = False) -> None: ...


class LocalBus:
    """In-process FIFO bus: ``publish`` queues, ``deliver`` runs handlers until idle.

    It counts messages and payload bytes per message type, so simulations
    report traffic the same way for every strategy.
    """

    def __init__(self) -> None:
        self._routes: Routes[Handler] = Routes()
        self._queue: deque[tuple[str, m.Message]] = deque()
        self.messages: Counter[str] = Counter()
        self.payload_bytes: Counter[str] = Counter()
        self.closed = False
        self._stopping = False

    def connect(self) -> None:
        """Nothing to reach: the bus is in this process."""

    def wait(self, timeout: float) -> None:
        """Returns at once: only this process's own handlers publish here."""

    @property
    def idle(self) -> bool:
        """Nothing queued: until someone publishes, nothing more happens."""
        return not self._queue

    def publish(self, topic: str, message: m.Message) -> None:
        if self.closed:
            raise SaflError("publish on a closed bus")
        kind = m.traffic_kind(message)
        self.messages[kind] += 1
        self.payload_bytes[kind] += m.payload_nbytes(message)
        self._queue.append((topic, message))

    def subscribe(self, topic_filter: str, handler: Handler) -> None:
        self._routes.add(topic_filter, handler)

    def deliver(self, limit: int | None = None) -> int:
        """Deliver queued messages, and those they cause, until the queue is empty, or until
        ``limit`` have reached their subscribers (a simulated factory takes the cloud's model
        and pauses while the driver records the round, ``lab/factory.py``)."""
        count = 0
        while self._queue and not self._stopping and (limit is None or count < limit):
            topic, message = self._queue.popleft()
            for handler in self._routes.handlers(topic):
                handler(topic, message)
            count += 1
        if self._stopping:
            self._queue.clear()
        return count

    def stop(self) -> None:
        """End ``deliver`` once the message being handled has reached every subscriber;
        what was still queued is dropped (a simulation that has trained its budget)."""
        self._stopping = True

    def close(self, final: bool = False) -> None:
        self.closed = True
        self._queue.clear()
