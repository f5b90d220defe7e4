"""``safl report RUN_DIR``: a finished run or field test as one self-contained HTML file,
with its pictures beside it as PNGs.

It reads what the run left in its folder: ``metrics.csv`` (the global model per round or
evaluation: the cloud's, or the simulator's with a ``strategy`` column, samples and bytes),
``devices.csv`` (each device over the run: the simulator's, or what ``safl monitor --out``
recorded in a field test), ``fleet.json`` (the monitor's last view of the stations and
devices) and any ``*.toml`` (the run's settings).  What is missing is said in the report,
not guessed.  The PNGs are embedded in the HTML as data, so the one file can be mailed.
"""

from __future__ import annotations

import base64
import csv
import html
import json
import re
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from edge_client.errors import ConfigError, SaflError

from .report import FATES, FATES_NOTE

__all__ = ["write_run_report", "REPORT_FILE"]

REPORT_FILE = "report.html"
Rows = list[dict[str, Any]]


def _number(text: str) -> Any:
    if text in ("", "None", "nan"):
        return None
    try:
        value = float(text)
    except ValueError:
        return text
    return int(value) if value.is_integer() and "." not in text and "e" not in text else value


def _read_csv(path: Path) -> Rows:
    if not path.exists():
        return []
    with open(path, newline="") as fh:
        return [{k: _number(v) for k, v in row.items()} for row in csv.DictReader(fh)]


def _by(rows: Rows, key: str = "strategy") -> dict[str, Rows]:
    out: dict[str, Rows] = {}
    for row in rows:
        out.setdefault(str(row.get(key) or "run"), []).append(row)
    return out


def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError as exc:
        raise SaflError("matplotlib is needed for the report: pip install "
                        "'safl-edge[plot]'") from exc
    return plt, MaxNLocator


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def _accuracy_figures(metrics: Rows, folder: Path) -> list[tuple[str, Path]]:
    """Global accuracy against samples (rounds, with integer ticks, where the run did not
    count samples) and against the bytes uploaded."""
    plt, integer = _pyplot()
    runs = _by(metrics)
    by_samples = all(r.get("samples") is not None for r in metrics)
    out = []
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, rows in runs.items():
        ax.plot([r["samples" if by_samples else "round"] for r in rows],
                [r["accuracy"] for r in rows], marker="." if len(rows) < 30 else None, label=name)
    ax.set_xlabel("samples trained (all devices)" if by_samples else "round")
    if not by_samples:
        ax.xaxis.set_major_locator(integer(integer=True))
    ax.set_ylabel("test accuracy of the global model")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    out.append(("Global model accuracy", _save(fig, folder / "report_accuracy.png")))
    plt.close(fig)
    against = []
    if all(r.get("bytes_device_up") is not None for r in metrics):
        against.append(("Accuracy against bytes uploaded", "report_accuracy_vs_bytes.png",
                        "MB uploaded (devices to stations, stations to cloud)",
                        lambda r: (r["bytes_device_up"] + r.get("bytes_station_up", 0)) / 1e6))
    if metrics and all(float(r.get("virtual_s") or 0.0) > 0 for r in metrics[-1:]):  # clocked
        against.append(("Accuracy against virtual time", "report_accuracy_vs_time.png",
                        "virtual seconds (the boards' compute and the links, priced)",
                        lambda r: float(r.get("virtual_s") or 0.0)))
    for caption, name, xlabel, x in against:
        fig, ax = plt.subplots(figsize=(7, 4))
        for strategy, rows in runs.items():
            ax.plot([x(r) for r in rows], [r["accuracy"] for r in rows], label=strategy)
        ax.set_xscale("symlog")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("test accuracy of the global model")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        out.append((caption, _save(fig, folder / name)))
        plt.close(fig)
    return out


def _device_figures(devices: Rows, folder: Path) -> list[tuple[str, Path]]:
    """Per strategy: each device's held-out (solid) and prequential (dashed) accuracy over
    the run, and its uploads, skips, refused and clipped claims at the end."""
    plt, integer = _pyplot()
    out = []
    for name, rows in _by(devices).items():
        slug = re.sub(r"[^A-Za-z0-9_.-]", "_", name)
        per = _by(rows, "device")
        x = "samples" if all(r.get("samples") is not None for r in rows) else \
            "seconds" if all(r.get("t") is not None for r in rows) else "round"
        if x == "seconds":  # a monitor's record: unix time, shown from its first row
            t0 = min(r["t"] for r in rows)
            rows = [{**r, "seconds": r["t"] - t0} for r in rows]
            per = _by(rows, "device")
        if all(r.get("local_accuracy") is None and r.get("prequential_accuracy") is None
               for r in rows):  # too little held out to measure, and no prequential scoring
            out.append((f"{name}: what each device sent, and what its station refused or "
                        "clipped (no device measured its accuracy)",
                        _bars(plt, {d: s[-1] for d, s in sorted(per.items())},
                              folder / f"report_uploads_{slug}.png")))
            continue
        fig, ax = plt.subplots(figsize=(7, 4))
        for j, (device, series) in enumerate(sorted(per.items())):
            color = f"C{j % 10}"
            for key, style in (("local_accuracy", "-"), ("prequential_accuracy", "--")):
                pts = [(r[x], r[key]) for r in series if r.get(key) is not None]
                if pts:
                    ax.plot(*zip(*pts, strict=True), style, color=color, lw=1.2,
                            label=device if style == "-" else None)
        ax.set_xlabel({"samples": "samples trained (all devices)",
                       "seconds": "seconds since the record began", "round": "round"}[x])
        if x == "round":
            ax.xaxis.set_major_locator(integer(integer=True))
        ax.set_ylabel("device accuracy")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        if len(per) <= 12 and ax.get_legend_handles_labels()[0]:  # some held-out line
            ax.legend(fontsize=7, ncol=2)
        out.append((f"{name}: each device's accuracy over the run (solid: held-out, dashed: "
                    "prequential)",
                    _save(fig, folder / f"report_devices_{slug}.png")))
        plt.close(fig)
        out.append((f"{name}: what each device sent, and what its station refused or clipped",
                    _bars(plt, {d: s[-1] for d, s in sorted(per.items())},
                          folder / f"report_uploads_{slug}.png")))
    return out


def _bars(plt, last: dict[str, dict[str, Any]], path: Path) -> Path:
    keys = [k for k in ("uploads", "skips", "refused", "clipped")
            if any(r.get(k) is not None for r in last.values())]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.35 * len(last) * len(keys) / 2), 3.8))
    width = 0.8 / max(1, len(keys))
    for i, key in enumerate(keys):
        ax.bar([j + i * width for j in range(len(last))],
               [r.get(key) or 0 for r in last.values()], width, label=key)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(last))])
    ax.set_xticklabels(list(last), rotation=60 if len(last) > 8 else 0, fontsize=8)
    ax.set_ylabel("count over the run")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    path = _save(fig, path)
    plt.close(fig)
    return path


def _table(rows: Sequence[dict[str, Any]]) -> str:
    if not rows:
        return ""
    keys = list(dict.fromkeys(k for r in rows for k in r))

    def cell(v: Any) -> str:
        return "-" if v is None else f"{v:.4f}" if isinstance(v, float) else html.escape(str(v))
    head = "".join(f"<th>{html.escape(k)}</th>" for k in keys)
    body = "".join("<tr>" + "".join(f"<td>{cell(r.get(k))}</td>" for k in keys) + "</tr>"
                   for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _summary(metrics: Rows) -> Rows:
    """Per strategy: rounds, samples, final and best accuracy, MB uploaded."""
    out = []
    for name, rows in _by(metrics).items():
        last = rows[-1]
        out.append({"strategy": name, "rounds": last.get("round"), "samples": last.get("samples"),
                    "final accuracy": last.get("accuracy"),
                    "best accuracy": max(r.get("accuracy") or 0.0 for r in rows),
                    "MB uploaded": None if last.get("bytes_device_up") is None else round(
                        (last["bytes_device_up"] + (last.get("bytes_station_up") or 0)) / 1e6, 2),
                    **{k: last[k] for k in FATES if k in last}})
    return out


def _settings(folder: Path) -> str:
    """The run's configuration files, as they were."""
    parts = [f"<h3>{html.escape(p.name)}</h3><pre>{html.escape(p.read_text())}</pre>"
             for p in sorted(folder.glob("*.toml"))]
    return "".join(parts) or "<p>No settings file in the folder.</p>"


def _fleet_tables(folder: Path) -> str:
    path = folder / "fleet.json"
    if not path.exists():
        return ""
    try:
        doc = json.loads(path.read_text())
        stations, devices = list(doc["stations"]), list(doc["devices"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError("fleet.json", f"{path} is not a monitor's record: {exc}") from exc
    return (f"<h2>Stations, as last seen</h2>{_table(stations)}"
            f"<h2>Devices, as last seen</h2>{_table(devices)}")


def _image(title: str, path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return (f"<figure><figcaption>{html.escape(title)}</figcaption>"
            f'<img alt="{html.escape(title)}" src="data:image/png;base64,{data}"></figure>')


STYLE = """body { font: 14px/1.45 system-ui, sans-serif; margin: 1.5em; color: #1b1f24; }
table { border-collapse: collapse; font-variant-numeric: tabular-nums; margin: .4em 0 1em; }
th, td { padding: 2px 8px; border-bottom: 1px solid #d8dee4; text-align: right; }
th { background: #f3f5f7; } td:first-child, th:first-child { text-align: left; }
figure { margin: 1em 0; } figcaption { font-weight: 600; } img { max-width: 100%; }
pre { background: #f6f8fa; padding: .6em; overflow-x: auto; } .note { color: #57606a; }"""


def write_run_report(folder: str | Path) -> Path:
    """Write ``report.html`` and its PNGs into ``folder``; returns the HTML's path."""
    folder = Path(folder)
    metrics = _read_csv(folder / "metrics.csv")
    if not metrics or any(r.get("accuracy") is None for r in metrics):
        raise ConfigError("RUN_DIR", f"{folder} has no metrics.csv with an accuracy per round "
                          "(the cloud's --out folder, or a demo's or experiment's output)")
    devices = _read_csv(folder / "devices.csv")
    summary = _summary(metrics)
    fates = f"<p class='note'>{html.escape(FATES_NOTE)}.</p>" if any(
        "sent" in row for row in summary) else ""
    figures = _accuracy_figures(metrics, folder) + _device_figures(devices, folder)
    missing = "" if devices else (
        "<p class='note'>No devices.csv: per-device figures were not recorded. In a field "
        "test, run <code>safl monitor --out RUN_DIR</code> beside the fleet.</p>")
    page = (f"<!doctype html><html lang='en'><head><meta charset='utf-8'>"
            f"<title>safl-edge run {html.escape(folder.name)}</title><style>{STYLE}</style>"
            f"</head><body><h1>safl-edge run {html.escape(folder.name)}</h1>"
            f"<p class='note'>Generated {datetime.now():%Y-%m-%d %H:%M} by "
            f"<code>safl report</code> from {html.escape(str(folder.resolve()))}.</p>"
            f"{_table(summary)}{fates}{missing}"
            + "".join(_image(t, p) for t, p in figures)
            + _fleet_tables(folder) + f"<h2>Settings</h2>{_settings(folder)}</body></html>")
    out = folder / REPORT_FILE
    out.write_text(page)
    return out
