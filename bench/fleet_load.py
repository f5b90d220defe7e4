"""Benchmark: a provisioned fleet of N devices on S stations under load, over TLS.

Each (N, S) runs :func:`lab.fleet_load.run_load`: ``safl provision`` writes the fleet
(certificates, ACLs, broker configs, role files); Mosquitto per broker, ``safl cloud``,
``safl station`` per station and the devices, each the device service on its own TLS
connection, in worker processes of up to 250.  Past a warm-up of 3 iterations it measures for
``--seconds``.  Devices train a linear head on 1,280 features (51 KB models) on replayed
samples, so the fleet runs as fast as the station turns iterations: the figures are what an
iteration costs, not how long training takes.

Per station and iteration: CPU seconds of its main thread (the role, admission, selection,
fusion, encoding and decoding) and of its other threads (the MQTT network thread: TLS and
the socket), wall seconds, the time from a selection to the last member's answer (median
and most); peak resident sets of the station, its broker and the workers; the factory
broker's CPU; messages and bytes per iteration through the factory broker (the station's
and its devices' own counts, in and out) and over the bridges (the cloud's).  Lost or
refused: the station's refusal and late-reply counters, the devices', reconnects.

``--faults broker,station,drop`` then restarts the first station's broker, kills and restarts
the station, and kills a tenth of its devices at once, and says how long each took to heal.

``--heads`` runs each size as a camera fleet on a body (``lab/load_body.py``), as the docs
recommend: each camera labels 2 frames a station iteration, its body's embeddings feed a head
solved from the statistics the fleet sums.  Each size runs twice, the baseline first: the same
fleet with ``head_init = "random"`` (no statistics), then ``"auto"`` (lda: the devices' head
statistics into the station, its sums over the bridge, the cloud's solve each round).  Printed
for the second: the statistics' bytes a second into the factory broker and over the bridge,
statistics messages an iteration, and the station's CPU a message (its main thread's CPU an
iteration less the baseline's, over the messages an iteration).

Run: ``python bench/fleet_load.py [--sizes 50:1,200:1,1000:1,200:4,1000:16] [--seconds 30]
[--faults broker,station,drop] [--heads]``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lab.fleet_load import run_load  # noqa: E402


def _delta(last: dict[str, Any], first: dict[str, Any], key: str) -> float:
    return float(last.get(key, 0)) - float(first.get(key, 0))


def _through(dev_a: dict[str, Any], dev_b: dict[str, Any], st_a: Any, st_b: Any,
             iters: int) -> dict[str, float]:
    def both(key: str) -> float:
        return (_delta(dev_b, dev_a, key) + _delta(st_b, st_a, key)) / iters
    return {"broker_messages_in": both("messages_out"), "broker_messages_out": both("messages_in"),
            "broker_mb_in": both("bytes_out") / 1e6, "broker_mb_out": both("bytes_in") / 1e6,
            "devices_seen": dev_b["seen"]}


def _statistics(first: dict[str, Any], last: dict[str, Any], wall: float,
                iters: int) -> dict[str, float]:
    """Head statistics over the window, the fleet's: bytes a second the devices published
    (into the factory brokers) and the stations (over the bridges), messages an iteration."""
    sids = list(first["threads"])

    def delta(key: str, pick: Any) -> float:
        return sum(_delta(pick(last["status"], s), pick(first["status"], s), key) for s in sids)

    into = delta("head_stats_bytes_out", lambda status, s: status["devices." + s])
    up = delta("head_stats_bytes_out", lambda status, s: status[s].transport)
    messages = delta("head_stats", lambda status, s: status[s].counters)
    return {"stats_mb_s_into_brokers": round(into / wall / 1e6, 3),
            "stats_mb_s_over_bridges": round(up / wall / 1e6, 3),
            "stats_messages_per_iteration": round(messages / max(iters, 1), 2)}


def figures(run: dict[str, Any]) -> dict[str, Any]:
    """Per-iteration figures of one run (the mean over its stations)."""
    first, last = run["window"]["first"], run["window"]["last"]
    wall = last["t"] - first["t"]
    per: list[dict[str, float]] = []
    for sid in first["threads"]:
        a, b = first["status"][sid], last["status"][sid]
        iters = max(1, b.iteration - a.iteration)
        ta, tb = first["threads"][sid], last["threads"][sid]
        main = (tb.get("main", 0) - ta.get("main", 0)) / iters
        other = sum(tb.values()) - sum(ta.values()) - main * iters
        broker = f"broker.{sid}"
        per.append({
            "iterations": iters, "wall_s": wall / iters, "main_cpu_s": main,
            "other_cpu_s": other / iters,
            "broker_cpu_s": (last["cpu"][broker] - first["cpu"][broker]) / iters,
            "messages_in": _delta(b.transport, a.transport, "messages_in") / iters,
            "messages_out": _delta(b.transport, a.transport, "messages_out") / iters,
            "mb_in": _delta(b.transport, a.transport, "bytes_in") / iters / 1e6,
            "mb_out": _delta(b.transport, a.transport, "bytes_out") / iters / 1e6,
            "reply_median_s": b.reply_median_s or 0.0, "reply_max_s": b.reply_max_s or 0.0,
            # Through the factory broker: what the station and its devices published (in)
            # and were delivered (out)
            **_through(first["status"][f"devices.{sid}"], last["status"][f"devices.{sid}"],
                       a.transport, b.transport, iters)})
    mean = {k: sum(p[k] for p in per) / len(per) for k in per[0]}
    ca, cb = first["status"]["cloud"], last["status"]["cloud"]
    iters = sum(p["iterations"] for p in per)
    refusals = {k: v for sid in first["threads"]
                for k, v in last["status"][sid].counters.items()
                if k.startswith(("rejected", "refused", "late", "iterations_below", "clipped"))}
    reports = run["workers_report"]
    devices = {k: sum(r["device"].get(k, 0) for r in reports) for r in reports
               for k in r["device"] if k.startswith(("rejected", "refused"))}
    transport = {k: sum(r["transport"].get(k, 0) for r in reports) for r in reports
                 for k in r["transport"] if not k.endswith(("_in", "_out"))}
    stats = _statistics(first, last, wall, iters)
    return {"devices": run["devices"], "stations": run["stations"], **stats,
            "provision_s": run["provision_s"], "start_s": run["start_s"],
            **{k: round(v, 4) for k, v in mean.items()},
            "bridge_mb": (_delta(cb.transport, ca.transport, "bytes_in")
                          + _delta(cb.transport, ca.transport, "bytes_out")) / iters / 1e6,
            "station_rss_mb": max(v for n, v in run["peak_rss_mb"].items()
                                  if n.startswith("st")),
            "broker_rss_mb": max(v for n, v in run["peak_rss_mb"].items()
                                 if n.startswith("broker.st")),
            "worker_rss_mb": max(v for n, v in run["peak_rss_mb"].items()
                                 if n.startswith("worker")),
            "connect_all_s": max(r["connect_all_s"] for r in reports),
            "station_refusals": refusals, "device_refusals": devices,
            "device_transport": transport, "station_parts": run.get("station_parts"),
            "faults": [{**{k: v for k, v in f.items() if k != "station"},
                        "refused_or_clipped": {k: v for k, v in f["station"].items()
                                               if k.startswith(("rejected", "clipped"))}}
                       for f in run.get("faults", [])]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="50:1,200:1,1000:1,200:4,1000:16",
                        help="N:S pairs: devices, stations")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--broker-nofile", type=int, default=None,
                        help="the brokers' descriptor limit (a stock systemd unit: 1024)")
    parser.add_argument("--faults", default="", help="after the window, one after the other: "
                        "broker, station, drop (a comma-separated list)")
    parser.add_argument("--profile", action="store_true",
                        help="run the first station under cProfile and split its main "
                        "thread's time into parts (the profiler slows it: CPU figures of "
                        "such a run are upper bounds)")
    parser.add_argument("--heads", action="store_true",
                        help="camera fleets on a body, without then with head statistics")
    parser.add_argument("--out", type=Path, default=None, help="JSON lines of the figures")
    args = parser.parse_args()
    for size in args.sizes.split(","):
        n, s = (int(v) for v in size.split(":"))
        baseline = None
        for head in ("random", "auto") if args.heads else ("",):
            row = _run(args, n, s, head)
            if baseline is not None and row["stats_messages_per_iteration"]:
                row["station_ms_per_stats_message"] = round(1e3 * (
                    row["main_cpu_s"] - baseline["main_cpu_s"])
                    / row["stats_messages_per_iteration"], 2)
            baseline = row
            line = json.dumps(row, default=str)
            print(line, flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(line + "\n")


def _run(args: argparse.Namespace, n: int, s: int, head: str) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix=f"fleet-load-{n}-{s}-"))
    try:
        return {"head_init": head or None, **figures(run_load(
            folder, n, s, seconds=args.seconds, broker_nofile=args.broker_nofile,
            faults=tuple(f for f in args.faults.split(",") if f), profile=args.profile,
            head=head))}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
