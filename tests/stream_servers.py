"""Network cameras on loopback for the tests, and the production line they watch.

:class:`Line` is a conveyor: items of known classes (scikit-learn digits drawn large) pass
the camera one after another; it renders what is in view at each instant as raw BGR frames
into a stream server's stdin, and publishes, as an inspection station would, a label for
what was in view, a realistic 0.5-3 s later.  The servers are real: ``ffmpeg`` serving HTTP
MJPEG (``-f mpjpeg -listen 1``), and GStreamer's RTSP server (``rtsp_server.py``, run by the
system python3).  Frames written while no server or client takes them are dropped, as a
camera's are.
"""

from __future__ import annotations

import heapq
import json
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

WIDTH = HEIGHT = 64
FPS = 10
SYSTEM_PYTHON = "/usr/bin/python3"
RTSP_SERVER = Path(__file__).with_name("rtsp_server.py")


def have_rtsp_server() -> bool:
    """GStreamer's RTSP server for the system python3 (Debian packages, see .ci/run)."""
    if not Path(SYSTEM_PYTHON).exists():
        return False
    probe = subprocess.run([SYSTEM_PYTHON, "-c", "import gi; gi.require_version("
                            "'GstRtspServer', '1.0'); from gi.repository import GstRtspServer"],
                           capture_output=True)
    return probe.returncode == 0


def have_ffmpeg() -> bool:
    return shutil.which("ffmpeg") is not None


class StreamServer:
    """One server process fed frames on stdin; :meth:`restart` kills it and starts anew."""

    def __init__(self, kind: str, port: int, log: Path) -> None:
        self.kind, self.port, self.log_path = kind, port, log
        self.restarts = 0
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def uri(self) -> str:
        if self.kind == "mjpeg":
            return f"http://127.0.0.1:{self.port}/cam.mjpg"
        return f"rtsp://127.0.0.1:{self.port}/cam"

    def _command(self) -> list[str]:
        if self.kind == "mjpeg":
            return ["ffmpeg", "-hide_banner", "-loglevel", "error", "-f", "rawvideo",
                    "-pix_fmt", "bgr24", "-s", f"{WIDTH}x{HEIGHT}", "-r", str(FPS), "-i", "-",
                    "-f", "mpjpeg", "-q:v", "3", "-listen", "1", self.uri]
        return [SYSTEM_PYTHON, str(RTSP_SERVER), str(self.port), str(WIDTH), str(HEIGHT),
                str(FPS)]

    def start(self) -> None:
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(self._command(), stdin=subprocess.PIPE, stdout=log,
                                         stderr=subprocess.STDOUT)
        self._slot: list[bytes] = []
        self._ready = threading.Condition()
        threading.Thread(target=self._writer, args=(self.proc,), daemon=True).start()

    def write(self, frame: bytes) -> None:
        """Offer a frame; while the server is not taking frames (no client yet, or down)
        the newest replaces the one waiting, as a camera drops frames nobody reads."""
        with self._ready:
            self._slot[:] = [frame]
            self._ready.notify()

    def _writer(self, proc: subprocess.Popen) -> None:
        while proc.poll() is None:
            with self._ready:
                if not self._slot:
                    self._ready.wait(0.5)
                    continue
                frame = self._slot.pop()
            try:
                proc.stdin.write(frame)  # whole frames only: raw video has no resync
                proc.stdin.flush()
            except (BrokenPipeError, OSError, ValueError):
                return  # the server is down: frames are lost, as a camera's

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(5)

    def restart(self) -> None:
        self.kill()
        self.start()
        self.restarts += 1

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.kill()


class Line:
    """Items of ``classes`` pass the camera, ``item_s`` seconds each (each one of the first
    ``variants`` images of its class); labels follow.

    ``publish(topic, payload)`` sends a label, each after a delay drawn from 0.5-3 s, stamped
    as ``stamping`` says: ``"middle"``, ``labels_per_item`` verdicts timed inside the item's
    middle (where a frame captured a little late still shows it); ``"start"``, one verdict
    stamped with the time the item came into view; ``"late"``, one stamped ``late_s`` after
    its middle (an inspection station downstream stamping its own verdict); ``"prediction"``,
    none by itself: :meth:`answer` gives each prediction the class of the item in front of the
    camera at the prediction's ``t``, stamped with that ``t``.
    """

    def __init__(self, images: np.ndarray, targets: np.ndarray, classes: tuple[int, ...], *,
                 topic: str, publish, item_s: float = 1.0, labels_per_item: int = 3,
                 variants: int = 3, seed: int = 0, smooth: bool = False,
                 stamping: str = "middle", late_s: float = 2.0) -> None:
        self.smooth, self.stamping, self.late_s = smooth, stamping, late_s
        # The line's lighting: what a lamp makes of each item's picture (None: as it was).
        self.lamp: Callable[[np.ndarray], np.ndarray] | None = None
        # Classes whose items are foreign parts: they pass the camera, and get no verdict.
        self.foreign: tuple[int, ...] = ()
        self.answered: list[tuple[float, int, int]] = []  # (t, predicted, the item's class)
        self.sent_t: list[float] = []  # the time each label sent names, in sending order
        self.images, self.targets, self.classes = images, targets, classes
        self.topic, self.publish_fn, self.item_s = topic, publish, item_s
        self.labels_per_item, self.variants = labels_per_item, variants
        self.rng = np.random.default_rng(seed)
        self.items: list[tuple[float, int, np.ndarray]] = []  # (start, label, picture)
        self.sent = 0
        self.delays: list[float] = []
        self._pending: list[tuple[float, float, int]] = []  # (send at, t, label)
        self._stop = threading.Event()
        self._lock = threading.Lock()  # answers come on the watcher's thread
        self._threads: list[threading.Thread] = []

    def _picture(self, label: int) -> np.ndarray:
        # A product type looks much the same every time: a few exemplars per class.
        pool = np.flatnonzero(self.targets == label)[:self.variants]
        image = self.images[self.rng.choice(pool)]
        side = int(np.sqrt(image.size))
        if self.smooth:  # a photographed item: no pixel blocks for the JPEG encoder to ring at
            import cv2
            big = cv2.resize(image.reshape(side, side).astype(np.float32), (WIDTH, HEIGHT),
                             interpolation=cv2.INTER_CUBIC)
        else:
            big = np.kron(image.reshape(side, side), np.ones((HEIGHT // side, WIDTH // side)))
        return np.repeat(np.clip(big * 255, 0, 255).astype(np.uint8)[:, :, None], 3, axis=2)

    def photo(self, label: int) -> np.ndarray:
        """A picture of an item of class ``label`` as the camera shows it (BGR, 64 x 64)."""
        return self._noisy(self._picture(label))

    def _noisy(self, picture: np.ndarray) -> np.ndarray:
        return np.clip(picture.astype(np.int16) + self.rng.integers(-12, 13, picture.shape),
                       0, 255).astype(np.uint8)

    def item_at(self, t: float) -> int | None:
        """The class of the item in front of the camera at time ``t``, if one was."""
        for start, label, _ in reversed(self.items):
            if start <= t < start + self.item_s:
                return label
        return None

    def _next_item(self, start: float) -> None:
        label = int(self.rng.choice(self.classes))
        self.items.append((start, label, self._picture(label)))
        margin = self.item_s * 0.4  # the first 40% of an item may still show the last
        stamps = {"middle": [start + margin + (self.item_s - margin) * (k + 0.5)
                             / self.labels_per_item for k in range(self.labels_per_item)],
                  "start": [start], "late": [start + self.item_s / 2 + self.late_s],
                  "prediction": []}[self.stamping]
        for t in stamps if label not in self.foreign else ():
            self._later(t, label)

    def _later(self, t: float, label: int) -> None:
        with self._lock:
            heapq.heappush(self._pending, (max(t, time.time()) + float(self.rng.uniform(0.5, 3.0)),
                                           t, label))

    def answer(self, t: float, predicted: int) -> None:
        """The line's verdict on a prediction it received (``stamping = "prediction"``)."""
        label = self.item_at(t)
        if label is not None and label not in self.foreign:
            self.answered.append((t, predicted, label))
            self._later(t, label)

    def run(self, servers: list[StreamServer]) -> None:
        start = time.time()
        self._next_item(start)
        self._threads = [threading.Thread(target=self._frames, args=(servers, start),
                                          daemon=True),
                         threading.Thread(target=self._labels, daemon=True)]
        for thread in self._threads:
            thread.start()

    def _frames(self, servers: list[StreamServer], start: float) -> None:
        frame_no = 0
        while not self._stop.is_set():
            now = time.time()
            while now >= self.items[-1][0] + self.item_s:
                self._next_item(self.items[-1][0] + self.item_s)
            picture = self.items[-1][2]
            if self.lamp is not None:
                picture = self.lamp(picture)
            noisy = self._noisy(picture)
            for server in servers:
                server.write(noisy.tobytes())
            frame_no += 1
            self._stop.wait(max(0.0, start + frame_no / FPS - time.time()))

    def _labels(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                due = self._pending and self._pending[0][0] <= time.time()
                if due:
                    at, t, label = heapq.heappop(self._pending)
            if due:
                self.publish_fn(self.topic, json.dumps({"t": t, "label": label}).encode())
                self.sent += 1
                self.sent_t.append(t)
                self.delays.append(at - t)
            else:
                self._stop.wait(0.02)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(2)
