"""Benchmark: the in-process simulator's time per sample trained, recipe by recipe, and
against the one this project had before (same run).

The workload is the reference experiment's fleet (``experiments/reference.toml``): the small
CNN on Fashion-MNIST at Dirichlet 0.1, 4 factories x 10 devices, L = 5, T = 10, batch 32,
6,400 samples trained per round, torch on the CPU.  Each run is ``--rounds`` rounds (a
multiple of 8, the evaluation cadence) in its own process; the figure is the steady-state
seconds per 1,000 samples trained (from the first evaluation to the last, so start-up and
data loading are left out and the evaluations at the reference cadence are in), projected
to a 1M-sample reference run.

The recipes table runs FedAvg, FedGS and SAFL+FedGS with torch on 1 and on 2 threads and
numpy's BLAS on one (what ``lab.experiment.run_task`` chooses: a torch run's BLAS work is
the stations' small selection problems, and OpenBLAS threads spinning beside torch's cost
FedGS half again its time), each ``--repeats`` times interleaved; ratios are to FedAvg at the
same thread count, measured in the same run.  ``--baseline`` adds the simulator of commit
``BASELINE`` (a temporary git worktree) on FedGS, configured as the reference experiment was
then.  Run it on a quiet machine: other jobs on the cores distort every figure.  Printed,
never asserted.

``--gpu`` adds FedGS and SAFL+FedGS on CUDA (one by one, and with each super node's members
in one batched call, ``[simulation] batched_steps``) and the 1M-sample reference run's time
there against these CPUs.

``--clock`` times the virtual clock (``lab/clock.py``) instead: FedGS and SAFL+FedGS on the
same run without a clock and under the mixed fleet of ``experiments/mixed_fleet.toml``
(pi4 boards and a Jetson, 20 ms links with 1% loss, 50 ms to the cloud), interleaved, on
the reference workload and on the quick digits one (an MLP: the simulator's own work is
most of its time there, so the clock's overhead shows most), and checks that two clocked
runs give the same bytes.

``--hot-path`` times the simulator's own work instead: FedAvg against FedGS with an MLP on
pixels (numpy), where a training step is cheap and what FedGS adds per iteration (a model
to every device, a reply checked, a super node picked) is much of its time, on two fleets
(``HOT_FLEETS``): ``experiments/attacks_small.toml`` without its attacker (2 x 3 devices,
the whole test set evaluated every round) and the reference fleet (4 x 10).  Each recipe
runs alone and in pairs (two runs at once on the two cores, as ``safl experiment --jobs 2``
runs them), interleaved, against the same runs on the simulator of ``HOT_PATH_BASELINE``.
Two measures per sample: the whole run (the experiment table's ``wall_s``, start-up
included) and the steady state.  Then one FedGS run under cProfile, its functions by own
time.

Run: ``python bench/simulator.py [--rounds 16] [--repeats 2] [--gpu] [--baseline]
[--clock] [--hot-path]`` from a git checkout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from baseline import ROOT, checkout, probe

BASELINE = "4d81892"  # main before the simulator work of issue 10
HOT_PATH_BASELINE = "ee747af"  # main before the hot path's work of issue 71
SAMPLES_PER_ROUND = 4 * 5 * 10 * 32
RECIPES = ("fedavg", "fedgs", "safl_fedgs")

_OLD = """
import dataclasses, sys, time, torch
torch.set_num_threads(1)
from aggregator.experiment import load_experiment, _run_one
cfg = dataclasses.replace(load_experiment("experiments/reference.toml"), rounds={rounds},
                          strategies=("fedgs",))
r = _run_one((cfg, "fedgs", 0, "none", False))
print(r.rows[-1]["wall_s"] - r.rows[0]["wall_s"])  # its rows count no samples: nominal ones
"""

_NEW = """
import dataclasses
from lab.engine import SimulationConfig
from lab.experiment import RunTask, load_experiment, run_task
cfg = dataclasses.replace(load_experiment("experiments/reference.toml"), samples=0,
                          rounds={rounds}, strategies=("{recipe}",))
engine = SimulationConfig(torch_device="{device}", batched_steps={batched})
r = run_task(RunTask(cfg, "{recipe}", 0, threads={threads}, engine=engine))
print(1000 * (r.rows[-1]["wall_s"] - r.rows[0]["wall_s"])
      / (r.rows[-1]["samples"] - r.rows[0]["samples"]))
"""


# The clock's cost: seconds per 1,000 samples and a digest of every figure but wall-clock
# time, so two clocked runs can be compared byte for byte.
_CLOCKED = """
import dataclasses, hashlib, json
from lab.engine import SimulationConfig
from lab.experiment import RunTask, load_experiment, run_task
cfg = dataclasses.replace(load_experiment("{toml}"), samples=0, rounds={rounds},
                          strategies=("{recipe}",))
engine = SimulationConfig(torch_device="cpu", **{clock})
r = run_task(RunTask(cfg, "{recipe}", 0, threads=1, engine=engine))
rows = [{{k: v for k, v in row.items() if k != "wall_s"}} for row in r.rows]
print(1000 * (r.rows[-1]["wall_s"] - r.rows[0]["wall_s"])
      / (r.rows[-1]["samples"] - r.rows[0]["samples"]),
      hashlib.sha256(json.dumps([rows, r.counters], sort_keys=True).encode()).hexdigest()[:12])
"""
# The hot path: FedAvg or FedGS with an MLP on pixels (numpy) on one of HOT_FLEETS; s per
# 1,000 samples over the whole run (as the experiment table's wall_s, start-up included)
# and from the first evaluation to the last (the steady state).
_HOT = """
import dataclasses, sys
from lab.experiment import RunTask, load_experiment, run_task
cfg = dataclasses.replace(load_experiment("{toml}"), strategies=("{recipe}",), **{changes})
r = run_task(RunTask(cfg, "{recipe}", int(sys.argv[1]), threads=1))
print(1000 * r.wall_s / r.rows[-1]["samples"], 1000 * (r.rows[-1]["wall_s"] - r.rows[0]["wall_s"])
      / (r.rows[-1]["samples"] - r.rows[0]["samples"]))
"""
HOT_FLEETS = {  # name: (experiment file, what changes)
    "small": ("experiments/attacks_small.toml", {"attackers": 0, "attacks": ("none",)}),
    "reference": ("experiments/reference.toml", {"samples": 0, "rounds": 16, "model": "mlp",
                                                 "backend": "numpy", "lr": 0.05}),
}
MIXED_FLEET = {"profiles": ("pi4-numpy=0.4", "pi4-torch=0.5", "jetson-orin-cuda=0.1"),
               "device_latency_ms": 20.0, "device_jitter_ms": 5.0, "device_loss": 0.01,
               "cloud_latency_ms": 50.0, "cloud_loss": 0.01}
CLOCK_WORKLOADS = (("reference", "experiments/reference.toml"),
                   ("quick digits", "experiments/quick.toml"))


def _clock_bench(rounds: int, repeats: int) -> dict[str, float]:
    """Clocked against clockless, same runs, interleaved: the ratio of medians per recipe
    and workload, and whether the clocked runs repeated byte for byte."""
    out = {}
    for label, toml in CLOCK_WORKLOADS:
        for recipe in RECIPES[1:]:
            times: dict[str, list[float]] = {"off": [], "on": []}
            digests = set()
            for _ in range(repeats):
                for mode, clock in (("off", {}), ("on", MIXED_FLEET)):
                    s, digest = probe(ROOT, _CLOCKED.format(toml=toml, rounds=rounds,
                                                            recipe=recipe, clock=clock)).split()
                    times[mode].append(float(s))
                    if mode == "on":
                        digests.add(digest)
            off, on = statistics.median(times["off"]), statistics.median(times["on"])
            print(f"{label:<13} {recipe:<11} clockless {off:.3f} s/1000 samples, clocked "
                  f"{on:.3f} ({min(times['on']):.3f}..{max(times['on']):.3f}): "
                  f"{on / off:.2f}x; clocked runs {'identical' if len(digests) == 1 else 'DIFFER'}")
            out[f"{label}/{recipe}"] = on / off
    return out


def _timed(code: str, cwd: Path) -> float:
    return float(probe(cwd, code))


def _paired(code: str, cwd: Path) -> list[list[float]]:
    """Two runs of ``code`` at once (seeds 0 and 1), each on its own core's share."""
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda seed: [float(v) for v in probe(cwd, code, str(seed)).split()],
                             (0, 1)))


def _hot_path(repeats: int) -> dict[str, float]:
    """FedAvg and FedGS on each of ``HOT_FLEETS``, alone and paired, here and at
    ``HOT_PATH_BASELINE``: FedGS's ratio to FedAvg per sample (medians) in each."""
    times: dict[tuple[str, ...], list[list[float]]] = {}
    with checkout(HOT_PATH_BASELINE) as old:
        for _ in range(repeats):  # interleaved: drift on the machine hits every figure
            for fleet, (toml, changes) in HOT_FLEETS.items():
                for tree, where in ((old, "baseline"), (ROOT, "now")):
                    for recipe in ("fedavg", "fedgs"):
                        code = _HOT.format(toml=toml, recipe=recipe, changes=changes)
                        times.setdefault((fleet, where, "alone", recipe), []).append(
                            [float(v) for v in probe(tree, code, "0").split()])
                        times.setdefault((fleet, where, "paired", recipe), []).extend(
                            _paired(code, tree))
    out = {}
    print(f"{repeats} time(s) each, an MLP on Fashion-MNIST pixels; s per 1,000 samples, "
          "median over runs: the whole run (the experiment table's wall_s) | the steady state")
    for fleet, where, mode in dict.fromkeys(k[:3] for k in times):
        avg, gs = (times[(fleet, where, mode, r)] for r in ("fedavg", "fedgs"))
        cells = []
        for i, measure in enumerate(("run", "steady")):
            a, g = (statistics.median(t[i] for t in runs) for runs in (avg, gs))
            out[f"{fleet}/{where}/{mode}/{measure}"] = round(g / a, 3)
            cells.append(f"fedavg {a:.4f} fedgs {g:.4f} {g / a:.2f}x")
        print(f"{fleet:<9} {where:<8} {mode:<6} " + " | ".join(cells))
    _profile()
    return out


def _profile() -> None:
    """One FedGS run on the reference fleet here under cProfile: its 25 heaviest functions
    by own time."""
    toml, changes = HOT_FLEETS["reference"]
    code = _HOT.format(toml=toml, recipe="fedgs", changes=changes).split("print(1000")[0].replace(
        "r = run_task(", "import cProfile, io, json, pstats\nprof = cProfile.Profile()\n"
        "r = prof.runcall(run_task, ") + (
        "text = io.StringIO()\n"
        "pstats.Stats(prof, stream=text).sort_stats('tottime').print_stats(25)\n"
        "print(json.dumps(text.getvalue()))\n")
    print("FedGS under cProfile (own time; the profiler's cost inflates the small calls):")
    print("\n".join(line for line in json.loads(probe(ROOT, code, "0")).splitlines()
                    if line.strip()))


def _gpu_runs(rounds: int) -> dict[tuple[str, bool], float]:
    """FedGS and SAFL+FedGS on CUDA, one by one and batched (s per 1,000 samples)."""
    has_cuda = probe(ROOT, "import torch; print(int(torch.cuda.is_available()))")
    if not int(has_cuda):
        print("no CUDA device here: the GPU figures need a machine with one")
        return {}
    return {(recipe, batched): _timed(_NEW.format(rounds=rounds, recipe=recipe, threads=1,
                                                  device="cuda", batched=batched), ROOT)
            for recipe in RECIPES[1:] for batched in (False, True)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--gpu", action="store_true",
                    help="also run FedGS and SAFL+FedGS on CUDA, one by one and with each "
                    "super node in one batched call, against the CPU figures of this run")
    ap.add_argument("--baseline", action="store_true",
                    help=f"also time FedGS on the simulator of {BASELINE}")
    ap.add_argument("--clock", action="store_true",
                    help="time the virtual clock against the clockless simulator instead")
    ap.add_argument("--hot-path", action="store_true",
                    help="time FedGS's own work against FedAvg's on an MLP instead, alone and "
                    f"paired, against {HOT_PATH_BASELINE}, with FedGS's profile")
    args = ap.parse_args()
    if args.rounds % 8:
        ap.error("--rounds must be a multiple of 8 (the evaluation cadence)")
    started = time.perf_counter()
    if args.clock:
        ratios = _clock_bench(args.rounds, args.repeats)
        print(json.dumps({"rounds": args.rounds, "clocked_over_clockless": ratios,
                          "bench_s": round(time.perf_counter() - started, 1)}))
        return
    if args.hot_path:
        ratios = _hot_path(args.repeats)
        print(json.dumps({"fedgs_over_fedavg": ratios,
                          "bench_s": round(time.perf_counter() - started, 1)}))
        return
    runs: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.repeats):  # interleaved: drift on the machine hits every recipe
        for threads in (1, 2):
            for recipe in RECIPES:
                code = _NEW.format(rounds=args.rounds, recipe=recipe, threads=threads,
                                   device="cpu", batched=False)
                runs.setdefault((recipe, threads), []).append(_timed(code, ROOT))
    gpu = _gpu_runs(args.rounds) if args.gpu else {}
    old = None
    if args.baseline:
        with checkout(BASELINE) as tree:
            old = 1000 * _timed(_OLD.format(rounds=args.rounds), tree) \
                / (args.rounds * SAMPLES_PER_ROUND)
    print(f"{args.rounds} rounds ({args.rounds * SAMPLES_PER_ROUND} samples) per run, "
          f"{args.repeats} run(s) each, median; small CNN, Fashion-MNIST alpha 0.1")
    print(f"{'recipe':<12} {'torch threads':>13} {'s/1000 samples':>15} {'min..max':>13} "
          f"{'x FedAvg':>9} {'min per 1M':>11}")
    medians = {key: statistics.median(v) for key, v in runs.items()}
    for (recipe, threads), values in runs.items():
        ratio = medians[(recipe, threads)] / medians[("fedavg", threads)]
        print(f"{recipe:<12} {threads:>13} {medians[(recipe, threads)]:>15.3f} "
              f"{min(values):>6.3f}..{max(values):<6.3f} {ratio:>8.2f}x "
              f"{medians[(recipe, threads)] * 1000 / 60:>10.1f}")
    best = min(medians[("fedavg", t)] for t in (1, 2))
    for recipe in RECIPES[1:]:
        own = min(medians[(recipe, t)] for t in (1, 2))
        print(f"{recipe}: best {own:.3f} s/1000 against FedAvg's best {best:.3f}: "
              f"{own / best:.2f}x")
    for (recipe, batched), value in gpu.items():
        cpu = min(medians[(recipe, t)] for t in (1, 2))
        print(f"{recipe} on CUDA{' batched' if batched else ''}: {value:.3f} s/1000, a 1M-sample "
              f"reference run in {value * 1000 / 60:.1f} min against {cpu * 1000 / 60:.1f} min "
              f"on these CPUs ({cpu / value:.2f}x)")
    if old is not None:
        print(f"baseline {BASELINE} FedGS (1 thread): {old:.3f} s/1000 samples; now "
              f"{old / min(medians[('fedgs', t)] for t in (1, 2)):.2f}x faster")
    print(json.dumps({"rounds": args.rounds, "s_per_1000": {f"{r}/{t}": v for (r, t), v
                                                             in runs.items()},
                      "baseline": old, "bench_s": round(time.perf_counter() - started, 1)}))


if __name__ == "__main__":
    main()
