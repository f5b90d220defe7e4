"""Benchmark: a device's footprint on each training backend, each in a fresh process.

For ORT and torch the model is ``small_cnn`` (114k parameters, 1x28x28); numpy runs the
``mlp`` and, as ``numpy-cnn``, the same ``small_cnn`` (``trainers/numpy_cnn.py``).  Each
child process imports its backend, builds a device
role and runs ``--iterations`` SAFL iterations (annealed merge + one SGD step on a batch of
32 from the stream buffer), then reports import time, time per training step and peak RSS.
Ratios are to the torch backend on the CPU measured in the same run.  Where torch sees a
CUDA device, a ``torch-cuda`` row runs the same iterations on it and the accelerator is named.

A second table puts the annealed merge (element masks, 101,770 parameters) beside the
numpy MLP's SGD step on a batch of 32, both on one thread in one process, at this checkout
and at ``BASELINE`` (a temporary git worktree), at an acceptance probability of 0.9 (early
in a run) and 0.5; the target is a merge under 0.2x the step.

A third table serves the stream: every frame predicted alone (batch of one) by the
deployable model before it enters the buffer, the per-frame latency beside the same run's
training step (target under 0.2x for small_cnn), and peak RSS with inference on against the
run with it off (target under +10%).  The same table times safe promotion's shadow score:
each arriving model is a candidate, one in ``promote_every`` (10) iterations is predicted
on the window of the last 200 labelled frames beside the deployed model's kept hits
(``edge_client/promotion.py``): the price of a scored candidate, of an iteration and of each
candidate offered, beside the step (target under 0.2x per candidate).

With ``--aarch64 N`` the same iterations of torch's and the numpy CNN's ``small_cnn`` also
run on the emulated Raspberry Pi 4 (a Cortex-A72 under qemu: the root filesystem and venvs
``deploy/check_aarch64.py`` builds, this checkout on their ``PYTHONPATH``), N iterations each,
and a table puts the numpy CNN's step beside torch's on both machines, from this one
run (targets: within 2x torch's on x86, at most torch's on the A72).  Needs root.

The last table is the numpy CNN device's peak RSS by feature (``FEATURES``): training
alone, then with the held-out slice and its device-local accuracy, the upload gate,
inference with its prequential window, and safe promotion, each row adding one, on the
host and (with ``--aarch64 N``, N >= 40 so that the held-out slice reaches the gate's 100
samples) on the emulated A72 (target: at most 200 MB there with everything on).

Run: ``python bench/device_footprint.py [--iterations N] [--backends torch,ort,numpy]
[--aarch64 N]``.  Needs the ort and torch extras for those rows.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time

from baseline import ROOT, checkout, probe

BASELINE = "9ed31b9"  # main before the merge drew bytes instead of floats (issue 14)

_MERGE = r"""
import json, math, statistics, time
import numpy as np
from edge_client.safl import annealed_merge
from edge_client.trainers import build_trainer
rng = np.random.default_rng(0)
trainer = build_trainer("mlp", backend="numpy", input_shape=(28, 28), num_classes=10, lr=0.1,
                        seed=0)
x, y = rng.random((32, 28, 28), dtype=np.float32), rng.integers(0, 10, 32)
local = rng.standard_normal(trainer.num_params).astype(np.float32)
zbar = rng.standard_normal(trainer.num_params).astype(np.float32)

def timed(fn, reps=400):
    for _ in range(20):
        fn()
    out = []
    for _ in range(reps):
        s = time.perf_counter()
        fn()
        out.append(time.perf_counter() - s)
    return statistics.median(out)

res = {"sgd": timed(lambda: trainer.train_step(x, y))}
for p in (0.9, 0.5):
    res[f"merge p={p}"] = timed(lambda: annealed_merge(local, zbar, -math.log(p),
                                                       temperature=1.0, mix=0.8, rng=rng))
res["sgd again"] = timed(lambda: trainer.train_step(x, y))
print(json.dumps(res))
"""

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
backend, model, artifacts, iterations = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
# The device's features, "+"-joined (FEATURES): training alone, or with the held-out slice
# and its device-local accuracy, the upload gate, inference with its prequential window, and
# safe promotion.
features = set(sys.argv[5].split("+"))
serving = "inference" in features
device = "cuda" if backend == "torch-cuda" else "cpu"
backend = {"torch-cuda": "torch", "numpy-cnn": "numpy"}.get(backend, backend)
if backend == "ort":
    from edge_client.trainers.ort_backend import load_training_api
    load_training_api()
elif backend == "torch":
    import torch  # default threads, like ORT: both may use every core
import numpy as np
from edge_client import messages as m
from edge_client.config import DeviceConfig, InferenceConfig
from edge_client.device import Device
from edge_client.trainers import build_trainer
import_s = time.perf_counter() - t0
shape = (1, 28, 28)
trainer = build_trainer(model, backend=backend, input_shape=shape, num_classes=10, lr=0.01,
                        artifacts=artifacts or None,
                        **({"device": device} if backend == "torch" else {}))
held = "holdout" in features
# The held-out slice fills at one sample in 10 (the default); its accuracy is measured
# every 10 iterations instead of 50, so that a short run measures it.
dev = Device(DeviceConfig(device_id="d", station="s", mix=0.5, temperature=50.0,
                          holdout_every=10 if held else 0, local_eval_interval=10 if held else 0,
                          nu=1.0 if "gate" in features else 0.0, buffer_capacity=4096), trainer,
             num_classes=10, sample_shape=shape, rng=np.random.default_rng(0),
             inference=InferenceConfig(promote="not_worse" if "promotion" in features
                                       else "always", budget=1.0) if serving else None)
rng = np.random.default_rng(1)
zbar = trainer.get_flat()
scores = lambda: dev.counters["promotions"] + dev.counters["promotions_refused"]
offered = lambda: scores() + dev.counters["promotions.waiting"]
scored_from = offered_from = None

def timed_score(call):
    # A candidate is judged lazily, at the next labelled samples or broadcast: whichever
    # call took a score is timed whole (a conservative price: it includes the call's work).
    before, start = scores(), time.perf_counter()
    out = call()
    if t >= 5 and scores() > before:  # the window is full by then
        shadow_times.append(time.perf_counter() - start)
    return out

times, frame_times, shadow_times = [], [], []
for t in range(iterations + 5):
    x, y = rng.random((32, *shape), dtype=np.float32), rng.integers(0, 10, 32)
    predicted = None
    if serving and dev.line.deployable is not None:
        # A camera delivers a frame at a time: each is predicted alone, then buffered.
        predicted = np.empty(32, dtype=np.int64)
        for i in range(32):
            start = time.perf_counter()
            predicted[i] = dev.line.infer(x[i:i + 1])[0][0]
            if t >= 5:
                frame_times.append(time.perf_counter() - start)
    if t == 5:
        scored_from, offered_from = scores(), offered()
    timed_score(lambda: dev.ingest(x, y, 0.0, predicted=predicted))
    timed_score(lambda: dev.handle(m.StationModel(fleet="default", sender="s", round=0,
                                                  iteration=t, weights=zbar), 0.0))
    start = time.perf_counter()
    out = dev.handle(m.Selection(fleet="default", sender="s", round=0, iteration=t,
                                 members=("d",), deadline=1.0), 0.0)
    if t >= 5:  # warm-up excluded (get_flat in the reply synchronises a CUDA device)
        times.append(time.perf_counter() - start)
    zbar = next((o.weights for o in reversed(out) if hasattr(o, "weights")), zbar)  # gated
# VmHWM is this process's own peak; ru_maxrss would carry the parent's across exec.
with open("/proc/self/status") as fh:
    rss_mb = next(int(l.split()[1]) for l in fh if l.startswith("VmHWM")) / 1024
print(json.dumps({"import_s": import_s, "step_ms": 1e3 * float(np.median(times)),
                  "frame_ms": 1e3 * float(np.median(frame_times)) if frame_times else None,
                  "shadow_ms": 1e3 * float(np.median(shadow_times)) if shadow_times else None,
                  # candidates scored per iteration (one in promote_every), and offered:
                  # each broadcast and each merged model
                  "scores_per_iteration": (scores() - scored_from) / iterations if serving
                  else 0.0,
                  "offered_per_iteration": (offered() - offered_from) / iterations
                  if serving else 0.0,
                  "peak_rss_mb": rss_mb, "params": trainer.num_params,
                  "local_evaluations": dev.counters["local_evaluations"],
                  "gate_decisions": dev.counters["uploads"] + dev.counters["skipped.gate"]
                  - dev.counters["gate.warming_up"] if "gate" in features else 0,
                  "torch_loaded": "torch" in sys.modules}))
"""


# Each row adds a feature of the device to the row above it; the last has everything on.
FEATURES = {"training alone": "train",
            "+ held-out slice, device-local accuracy": "train+holdout",
            "+ upload gate (nu 1)": "train+holdout+gate",
            "+ inference, prequential window": "train+holdout+gate+inference",
            "+ safe promotion": "train+holdout+gate+inference+promotion"}
SERVED = "train+inference+promotion"  # the inference table's device


def _child(backend: str, model: str, artifacts: str, iterations: int,
           features: str = "train") -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, backend, model, artifacts,
                          str(iterations), features], capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


EMULATED = {"torch": "/opt/safl-torch", "numpy-cnn": "/opt/safl-numpy"}  # row: guest venv


def _emulated(iterations: int) -> tuple[dict[str, dict], dict[str, dict]] | str:
    """The child of each EMULATED row on the emulated board, and the numpy CNN's by
    FEATURES, or why they cannot run here."""
    sys.path.insert(0, str(ROOT / "deploy"))
    import check_aarch64 as board

    try:
        board.enable_emulation()
    except board.Skip as why:
        return str(why)
    rootfs = board.rootfs_path(board.CACHE)  # the check's, with its venvs
    if not (rootfs / ".complete").exists() or not all(
            (rootfs / v.lstrip("/") / "bin" / "python").exists() for v in EMULATED.values()):
        return (f"no emulated board with both venvs at {rootfs}: `python "
                "deploy/check_aarch64.py` (as root) builds it once")
    def child(name: str, features: str) -> dict:
        cmd = board.guest(rootfs, "/usr/bin/env", f"PYTHONPATH={ROOT}",
                          f"{EMULATED[name]}/bin/python", "-c", CHILD, name, "small_cnn", "",
                          str(iterations), features)
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=3600)
        return json.loads(out.stdout.strip().splitlines()[-1])

    with board.mounted(rootfs, ROOT):
        rows = {name: child(name, "train") for name in EMULATED}
        by_feature = {label: rows["numpy-cnn"] if f == "train" else child("numpy-cnn", f)
                      for label, f in FEATURES.items()}
    return rows, by_feature


def _by_feature(host: dict[str, dict], board: dict[str, dict] | None) -> None:
    """Peak RSS of the numpy CNN's device as its features are turned on, one by one."""
    print("\nthe numpy CNN's device (small_cnn) by feature, each row adding one to the row "
          "above, each in a fresh process (peak RSS, VmHWM)")
    print(f"{'features':<42} {'x86_64 MB':>10} {'A72 MB':>8} {'local evals x86/A72':>20} "
          f"{'gate evals x86/A72':>19}")
    for label, r in host.items():
        b = board[label] if board else None
        emulated = f"{b['peak_rss_mb']:>8.0f}" if b else f"{'-':>8}"
        evals = f"{r['local_evaluations']}/{b['local_evaluations'] if b else '-'}"
        gate = f"{r['gate_decisions']}/{b['gate_decisions'] if b else '-'}"
        print(f"{label:<42} {r['peak_rss_mb']:>10.1f} {emulated} {evals:>20} {gate:>19}")
    print("target: at most 200 MB on the emulated A72 with everything on (local evals and "
          "gate evals: the held-out slice was scored, so its cost is in the figure)")


def _side_by_side(host: dict[str, dict], board: dict[str, dict] | str, cpu: str) -> None:
    print(f"\nthe numpy CNN's step beside torch's, small_cnn, batch 32, this run; emulated: "
          f"{cpu} under qemu-user (a Raspberry Pi 4's core)")
    if isinstance(board, str):
        print(f"emulated board skipped: {board}")
        return
    print(f"{'backend':<10} {'x86_64 ms':>10} {'/ torch':>8} {'A72 ms':>9} {'/ torch':>8} "
          f"{'A72 peak RSS MB':>16}")
    for name in EMULATED:
        h, b = host[name], board[name]
        print(f"{name:<10} {h['step_ms']:>10.2f} "
              f"{h['step_ms'] / host['torch']['step_ms']:>8.2f} "
              f"{b['step_ms']:>9.1f} {b['step_ms'] / board['torch']['step_ms']:>8.2f} "
              f"{b['peak_rss_mb']:>16.0f}")
    print("targets: numpy-cnn within 2x torch on x86_64, at most 1x torch on the A72")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--backends", default="torch,ort,numpy,numpy-cnn",
                        help="comma-separated rows; torch (on the CPU) is the baseline")
    parser.add_argument("--aarch64", type=int, default=0, metavar="N",
                        help="also N iterations of torch and numpy-cnn on the emulated A72")
    args = parser.parse_args()
    import torch

    wanted = args.backends.split(",")
    if "torch" not in wanted:
        parser.error("--backends needs torch: its row is what the others are compared with")
    if torch.cuda.is_available():
        wanted.append("torch-cuda")
        print(f"accelerator: {torch.cuda.get_device_name()} (torch {torch.__version__})")
    else:
        print(f"accelerator: none (torch {torch.__version__} sees no CUDA device)")
    models = {"torch": "small_cnn", "torch-cuda": "small_cnn", "ort": "small_cnn",
              "numpy": "mlp", "numpy-cnn": "small_cnn"}
    with tempfile.TemporaryDirectory() as folder:
        if "ort" in wanted:
            from models.export import export_model

            t0 = time.perf_counter()
            export_model("small_cnn", folder, force=True)
            print(f"exported small_cnn artifacts in {time.perf_counter() - t0:.1f} s")
        rows = {name: _child(name, models[name], folder if name == "ort" else "",
                             args.iterations) for name in wanted}
        served = {name: _child(name, models[name], folder if name == "ort" else "",
                               args.iterations, SERVED) for name in wanted}
    base = rows["torch"]
    print(f"\n{'backend':<10} {'model':<10} {'params':>7} {'import s':>9} {'step ms':>8} "
          f"{'peak RSS MB':>12} {'step/torch':>11} {'RSS/torch':>10} {'torch loaded':>13}")
    for name in wanted:
        r, model = rows[name], models[name]
        print(f"{name:<10} {model:<10} {r['params']:>7} {r['import_s']:>9.2f} "
              f"{r['step_ms']:>8.2f} {r['peak_rss_mb']:>12.1f} "
              f"{r['step_ms'] / base['step_ms']:>11.2f} "
              f"{r['peak_rss_mb'] / base['peak_rss_mb']:>10.2f} {str(r['torch_loaded']):>13}")
    print("\ninference on the stream: each frame predicted alone by the deployable model "
          "before it is buffered (docs/sources.md); the same run with inference off beside it")
    print(f"{'backend':<10} {'model':<10} {'frame ms':>9} {'step ms':>8} {'frame/step':>11} "
          f"{'shadow ms':>10} {'shadow/step':>12} {'a iteration':>12} {'a candidate':>12} "
          f"{'RSS off MB':>11} {'RSS on MB':>10} {'on/off':>7}")
    for name in wanted:
        r, off = served[name], rows[name]
        step = off["step_ms"]  # the step without inference: what the scores are priced in
        shadow = r["shadow_ms"] / step
        print(f"{name:<10} {models[name]:<10} {r['frame_ms']:>9.3f} {step:>8.2f} "
              f"{r['frame_ms'] / step:>11.2f} {r['shadow_ms']:>10.2f} {shadow:>12.2f} "
              f"{shadow * r['scores_per_iteration']:>12.2f} "
              f"{shadow * r['scores_per_iteration'] / r['offered_per_iteration']:>12.2f} "
              f"{off['peak_rss_mb']:>11.1f} "
              f"{r['peak_rss_mb']:>10.1f} {r['peak_rss_mb'] / off['peak_rss_mb']:>7.3f}")
    print("shadow: one scored candidate on the 200-sample window; a iteration: those scores "
          "spread over the iterations (promote_every 10, a selected device); a candidate: "
          "over every model offered (each broadcast and merged model)")
    print("targets: small_cnn frame < 0.2x a step, shadow score per candidate < 0.2x a "
          "step; RSS with inference on < 1.10x off")
    merge = {}
    with checkout(BASELINE) as tree:
        merge["baseline"] = json.loads(probe(tree, _MERGE))
    merge["now"] = json.loads(probe(ROOT, _MERGE))
    print(f"\nannealed merge (element masks, mix 0.8) beside the numpy MLP's SGD step, one "
          f"thread; baseline = {BASELINE}")
    print(f"{'':<9} {'SGD step ms':>12} {'merge ms':>9} {'p':>4} {'merge / step':>13}")
    for name, r in merge.items():
        step = (r["sgd"] + r["sgd again"]) / 2
        for p in (0.9, 0.5):
            m = r[f"merge p={p}"]
            print(f"{name:<9} {1e3 * step:>12.3f} {1e3 * m:>9.3f} {p:>4} {m / step:>13.2f}")
    board: tuple[dict[str, dict], dict[str, dict]] | str = "--aarch64 not given"
    if args.aarch64 and "numpy-cnn" in rows:
        sys.path.insert(0, str(ROOT / "deploy"))
        from check_aarch64 import BOARD_CPU

        board = _emulated(args.aarch64)
        _side_by_side(rows, board if isinstance(board, str) else board[0], BOARD_CPU)
    if "numpy-cnn" in rows:
        _by_feature({label: rows["numpy-cnn"] if f == "train" else
                     _child("numpy-cnn", "small_cnn", "", args.iterations, f)
                     for label, f in FEATURES.items()},
                    None if isinstance(board, str) else board[1])
    if "numpy-cnn" in rows:
        cnn = rows["numpy-cnn"]
        print(f"targets: numpy small_cnn step within 2x torch's "
              f"({cnn['step_ms'] / base['step_ms']:.2f}x) and RSS under half "
              f"({cnn['peak_rss_mb'] / base['peak_rss_mb']:.2f}x)")
    if "ort" in rows:
        ort = rows["ort"]
        print(f"\ntargets: ORT peak RSS <= 120 MB ({ort['peak_rss_mb']:.0f}) and <= 0.5x torch "
              f"({ort['peak_rss_mb'] / base['peak_rss_mb']:.2f}x); ORT step <= 1.5x torch "
              f"({ort['step_ms'] / base['step_ms']:.2f}x)")


if __name__ == "__main__":
    main()
