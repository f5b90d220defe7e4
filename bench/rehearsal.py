"""Benchmark: the virtual clock's seconds per round against a real fleet on emulated links.

Issue 35's check of ``lab/clock.py``.  The fleet: 2 factories x 3 devices on scikit-learn
digits (Dirichlet 0.5), the small CNN on numpy, every device a ``pi4-numpy`` (or
``--profile``) board, paced to that profile's step time (``[service] emulate_step_s``),
predictions priced at ``--handling-ms`` a message handled (``HOST_HANDLING_MS``;
``--calibrate`` fits it first on links of no latency), one Mosquitto on loopback, each
device and the cloud behind a :class:`~lab.relay.LinkRelay` with the setting's link (the
stations sit beside the broker, as the simulator places them).  For each link setting
(``--links``, ``LATENCY_MS:LOSS`` pairs) and recipe (``--strategies``) the same fleet is
simulated with its clock, then launched as processes for ``--rounds`` rounds; printed:
seconds per round, predicted and real, the prediction's error, and whether the two rank
the recipes alike.  ``--straggler`` adds FedGS with device 0 ``--slow-factor`` times slower
(the station's default straggler deadline), as round rate against the fleet without it,
predicted and real.  Printed, never asserted: the target (within 15%, the same order, 0.8x
with the straggler) is read off the output (docs/experiments.md "The clock against a real
fleet").

Run: ``python bench/rehearsal.py [--links 5:0,40:0.02] [--rounds 5] [--calibrate]
[--straggler]``.
Needs Debian's mosquitto.  ``--short`` (``.ci/run``): one link setting, FedAvg and FedGS,
3 rounds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from brokers import Mosquitto, fleet_mosquitto  # noqa: E402
from stragglers import FEDGS  # noqa: E402

from lab.clock import HOST_HANDLING_MS, ClockConfig, LinkSpec  # noqa: E402
from lab.datasets import Dataset, assign_groups, dirichlet_label_skew, load_dataset  # noqa: E402
from lab.experiment import ExperimentConfig  # noqa: E402
from lab.relay import launch_relayed  # noqa: E402
from lab.simulation import FleetSpec, Strategy, plan_fleet, run_federation  # noqa: E402
from lab.strategies import build_strategy  # noqa: E402


def _strategy(name: str) -> Strategy:
    settings = ExperimentConfig(name="rehearsal", factories=2, super_node=2,
                                devices_per_factory=3, rand_per_group=1, sync_period=5,
                                rounds=1).settings
    return build_strategy(name, settings)


def _spec(data: Dataset, rounds: int, clock: ClockConfig, devices: int = 6) -> FleetSpec:
    rng = np.random.default_rng(0)
    return FleetSpec(partitions=tuple(dirichlet_label_skew(data.y_train, devices, 0.5, rng)),
                     groups=tuple(assign_groups(devices, 2, rng)), rounds=rounds, lr=0.1,
                     arrivals_per_step=32, initial_samples=64, model="small_cnn",
                     backends=("numpy",), eval_samples=200, clock=clock)


def _per_round(rows: list[dict], key: str) -> float:
    """Seconds a round took, from the first global model (round 0: the fleet had joined)
    to the last."""
    return (rows[-1][key] - rows[0][key]) / (rows[-1]["round"] - rows[0]["round"])


def _real(data: Dataset, strategy: Strategy, spec: FleetSpec, folder: Path) -> tuple[float, dict]:
    folder.mkdir(parents=True)
    broker = fleet_mosquitto(folder, plan_fleet(strategy, spec), extra_users=())
    try:
        rows, relays = launch_relayed(folder / "run", data, strategy, spec, broker.url,
                                      credentials=lambda user: (user, Mosquitto.PASSWORD))
    finally:
        broker.stop()
    return _per_round(rows, "wall_s"), {n: dict(r.counters) for n, r in relays.items()}


def _predicted(data: Dataset, strategy: Strategy, spec: FleetSpec, handling_ms: float) -> float:
    assert spec.clock is not None
    clock = dataclasses.replace(spec.clock, handling_ms=handling_ms)
    rows = run_federation(data, strategy, dataclasses.replace(spec, clock=clock)).rows
    return _per_round(rows, "virtual_s")


def _case(data: Dataset, name: str, strategy: Strategy, spec: FleetSpec, tmp: Path,
          handling_ms: float) -> dict:
    bare = _predicted(data, strategy, spec, 0.0)
    predicted = _predicted(data, strategy, spec, handling_ms)
    started = time.perf_counter()
    real, traffic = _real(data, strategy, spec, tmp / name)
    error = predicted / real - 1
    print(f"  {name:<24} predicted {predicted:6.3f} s/round ({bare:6.3f} without handling), "
          f"real {real:6.3f} s/round, error {100 * error:+5.1f}% ({100 * (bare / real - 1):+5.1f}%)"
          f"  ({time.perf_counter() - started:.0f} s, "
          f"{sum(t.get('bytes_up', 0) for t in traffic.values()) / 1e6:.1f} MB up the relays)",
          flush=True)
    return {"predicted_s": round(predicted, 4), "unhandled_s": round(bare, 4),
            "real_s": round(real, 4), "error": round(error, 4)}


def _calibrate(data: Dataset, profile: str, rounds: int, tmp: Path) -> float:
    """This host's handling figure: FedGS on links of no latency, real against predicted,
    the difference divided by what a millisecond of handling adds to a predicted round."""
    clock = ClockConfig(profiles=((profile, 1.0),))
    strategy, spec = _strategy("fedgs"), _spec(data, rounds, clock)
    real, _ = _real(data, strategy, spec, tmp / "calibration")
    bare = _predicted(data, strategy, spec, 0.0)
    slope = _predicted(data, strategy, spec, 1.0) - bare
    fitted = max(0.0, (real - bare) / slope)
    print(f"calibration (FedGS, 0 ms links): real {real:.3f} s/round, predicted {bare:.3f} "
          f"without handling, +{slope:.3f} s a round per ms of handling: {fitted:.2f} ms a "
          f"message", flush=True)
    return fitted


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--links", default="5:0,40:0.02")
    ap.add_argument("--strategies", default="fedavg,fedgs,fedgs_long")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--straggler", action="store_true")
    ap.add_argument("--slow-factor", type=float, default=30.0)
    ap.add_argument("--profile", default="pi4-numpy")
    ap.add_argument("--handling-ms", type=float, default=HOST_HANDLING_MS)
    ap.add_argument("--calibrate", action="store_true",
                    help="fit --handling-ms on a run with links of no latency first")
    ap.add_argument("--short", action="store_true")
    args = ap.parse_args()
    if args.short:
        args.links, args.strategies, args.rounds = "5:0", "fedavg,fedgs", 3
    # One BLAS thread a process: six devices on two cores, as six boards would not share.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    started = time.perf_counter()
    data = load_dataset("digits")
    out: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        if args.calibrate:
            args.handling_ms = _calibrate(data, args.profile, args.rounds, tmp)
        print(f"handling: {args.handling_ms:.2f} ms a message", flush=True)
        for setting in args.links.split(","):
            latency, loss = (float(v) for v in setting.split(":"))
            link = LinkSpec(latency_ms=latency, loss=loss)
            clock = ClockConfig(profiles=((args.profile, 1.0),), device_link=link, cloud_link=link)
            print(f"links {latency:g} ms one way, {100 * loss:g}% segment loss; every device "
                  f"{args.profile}, small_cnn, {args.rounds} rounds:", flush=True)
            cases = out.setdefault(setting, {})
            for name in args.strategies.split(","):
                cases[name] = _case(data, f"{setting.replace(':', 'ms-')}-{name}", _strategy(name),
                                    _spec(data, args.rounds, clock), tmp, args.handling_ms)
            predicted, real = (sorted(cases, key=lambda n: cases[n][key])
                               for key in ("predicted_s", "real_s"))
            print(f"  order (fastest round first): predicted {predicted}, real {real}: "
                  f"{'same' if predicted == real else 'DIFFERENT'}", flush=True)
        if args.straggler:  # bench/stragglers.py's fleet: 12 devices, FedGS L=3, 5 steps
            print(f"12 devices in 2 factories, FedGS (L=3, T=5, 5 local steps), 20 ms links "
                  f"(50 ms to the cloud), {2 * args.rounds} rounds, device 0 "
                  f"{args.slow_factor:g}x slower or not:", flush=True)
            runs = {}
            for label, slow in (("no straggler", ()), ("straggler", (0,))):
                clock = ClockConfig(profiles=((args.profile, 1.0),),
                                    device_link=LinkSpec(latency_ms=20),
                                    cloud_link=LinkSpec(latency_ms=50), slow_devices=slow,
                                    slow_factor=args.slow_factor)
                runs[label] = _case(data, label.replace(" ", "-"), FEDGS,
                                    _spec(data, 2 * args.rounds, clock, devices=12), tmp,
                                    args.handling_ms)
            rates = {key: runs["no straggler"][key] / runs["straggler"][key]
                     for key in ("predicted_s", "real_s")}
            print(f"  one device {args.slow_factor:g}x slower: round rate "
                  f"{rates['predicted_s']:.2f}x predicted, {rates['real_s']:.2f}x real "
                  f"(target: at least 0.8x)")
            out["straggler"] = runs | {"rate": {k: round(v, 3) for k, v in rates.items()}}
    errors = [abs(c["error"]) for s, cases in out.items() if s != "straggler"
              for c in cases.values()]
    print(f"largest prediction error {100 * max(errors):.1f}% over {len(errors)} runs "
          f"(target: within 15%)")
    print(json.dumps(out | {"handling_ms": round(args.handling_ms, 3),
                            "bench_s": round(time.perf_counter() - started, 1)}))


if __name__ == "__main__":
    main()
