"""``safl monitor --http HOST:PORT``: a live page of the fleet for a field test.

The monitor reads what ``safl status`` reads (presences, the stations', cloud's and devices'
retained summaries, the manifest; never an update or a model), keeps a short history of it
(:class:`FleetHistory`: the global model's accuracy per round, each device's accuracy over
time, the bytes the devices and stations sent and received), and serves it read-only over
HTTP (:class:`MonitorServer`): ``/`` the page, ``/monitor.js`` its script, ``/api/fleet``
the JSON the script redraws from every two seconds.  Everything the page needs is in
:mod:`aggregator.monitor_page`; nothing is fetched from elsewhere.  Bad requests (unknown
paths, oversized or malformed request lines, more connections than it serves at once) get
an error answer and a counter, and never stop it.  With ``--out`` it records the field test
for ``safl report`` (``devices.csv``, ``metrics.csv``, ``fleet.json``).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import logging
import math
import threading
import time
from collections import Counter, deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from edge_client import messages as m
from edge_client.config import BrokerConfig
from edge_client.config.sources import MAX_LABEL_LAG
from edge_client.documents import CloudSummary, DeviceSummary, Document, StationSummary
from edge_client.errors import SaflError
from edge_client.files import write_atomic
from edge_client.metrics import counted
from edge_client.runner import StopFlag
from edge_client.topics import CLOUD_ID

from .monitor_page import (
    CHART_DEVICES,
    PAGE,
    PAGE_ROWS,
    SCRIPT,
    SHOWN_ERRORS,
    requested_page,
    trouble,
)
from .status import FleetStatus, observer, prediction_age

__all__ = ["FleetHistory", "MonitorServer", "run_monitor", "watch"]

log = logging.getLogger(__name__)

MAX_POINTS = 600  # per series: ten minutes of a device reporting every second
MAX_PATH = 2048  # bytes of a request target; the page's own are short
MAX_CLIENTS = 16  # requests served at once; more are told to come back
MAX_DEVICES = 10_000  # devices with a series: an open broker's flood of ids stops there
DEVICE_COLUMNS = ["t", "round", "iteration", "device", "station", "local_accuracy",
                  "prequential_accuracy", "uploads", "skips", "refused", "clipped",
                  "frames_dropped", "label_joined", "label_unmatched", "label_expired",
                  "bytes_out", "bytes_in"]


class FleetHistory:
    """The fleet as the monitor has seen it: the latest documents and presences
    (:class:`FleetStatus`), with series of what changed since the monitor started."""

    def __init__(self, fleet: str, clock=time.monotonic) -> None:
        self.fleet, self.clock, self.started = fleet, clock, clock()
        self.status = FleetStatus()
        self.global_accuracy: dict[int, float] = {}  # round -> accuracy of its global model
        self.device_accuracy: dict[str, deque[tuple[float, float | None, float | None]]] = {}
        self._device_at: dict[str, tuple[int, int]] = {}
        self.traffic: deque[tuple[float, int, int]] = deque(maxlen=MAX_POINTS)
        self._bytes_of: dict[str, tuple[int, int]] = {}  # each participant's last count
        self._sent = self._received = 0
        self.recorded: list[dict[str, Any]] = []  # device rows not yet written to devices.csv
        self.lock = threading.Lock()
        self.counters: Counter[str] = Counter()  # what the fleet sent that it did not show

    def take(self, doc: Document) -> None:
        """A document arrived (``status`` has already kept it): extend the series."""
        now = round(self.clock() - self.started, 2)
        if isinstance(doc, CloudSummary):
            self.global_accuracy.update(zip(doc.accuracy_rounds, doc.accuracies, strict=False))
        elif isinstance(doc, DeviceSummary):
            if doc.device not in self.device_accuracy and len(self.device_accuracy) >= \
                    MAX_DEVICES:
                self.counters["fleet.too_many_devices"] += 1
                self.status.devices.pop(doc.device, None)
                return
            doc = self._plausible(doc)
            at = (doc.round, doc.iteration)
            if self._device_at.get(doc.device) != at and (
                    doc.local_accuracy is not None or doc.prequential_accuracy is not None):
                self._device_at[doc.device] = at
                self.device_accuracy.setdefault(doc.device, deque(maxlen=MAX_POINTS)).append(
                    (now, doc.local_accuracy, doc.prequential_accuracy))
                # Wall-clock time: a restarted monitor appends to the same record.
                row = {**self._device_row(doc.device), "t": round(time.time(), 2),
                       "device": doc.device}
                self.recorded.append({k: row.get(k) for k in DEVICE_COLUMNS})
        if isinstance(doc, (DeviceSummary, StationSummary)):
            self._count_bytes(doc, now)

    def _plausible(self, doc: DeviceSummary) -> DeviceSummary:
        """A device's claimed accuracies outside [0, 1], lags outside [-MAX_LABEL_LAG,
        MAX_LABEL_LAG], negative times and durations are shown as not measured, counted."""
        def within(key: str, high: float = 1.0, low: float = 0.0) -> Any:
            value = getattr(doc, key)
            if value is None or low <= value <= high:
                return value
            self.counters[f"fleet.implausible_{key}"] += 1
            return None
        checked = dataclasses.replace(
            doc, local_accuracy=within("local_accuracy"),
            prequential_accuracy=within("prequential_accuracy"),
            shadow_accuracy=within("shadow_accuracy"),
            # A lag the device cannot have applied or measured, a body that ran backwards.
            label_lag=within("label_lag", MAX_LABEL_LAG, -MAX_LABEL_LAG),
            label_lag_estimate=within("label_lag_estimate", MAX_LABEL_LAG, -MAX_LABEL_LAG),
            body_ms_per_frame=within("body_ms_per_frame", math.inf),
            camera_outage=within("camera_outage", math.inf),
            predictions_behind=within("predictions_behind"),
            labels_held=within("labels_held", math.inf),
            last_prediction=within("last_prediction", math.inf))
        self.status.devices[doc.device] = checked
        return checked

    def _count_bytes(self, doc: DeviceSummary | StationSummary, now: float) -> None:
        """Bytes the devices and stations have sent and received, by their own count: the
        totals move by what this participant's count moved (one summary, not the fleet,
        each time), and the series keeps a point a second."""
        who = doc.device if isinstance(doc, DeviceSummary) else f"station/{doc.station}"
        count = (doc.transport.get("bytes_out", 0), doc.transport.get("bytes_in", 0))
        before = self._bytes_of.get(who, (0, 0))
        self._bytes_of[who] = count
        self._sent += count[0] - before[0]
        self._received += count[1] - before[1]
        if self.traffic and now - self.traffic[-1][0] < 1.0:
            self.traffic[-1] = (self.traffic[-1][0], self._sent, self._received)
        else:
            self.traffic.append((now, self._sent, self._received))

    def _online(self, role: m.Participant, ident: str) -> bool | None:
        return self.status.presence.get((role, ident))

    def _station_row(self, sid: str) -> dict[str, Any]:
        doc = self.status.stations.get(sid)
        row: dict[str, Any] = {"id": sid, "presence": self._online(m.Participant.STATION, sid)}
        if doc is None:
            return row
        counters = {**doc.counters, **doc.transport}
        return {**row, **{k: v for k, v in dataclasses.asdict(doc).items()
                          if k not in ("counters", "transport", "station")},
                "uploads": doc.counters.get("received_updates", 0),
                "skips": doc.counters.get("received_skips", 0),
                "refused": counted(counters, "rejected."), "clipped": counted(counters, "clipped."),
                "bytes_out": doc.transport.get("bytes_out", 0),
                "bytes_in": doc.transport.get("bytes_in", 0)}

    def _device_row(self, did: str) -> dict[str, Any]:
        doc = self.status.devices.get(did)
        row: dict[str, Any] = {"id": did, "presence": self._online(m.Participant.DEVICE, did)}
        if doc is None:
            return row
        seen_by = self.status.stations.get(doc.station)  # its claims, its drift
        return {**row, "station": doc.station, "state": doc.state.value, "round": doc.round,
                "iteration": doc.iteration, "local_accuracy": doc.local_accuracy,
                "prequential_accuracy": doc.prequential_accuracy, "epsilon": doc.epsilon,
                "deployed_round": doc.deployed_round, "shadow_accuracy": doc.shadow_accuracy,
                "promotions_refused": doc.counters.get("promotions_refused", 0),
                "unknown": doc.counters.get("predictions.unknown", 0),  # parts: novelty.py
                "uploads": doc.counters.get("uploads", 0), "labels_held": doc.labels_held,
                "skips": counted(doc.counters, "skipped."),
                "drift_from": seen_by.drifting.get(did) if seen_by else None,  # drift.py
                "refused": seen_by.device_refused.get(did, 0) if seen_by else None,
                "clipped": seen_by.device_clipped.get(did, 0) if seen_by else None,
                "frames_dropped": doc.source.get("frames_dropped", 0),
                "label_lag": doc.label_lag, "label_lag_estimate": doc.label_lag_estimate,
                "body_ms_per_frame": doc.body_ms_per_frame, "error": doc.error,
                # Predicting now, on this host's clock (NTP): a stalled camera's device is online.
                "prediction_age": prediction_age(doc.last_prediction),
                "camera_outage": doc.camera_outage, "predictions_behind": doc.predictions_behind,
                # A live line's labels: joined to a frame, matching none, or too late.
                **{k: doc.source.get(k) for k in ("label_joined", "label_unmatched",
                                                   "label_expired")},
                **{k: doc.transport.get(k, 0) for k in ("bytes_out", "bytes_in")}}

    def forget(self) -> None:
        """Drop the series so far and the devices' summaries (what a broker still retained
        from an earlier run)."""
        self.status.devices.clear()
        self.global_accuracy.clear()
        self.device_accuracy.clear()
        self._device_at.clear()
        self.traffic.clear()
        self.recorded = []
        self.started = self.clock()

    def save(self, folder: Path) -> None:
        """Record the run for ``safl report``: the device rows since the last save appended
        to ``devices.csv``, the global model's accuracy by round in ``metrics.csv``, and the
        tables as last seen in ``fleet.json``."""
        folder.mkdir(parents=True, exist_ok=True)
        rows, self.recorded = self.recorded, []
        path = folder / "devices.csv"
        if rows:
            new = not path.exists()
            with open(path, "a", newline="") as fh:
                writer = csv.DictWriter(fh, fieldnames=DEVICE_COLUMNS, extrasaction="ignore")
                if new:
                    writer.writeheader()
                writer.writerows(rows)
        lines = ["round,accuracy"] + [f"{r},{a}" for r, a in sorted(self.global_accuracy.items())]
        write_atomic(folder / "metrics.csv", ("\n".join(lines) + "\n").encode())
        doc = self.snapshot(Counter(), page=None)
        write_atomic(folder / "fleet.json", json.dumps(
            {k: doc[k] for k in ("fleet", "seconds", "cloud", "stations", "devices")},
            indent=1).encode())

    def snapshot(self, served: Counter[str], page: int | None = 0) -> dict[str, Any]:
        """The page's JSON: the tables now, and the series so far.  Devices: ``page`` of
        ``PAGE_ROWS`` rows, those offline, in error or refused first (None: every row, for
        the record), the counts of all, their errors (the first ``SHOWN_ERRORS``), and the
        series of the ``CHART_DEVICES`` with the lowest accuracy now."""
        st = self.status
        stations = sorted({s for (r, s) in st.presence if r == m.Participant.STATION}
                          | set(st.stations))
        ids = sorted({d for (r, d) in st.presence if r == m.Participant.DEVICE}
                     | set(st.devices))
        rows = sorted((self._device_row(d) for d in ids), key=trouble)
        pages = max(1, -(-len(rows) // PAGE_ROWS))
        shown = rows if page is None else rows[min(page, pages - 1) * PAGE_ROWS:][:PAGE_ROWS]
        errors = [[r["id"], r["error"]] for r in rows if r.get("error")]
        cloud = dataclasses.asdict(st.cloud) if st.cloud else {}
        return {"fleet": self.fleet, "seconds": round(self.clock() - self.started, 1),
                "cloud": {**cloud, "presence": self._online(m.Participant.CLOUD, CLOUD_ID)},
                "stations": [self._station_row(s) for s in stations],
                "devices": shown, "devices_total": len(rows),
                "devices_online": sum(1 for r in rows if r["presence"]),
                "page": 0 if page is None else min(page, pages - 1), "pages": pages,
                "page_rows": PAGE_ROWS, "device_errors": errors[:SHOWN_ERRORS],
                "device_errors_total": len(errors),
                "global_accuracy": sorted(self.global_accuracy.items()),
                "device_accuracy": {d: list(self.device_accuracy[d]) for d in self._charted()},
                "traffic": list(self.traffic), "monitor": {**served, **self.counters}}

    def _charted(self) -> list[str]:
        """The devices whose series the page draws: all of a small fleet, else those with
        the lowest accuracy now (held-out, else prequential)."""
        def now(d: str) -> float:
            _, local, prequential = self.device_accuracy[d][-1]
            value = local if local is not None else prequential
            return 2.0 if value is None else value
        return sorted(sorted(self.device_accuracy, key=now)[:CHART_DEVICES])


class MonitorServer:
    """The page and its JSON over HTTP, from daemon threads; :meth:`close` stops it."""

    def __init__(self, history: FleetHistory, host: str = "127.0.0.1", port: int = 0) -> None:
        self.history, self.counters = history, Counter[str]()
        self._slots = threading.BoundedSemaphore(MAX_CLIENTS)
        handler = type("MonitorHandler", (_Handler,), {"monitor": self})
        try:
            self.httpd = ThreadingHTTPServer((host, port), handler)
        except OSError as exc:
            raise SaflError(f"cannot serve the monitor on {host}:{port}: {exc.strerror} (is "
                            "the port taken? choose another with --http)") from exc
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True,
                         name="safl-monitor").start()
        log.info("monitor on http://%s:%d/", host, self.port)

    def answer(self, path: str) -> tuple[int, str, bytes]:
        """Status, content type and body for a GET of ``path``."""
        target = path.split("?", 1)[0]
        if target in ("/", "/index.html"):
            return 200, "text/html; charset=utf-8", PAGE.encode()
        if target == "/monitor.js":
            return 200, "text/javascript; charset=utf-8", SCRIPT.encode()
        if target == "/api/fleet":
            page = requested_page(path)
            if page is None:
                self.counters["http.bad_query"] += 1
                page = 0
            with self.history.lock:
                doc = self.history.snapshot(self.counters, page)
            return 200, "application/json", json.dumps(doc).encode()
        if target == "/healthz":
            return 200, "application/json", b'{"status": "ok"}'
        self.counters["http.not_found"] += 1
        return 404, "application/json", json.dumps(
            {"error": f"no such page {target[:80]!r}: the monitor serves /, /api/fleet and "
                      "/healthz"}).encode()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _Handler(BaseHTTPRequestHandler):
    monitor: MonitorServer
    timeout = 10  # seconds a client may take to send its request: a stalled one lets go
    server_version = "safl-monitor"

    def handle_one_request(self) -> None:
        if not self.monitor._slots.acquire(blocking=False):
            self.monitor.counters["http.busy"] += 1
            try:
                self._send(503, "application/json", b'{"error": "busy: too many requests at '
                           b'once, try again"}', close=True)
            except OSError:
                self.close_connection = True
            return
        try:
            super().handle_one_request()
        except (OSError, ValueError) as exc:  # a client that hung up or sent garbage
            self.monitor.counters["http.broken"] += 1
            log.debug("monitor: a request failed: %s", exc)
            self.close_connection = True
        finally:
            self.monitor._slots.release()

    def do_GET(self) -> None:  # noqa: N802 - the http.server API
        if len(self.path) > MAX_PATH:
            self.monitor.counters["http.too_long"] += 1
            self._send(414, "application/json", b'{"error": "request target too long"}')
            return
        self._send(*self.monitor.answer(self.path))

    def send_error(self, code: int, message: str | None = None,
                   explain: str | None = None) -> None:
        self.monitor.counters[f"http.error_{code}"] += 1  # malformed, unsupported method
        self._send(code, "application/json",
                   json.dumps({"error": message or "bad request"}).encode(), close=True)

    def _send(self, code: int, kind: str, body: bytes, close: bool = False) -> None:
        # Every answer has a status line, also to a request too broken to name its version
        # (http.server would answer those as HTTP/0.9: a bare body).
        if getattr(self, "request_version", "HTTP/0.9") == "HTTP/0.9":
            self.request_version = "HTTP/1.0"
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        # The page runs its own script and nothing else; it fetches only from here.
        self.send_header("Content-Security-Policy", "default-src 'self'; style-src 'self' "
                         "'unsafe-inline'; img-src 'self' data:")
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        if getattr(self, "command", "") != "HEAD":
            self.wfile.write(body)

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        pass  # a busy answer goes out before any request line was read

    def log_message(self, format: str, *args: Any) -> None:
        pass


def watch(broker: BrokerConfig, history: FleetHistory, stop: StopFlag,
          out: Path | None = None, save_every: float = 5.0) -> None:
    """Keep ``history`` up to date with its fleet until ``stop``; with ``out``, record it
    there for ``safl report`` every ``save_every`` seconds and at the end."""
    transport = observer(broker, history.fleet, history.status, name="monitor",
                         on_document=history.take)
    transport.connect()
    saved = time.monotonic()
    try:
        while not stop:
            with history.lock:
                transport.deliver()
                if out is not None and time.monotonic() - saved >= save_every:
                    history.save(out)
                    saved = time.monotonic()
            transport.wait(0.2)
    finally:
        transport.close()
        if out is not None:
            with history.lock:
                history.save(out)


def run_monitor(broker: BrokerConfig, fleet: str, host: str, port: int,
                stop: StopFlag | None = None, out: Path | None = None,
                save_every: float = 5.0) -> None:
    """Watch ``fleet`` and serve its page until ``stop`` (Ctrl-C) is set; with ``out``,
    record it there for ``safl report``."""
    history = FleetHistory(fleet)
    server = MonitorServer(history, host, port)
    print(f"monitor of fleet {fleet}: http://{host}:{server.port}/", flush=True)
    try:
        watch(broker, history, StopFlag() if stop is None else stop, out, save_every)
    finally:
        server.close()
