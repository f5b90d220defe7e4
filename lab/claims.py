"""Which paper claims an experiment reproduces, judged against the seed spread.

Seed ``k`` of every strategy shares its partitions, initial weights and device seeds, so an
effect is measured per seed as a paired difference; its spread is the sample standard
deviation of those differences.  A claim is *reproduced* when the effect exceeds its spread
and is not reliably smaller than the claimed size, *not reproduced* when even effect plus
spread falls short of the claim, and *inconclusive* otherwise (and always with one seed).
Accuracy is each run's mean over its last evaluations; "samples to target" counts a run that
never held the target as its total samples plus one evaluation (censored).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .simulation import RunResult
from .summary import by_strategy, run_summary

__all__ = ["Claim", "assess_claims", "markdown_section", "BASELINES", "verdict", "paired_points",
           "sweep_claims"]

BASELINES = ("fedavg", "fedprox", "fedavgm", "fedadagrad", "fedadam", "fedyogi", "ida")


@dataclass(frozen=True)
class Claim:
    claim: str
    verdict: str  # "reproduced", "not reproduced", "inconclusive"
    evidence: str


def verdict(effect: float, spread: float, claimed: float) -> str:
    """Judge a measured ``effect`` (mean paired difference) of a claim of size ``claimed``."""
    if not math.isfinite(spread):
        return "inconclusive"
    if effect + spread < claimed:
        return "not reproduced"
    return "reproduced" if effect > spread else "inconclusive"


def _paired(a: Sequence[float] | np.ndarray,
            b: Sequence[float] | np.ndarray) -> tuple[float, float]:
    n = min(len(a), len(b))  # seed k pairs with seed k; a strategy may have fewer seeds
    d = np.asarray(a[:n], dtype=float) - np.asarray(b[:n], dtype=float)
    return float(d.mean()), float(d.std(ddof=1)) if len(d) > 1 else math.nan


def paired_points(a: Sequence[float], b: Sequence[float]) -> tuple[float, float]:
    """The paired per-seed effect of ``a`` over ``b`` (accuracies) in points: mean, sd."""
    effect, spread = _paired(a, b)
    return 100 * effect, 100 * spread


def _ratio(a: Sequence[float], b: Sequence[float]) -> np.ndarray:
    n = min(len(a), len(b))
    return np.divide(np.asarray(a[:n], dtype=float), np.asarray(b[:n], dtype=float))


def _fmt(effect: float, spread: float, unit: str = " points") -> str:
    sd = "" if not math.isfinite(spread) else f" +- {spread:.1f}"
    return f"{effect:+.1f}{sd}{unit}"


def assess_claims(results: Sequence[RunResult], target: float) -> list[Claim]:
    """Check the papers' claims, and this project's bar for SAFL+FedGS, on per-seed runs."""
    ev = _Evidence(by_strategy(list(results)), target)
    return [*_fedgs_claims(ev), *_safl_claims(ev), *_gate_claims(ev), *_safl_fedgs_claims(ev)]


class _Evidence:
    """Each strategy's runs and their summaries, and the two figures the claims compare."""

    def __init__(self, runs: dict[str, list[RunResult]], target: float) -> None:
        self.runs, self.target = runs, target
        self.summ = {k: [run_summary(r, target) for r in v] for k, v in runs.items()}
        self.baselines = [b for b in BASELINES if b in self.summ]

    def has(self, *names: str) -> bool:
        return all(n in self.summ for n in names)

    def acc(self, name: str) -> list[float]:
        """Final accuracy per seed, in points."""
        return [100 * s["accuracy"] for s in self.summ[name]]

    def reach(self, name: str) -> list[float]:
        """Samples to a sustained target per seed (one evaluation more where never reached)."""
        out: list[float] = []
        for s, r in zip(self.summ[name], self.runs[name], strict=False):
            step = r.rows[-1]["samples"] - r.rows[-2]["samples"] if len(r.rows) > 1 else 1
            out.append(s["samples_to_target"] or s["samples"] + step)
        return out


def _fedgs_claims(ev: _Evidence) -> list[Claim]:
    claims = []
    base = ev.baselines
    if ev.has("fedgs") and base:
        per = {b: _paired(ev.acc("fedgs"), ev.acc(b)) for b in base}
        d = float(np.mean([e for e, _ in per.values()]))
        spread = float(np.mean([s for _, s in per.values()]))
        claims.append(Claim(
            "FedGS: +3.5 points accuracy over the baselines on average", verdict(d, spread, 3.5),
            f"mean {_fmt(d, spread)} over {len(base)} baselines ("
            + ", ".join(f"{b} {_fmt(*e, unit='')}" for b, e in per.items()) + ")"))
        cuts = {b: _paired([1.0] * len(ev.runs[b]), _ratio(ev.reach("fedgs"), ev.reach(b)))
                for b in base}
        d = float(np.mean([e for e, _ in cuts.values()]))
        spread = float(np.mean([s for _, s in cuts.values()]))
        claims.append(Claim(
            f"FedGS: 59% fewer samples to a sustained {ev.target:.0%}",
            verdict(d, spread, 0.59),
            f"mean cut {d:.0%}" + ("" if not math.isfinite(spread) else f" +- {spread:.0%}")
            + " (" + ", ".join(f"{b} {e:.0%}" for b, (e, _) in cuts.items()) + ")"))
    if ev.has("fedgs", "fedgs_random"):
        d, spread = _paired(ev.acc("fedgs"), ev.acc("fedgs_random"))
        claims.append(Claim("GBP-CS beats random super nodes (FedGS ablation)",
                            verdict(d, spread, 0.0), _fmt(d, spread)))
    return claims


def _safl_claims(ev: _Evidence) -> list[Claim]:
    if not ev.has("safl", "fedavg"):
        return []
    ratio = _ratio(ev.reach("fedavg"), ev.reach("safl"))
    d, spread = _paired(ratio, [0.0] * len(ratio))
    faster = Claim(
        f"SAFL: about 2x faster than FedAvg (samples to a sustained {ev.target:.0%})",
        verdict(d - 1, spread, 0.8), f"{d:.2f}x" + (
            "" if not math.isfinite(spread) else f" +- {spread:.2f}"))
    gain = _ratio(ev.acc("safl"), ev.acc("fedavg")) - 1
    d, spread = _paired(gain, [0.0] * len(gain))
    better = Claim("SAFL: >50% accuracy improvement over FedAvg on non-i.i.d. data",
                   verdict(d, spread, 0.5), f"{d:+.1%}" + (
                       "" if not math.isfinite(spread) else f" +- {spread:.1%}"))
    return [faster, better]


def _gate_claims(ev: _Evidence) -> list[Claim]:
    if not ev.has("safl", "safl_gated"):
        return []
    n = min(len(ev.runs["safl"]), len(ev.runs["safl_gated"]))
    up = [r.rows[-1]["uploads"] for r in ev.runs["safl"][:n]]
    gated = [r.rows[-1]["uploads"] for r in ev.runs["safl_gated"][:n]]
    cut = 1 - float(np.sum(gated)) / max(1.0, float(np.sum(up)))
    d, spread = _paired(ev.acc("safl_gated"), ev.acc("safl"))
    # Similar accuracy: not reliably more than a point below, however small the spread.
    similar = "inconclusive" if not math.isfinite(spread) else (
        "not reproduced" if d + spread < -1.0 else "reproduced")
    return [Claim("SAFL upload gating: fewer uploads at similar accuracy (within 1 point)",
                  similar if cut > 0 else "not reproduced",
                  f"{cut:.0%} fewer uploads, accuracy {_fmt(d, spread)}")]


def _safl_fedgs_claims(ev: _Evidence) -> list[Claim]:
    if not ev.has("safl_fedgs", "fedgs"):
        return []
    d, spread = _paired(ev.acc("safl_fedgs"), ev.acc("fedgs"))
    keeps = "inconclusive" if not math.isfinite(spread) else (
        "reproduced" if d >= -spread else "not reproduced")
    claims = [Claim("SAFL+FedGS keeps FedGS's global accuracy (within the seed spread)",
                    keeps, _fmt(d, spread))]
    local = _paired([100 * s["local_q1"] for s in ev.summ["safl_fedgs"]],
                    [100 * s["local_q1"] for s in ev.summ["fedgs"]])
    claims.append(Claim("SAFL+FedGS beats FedGS on device-local accuracy in the first "
                        "quarter", verdict(*local, 0.0), _fmt(*local)))
    if ev.baselines:
        per = {b: _paired(ev.acc("safl_fedgs"), ev.acc(b)) for b in ev.baselines}
        worst = min(per, key=lambda b: per[b][0] - (per[b][1] if math.isfinite(
            per[b][1]) else 0))
        votes = [verdict(e, s, 0.0) for e, s in per.values()]
        overall = "reproduced" if all(v == "reproduced" for v in votes) else (
            "not reproduced" if "not reproduced" in votes else "inconclusive")
        claims.append(Claim("SAFL+FedGS beats every baseline by more than the seed spread",
                            overall, f"closest: {worst} {_fmt(*per[worst])}"))
    return claims


def sweep_claims(rows: Sequence[dict[str, object]]) -> list[Claim]:
    """Issue 25's goal for the update stages, where a sweep varies them: some list of stages
    sends 4x fewer bytes into the stations with its accuracy loss within its seed spread
    (paired effect plus its sd not below 0)."""
    staged = [r for r in rows if "update_stages" in r and "vs_first" in r]
    if not staged:
        return []
    met = [r for r in staged if float(str(r["fewer_bytes"]).rstrip("x")) >= 4
           and r["within_spread"] == "yes"]
    evidence = "; ".join(f"{r['strategy']} {r['update_stages']}: {r['fewer_bytes']} fewer "
                         f"bytes, {r['vs_first']} points" for r in staged)
    return [Claim("4x fewer bytes into stations at accuracy within the seed spread",
                  "reached" if met else "not reached", evidence)]


def markdown_section(title: str, command: str, config: dict[str, object],
                     rows: Sequence[dict[str, object]], claims: Sequence[Claim]) -> str:
    """One experiment's part of ``docs/results.md`` (a column for every key any row has)."""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    lines = [f"## {title}", "", "Regenerate with:", "", "```sh", command, "```", "",
             "Settings: " + ", ".join(f"`{k} = {v}`" for k, v in config.items()), "",
             "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join("-" if r.get(k) in (None, "") else str(r[k]) for k in keys) + " |"
              for r in rows]
    if claims:
        lines += ["", "| claim | verdict | evidence |", "|---|---|---|"]
        lines += [f"| {c.claim} | **{c.verdict}** | {c.evidence} |" for c in claims]
    return "\n".join(lines) + "\n"
