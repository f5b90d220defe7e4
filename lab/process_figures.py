"""What a process of a fleet costs, read from ``/proc`` and from a cProfile record: its CPU
time and resident set, its threads' CPU, and a profiled station's time by part
(``lab/fleet_load.py`` and ``bench/fleet_load.py`` report them, ``docs/scale.md``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = ["process_figures", "thread_cpu", "profile_parts", "PARTS"]


def process_figures(pid: int) -> tuple[float, float]:
    """CPU seconds (user and system) and resident set in MB of process ``pid`` (0, 0 gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0.0, 0.0
    rss = next((int(line.split()[1]) for line in status.splitlines()
                if line.startswith("VmRSS:")), 0)
    return (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK"), rss / 1024


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of each of ``pid``'s threads by name (the main thread as ``main``)."""
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            stat = (task / "stat").read_text().rsplit(")", 1)[1].split()
            name = "main" if task.name == str(pid) else (task / "comm").read_text().strip()
        except OSError:
            continue
        name = name.split("-")[0]
        out[name] = out.get(name, 0.0) + (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")
    return out


# The station's parts, by the files their functions are in (the profile's own time of each).
PARTS = {"admission and trust": ("aggregator/admission.py", "aggregator/trust.py",
                                 "aggregator/roster.py", "edge_client/admission.py",
                                 "edge_client/reassembly.py"),
         "selection": ("aggregator/selection.py", "aggregator/seating.py",
                       "aggregator/stragglers.py"),
         "fusion": ("aggregator/fusion.py", "aggregator/internal_sync.py",
                    "aggregator/external_sync.py", "aggregator/central_dp.py"),
         "serialisation": ("edge_client/codec.py", "edge_client/documents.py", "json/"),
         "transport": ("edge_client/mqtt.py", "edge_client/socket_owner.py", "paho/",
                       "threading.py", "queue.py", "ssl.py"),
         "checkpoints": ("aggregator/station_resume.py", "aggregator/checkpoint.py",
                         "edge_client/files.py")}


def _part(file: str) -> str | None:
    return next((name for name, files in PARTS.items() if any(f in file for f in files)), None)


def profile_parts(path: Path) -> dict[str, float]:
    """Seconds of the station's main thread in each of ``PARTS`` (the rest as ``other``),
    from its cProfile record: a function's own time counts to its part, and a library's
    (numpy's, hashlib's) to its callers' parts in proportion to the time each spent in it."""
    import pstats

    stats = pstats.Stats(str(path)).stats  # type: ignore[attr-defined]
    shares: dict[Any, dict[str, float]] = {}

    def owner(fn: Any, seen: frozenset[Any]) -> dict[str, float]:
        if fn in shares:
            return shares[fn]
        # A lock's wait is the idle thread waiting for frames (transport.wait), not work.
        part = "waiting" if "acquire' of '_thread.lock" in fn[2] else _part(fn[0])
        callers = stats[fn][4] if fn in stats else {}
        if part is not None or not callers or fn in seen or "/aggregator/" in fn[0] \
                or "/edge_client/" in fn[0]:
            out = {part or "other": 1.0}
        else:
            total = sum(c[3] for c in callers.values()) or 1.0
            out = {}
            for caller, c in callers.items():
                for name, f in owner(caller, seen | {fn}).items():
                    out[name] = out.get(name, 0.0) + f * c[3] / total
        shares[fn] = out
        return out

    parts: dict[str, float] = {}
    for fn, (_, _, own, _, _) in stats.items():
        for name, f in owner(fn, frozenset()).items():
            parts[name] = parts.get(name, 0.0) + own * f
    return {k: round(v, 3) for k, v in sorted(parts.items(), key=lambda kv: -kv[1])}
