"""The transport interface, the in-process bus, and the runner binding a role to either.

A role is any object with ``subscriptions()``, ``start(now)``, ``handle(msg,
now)`` and ``tick(now)`` returning messages to publish.  :class:`RoleRunner`
drives it over a :class:`Transport`; the MQTT transport and :class:`LocalBus`
both implement that interface, so roles cannot tell them apart.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Protocol

from . import messages as m
from .admission import LogLimiter
from .errors import SaflError
from .role import Role
from .topics import matches, topic_for

__all__ = ["Transport", "LocalBus", "RoleRunner"]

log = logging.getLogger(__name__)

Handler = Callable[[str, m.Message], None]


class Transport(Protocol):
    """Publish typed messages to topics and deliver them to subscribers."""

    def publish(self, topic: str, message: m.Message) -> None: ...
    def subscribe(self, topic_filter: str, handler: Handler) -> None: ...
    def deliver(self) -> int: ...
    def close(self) -> None: ...


class LocalBus:
    """In-process FIFO bus: ``publish`` queues, ``deliver`` runs handlers until idle.

    It counts messages and payload bytes per message type, so simulations
    report traffic the same way for every strategy.
    """

    def __init__(self) -> None:
        # Exact topics are looked up, wildcard filters scanned; both keep subscription order
        # (an index), which decides who sees a message first.  Simulated fleets of thousands
        # of devices would otherwise match every message against every subscription.
        self._exact: dict[str, list[tuple[int, Handler]]] = {}
        self._wild: list[tuple[int, str, Handler]] = []
        self._count = 0
        self._queue: deque[tuple[str, m.Message]] = deque()
        self.messages: Counter[str] = Counter()
        self.payload_bytes: Counter[str] = Counter()
        self.closed = False
        self._stopping = False

    def publish(self, topic: str, message: m.Message) -> None:
        if self.closed:
            raise SaflError("publish on a closed bus")
        kind = type(message).__name__
        self.messages[kind] += 1
        self.payload_bytes[kind] += m.payload_nbytes(message)
        self._queue.append((topic, message))

    def subscribe(self, topic_filter: str, handler: Handler) -> None:
        self._count += 1
        if "+" in topic_filter or "#" in topic_filter:
            self._wild.append((self._count, topic_filter, handler))
        else:
            self._exact.setdefault(topic_filter, []).append((self._count, handler))

    def deliver(self) -> int:
        """Deliver queued messages, and those they cause, until the queue is empty."""
        count = 0
        while self._queue and not self._stopping:
            topic, message = self._queue.popleft()
            handlers = list(self._exact.get(topic, ()))
            handlers += [(i, h) for i, f, h in self._wild if matches(f, topic)]
            for _, handler in sorted(handlers, key=lambda pair: pair[0]):
                handler(topic, message)
            count += 1
        if self._stopping:
            self._queue.clear()
        return count

    def stop(self) -> None:
        """End ``deliver`` once the message being handled has reached every subscriber;
        what was still queued is dropped (a simulation that has trained its budget)."""
        self._stopping = True

    def close(self) -> None:
        self.closed = True
        self._queue.clear()


class RoleRunner:
    """Runs one role on a transport: subscribes it, feeds it, publishes what it returns."""

    def __init__(self, role: Role, transport: Transport,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.role = role
        self.transport = transport
        self.clock = clock
        self.errors = 0
        self._limiter = LogLimiter()
        self.observers: list[Callable[[m.Message], None]] = []  # see what the role sends
        for topic_filter in role.subscriptions():
            transport.subscribe(topic_filter, self._on_message)

    def start(self) -> None:
        self.publish(self.role.start(self.clock()))

    def tick(self) -> None:
        """One tick of the role; an error in it is counted (``errors.tick``), never raised."""
        try:
            out = self.role.tick(self.clock())
        except Exception:  # the last line: a service never exits because of one tick
            self.count_error("errors.tick", "%s failed in tick", type(self.role).__name__)
            return
        self.publish(out)

    def count_error(self, key: str, *log_args: object) -> None:
        """Count an unexpected error under ``key``; its traceback is logged at most once a
        minute per key, so a bug hit every loop turn fills no disk."""
        self.errors += 1
        counters = getattr(self.role, "counters", None)
        if counters is not None:
            counters[key] += 1
        if log_args and self._limiter.allow(type(self.role).__name__, key):
            log.exception(*log_args)

    def publish(self, out: list[m.Message]) -> None:
        for message in out:
            for observe in self.observers:
                observe(message)
            self.transport.publish(topic_for(message), message)

    def _on_message(self, topic: str, message: m.Message) -> None:
        try:
            out = self.role.handle(message, self.clock())
        except Exception:
            # Roles count their own rejections; this is the last line that keeps a service up.
            self.count_error("rejected.internal", "%s failed on %s from %s",
                             type(self.role).__name__, type(message).__name__, topic)
            return
        self.publish(out)
