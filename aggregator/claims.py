"""Which paper claims an experiment reproduces, and by how much: the ``results.md`` report."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Claim", "assess_claims", "markdown_section", "BASELINES"]

BASELINES = ("fedavg", "fedprox", "fedavgm", "fedadagrad", "fedadam", "fedyogi", "ida")


@dataclass(frozen=True)
class Claim:
    claim: str
    verdict: str  # "reproduced", "partly", "not reproduced", "not tested"
    evidence: str


def _verdict(value: float, full: float) -> str:
    return "reproduced" if value >= full else "partly" if value > 0 else "not reproduced"


def assess_claims(rows: Sequence[dict[str, Any]], target: float,
                  rounds: int) -> list[Claim]:
    """Check the papers' claims against one experiment's ``results.csv`` rows."""
    by = {r["strategy"]: r for r in rows}
    key = f"rounds_to_{target:g}"

    def reach(name: str) -> int:  # never reaching the target counts as rounds + 1 (censored)
        value = by[name][key]
        return rounds + 1 if value in (None, "") else int(value)

    claims = []
    base = [b for b in BASELINES if b in by]
    if "fedgs" in by and base:
        deltas = {b: 100 * (by["fedgs"]["final_accuracy"] - by[b]["final_accuracy"]) for b in base}
        mean = sum(deltas.values()) / len(deltas)
        claims.append(Claim(
            "FedGS: +3.5 points accuracy over the baselines on average",
            _verdict(mean, 3.5),
            f"mean {mean:+.1f} points over {len(base)} baselines ("
            + ", ".join(f"{b} {d:+.1f}" for b, d in deltas.items()) + ")"))
        cuts = {b: 1 - reach("fedgs") / reach(b) for b in base}
        mean_cut = sum(cuts.values()) / len(cuts)
        censored = [b for b in base if reach(b) > rounds]
        claims.append(Claim(
            f"FedGS: 59% fewer rounds to {target:.0%} accuracy",
            "not reproduced" if reach("fedgs") > rounds else _verdict(mean_cut, 0.59),
            f"FedGS {reach('fedgs') if reach('fedgs') <= rounds else 'never'}; mean cut "
            f"{mean_cut:.0%}" + (f" (never reached, counted as {rounds + 1}: "
                                 f"{', '.join(censored)})" if censored else "")))
    if "fedgs" in by and "fedgs_random" in by:
        d = 100 * (by["fedgs"]["final_accuracy"] - by["fedgs_random"]["final_accuracy"])
        claims.append(Claim("GBP-CS beats random super nodes (FedGS ablation)",
                            _verdict(d, 0.5), f"{d:+.1f} points"))
    if "safl" in by and "fedavg" in by:
        ratio = reach("fedavg") / reach("safl")
        claims.append(Claim(
            f"SAFL: about 2x faster convergence than FedAvg (rounds to {target:.0%})",
            "reproduced" if ratio >= 1.8 else "partly" if ratio > 1 else "not reproduced",
            f"FedAvg {reach('fedavg')} / SAFL {reach('safl')} rounds = {ratio:.2f}x"))
        fa, sa = by["fedavg"]["final_accuracy"], by["safl"]["final_accuracy"]
        gain = (sa - fa) / fa if fa else 0.0
        claims.append(Claim("SAFL: >50% accuracy improvement over FedAvg on non-i.i.d. data",
                            _verdict(gain, 0.5), f"{sa:.3f} vs {fa:.3f} ({gain:+.0%})"))
    if "safl" in by and "safl_gated" in by:
        up, gated = by["safl"]["uploads"], by["safl_gated"]["uploads"]
        d = 100 * (by["safl_gated"]["final_accuracy"] - by["safl"]["final_accuracy"])
        cut = 1 - gated / up if up else 0.0
        claims.append(Claim("SAFL upload gating: fewer uploads at similar accuracy",
                            "reproduced" if cut > 0 and d > -1 else "partly" if cut > 0
                            else "not reproduced",
                            f"{cut:.0%} fewer uploads ({gated} vs {up}), accuracy {d:+.1f} points"))
    return claims


def markdown_section(title: str, command: str, config: dict[str, Any],
                     rows: Sequence[dict[str, Any]], claims: Sequence[Claim]) -> str:
    """One experiment's part of ``docs/results.md``."""
    keys = list(rows[0])
    lines = [f"## {title}", "", "Regenerate with:", "", "```sh", command, "```", "",
             "Settings: " + ", ".join(f"`{k} = {v}`" for k, v in config.items()), "",
             "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join("-" if r[k] in (None, "") else str(r[k]) for k in keys) + " |"
              for r in rows]
    if claims:
        lines += ["", "| claim | verdict | evidence |", "|---|---|---|"]
        lines += [f"| {c.claim} | **{c.verdict}** | {c.evidence} |" for c in claims]
    return "\n".join(lines) + "\n"
