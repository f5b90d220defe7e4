"""Run outputs: progress on stderr, the summary table, metrics CSV/JSON and the accuracy plot."""

from __future__ import annotations

import csv
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from edge_client.errors import SaflError

from .simulation import RunResult

__all__ = ["Progress", "summary_rows", "format_table", "write_csv", "write_metrics",
           "plot_accuracy", "reply_fates", "with_fates", "FATES", "FATES_NOTE"]

FATES = ("asked", "sent", "admitted", "late", "refused", "lost")

# What the demo's table says of its fate columns (also under report.html's table).
FATES_NOTE = ("asked: super-node seats the stations filled; sent: the updates and skips the "
              "devices sent (asked - sent: selections a device never got or could not answer) "
              "= uploads and skips (what their stations admitted) + late (after the super "
              "node's deadline: straggler_factor x the median reply, at least "
              "straggler_min_wait s, at most iteration_timeout s) + refused (a check failed; "
              "summary.json has each reason) + lost (never counted by a station)")


def reply_fates(counters: dict[str, int]) -> dict[str, int]:
    """Where every device reply (an update, or a skip notice) went, from a run's merged role
    counters: asked for by the stations, sent by the devices, admitted, late, refused or
    duplicated by their stations, and lost (the rest: dropped by the broker or a link, or in
    flight at the end)."""
    sent = counters.get("uploads", 0) + sum(v for k, v in counters.items()
                                            if k.startswith("skipped."))
    admitted = counters.get("received_updates", 0) + counters.get("received_skips", 0)
    late = counters.get("late_replies", 0)
    # Refused by admission's checks, or a reply for another iteration or from a non-member
    # (a station also refuses a global round it applied already as stale: after a restart).
    refused = counters.get("refused_updates", 0) + sum(
        counters.get(f"rejected.{why}", 0) for why in ("stale_iteration", "not_selected"))
    counted = admitted + late + refused + counters.get("duplicates", 0)
    return {"asked": counters.get("asked", 0), "sent": sent, "admitted": admitted,
            "late": late, "refused": refused,
            "lost": max(0, sent - counted)}


class Progress:
    """A one-line progress bar (redrawn in place on a terminal, sparse lines otherwise)."""

    def __init__(self, label: str, total: int, stream: TextIO | None = None, width: int = 30):
        stream = stream or sys.stderr
        self.label, self.total, self.stream, self.width = label, total, stream, width
        self.started = time.perf_counter()
        self._tty = stream.isatty()
        self._last_pct = -1

    def __call__(self, done: int, accuracy: float) -> None:
        frac = done / self.total if self.total else 1.0
        pct = int(100 * frac)
        if not self._tty and pct // 25 == self._last_pct // 25 and done != self.total:
            return
        self._last_pct = pct
        bar = "#" * int(self.width * frac) + "-" * (self.width - int(self.width * frac))
        line = (f"{self.label:<14} [{bar}] {done:>4}/{self.total} rounds  acc {accuracy:.3f}  "
                f"{time.perf_counter() - self.started:5.1f}s")
        end = "\n" if not self._tty or done == self.total else ""
        self.stream.write(("\r" if self._tty else "") + line + end)
        self.stream.flush()


def with_fates(results: Sequence[RunResult]) -> Sequence[RunResult]:
    """``results`` with each run's last row saying where its device replies went (the demo's
    table, metrics.csv, report.html).  One run each: counters merged over seeds would not
    be one run's fates."""
    for r in results:
        if r.counters and r.rows:
            r.rows[-1].update(reply_fates(r.counters))
    return results


def summary_rows(results: Sequence[RunResult]) -> list[dict[str, object]]:
    """One row per strategy: accuracy, uploads, skips and traffic at the end of the run, and
    where its device replies went where the run says (:func:`with_fates`)."""
    out: list[dict[str, object]] = []
    for r in results:
        last: dict[str, Any] = r.rows[-1]
        fates: dict[str, Any] = {k: last[k] for k in FATES if k in last and k != "admitted"}
        out.append({"strategy": r.strategy, "final_accuracy": round(r.final_accuracy, 4),
                    "best_accuracy": round(r.best_accuracy, 4), "rounds": last["round"],
                    "uploads": last["uploads"], "skips": last["skips"],
                    **fates,
                    "mb_device_up": round(last["bytes_device_up"] / 1e6, 1),
                    "mb_station_up": round(last["bytes_station_up"] / 1e6, 1),
                    "mb_down": round((last["bytes_device_down"] + last["bytes_station_down"])
                                     / 1e6, 1),
                    "wall_s": round(r.wall_s, 1)})
    return out


def format_table(rows: Sequence[dict[str, object]]) -> str:
    """Fixed-width text table of :func:`summary_rows` (a column for every key any row has)."""
    if not rows:
        return ""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    cells = [keys] + [[str(r.get(k, "")) for k in keys] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(keys))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_csv(path: Path, rows: Sequence[dict[str, Any]]) -> Path:
    """``rows`` as CSV, with every key any row has as a column."""
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
        writer.writeheader()
        writer.writerows(rows)
    return path


def write_metrics(results: Sequence[RunResult], out: Path) -> tuple[Path, Path]:
    """Write per-round ``metrics.csv``, per-device ``devices.csv`` (where the run recorded
    its devices) and the ``summary.json`` of a run."""
    out.mkdir(parents=True, exist_ok=True)
    csv_path, json_path = out / "metrics.csv", out / "summary.json"
    write_csv(csv_path, [row for r in results for row in r.rows])
    devices = [row for r in results for row in r.devices]
    if devices:
        write_csv(out / "devices.csv", devices)
    summary = {"strategies": summary_rows(results),
               "counters": {r.strategy: r.counters for r in results}}
    json_path.write_text(json.dumps(summary, indent=2) + "\n")
    return csv_path, json_path


def plot_accuracy(results: Sequence[RunResult], path: Path, title: str) -> Path:
    """Test accuracy of the global model against samples trained (rounds where a run has no
    sample counts), one line per strategy, with the seed spread as a band."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError as exc:
        raise SaflError("matplotlib is needed for plots: pip install 'safl-edge[plot]'") from exc
    fig, ax = plt.subplots(figsize=(7, 4.2))
    by_samples = all("samples" in row for r in results for row in r.rows)
    for r in results:
        x = [row["samples"] if by_samples else row["round"] for row in r.rows]
        acc = [row["accuracy"] for row in r.rows]
        line, = ax.plot(x, acc, label=f"{r.strategy} (final {r.final_accuracy:.3f})")
        if all("accuracy_sd" in row for row in r.rows):  # mean over seeds: show the spread
            sd = [row["accuracy_sd"] for row in r.rows]
            ax.fill_between(x, [a - s for a, s in zip(acc, sd, strict=True)],
                            [a + s for a, s in zip(acc, sd, strict=True)],
                            color=line.get_color(), alpha=0.15)
    ax.set_xlabel("samples trained (all devices)" if by_samples
                  else "round (external synchronisation)")
    if not by_samples:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # no round 2.5
    ax.set_ylabel("test accuracy of the global model")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
