"""Prometheus metrics and a health check over HTTP, on an optional port, without a client
library.

A service hands :class:`MetricsServer` a function returning its counters and gauges; ``GET
/metrics`` renders them in the Prometheus text format, each with ``# HELP`` and ``# TYPE``
and the labels ``role``, ``fleet`` and (where they apply) ``station`` and ``device``.  Names
like ``rejected.bad_checksum`` become ``safl_rejected_total{reason="bad_checksum",...}``; a
gauge ``buffer.unread`` becomes ``safl_buffer_unread``.  ``GET /healthz`` answers 200 while
the service loop turns (:meth:`MetricsServer.beat`) and 503 once it has stalled.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Callable, Mapping, MutableMapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from . import messages as m
from .errors import SaflError

__all__ = ["MetricsServer", "render", "HELP", "counted", "count_published"]

log = logging.getLogger(__name__)

# Counters, and gauges (None: not measured yet, left out of the page).
Collect = Callable[[], tuple[Mapping[str, float], Mapping[str, float | None]]]


def _name(key: str, labelled: bool) -> tuple[str, str]:
    """Key -> (metric name, label text); a counter's ``a.b`` becomes ``a{reason|kind="b"}``."""
    if not labelled:
        return re.sub(r"[^a-zA-Z0-9_]", "_", key), ""
    base, _, reason = key.partition(".")
    base = re.sub(r"[^a-zA-Z0-9_]", "_", base)
    if reason:
        label = "reason" if base in ("rejected", "skipped") else "kind"
        return base, f'{{{label}="{reason}"}}'
    return base, ""


def count_published(counters: MutableMapping[str, int], message: m.Message, size: int) -> None:
    """A published message in its transport's counters: it, its bytes, and a head's
    statistics' bytes apart too (most of what a body fleet's devices send)."""
    counters["bytes_out"] += size
    counters["messages_out"] += 1
    if isinstance(message, m.HeadStats):
        counters["head_stats_bytes_out"] += size


def counted(counters: Mapping[str, float], prefix: str) -> int:
    """All counts of one kind, whatever their reason: ``counted(c, "rejected.")`` sums
    ``rejected.bad_checksum``, ``rejected.stale_iteration``, ..."""
    return int(sum(v for k, v in counters.items() if k.startswith(prefix)))


# What the common metrics mean; any other is described by its name.
HELP = {
    "rejected": "messages or frames refused, by reason (docs/reliability.md)",
    "clipped": "participant claims scaled down to a plausible size, by kind",
    "skipped": "device iterations without an upload, by reason",
    "bytes_in": "bytes received from the broker",
    "bytes_out": "bytes published to the broker",
    "head_stats_bytes_out": "bytes of closed-form head statistics published (in bytes_out)",
    "messages_in": "messages admitted",
    "messages_out": "messages published",
    "received_updates": "device updates a station accepted",
    "received_skips": "skip notices a station received",
    "uploads": "updates a device uploaded",
    "predictions": "predictions a device made for the line (kind unknown: flagged as a part "
                   "the fleet never labelled)",
    "steps": "training iterations a device ran",
    "round": "the current round (external synchronisations so far)",
    "iteration": "the current station iteration",
    "devices_online": "roster devices online at a station",
    "devices_drifting": "roster devices whose prequential accuracy fell 5 points or more "
                        "(ADWIN at the station)",
    "last_accuracy": "test accuracy of the last global model",
    "promotions": "candidate models a device put into use (kind unscored: with no evidence)",
    "promotions_refused": "candidate models kept out of use: worse than the deployed one",
    "deployed_round": "the round of the model a device predicts with",
    "shadow_accuracy": "the last candidate model's accuracy on the recent labelled samples",
    "deployed_accuracy": "the deployed model's accuracy on the same samples",
    "body_ms_per_frame": "the frozen body's mean wall time a frame, in milliseconds",
    "label_lag_seconds": "seconds a label's time is shifted by to reach its frame (label_lag)",
    "label_lag_estimate_seconds": "the lag between labels' times and frames' reads that the "
                                  "labels point to",
    "camera_outage_seconds": "seconds the live camera has been lost for (0 while it delivers)",
    "last_prediction_age_seconds": "seconds since the device's last prediction to the line",
    "predictions_behind": "share of the frames chosen for a prediction over the last minute "
                          "that went unpredicted, over the [inference] budget",
}


def render(role: str, counters: Mapping[str, float], gauges: Mapping[str, float | None],
           labels: Mapping[str, str] | None = None) -> str:
    """The Prometheus text exposition of one service's numbers."""
    lines: list[str] = []
    typed: set[str] = set()
    common = ",".join(f'{k}="{v}"' for k, v in {"role": role, **(labels or {})}.items())
    for kind, values, suffix in (("counter", counters, "_total"), ("gauge", gauges, "")):
        for key in sorted(values):
            value = values[key]
            if value is None:
                continue
            base, label = _name(key, kind == "counter")
            metric = f"safl_{base}{suffix}"
            if metric not in typed:
                lines.append(f"# HELP {metric} {HELP.get(base, base.replace('_', ' '))}")
                lines.append(f"# TYPE {metric} {kind}")
                typed.add(metric)
            lines.append(f'{metric}{label[:-1] + "," if label else "{"}{common}}} '
                         f"{float(value):g}")
    return "\n".join(lines) + "\n"


class MetricsServer:
    """Serves ``/metrics`` and ``/healthz`` on ``127.0.0.1:port`` (or ``host``) from a
    daemon thread.  ``stall_after`` is how long the loop may go without :meth:`beat`."""

    def __init__(self, port: int, role: str, collect: Collect, host: str = "127.0.0.1",
                 labels: Mapping[str, str] | None = None, stall_after: float = 30.0):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the http.server API
                path = self.path.split("?")[0]
                if path == "/metrics":
                    counters, gauges = collect()
                    self._send(200, render(server.role, counters, gauges, server.labels),
                               "text/plain; version=0.0.4")
                elif path == "/healthz":
                    quiet = time.monotonic() - server.last_beat
                    ok = quiet <= server.stall_after
                    doc = {"status": "ok" if ok else "stalled", "role": server.role,
                           **server.labels, "loop_idle_s": round(quiet, 3)}
                    self._send(200 if ok else 503, json.dumps(doc), "application/json")
                else:
                    self.send_error(404)

            def _send(self, code: int, text: str, kind: str) -> None:
                body = text.encode()
                self.send_response(code)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.role, self.labels = role, dict(labels or {})
        self.stall_after = stall_after
        self.last_beat = time.monotonic()
        try:
            self.httpd = ThreadingHTTPServer((host, port), Handler)
        except OSError as exc:
            raise SaflError(f"cannot serve metrics on {host}:{port}: {exc.strerror} (is the "
                            "port taken? choose another with --metrics-port)") from exc
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True,
                         name="safl-metrics").start()
        log.info("metrics on http://%s:%d/metrics", host, self.port)

    def beat(self) -> None:
        """The service loop turned: ``/healthz`` stays healthy."""
        self.last_beat = time.monotonic()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
