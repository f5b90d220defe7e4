"""The figures tables and verdicts are made of: one run's (accuracy as the mean of its last
evaluations, samples to a sustained target, device-local accuracy early and late) and a
strategy's over its seeds (mean and sample sd, seed-averaged curves)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

import numpy as np

from edge_client.metrics import counted

from .simulation import RunResult

__all__ = ["merge_seeds", "by_strategy", "run_summary", "samples_to", "result_rows", "per_run",
           "mean_sd", "LAST_K"]


def merge_seeds(results: list[RunResult]) -> list[RunResult]:
    """One result per strategy: accuracy and loss averaged over its seeds per round, with
    ``accuracy_sd`` (sample standard deviation) beside them."""
    merged = []
    for name, runs in by_strategy(results).items():
        if len(runs) == 1:
            merged.append(runs[0])
            continue
        rows = []
        # Budget-stopped seeds may evaluate a different number of times: pair the first ones.
        for i, row in enumerate(runs[0].rows[:min(len(r.rows) for r in runs)]):
            acc = [r.rows[i]["accuracy"] for r in runs]
            rows.append({**row, "accuracy": float(np.mean(acc)),
                         "samples": float(np.mean([r.rows[i]["samples"] for r in runs])),
                         "virtual_s": float(np.mean([r.rows[i].get("virtual_s", 0.0)
                                                     for r in runs])),
                         "accuracy_sd": float(np.std(acc, ddof=1)),
                         "loss": float(np.mean([r.rows[i]["loss"] for r in runs]))})
        counters: dict[str, int] = {}
        for r in runs:
            for key, value in r.counters.items():
                counters[key] = counters.get(key, 0) + value
        # Per-device figures are one fleet's: the first seed's.
        merged.append(RunResult(name, rows, counters, sum(r.wall_s for r in runs),
                                devices=runs[0].devices))
    return merged


NAN = float("nan")
LAST_K = 3  # a run's accuracy: the mean of its last evaluations, not one noisy point


def samples_to(rows: list[dict[str, Any]], target: float, key: str = "samples") -> Any:
    """Samples trained (or ``key``: ``virtual_s``, seconds of virtual time) when the accuracy
    reached ``target`` and held it at every later evaluation (None: it never held)."""
    held = None
    for r in rows:
        if r["accuracy"] >= target:
            held = r.get(key, 0.0) if held is None else held
        else:
            held = None
    return held


def _nanmean(values: list[float]) -> float:
    values = [v for v in values if v == v]
    return float(np.mean(values)) if values else float("nan")


class RunSummary(TypedDict):
    """One run's figures (see :func:`run_summary`); NaN where the run did not measure one."""

    accuracy: float
    samples_to_target: int | None  # None: the target was not held
    local_q1: float
    worst10_q1: float
    local_end: float
    worst10_end: float
    prequential_end: float
    prequential_worst10_end: float
    samples: int
    virtual_s_to_target: float | None  # under a clock (lab/clock.py); None: not held
    virtual_s: float  # 0.0: the run had no clock
    # The global model's accuracy at a fixed virtual time (its last evaluation by then; a
    # run that ended sooner keeps its final model); NaN without a clock or a time asked for.
    accuracy_at: float


def accuracy_at(rows: Sequence[Mapping[str, Any]], virtual_s: float) -> float:
    """The accuracy of the last evaluation at or before ``virtual_s`` (NaN: none yet, or no
    clock)."""
    scored = [r["accuracy"] for r in rows if 0 < virtual_s and r.get("virtual_s", 0.0)
              and r["virtual_s"] <= virtual_s + 1e-9]
    return float(scored[-1]) if scored else NAN


def run_summary(result: RunResult, target: float, at_virtual_s: float = 0.0) -> RunSummary:
    """One run's figures: accuracy (mean of the last ``LAST_K`` evaluations), samples to a
    sustained ``target``, device-local accuracy (mean, worst 10%) over the first quarter
    of the samples and at the end, and under a clock the virtual time to ``target`` and the
    accuracy at ``at_virtual_s``."""
    rows = result.rows
    quarter = [r for r in rows if r["samples"] <= rows[-1]["samples"] / 4] or rows[:1]
    tail = rows[-LAST_K:]
    return RunSummary(
        accuracy=float(np.mean([r["accuracy"] for r in tail])),
        samples_to_target=samples_to(rows, target),
        local_q1=_nanmean([r["local_mean"] for r in quarter]),
        worst10_q1=_nanmean([r["local_worst10"] for r in quarter]),
        local_end=_nanmean([r["local_mean"] for r in tail]),
        worst10_end=_nanmean([r["local_worst10"] for r in tail]),
        # Runs without prequential scoring (and runs cached before it) have no such column.
        prequential_end=_nanmean([r.get("prequential_mean", NAN) for r in tail]),
        prequential_worst10_end=_nanmean([r.get("prequential_worst10", NAN) for r in tail]),
        samples=rows[-1]["samples"],
        virtual_s_to_target=samples_to(rows, target, "virtual_s"),
        virtual_s=rows[-1].get("virtual_s", 0.0),  # runs cached before the clock have none
        accuracy_at=accuracy_at(rows, at_virtual_s))


def by_strategy(results: list[RunResult]) -> dict[str, list[RunResult]]:
    """Per-seed results grouped by strategy, seeds in run order (seed k pairs with seed k:
    the same partitions, initial weights and device seeds)."""
    out: dict[str, list[RunResult]] = {}
    for r in results:
        out.setdefault(r.strategy, []).append(r)
    return out


def mean_sd(values: list[float], digits: int = 4) -> tuple[float | None, float | str | None]:
    """Mean and sample sd over seeds; None where no seed measured it (no local accuracy)."""
    arr = np.array(values, dtype=float)
    if np.isnan(arr).any():
        return None, None
    return round(float(arr.mean()), digits), \
        round(float(arr.std(ddof=1)), digits) if len(arr) > 1 else ""


def _prequential_columns(sums: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Prequential accuracy at the end (mean, sd, worst 10%), where every seed measured it."""
    pend, pend_sd = mean_sd([s["prequential_end"] for s in sums])
    if pend is None:
        return {}
    pw10, _ = mean_sd([s["prequential_worst10_end"] for s in sums])
    return {"prequential_end": pend, "prequential_end_sd": pend_sd, "prequential_worst10": pw10}


def _personal_columns(runs: Sequence[RunResult]) -> dict[str, Any]:
    """Device-local accuracy at the end with the global head and with personal heads
    (mean, sd over seeds), where every seed measured both."""
    ends = [r.rows[-1] for r in runs]
    if not all("local_personal_head" in row for row in ends):
        return {}
    out: dict[str, Any] = {}
    for key in ("local_global_head", "local_personal_head"):
        out[key], out[f"{key}_sd"] = mean_sd([row[key] for row in ends])
    return out


def _virtual_time_columns(sums: Sequence[Mapping[str, Any]], target: float,
                          at_virtual_s: float) -> dict[str, Any]:
    """Virtual seconds to a sustained ``target`` (mean, sd; ``never (k/n)`` where a seed did
    not hold it), the accuracy at ``at_virtual_s`` (mean, sd; where asked for), and the
    virtual seconds at the end, for runs under a clock (no columns without one)."""
    if not all(s["virtual_s"] for s in sums):
        return {}
    reach = [s["virtual_s_to_target"] for s in sums]
    missing = sum(v is None for v in reach)
    to, to_sd = mean_sd([v for v in reach if v is not None], 1) if not missing else (None, "")
    out = {f"virtual_s_to_{target:g}": to if not missing else f"never ({missing}/{len(sums)})",
           f"virtual_s_to_{target:g}_sd": to_sd}
    if at_virtual_s:
        at, at_sd = mean_sd([s["accuracy_at"] for s in sums])
        out |= {f"accuracy_at_{at_virtual_s:g}s": at, f"accuracy_at_{at_virtual_s:g}s_sd": at_sd}
    return out | {"virtual_s": round(float(np.mean([s["virtual_s"] for s in sums])), 1)}


def per_run(runs: list[RunResult], prefix: str) -> int:
    """Counted events of one kind per run: ``rejected.`` (claims refused, each a reply or
    report lost) or ``clipped.`` (claims trimmed to their bound, and still used)."""
    return sum(counted(r.counters, prefix) for r in runs) // len(runs)


def epsilon_column(runs: list[RunResult]) -> dict[str, float]:
    """The most epsilon any device's data spent by the end of a run, local or central DP at
    the stations, and any station's at the cloud, mean over seeds (no column where the fleet
    used none)."""
    keys = ("epsilon_local", "epsilon_central")
    out = {}
    if any(k in r.rows[-1] for r in runs for k in keys):
        out["epsilon"] = round(float(np.mean([max(r.rows[-1].get(k, 0.0) for k in keys)
                                              for r in runs])), 3)
    if any("epsilon_cloud" in r.rows[-1] for r in runs):  # a station's data, not a device's
        out["epsilon_cloud"] = round(float(np.mean([r.rows[-1].get("epsilon_cloud", 0.0)
                                                    for r in runs])), 3)
    return out


def accuracy_at_samples(rows: Sequence[Mapping[str, Any]], samples: int) -> float:
    """The accuracy when the fleet had trained ``samples``, interpolated linearly between the
    evaluations either side (NaN past the run's end)."""
    done = [float(r["samples"]) for r in rows]
    if samples > done[-1] + 1e-9:
        return NAN
    return float(np.interp(samples, done, [float(r["accuracy"]) for r in rows]))


def _samples_columns(runs: list[RunResult], at_samples: Sequence[int]) -> dict[str, Any]:
    """The accuracy at each of ``at_samples`` trained fleet-wide (mean, sd over seeds)."""
    out: dict[str, Any] = {}
    for n in at_samples:
        at, at_sd = mean_sd([accuracy_at_samples(r.rows, n) for r in runs])
        out |= {f"accuracy_at_{n / 1000:g}k": at, f"accuracy_at_{n / 1000:g}k_sd": at_sd}
    return out


def result_rows(results: list[RunResult], target: float, at_virtual_s: float = 0.0,
                at_samples: Sequence[int] = ()) -> list[dict[str, Any]]:
    """One row per strategy for ``results.csv``: mean and sample sd over seeds of the
    accuracy (mean of the last evaluations), samples to a sustained ``target`` (``never``
    when some seed did not hold it), the accuracy at ``at_samples`` trained, device-local
    accuracy, virtual time, traffic."""
    out = []
    for name, runs in by_strategy(results).items():
        sums = [run_summary(r, target, at_virtual_s) for r in runs]
        acc, acc_sd = mean_sd([s["accuracy"] for s in sums])
        reach = [s["samples_to_target"] for s in sums]
        reached = [v for v in reach if v is not None]
        held = len(reached)
        lq1, lq1_sd = mean_sd([s["local_q1"] for s in sums])
        w10, _ = mean_sd([s["worst10_q1"] for s in sums])
        lend, _ = mean_sd([s["local_end"] for s in sums])
        last = runs[0].rows[-1]
        out.append({"strategy": name, "seeds": len(runs), "accuracy": acc,
                    "accuracy_sd": acc_sd,
                    f"samples_to_{target:g}": (f"{np.mean(reached) / 1000:.0f}k"
                                               if held == len(runs)
                                               else f"never ({len(runs) - held}/{len(runs)})"),
                    "local_q1": lq1, "local_q1_sd": lq1_sd, "worst10_q1": w10,
                    **_samples_columns(runs, at_samples),
                    "local_end": lend, **_prequential_columns(sums), **_personal_columns(runs),
                    "samples": int(np.mean([s["samples"] for s in sums])),
                    **_virtual_time_columns(sums, target, at_virtual_s),
                    "uploads": int(np.mean([r.rows[-1]["uploads"] for r in runs])),
                    "skips": int(np.mean([r.rows[-1]["skips"] for r in runs])),
                    "mb_up": round((last["bytes_device_up"] + last["bytes_station_up"]) / 1e6, 1),
                    # everything sent up, a closed-form head's statistics included
                    "mb_into_stations": round((last["bytes_device_up"]
                                               + last.get("bytes_head_device_up", 0)) / 1e6, 1),
                    "mb_to_cloud": round((last["bytes_station_up"]
                                          + last.get("bytes_head_station_up", 0)) / 1e6, 1),
                    "refused": per_run(runs, "rejected."), "clipped": per_run(runs, "clipped."),
                    **epsilon_column(runs),
                    "wall_s": round(float(np.mean([r.wall_s for r in runs])), 1)})
    return out
