"""The operators' Prometheus: a scrape configuration for a provisioned fleet and its alert
rules (``docs/operations.md``).

``safl provision`` writes ``prometheus/prometheus.yml`` (one job per role: the cloud, the
stations, the devices, each target labelled with its participant) and ``alerts.yml`` beside
it, when the fleet file gives ``metrics_port``.  The rules use only series the services
serve (``edge_client/metrics.py``); ``deploy/prometheus/`` holds the example fleet's copy,
which a test keeps equal to what this module writes and checks with ``promtool``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["ALERT_RULES", "JOBS", "scrape_config"]

JOBS = {"cloud": "safl-cloud", "station": "safl-stations", "device": "safl-devices"}

ALERT_RULES = """\
# Alert rules for a safl-edge fleet (written by `safl provision`; docs/operations.md).
groups:
  - name: safl-edge
    rules:
      - alert: SaflServiceDown
        expr: up{job=~"safl-cloud|safl-stations"} == 0
        for: 1m
        labels:
          severity: critical
        annotations:
          summary: "{{ $labels.participant }} ({{ $labels.job }}) unanswered for 1m"
      - alert: SaflDeviceOffline
        expr: up{job="safl-devices"} == 0
        for: 2m
        labels:
          severity: warning
        annotations:
          summary: "device {{ $labels.participant }} has not answered a scrape for 2m"
      - alert: SaflStationLostDevices
        expr: safl_devices_online < max_over_time(safl_devices_online[1h])
        for: 5m
        labels:
          severity: warning
        annotations:
          summary: "station {{ $labels.station }}: {{ $value }} devices online, fewer than lately"
      - alert: SaflStationStarved
        expr: increase(safl_iterations_without_data_total[10m]) > 0
        labels:
          severity: warning
        annotations:
          summary: "station {{ $labels.station }} closed iterations untrained (below quorum)"
      - alert: SaflAccuracyFalling
        expr: safl_last_accuracy < max_over_time(safl_last_accuracy[1h]) - 0.05
        for: 10m
        labels:
          severity: warning
        annotations:
          summary: "global accuracy {{ $value }}: 5 points below its best of the last hour"
      - alert: SaflCamerasDrifting
        expr: safl_devices_drifting > 0
        for: 5m
        labels:
          severity: warning
        annotations:
          summary: "station {{ $labels.station }}: {{ $value }} devices drifting (safl status)"
      - alert: SaflRefusalsRising
        expr: sum by (fleet, station) (increase(safl_rejected_total{role="station"}[10m])) > 10
        for: 5m
        labels:
          severity: warning
        annotations:
          summary: "station {{ $labels.station }} refused over 10 messages in 10m"
"""


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def scrape_config(fleet: str, targets: Mapping[str, Sequence[tuple[str, str]]], *,
                  interval: str = "15s", rules: str = "alerts.yml") -> str:
    """``prometheus.yml`` for ``fleet``: ``targets`` maps a role (``cloud``, ``station``,
    ``device``) to ``(participant, "host:port")`` pairs, each scraped with the label
    ``participant`` (the services' own series carry ``fleet``, ``station`` and ``device``)."""
    lines = [f"# Prometheus for the safl-edge fleet {fleet} (written by `safl provision`).",
             "global:", f"  scrape_interval: {interval}", f"  evaluation_interval: {interval}",
             "rule_files:", f"  - {_quote(rules)}", "scrape_configs:"]
    for role, job in JOBS.items():
        if not targets.get(role):
            continue
        lines += [f"  - job_name: {_quote(job)}", "    static_configs:"]
        for participant, address in targets[role]:
            lines += [f"      - targets: [{_quote(address)}]", "        labels:",
                      f"          participant: {_quote(participant)}"]
    return "\n".join(lines) + "\n"
