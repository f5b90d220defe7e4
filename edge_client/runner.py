"""Running roles on a transport: :class:`RoleRunner` binds one role to a transport,
:func:`serve` is the loop every service and every simulation runs, :class:`StopFlag` ends it,
and :func:`pace_replay` feeds a replayed stream in step with the federation.

A role is any object with ``subscriptions()``, ``start(now)``, ``handle(msg, now)`` and
``tick(now)`` returning messages to publish (``role.py``); a transport is anything that keeps
the :class:`~edge_client.transport.Transport` contract (MQTT, or the in-process bus).
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from . import messages as m
from .admission import LogLimiter
from .documents import MAX_ERROR
from .errors import RoleStalled, SaflError, SourceError
from .metrics import MetricsServer
from .role import Role
from .sources.replay import ReplaySource
from .topics import station_model_topic, topic_for
from .transport import Transport

if TYPE_CHECKING:  # the device imports the runner's module family, not the other way round
    from .body import Body
    from .device import Device

__all__ = ["RoleRunner", "StopFlag", "Watchdog", "serve", "pace_replay", "STALL_AFTER_S"]

log = logging.getLogger(__name__)

# How long a role's own work may fail on every try before the role ends (RoleStalled): a
# minute is a thousand ticks, or a few of its parent's models, and well past a transient.
STALL_AFTER_S = 60.0
# A model from the role's parent (its station's, the cloud's): a role that cannot handle
# them cannot follow the federation.  Messages from below (a device's update, a station's)
# never count: one participant's message must not be able to end a station or the cloud.
ESSENTIAL = (m.StationModel, m.GlobalModel)


class StopFlag:
    """Set by SIGTERM/SIGINT (when installed from the main thread) or by hand."""

    def __init__(self, install: bool = True) -> None:
        self.event = threading.Event()
        if install and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: self.event.set())

    def __bool__(self) -> bool:
        return self.event.is_set()


class Watchdog:
    """The role's own work that fails on every try: ``failed`` and ``succeeded`` per kind of
    work, ``check`` ends the role (:class:`RoleStalled`) once one kind has failed at least
    ``tries`` times and for ``after`` seconds with no success between."""

    def __init__(self, after: float = STALL_AFTER_S, tries: int = 3) -> None:
        self.after, self.tries = after, tries
        self._failing: dict[str, tuple[float, int, str]] = {}  # since, tries, last cause

    def failed(self, work: str, now: float, cause: str) -> None:
        since, tries, _ = self._failing.get(work, (now, 0, ""))
        self._failing[work] = (since, tries + 1, cause)

    def succeeded(self, work: str) -> None:
        self._failing.pop(work, None)

    def check(self, now: float) -> None:
        for work, (since, tries, cause) in self._failing.items():
            if tries >= self.tries and now - since >= self.after:
                raise RoleStalled(f"{work} failed on every one of {tries} tries over "
                                  f"{now - since:.0f} s, last: {cause}")


R = TypeVar("R", bound=Role)


class RoleRunner(Generic[R]):
    """Runs one role on a transport: subscribes it, feeds it, publishes what it returns."""

    def __init__(self, role: R, transport: Transport,
                 clock: Callable[[], float] = time.monotonic,
                 watchdog: Watchdog | None = None) -> None:
        self.role = role
        self.watchdog = watchdog or Watchdog()
        self.transport = transport
        self.clock = clock
        self.errors = 0
        # The last unexpected error, "<counter>: <exception>", for the role's summary: what
        # `safl status` and the monitor's page show beside the counter.
        self.last_error = ""
        self._limiter = LogLimiter()
        # Seconds from a message's arrival (where the transport stamps it) to the answer it
        # caused leaving: the last and the longest.  A device's answer to its selection is
        # what the station's deadline waits for; a board that falls behind shows it here.
        self.answer_s = self.answer_max_s = 0.0
        self.observers: list[Callable[[m.Message], None]] = []  # see what the role sends
        for topic_filter in role.subscriptions():
            transport.subscribe(topic_filter, self._on_message)

    def start(self) -> None:
        """Start the role; one that cannot start ends the service, naming why."""
        try:
            out = self.role.start(self.clock())
        except SaflError:
            raise
        except Exception as exc:
            raise RoleStalled(f"{type(self.role).__name__} could not start: "
                              f"{type(exc).__name__}: {exc}") from exc
        self.publish(out)

    def tick(self) -> None:
        """One tick of the role; an error in it is counted (``errors.tick``), never raised:
        the watchdog ends the role only when every tick fails for its whole window."""
        now = self.clock()
        try:
            out = self.role.tick(now)
        except Exception:  # the last line: a service never exits because of one tick
            self.count_error("errors.tick", "%s failed in tick", type(self.role).__name__)
            self.watchdog.failed("tick", now, self.last_error)
            return
        self.watchdog.succeeded("tick")
        self.publish(out)

    def count_error(self, key: str, *log_args: object) -> None:
        """Count an unexpected error under ``key``; its traceback is logged at most once a
        minute per key, so a bug hit every loop turn fills no disk."""
        self.errors += 1
        counters = getattr(self.role, "counters", None)
        if counters is not None:
            counters[key] += 1
        exc = sys.exc_info()[1]
        if exc is not None:  # one printable line, as summaries carry it (documents.MAX_ERROR)
            text = f"{key}: {type(exc).__name__}: {exc}"
            self.last_error = "".join(c if c.isprintable() else " " for c in text)[:MAX_ERROR]
        if log_args and self._limiter.allow(type(self.role).__name__, key):
            log.exception(*log_args)

    def publish(self, out: list[m.Message]) -> None:
        for message in out:
            for observe in self.observers:
                try:
                    observe(message)
                except Exception:
                    # An observer (an evaluation, a checkpoint, a manifest) that fails must
                    # not hold the message back: the federation would stall on it, silently.
                    self.count_error("errors.observer", "%s: an observer of %s failed; the "
                                     "message goes out all the same",
                                     type(self.role).__name__, type(message).__name__)
            self.transport.publish(topic_for(message), message)

    def figures(self) -> dict[str, float]:
        return {"answer_seconds": self.answer_s, "answer_max_seconds": self.answer_max_s}

    def _on_message(self, topic: str, message: m.Message) -> None:
        began, now = time.monotonic(), self.clock()
        essential = isinstance(message, ESSENTIAL)
        try:
            out = self.role.handle(message, now)
        except Exception:
            # Roles count their own rejections; this is the last line that keeps a service up.
            self.count_error("rejected.internal", "%s failed on %s from %s",
                             type(self.role).__name__, type(message).__name__, topic)
            if essential:
                self.watchdog.failed(f"handling {type(message).__name__}", now,
                                     self.last_error)
            return
        if essential:
            self.watchdog.succeeded(f"handling {type(message).__name__}")
        self.publish(out)
        if out:
            self.answer_s = time.monotonic() - getattr(self.transport, "arrived_at", began)
            self.answer_max_s = max(self.answer_max_s, self.answer_s)


def serve(runners: RoleRunner[Any] | Sequence[RoleRunner[Any]], transport: Transport, *,
          stop: StopFlag, done: Callable[[], bool] = lambda: False,
          hooks: tuple[Callable[[float], None], ...] = (),
          on_stop: Callable[[], None] | None = None,
          metrics: MetricsServer | None = None,
          idle_sleep: float = 0.05, linger: float = 0.5) -> None:
    """Connect, start every runner's role, then deliver messages and tick deadlines until
    ``stop`` is set or ``done()`` is true; close the transport whatever happens.

    ``hooks`` run every loop turn with the time (feeding samples, publishing a summary); a
    hook that fails is counted on the first runner and the loop goes on, except a source
    that failed for good (:class:`SourceError`, a camera past its ``retries``): the service
    ends with that error, and its unit restarts it.  So does a role whose own work fails on
    every try for its watchdog's window (:class:`RoleStalled`, exit code 9).  ``linger`` seconds
    of delivery after the end let the last answers go out; ``metrics`` closes with the loop.
    """
    runners = [runners] if isinstance(runners, RoleRunner) else list(runners)
    clock = runners[0].clock
    ended = False  # by the federation (done), not by a signal or an error
    transport.connect()
    try:
        try:
            for runner in runners:
                runner.start()
            while not stop and not done():
                if metrics is not None:
                    metrics.beat()
                busy = transport.deliver()
                for runner in runners:
                    runner.tick()
                for hook in hooks:
                    try:
                        hook(clock())
                    except SourceError:  # the camera is gone past its retries: end, naming it
                        raise
                    except Exception:  # feeding or reporting failed once: count it, go on
                        runners[0].count_error("errors.tick", "a service hook failed")
                for runner in runners:
                    runner.watchdog.check(runner.clock())
                if not busy:
                    transport.wait(idle_sleep)  # wakes as soon as a frame arrives
        except RoleStalled as exc:
            _stalled(runners, exc, on_stop)
            raise
        ended = not stop
        end = time.monotonic() + linger
        while time.monotonic() < end and not stop:
            transport.deliver()
            time.sleep(idle_sleep)
        if on_stop is not None:
            on_stop()
    finally:
        transport.close(final=ended)  # its presence says so
        if metrics is not None:
            metrics.close()


def _stalled(runners: Sequence[RoleRunner[Any]], exc: RoleStalled,
             on_stop: Callable[[], None] | None) -> None:
    """A role that cannot go on says why at error level and in its last summary (what
    ``safl status`` and the page show), before its presence goes offline."""
    log.error("%s cannot go on and ends (exit code %d): %s",
              ", ".join(type(r.role).__name__ for r in runners), exc.exit_code, exc)
    for runner in runners:
        runner.last_error = f"stalled: {exc}"[:MAX_ERROR]
    if on_stop is not None:
        try:
            on_stop()
        except Exception:
            log.exception("the last summary could not go out")


def pace_replay(runner: RoleRunner[Device], source: ReplaySource, rate: float,
                body: Body | None = None) -> None:
    """Feed ``runner``'s device ``rate`` samples per local step of each station model, from
    ``source``: a replayed stream paced by the federation (simulations, and devices with
    ``[source] per_iteration``).  Subscribed after the role, so the device has stored the
    model when that iteration's samples arrive.  A ``body`` embeds them first."""
    device = runner.role
    steps = device.config.local_steps

    def on_model(topic: str, message: m.Message) -> None:
        x, y = source.paced(rate, steps)
        if len(y) and body is not None:
            x = body.embed(x)
        if len(y):
            runner.publish(device.ingest(x, y, runner.clock()))
    runner.transport.subscribe(station_model_topic(device.config.fleet, device.config.station),
                               on_model)
