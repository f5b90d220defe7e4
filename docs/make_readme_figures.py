"""Rewrite the README's demo tables from runs of today's code: ``make readme-figures``.

It runs ``safl demo`` over the embedded broker ``--runs`` times (the figures move from run to
run on 2 cores, so the table gives mean +- sd, and the range of uploads) and ``safl demo --bus
local`` once (the in-process bus repeats exactly), reads each run's ``summary.json``, and
replaces what lies between the README's ``<!-- demo-figures -->`` markers: the date, the
commit, both tables and where every device reply went.  ``--from DIR`` renders from runs
already made (``DIR/broker-K``, ``DIR/local``).  ``tests/test_readme.py`` fails when the
README's block is not in the format :func:`render` writes.

Run: ``python docs/make_readme_figures.py`` from the repository root (about 11 minutes).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from datetime import date
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BEGIN, END = "<!-- demo-figures -->", "<!-- /demo-figures -->"
RECIPES = ("safl+fedgs", "fedgs", "fedavg")
BROKER_HEAD = ("| strategy   | final acc       | best acc        | device uploads    | asked | "
               "sent | late | refused | lost | MB into stations | MB station->cloud | wall s |")
LOCAL_HEAD = ("| strategy   | final acc | best acc | device uploads | skips | "
              "MB device->station | MB station->cloud | wall s |")
_PM = r"\d\.\d{3} \+- \d\.\d{3}"
# One row of each table, as render writes it (the test holds the README to these).
BROKER_ROW = re.compile(rf"\| (safl\+fedgs|fedgs|fedavg) +\| {_PM} +\| {_PM} +\| "
                        r"\d+ \(\d+-\d+\) +\| \d+ +\| \d+ +\| \d+ +\| \d+ +\| \d+ +\| [\d.]+ +\| "
                        r"[\d.]+ +\| [\d.]+ +\|")
LOCAL_ROW = re.compile(r"\| (safl\+fedgs|fedgs|fedavg) +\| \d\.\d{3} +\| \d\.\d{3} +\| \d+ +\| "
                       r"\d+ +\| [\d.]+ +\| [\d.]+ +\| [\d.]+ +\|")
MEASURED = re.compile(r"Measured on \d{4}-\d{2}-\d{2} at commit [0-9a-f]{7,}, from (\d+) runs "
                      r"of `safl demo` over the embedded broker and one of `safl demo --bus "
                      r"local`")


def _demo(out: Path, *args: str) -> dict[str, Any]:
    subprocess.run([sys.executable, "-m", "safl", "demo", "--out", str(out), *args],
                   check=True, cwd=ROOT)
    return _summary(out)


def _summary(folder: Path) -> dict[str, Any]:
    doc = json.loads((folder / "summary.json").read_text())
    return {row["strategy"]: row for row in doc["strategies"]}


def _pm(values: list[float]) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f} +- {sd:.3f}"


def _row(cells: list[str], head: str) -> str:
    widths = [len(c) - 2 for c in head.strip("|").split("|")]
    return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"


def render(broker: list[dict[str, Any]], local: dict[str, Any], commit: str,
           day: str) -> str:
    """The README's block from the broker runs' and the local run's summaries."""
    def mean(name: str, key: str) -> float:
        return statistics.mean(run[name][key] for run in broker)

    lines = [BEGIN, "", f"Measured on {day} at commit {commit}, from {len(broker)} runs of "
             "`safl demo` over the embedded broker and one of `safl demo --bus local` (seed 0, "
             "numpy MLP, 101,770 parameters), by `make readme-figures`.", "",
             f"`safl demo` (over amqtt, 20 rounds): mean +- sd over the {len(broker)} runs, "
             "uploads as mean (min-max); where every device reply went, as means:", "",
             BROKER_HEAD, re.sub(r"[^|]", "-", BROKER_HEAD)]
    for name in RECIPES:
        uploads = [run[name]["uploads"] for run in broker]
        lines.append(_row([name, _pm([run[name]["final_accuracy"] for run in broker]),
                           _pm([run[name]["best_accuracy"] for run in broker]),
                           f"{round(statistics.mean(uploads))} ({min(uploads)}-{max(uploads)})",
                           *(str(round(mean(name, k))) for k in ("asked", "sent", "late",
                                                                 "refused", "lost")),
                           f"{mean(name, 'mb_device_up'):.1f}",
                           f"{mean(name, 'mb_station_up'):.1f}",
                           f"{mean(name, 'wall_s'):.1f}"], BROKER_HEAD))
    lines += ["", "`safl demo --bus local` (100 rounds; the in-process bus loses nothing and "
              "repeats exactly):", "", LOCAL_HEAD, re.sub(r"[^|]", "-", LOCAL_HEAD)]
    for name in RECIPES:
        row = local[name]
        lines.append(_row([name, f"{row['final_accuracy']:.3f}", f"{row['best_accuracy']:.3f}",
                           str(row["uploads"]), str(row["skips"]), f"{row['mb_device_up']:.1f}",
                           f"{row['mb_station_up']:.1f}", f"{row['wall_s']:.1f}"], LOCAL_HEAD))
    return "\n".join([*lines, "", END])


def _block(readme: str) -> tuple[int, int] | None:
    """Where the README's block begins and where its end marker does (None: no block)."""
    start, stop = readme.find(BEGIN), readme.find(END)
    return (start, stop) if 0 <= start < stop else None


def problems(readme: str) -> list[str]:
    """What in the README's block is not as :func:`render` writes it ([] when it is)."""
    where = _block(readme)
    if where is None:
        return [f"no {BEGIN} ... {END} block"]
    block = readme[where[0]:where[1]].splitlines()
    out = [] if any(MEASURED.search(line) for line in block) else ["no 'Measured on' line"]
    for head, pattern in ((BROKER_HEAD, BROKER_ROW), (LOCAL_HEAD, LOCAL_ROW)):
        if head not in block:
            out.append(f"no table headed {head[:40]}...")
            continue
        rows = block[block.index(head) + 2:block.index(head) + 2 + len(RECIPES)]
        for name, row in zip(RECIPES, rows, strict=False):
            if not pattern.fullmatch(row) or f"| {name} " not in row:
                out.append(f"row {row!r} is not {name}'s in the format render writes")
        if len(rows) < len(RECIPES):
            out.append(f"{head[:40]}... has {len(rows)} rows")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="demos over the broker")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "readme-figures")
    parser.add_argument("--from", dest="source", type=Path, help="render from earlier runs")
    args = parser.parse_args(argv)
    if args.source:
        broker = [_summary(p) for p in sorted(args.source.glob("broker-*"))]
        local = _summary(args.source / "local")
    else:
        broker = [_demo(args.out / f"broker-{k}") for k in range(args.runs)]
        local = _demo(args.out / "local", "--bus", "local")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=ROOT).stdout.strip() or "unknown"
    text = README.read_text()
    where = _block(text)
    if where is None:
        raise SystemExit(f"README.md has no {BEGIN} ... {END} block to rewrite")
    README.write_text(text[:where[0]] + render(broker, local, commit, date.today().isoformat())
                      + text[where[1] + len(END):])
    print(f"rewrote README.md's demo tables from {len(broker)} + 1 runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
