"""``safl demo``: SAFL+FedGS against plain FedAvg (and FedGS alone) on one non-i.i.d. fleet.

Both strategies get the same partitions, initial weights, seeds and compute per
round: FedGS takes ``T`` one-step iterations per round on a super node of ``L``
devices; FedAvg takes one iteration of ``T`` local steps on ``L`` random devices.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import logging
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from edge_client.config import BrokerConfig, check_range
from edge_client.errors import ConfigError, SaflError
from edge_client.runner import StopFlag
from edge_client.states import DeviceState

from .datasets import assign_groups, dirichlet_label_skew, load_default, through_body
from .report import (
    FATES_NOTE,
    Progress,
    format_table,
    plot_accuracy,
    summary_rows,
    with_fates,
    write_metrics,
)
from .run_report import write_run_report
from .simulation import FleetSpec, RunResult, Strategy, plan_fleet, run_federation

if TYPE_CHECKING:
    from aggregator.monitor import FleetHistory

__all__ = ["demo_strategies", "run_demo", "DEFAULT_ROUNDS"]

# A linear head on a body's embeddings: chosen on experiments/camera_body_linear.toml (seed 0,
# 0.003 to 1.0; docs/bodies.md).
BODY_LR = 0.01

# Over the embedded broker every iteration crosses amqtt (pure Python): fewer rounds by default.
DEFAULT_ROUNDS = {"local": 100, "mqtt": 20}

log = logging.getLogger(__name__)


def demo_strategies(super_node_size: int = 4, sync_period: int = 5,
                    rounds: int = DEFAULT_ROUNDS["local"], factories: int = 2) -> list[Strategy]:
    """The recipes the demo compares (``lab/strategies.py``, with the experiments'
    default settings), named for the table: ``safl+fedgs``, ``fedgs`` (the same without
    SAFL, so the table separates what GBP-CS brings from what SAFL adds) and ``fedavg``
    (the same device steps per round on random devices)."""
    from .experiment import ExperimentConfig
    from .strategies import build_strategy

    settings = ExperimentConfig(name="demo", factories=factories, super_node=super_node_size,
                                devices_per_factory=super_node_size, rand_per_group=1,
                                sync_period=sync_period, rounds=rounds).settings
    return [dataclasses.replace(build_strategy(recipe, settings), name=label)
            for label, recipe in (("safl+fedgs", "safl_fedgs"), ("fedgs", "fedgs"),
                                  ("fedavg", "fedavg"))]


def _over_broker(data, strategy: Strategy, spec: FleetSpec, url: str, out: Path,
                 rounds: int) -> RunResult:
    """One strategy as separate processes; the table's traffic is what crossed the wire."""
    from aggregator.status import fleet_status

    from .launch import launch_fleet

    started = time.perf_counter()
    fleet = strategy.device.get("fleet", "sim")
    devices = [values["device_id"] for values in plan_fleet(strategy, spec).devices]
    with _watching(BrokerConfig(url=url), fleet, devices) as history:
        rows = launch_fleet(out / strategy.name, data, strategy, spec, url,
                            progress=Progress(strategy.name, rounds))
    # Retained status of an earlier recipe's stations may linger on the broker (a flat fleet
    # has one station, a hierarchical one a station per factory): count this fleet's only.
    # Read until every station's and device's summary is in (up to 10 s): a fixed second on a
    # loaded machine once read none, and the run's table had no reply fates.
    ids = {values["station_id"] for values in plan_fleet(strategy, spec).stations}
    found = fleet_status(BrokerConfig(url=url), fleet, wait=10.0, until=lambda f: ids <= set(
        f.stations) and set(devices) <= set(f.devices))
    stations = [doc for sid, doc in found.stations.items() if sid in ids]
    cloud_transport = found.cloud.transport if found.cloud else {}

    def total(docs, section, key):
        return sum(getattr(d, section).get(key, 0) for d in docs)

    # What each device says it sent and what its station says became of it (reply_fates).
    counters: Counter[str] = Counter()
    docs: list[Any] = [*stations, *(found.devices[d] for d in devices if d in found.devices)]
    for doc in docs:
        counters.update({k: int(v) for k, v in doc.counters.items()})
    result_rows = [{"strategy": strategy.name, **row} for row in rows]
    result_rows[-1].update(
        uploads=total(stations, "counters", "received_updates"),
        skips=total(stations, "counters", "received_skips"),
        bytes_device_up=total(stations, "transport", "bytes_in"),
        bytes_device_down=total(stations, "transport", "bytes_out"),
        bytes_station_up=cloud_transport.get("bytes_in", 0),
        bytes_station_down=cloud_transport.get("bytes_out", 0))
    return RunResult(strategy.name, result_rows, dict(counters), time.perf_counter() - started,
                     devices=[{"strategy": strategy.name, **row} for row in history.recorded])


def _all_done(history: FleetHistory, devices: list[str]) -> bool:
    with history.lock:
        found = history.status.devices
        return all(d in found and found[d].state == DeviceState.DONE for d in devices)


@contextlib.contextmanager
def _watching(broker: BrokerConfig, fleet: str,
              devices: list[str]) -> Iterator[FleetHistory]:
    """What the fleet's devices report while the block runs, as a monitor sees it (what the
    broker retained from the recipe before is forgotten once delivered), up to each
    device's last summary, which says it is done (or 10 s after the block)."""
    from aggregator.monitor import FleetHistory, watch

    history, stop = FleetHistory(fleet), StopFlag(install=False)
    thread = threading.Thread(target=watch, args=(broker, history, stop), daemon=True)
    thread.start()
    time.sleep(1.0)
    with history.lock:
        history.forget()
    try:
        yield history
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not _all_done(history, devices):
            time.sleep(0.2)
    finally:
        stop.event.set()
        thread.join(10)


@contextlib.contextmanager
def _embedded_broker():
    """Start ``safl broker`` on a free loopback port for the duration of the demo."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "safl", "broker", "--port",
                             str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SaflError("the embedded broker did not start: pip install "
                                    "'safl-edge[broker]'") from None
                time.sleep(0.1)
        yield f"mqtt://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:  # amqtt on a loaded machine: the run is done
            log.warning("the embedded broker did not stop within 10 s of SIGTERM: killed")
            proc.kill()
            proc.wait()


def _fleet(rounds: int, seed: int, stations: int, devices_per_station: int, alpha: float,
           lr: float, body: str = "none", body_dir: str = ""):
    """The demo's data and fleet: the same for every strategy, run or written out.  With a
    body the images become camera frames (3x64x64), embedded once by the body (cached), and
    the model is a linear head on them (docs/bodies.md)."""
    from .experiment import closed_form_head

    data, note = load_default()
    print(f"dataset: {note}", file=sys.stderr)
    model = "mlp"
    if body != "none":
        data, model, lr = through_body(data, (3, 64, 64), body, body_dir), "linear", BODY_LR
    return data, _spec(data, rounds, seed, stations, devices_per_station, alpha, lr=lr,
                       model=model, body=body,
                       head=closed_form_head(model, body, (3, 64, 64), body_dir,
                                             data.num_classes))


def _spec(data, rounds: int, seed: int, stations: int, devices_per_station: int,
          alpha: float, **fields: Any) -> FleetSpec:
    """The demo's fleet on ``data``: Dirichlet(``alpha``) label skew over its devices,
    grouped into stations, streaming as the demo streams."""
    rng = np.random.default_rng(seed)
    n_dev = stations * devices_per_station
    return FleetSpec(partitions=tuple(dirichlet_label_skew(data.y_train, n_dev, alpha, rng)),
                     groups=tuple(assign_groups(n_dev, stations, rng)), rounds=rounds,
                     seed=seed, arrivals_per_step=48, initial_samples=64, **fields)


# Frames a hand-started body fleet's devices replay, all together (uint8 pixels: 74 MB at
# 3x64x64), and test frames its cloud embeds at start-up.  A linear head on a pretrained
# body is at 80% after about 500 labelled samples (docs/bodies.md): these are plenty.
CAMERA_TRAIN, CAMERA_TEST = 6000, 2000


def _camera_fleet(rounds: int, seed: int, body: str, body_dir: str, stations: int = 2,
                  devices_per_station: int = 6, alpha: float = 0.3):
    """The demo's fleet as cameras feed a body fleet: the first :data:`CAMERA_TRAIN` images
    as camera frames at the body's input shape, in uint8 pixels, which each device replays
    and embeds itself as it would a camera's frames, and :data:`CAMERA_TEST` test frames,
    which the cloud embeds at start-up (``aggregator.services.evaluation_set``)."""
    from edge_client.body import load_body_manifest

    from .datasets import body_folder, camera_frames

    folder = body_folder(body, (3, 64, 64), body_dir)
    shape = load_body_manifest(folder).input_shape
    data, note = load_default()
    print(f"dataset: {note}, as {'x'.join(map(str, shape))} camera frames", file=sys.stderr)

    def pixels(images: np.ndarray) -> np.ndarray:
        return np.round(camera_frames(images, shape) * 255).astype(np.uint8)
    data = dataclasses.replace(data, name=f"{data.name}@{'x'.join(map(str, shape))}",
                               x_train=pixels(data.x_train[:CAMERA_TRAIN]),
                               y_train=data.y_train[:CAMERA_TRAIN],
                               x_test=pixels(data.x_test[:CAMERA_TEST]),
                               y_test=data.y_test[:CAMERA_TEST])
    return data, _spec(data, rounds, seed, stations, devices_per_station, alpha, lr=BODY_LR,
                       model="linear", body=body, body_dir=str(folder))


def write_demo_fleet(folder: Path, *, broker: str, rounds: int = 20, seed: int = 0,
                     strategy: str = "safl+fedgs", body: str = "none",
                     body_dir: str = "") -> dict[str, Path]:
    """Write the demo's fleet (one strategy) as files to start by hand: every role's TOML
    with absolute paths, each device's data, the test set, and a README with the commands.
    With a ``body`` it is a body fleet: every role's ``[model]`` names it, the devices
    replay camera frames and embed them, the cloud scores the head on test frames it
    embeds (:func:`_camera_fleet`)."""
    from .launch import fleet_commands, write_fleet

    check_range("rounds", rounds, 1)
    recipes = demo_strategies(rounds=rounds, factories=2)
    chosen = [s for s in recipes if s.name == strategy]
    if not chosen:
        raise ConfigError("strategy", f"must be one of {[s.name for s in recipes]}")
    data, spec = _fleet(rounds, seed, 2, 6, 0.3, 0.1) if body == "none" else \
        _camera_fleet(rounds, seed, body, body_dir)
    folder = Path(folder).resolve()
    paths = write_fleet(folder, data, chosen[0], spec, broker)
    what = "" if body == "none" else f", a linear head on {body} (devices replay camera frames)"
    lines = [f"# A safl-edge fleet: {strategy}, {rounds} rounds, 2 stations x 6 devices{what}",
             "",
             "Start a broker (`safl broker --port 1883`, or Mosquitto), then each line in its",
             "own terminal or host (the cloud first is tidiest; any order works). The",
             "`--broker` flag overrides the URL in the files. A station waits until every",
             "device of its roster reported and logs the ones it is missing.", "", "```sh",
             *(" ".join(c) for c in fleet_commands(paths, broker).values()), "```", "",
             "The cloud writes metrics.csv here; cloud and stations checkpoint under state/",
             "(remove it to start over).", ""]
    (folder / "README.md").write_text("\n".join(lines))
    return paths


def run_demo(*, rounds: int | None = None, out: Path | None = None, seed: int = 0,
             stations: int = 2, devices_per_station: int = 6, alpha: float = 0.3,
             lr: float = 0.1, bus: str = "mqtt", broker: str | None = None,
             body: str = "none", body_dir: str = "") -> list[RunResult]:
    """Run the demo, print its table, write metrics (CSV, JSON) and ``accuracy.png``.

    ``bus = "mqtt"`` runs every role as its own process over ``broker`` (the embedded
    amqtt broker when None); ``bus = "local"`` runs them in this process.  With a ``body``
    (exported in ``body_dir``, by default the cache) the devices train a linear head on its
    embeddings of the dataset's camera frames, which the lab computes once; over the broker
    the device processes replay those embeddings.
    """
    if bus not in ("mqtt", "local"):
        raise ConfigError("bus", f"must be 'mqtt' or 'local', got {bus!r}")
    rounds = rounds if rounds is not None else DEFAULT_ROUNDS[bus]
    check_range("rounds", rounds, 1)
    # Extras are checked before minutes of training, not after.
    if bus == "mqtt" and broker is None and importlib.util.find_spec("amqtt") is None:
        raise SaflError("the demo's embedded broker needs amqtt: pip install "
                        "'safl-edge[broker]' (or pass --broker mqtt://host:port, or --bus local)")
    try:
        import matplotlib  # noqa: F401
        plotting = True
    except ImportError:
        plotting = False
        print("matplotlib is not installed: the demo writes its CSV and JSON but no plot "
              "(pip install 'safl-edge[plot]' for accuracy.png)", file=sys.stderr)
    # Over the broker a body fleet's devices embed the camera frames they replay, as a
    # camera's would, so that every role's [model] names the body and solves its head.
    data, spec = _fleet(rounds, seed, stations, devices_per_station, alpha, lr, body, body_dir) \
        if body == "none" or bus == "local" else \
        _camera_fleet(rounds, seed, body, body_dir, stations, devices_per_station, alpha)
    where = "in this process" if bus == "local" else (
        f"one process per role over {broker or 'the embedded amqtt broker'}")
    model = "MLP" if body == "none" else f"a linear head on {body}'s embeddings"
    print(f"fleet: {stations} stations x {devices_per_station} devices, Dirichlet({alpha}) label "
          f"skew, {model} on numpy, {rounds} rounds, {where}", file=sys.stderr)
    if body != "none":
        print('head: head_init = "auto" (lda with a body): each device sums its '
              "labelled frames' statistics, and the cloud solves the head from the fleet's "
              "sums before round 0 and every round after (docs/bodies.md)", file=sys.stderr)
    out = out or Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S")
    if bus == "local":
        results = [run_federation(data, s, spec, Progress(s.name, rounds))
                   for s in demo_strategies(rounds=rounds, factories=stations)]
    else:
        with contextlib.ExitStack() as stack:
            url = broker or stack.enter_context(_embedded_broker())
            results = [_over_broker(data, s, spec, url, out, rounds)
                       for s in demo_strategies(rounds=rounds, factories=stations)]
    csv_path, json_path = write_metrics(with_fates(results), out)
    written = [str(csv_path), str(json_path)]
    if plotting:
        written.append(str(plot_accuracy(results, out / "accuracy.png",
                                         f"{data.name}: {stations}x{devices_per_station} "
                                         f"devices, Dirichlet({alpha})")))
        written.append(str(write_run_report(out)))
    print(format_table(summary_rows(results)))
    print(f"({FATES_NOTE})")
    print(f"\nwrote {', '.join(written)}" + ("" if plotting else
                                              " (no plot: pip install 'safl-edge[plot]')"))
    return results
