"""Cameras and recorded video through OpenCV ``VideoCapture``: one code path for both.

The URI is a device index (``"0"``), an RTSP/HTTP URL, a GStreamer pipeline
(anything containing ``" ! "``, e.g. a Jetson CSI camera through ``nvarguscamerasrc``),
or a video file.  Opening retries with jittered exponential backoff, then fails with a
:class:`SourceError` that names the URI: a camera that never answered is a wrong address.
A live camera lost after it delivered frames is an outage, not an error: it is reopened
for as long as it takes, the backoff capped at ``max_backoff`` (a line runs unattended,
and a camera rebooting or a switch replaced must not end its device), the outage counted
(``camera_outages``), timed (:attr:`VideoSource.outage_s`) and said at error level once it
outlasts the retries.  A recording ends once (logged,
counted as ``recording_ended``) or, with ``loop``, starts over (``loops``); frames of the
wrong shape are refused with one log line and counted (``wrong_shape``).  Each frame is
yielded as ``(sample, label, frame number, capture time)``, the time in unix seconds; with
no labeller (labels that arrive live) its label is None.
"""

from __future__ import annotations

import logging
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ShapeError, SourceError
from .preprocess import Preprocess

__all__ = ["VideoSource", "Labeler"]

log = logging.getLogger(__name__)

Labeler = Callable[[int, float, np.ndarray], "int | None"]


def _kind(uri: str) -> str:
    if uri.isdigit():
        return "device"
    if " ! " in uri:
        return "gstreamer"
    if "://" in uri:
        return "url"
    return "file"


class VideoSource:
    """Frames from a camera or a video file, sampled, preprocessed and labelled.

    Parameters
    ----------
    uri : str
        Device index, URL, GStreamer pipeline or file path.
    sample_fps : float
        Frames kept per second of stream time (0 keeps every frame).  Files use
        their own timestamps, live sources the clock.
    retries, backoff, max_backoff : int, float, float
        Attempts after the first at opening the camera (a camera lost later is retried
        until it is back), and the backoff base and cap in seconds.
    timeout : float
        Seconds a network camera may take to open, or between frames, before it counts as
        lost (``read_failures``) and is reconnected.
    loop : bool
        A video file starts over at its end (frame numbers and times too, so a sidecar
        keyed by either labels every pass alike).
    """

    def __init__(self, uri: str, preprocess: Preprocess, labeler: Labeler | None, *,
                 sample_fps: float = 0.0, retries: int = 5, backoff: float = 0.5,
                 loop: bool = False, timeout: float = 10.0,
                 max_backoff: float = 10.0, rng: np.random.Generator | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.uri, self.kind = str(uri), _kind(str(uri))
        if self.kind == "file" and not Path(self.uri).is_file():
            raise SourceError(f"video file {self.uri} does not exist")
        self.preprocess, self.labeler, self.sample_fps = preprocess, labeler, sample_fps
        self.retries, self.backoff, self.max_backoff = retries, backoff, max_backoff
        self.loop, self.timeout = loop, timeout
        # Reconnect jitter: the caller's generator, else one of this camera's own (seeded by
        # its address, so two cameras back off apart and a run repeats).
        self.rng = rng if rng is not None else np.random.default_rng(zlib.crc32(self.uri.encode()))
        self.clock, self.sleep = clock, sleep
        # One set of metrics per source: the labeler counts into the same Counter.
        self.wall = time.time  # capture times: labels from the line name wall-clock times
        shared = getattr(labeler, "counters", None)
        self.counters: Counter[str] = shared if shared is not None else Counter()
        self._cap = None
        self._stopped = False
        self._lost_at: float | None = None  # self.clock() when a live camera was lost

    @property
    def live(self) -> bool:
        return self.kind != "file"

    @property
    def outage_s(self) -> float:
        """Seconds the live camera has been lost for (0 while it delivers)."""
        return 0.0 if self._lost_at is None else self.clock() - self._lost_at

    def _open(self) -> Any:
        """The capture, opened: ``retries`` more attempts for a camera never opened, every
        attempt it takes for one lost during an outage (``_lost_at`` set)."""
        attempt = 0
        while not self._stopped:
            cap = self._capture()
            if cap.isOpened():
                return cap
            cap.release()
            self.counters["open_failures"] += 1
            if attempt >= self.retries and self._lost_at is None:
                raise SourceError(f"cannot open {self.kind} {self.uri!r} after "
                                  f"{self.retries + 1} attempts: check the device, URL or "
                                  "pipeline")
            delay = min(self.max_backoff, self.backoff * 2 ** min(attempt, 32))
            delay *= 0.5 + 0.5 * self.rng.random()  # jitter: cameras rebooting together
            if attempt == self.retries:  # said once an outage, at error level
                log.error("%s %s lost %.0f s ago and still not back after %d attempts: "
                          "trying again every %.0f s at most for as long as it takes "
                          "(camera_outage_seconds)", self.kind, self.uri, self.outage_s,
                          attempt + 1, self.max_backoff)
            elif attempt < self.retries:
                log.warning("cannot open %s %s (attempt %d of %d); retrying in %.1f s",
                            self.kind, self.uri, attempt + 1, self.retries + 1, delay)
            self.sleep(delay)
            attempt += 1
        return None

    def _capture(self) -> Any:
        import cv2

        if self.kind == "device":
            cap = cv2.VideoCapture(int(self.uri))
        elif self.kind == "gstreamer":
            cap = cv2.VideoCapture(self.uri, cv2.CAP_GSTREAMER)
        elif self.kind == "url":
            # A network camera that accepts the connection but sends nothing would hold
            # the read for FFmpeg's default 30 s: give up sooner and reconnect.
            ms = int(self.timeout * 1000)
            cap = cv2.VideoCapture(self.uri, cv2.CAP_FFMPEG,
                                   [cv2.CAP_PROP_OPEN_TIMEOUT_MSEC, ms,
                                    cv2.CAP_PROP_READ_TIMEOUT_MSEC, ms])
        else:
            cap = cv2.VideoCapture(self.uri)
        return cap

    def samples(self) -> Iterator[tuple[np.ndarray, int | None, int, float]]:
        import cv2

        self._cap = self._open()
        try:
            yield from self._frames(cv2)
        finally:
            if self._cap is not None:
                self._cap.release()

    def _frames(self, cv2: Any) -> Iterator[tuple[np.ndarray, int | None, int, float]]:
        frame_no, next_t = -1, 0.0
        while self._cap is not None and not self._stopped:
            ok, frame = self._cap.read()
            if not ok:
                if not self.live:
                    if self.loop and frame_no >= 0:
                        if not self.counters["loops"]:
                            log.info("%s ended after %d frames; looping", self.uri,
                                     frame_no + 1)
                        self.counters["loops"] += 1
                        self._cap.set(cv2.CAP_PROP_POS_FRAMES, 0)
                        frame_no, next_t = -1, 0.0
                        continue
                    self.counters["recording_ended"] = 1
                    log.info("%s ended after %d frames", self.uri, frame_no + 1)
                    return
                self.counters["read_failures"] += 1
                if self._lost_at is None:
                    self._lost_at = self.clock()
                    self.counters["camera_outages"] += 1
                log.warning("lost %s %s; reconnecting", self.kind, self.uri)
                self._cap.release()
                self._cap = self._open()
                if self._cap is not None:
                    self.counters["reconnects"] += 1
                continue
            if self._lost_at is not None:  # frames again: the outage is over
                log.info("%s %s is back after %.1f s", self.kind, self.uri, self.outage_s)
                self._lost_at = None
            frame_no += 1
            captured = self.wall()
            t = self.clock() if self.live else self._cap.get(cv2.CAP_PROP_POS_MSEC) / 1000.0
            if self.sample_fps:
                if t < next_t:
                    continue
                next_t = t + 1.0 / self.sample_fps
            try:
                sample = self.preprocess(frame)
            except ShapeError as exc:
                if not self.counters["wrong_shape"]:  # one line, however many frames follow
                    log.warning("%s frame %d: %s; refusing such frames (counted as "
                                "wrong_shape; fix [source] crop/resize)", self.uri, frame_no, exc)
                self.counters["wrong_shape"] += 1
                continue
            if self.labeler is None:  # its label comes later, from the line
                yield sample, None, frame_no, captured
                continue
            label = self.labeler(frame_no, t, sample)
            if label is None:
                self.counters["unlabelled"] += 1
                continue
            yield sample, label, frame_no, captured

    def close(self) -> None:
        """Ask the reading loop to stop; it releases the capture itself."""
        self._stopped = True
