"""Prometheus metrics over HTTP, on an optional port, without a client library.

A service hands :class:`MetricsServer` a function returning its counters and gauges; ``GET
/metrics`` renders them in the Prometheus text format.  Names like ``rejected.bad_checksum``
become ``safl_rejected_total{reason="bad_checksum"}``; a gauge ``buffer.unread`` becomes
``safl_buffer_unread``.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

__all__ = ["MetricsServer", "render"]

log = logging.getLogger(__name__)

Collect = Callable[[], tuple[Mapping[str, float], Mapping[str, float]]]


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


def render(role: str, counters: Mapping[str, float], gauges: Mapping[str, float]) -> str:
    """The Prometheus text exposition of one service's numbers."""
    lines: list[str] = []
    typed: set[str] = set()
    for kind, values, suffix in (("counter", counters, "_total"), ("gauge", gauges, "")):
        for key in sorted(values):
            value = values[key]
            if value is None:
                continue
            base, labels = _name(key, kind == "counter")
            metric = f"safl_{base}{suffix}"
            if metric not in typed:
                lines.append(f"# TYPE {metric} {kind}")
                typed.add(metric)
            lines.append(f'{metric}{labels[:-1] + "," if labels else "{"}role="{role}"}} '
                         f"{float(value):g}")
    return "\n".join(lines) + "\n"


class MetricsServer:
    """Serves ``/metrics`` on ``127.0.0.1:port`` (or ``host``) from a daemon thread."""

    def __init__(self, port: int, role: str, collect: Collect, host: str = "127.0.0.1"):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the http.server API
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404)
                    return
                counters, gauges = collect()
                body = render(server.role, counters, gauges).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.role = role
        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True,
                         name="safl-metrics").start()
        log.info("metrics on http://%s:%d/metrics", host, self.port)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
