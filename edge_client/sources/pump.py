"""Runs a source in its own thread and hands its samples to the training loop.

Items are ``(sample, label)`` or ``(sample, label, frame number, capture time)``; the pump
numbers and stamps (unix seconds) those that come without.  A label of None waits for a
live label (``live_labels.py``); it travels as ``UNLABELLED``.

Back-pressure: for recordings and replays the pump blocks when its queue is
full (nothing recorded is lost); for live cameras it drops the newest frame
and counts it, because a camera cannot wait.  A source that fails stops the
pump with its error kept: :meth:`SourcePump.check` raises it in the training
loop, so a dead camera is never silent.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any, NamedTuple, Protocol

import numpy as np

from ..errors import SaflError, SourceError

__all__ = ["Source", "SourcePump", "Drained", "UNLABELLED"]

UNLABELLED = -1


class Drained(NamedTuple):
    """Samples taken from the pump, in arrival order."""

    x: np.ndarray
    y: np.ndarray  # UNLABELLED where the label is still to come
    frames: np.ndarray
    times: np.ndarray  # capture, unix seconds

log = logging.getLogger(__name__)


class Source(Protocol):
    counters: Counter[str]

    def samples(self) -> Iterator[tuple[Any, ...]]: ...
    def close(self) -> None: ...


class SourcePump:
    """A daemon thread moving ``(sample, label)`` pairs from a source into a bounded queue."""

    def __init__(self, source: Source, *, capacity: int = 256, drop_when_full: bool = False,
                 name: str = "source") -> None:
        self.source = source
        self.drop_when_full = drop_when_full
        self.counters: Counter[str] = Counter()
        self.error: BaseException | None = None
        self.finished = threading.Event()
        self._queue: queue.Queue[tuple[Any, ...]] = queue.Queue(maxsize=capacity)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"safl-{name}", daemon=True)

    def start(self) -> SourcePump:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            for sample in self.source.samples():
                if self._stop.is_set():
                    break
                # (x, y), or a camera's (x, y, frame, capture time)
                item = (*sample, self.counters["samples"], time.time()) \
                    if len(sample) == 2 else sample
                if self.drop_when_full:
                    try:
                        self._queue.put_nowait(item)
                    except queue.Full:
                        self.counters["frames_dropped"] += 1
                        continue
                else:
                    while not self._stop.is_set():
                        try:
                            self._queue.put(item, timeout=0.1)
                            break
                        except queue.Full:
                            self.counters["waits"] += 1
                self.counters["samples"] += 1
        except Exception as exc:  # any failure of a source must reach the training loop
            self.error = exc
            self.counters["source_errors"] += 1
            log.error("source stopped: %s", exc)
        finally:
            self.finished.set()

    def drain(self, max_samples: int) -> Drained | None:
        """Up to ``max_samples`` queued samples, or None if none are queued."""
        items: list[tuple[Any, ...]] = []
        while len(items) < max_samples:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                break
        if not items:
            return None
        return Drained(np.stack([it[0] for it in items]),
                       np.array([UNLABELLED if it[1] is None else it[1] for it in items],
                                dtype=np.int64),
                       np.array([it[2] for it in items], dtype=np.int64),
                       np.array([it[3] for it in items], dtype=np.float64))

    def check(self) -> None:
        """Raise the source's error, if it failed."""
        if self.error is not None:
            if isinstance(self.error, SaflError):
                raise self.error
            raise SourceError(f"source failed: {self.error!r}") from self.error

    @property
    def exhausted(self) -> bool:
        """The source ended (a finished recording) and every sample was drained."""
        return self.finished.is_set() and self._queue.empty()

    def metrics(self) -> dict[str, int]:
        """Pump and source counters, e.g. ``frames_dropped``, ``unlabelled``, ``wrong_shape``."""
        return {**self.source.counters, **self.counters, "queued": self._queue.qsize()}

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self.source.close()
        if self._thread.is_alive():
            self._thread.join(timeout)
