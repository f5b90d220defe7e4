"""docs/camera-line.md, run as written: a body fleet of two network cameras learning from the
labels its line application publishes, over the provisioned TLS brokers.

The page's ``<!-- run -->`` blocks run in order, as root, with deploy.md's two broker blocks
and its board block (once per device) where the page says so, and the page's line
application saved from its ``<!-- file: line_app.py -->`` block.  What the test provides is
what a factory has: two MJPEG cameras (ffmpeg on loopback) filming a conveyor of four
products, photos of those products for the cloud's evaluation set, and the inspection
station's labels (0.5-3 s after each item) written into the line application's label feed.
What it changes: the addresses and ports (loopback, free ports), the camera URIs, ``/etc/safl``
and ``/var/lib/safl`` (folders of the test), ``safl`` and ``/opt/safl/bin/python`` (this
checkout's), the label feed's path, and the second board's metrics port (both boards are
this one machine).  It asserts what the line gets: predictions from both cameras reach the
line application, each device's prequential accuracy rises well above chance, and the
cameras' predictions, as the line scores them, come within 5 points of the cloud's accuracy
on its evaluation photos (or above it): a camera as good as its fleet.  Then the line starts
making a fifth product, which the inspection station names before the fleet has it: the
cameras hold its labels, the product is added as section 8 says, and the cameras come to
name it on the items in front of them.  Once the fleet's unknown-part detector has come, a
foreign part passes with no verdict (section 9) and its predictions are flagged; then the
lamp changes.  The cloud's accuracy on its photos, read every round until the lamp, never
falls more than 2 points below its best so far, through the body's 1,280 features.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from brokers import free_port
from doc_blocks import blocks_of, files_of, localise, localise_files, run_block, venv_runs_as_safl
from stream_servers import Line, StreamServer, have_ffmpeg

DOCS = Path(__file__).resolve().parents[1] / "docs"
CLASSES = (0, 1, 2, 3)
# What the inspection station calls them: the fleet file's class_names, and the fifth product
# the line starts making once the four are learnt (section 8).
NAMES = ("bolt", "nut", "washer", "bracket", "gear")
GEAR = 4
HELD = 20  # gears' labels the cameras hold, between them, before the product is added
NEW_PRODUCT_S = 240.0  # the longest the cameras are given to learn it once added
GEAR_TARGET = 0.8  # of the gears in front of the cameras over the last 30 s, named "gear"
SECONDS = 420.0  # the longest the line is given to learn
# A foreign part (section 9): a class the line never makes, shown without a verdict once the
# fleet's detector and its threshold reached the cameras (1,280 labelled frames and 200 more).
FOREIGN = 7
DETECTOR_S = 300.0  # the longest the cameras are given to flag parts
FOREIGN_S = 40.0  # how long foreign parts pass the cameras (one item in six)
FOREIGN_FLAGGED = 0.5  # the share of predictions on a foreign part flagged unknown, at least
KNOWN_FLAGGED = 0.15  # and of those on the four first products, at most (the fleet's is 0.05)
# What the new lamp may cost the line at once, live: measured 0.4-4.7 points with the frames
# stretched and 3.4 without (the labels go on teaching the new picture; the lab's table in
# camera-line.md is the stretch's measure), and 10.2-14.7 in five later runs on the same
# machine, the same code included: a line the lamp breaks (toward chance, 0.25) fails here.
LAMP_COST = 0.20
TARGET = 0.6  # each device's prequential accuracy (chance: 0.25)
# The cameras' predictions, as the line scores them over the last minute, against the
# cloud's accuracy on its evaluation photos: a camera as good as its fleet.
FLEET_GAP = 0.05
# The most the cloud's accuracy on its photos may fall below its best so far, from its first
# round to the new lamp, through the body's 1,280 features (a solve without a dip).
CLOUD_FALL = 0.02
# A camera device's peak resident memory, at most, with torch installed beside it (224-227
# MB measured; 711-714 before the body's ONNX Runtime was imported without torch).
DEVICE_MB = 250.0

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="the page is run as root, as on a server"),
    pytest.mark.skipif(shutil.which("mosquitto") is None,
                       reason="Mosquitto is installed by .ci/run"),
    pytest.mark.skipif(not have_ffmpeg(), reason="ffmpeg is installed by .ci/run"),
    pytest.mark.skipif(shutil.which("runuser") is None or shutil.which("curl") is None,
                       reason="needs runuser and curl"),
]


def _fleet_file(text: str, root: Path, ports: dict[str, int], cameras: list[str]) -> str:
    block = re.search(r"## 1\. The fleet file\n\n```toml\n(.*?)```", text, re.S)
    assert block, "camera-line.md lost its fleet file"
    fleet = block.group(1).replace('"/etc/safl/', f'"{root}/etc/safl/')
    for host in ("cloud.example.com", "10.1.0.2"):
        fleet = fleet.replace(f'"{host}"', '"127.0.0.1"')
    fleet = fleet.replace("cloud_port = 8883", f"cloud_port = {ports['cloud']}")
    fleet = fleet.replace("\nport = 8883", f"\nport = {ports['station']}")
    fleet = re.sub(r"^metrics_port = \d+", f"metrics_port = {ports['metrics']}", fleet,
                   flags=re.M)
    for address, uri in zip(("http://10.1.0.21:8080/cam.mjpg", "http://10.1.0.22:8080/cam.mjpg"),
                            cameras, strict=True):
        assert address in fleet
        fleet = fleet.replace(address, uri)
    return fleet


def _scrape(port: int) -> str:
    """A device's /metrics page ("" where it cannot be read)."""
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
    except OSError:
        return ""


def _metrics(port: int) -> dict[str, float]:
    found = (re.match(r"^(\w+)(?:\{[^}]*\})? (\S+)$", line) for line in _scrape(port).split("\n"))
    return {f.group(1): float(f.group(2)) for f in found if f}


def _watch_the_cloud(port: int, curve: list[tuple[float, float]]) -> threading.Event:
    """The cloud's accuracy on its photos, a point a round, read in the background until the
    event returned is set: a solve without a dip as the samples pass the body's features."""
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(2.0):
            read = _metrics(port)
            if "safl_last_accuracy" in read and (not curve or curve[-1][0] != read["safl_round"]):
                curve.append((read["safl_round"], read["safl_last_accuracy"]))
    threading.Thread(target=watch, daemon=True).start()
    return stop


def _largest_fall(curve: list[tuple[float, float]]) -> float:
    """The most the accuracy fell below its best so far."""
    values = np.array([accuracy for _, accuracy in curve])
    return float(np.max(np.maximum.accumulate(values) - values)) if len(values) else 0.0


def _device_use(root: Path, ports: dict[str, int], seconds: float) -> dict[str, dict]:
    """Each camera device's budget, from its process (its command names its ``device.toml``
    under ``root``) and its metrics: peak resident MB, cores used over the ``seconds`` the
    line ran, KB a second to and from the broker, and whether it has libtorch mapped."""
    found: dict[str, dict] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            command = (proc / "cmdline").read_bytes().split(b"\0")
            if b"device" not in command or not any(str(root).encode() in a and
                                                   a.endswith(b"device.toml") for a in command):
                continue
            camera = next(a for a in command if a.endswith(b"device.toml")).decode().split("/")[-2]
            peak = next(line for line in (proc / "status").read_text().splitlines()
                        if line.startswith("VmHWM"))
            mb, torch = int(peak.split()[1]) / 1024, "libtorch" in (proc / "maps").read_text()
            cpu = sum(map(int, (proc / "stat").read_text().rsplit(")", 1)[1].split()[11:13]))
        except (OSError, StopIteration):
            continue
        # runuser's command names the file too: the device is the larger of the two
        if mb > found.get(camera, {}).get("mb", 0.0):
            read = _metrics(ports[camera])
            found[camera] = {"mb": mb, "torch": torch, "cores": cpu / tick / seconds,
                             "out_kbs": read.get("safl_bytes_out_total", 0) / seconds / 1e3,
                             "in_kbs": read.get("safl_bytes_in_total", 0) / seconds / 1e3}
    return found


def _diagnosis(device_ports: dict[str, int], var: Path) -> str:
    """What a device that did not learn says of its joins and promotions: its metrics on
    label lag, promotions and the deployed model, and its log's warnings and lag changes."""
    out = []
    for device, port in device_ports.items():
        out += [f"== {device}"] + [line for line in _scrape(port).split("\n") if re.search(
            "promotion|label_lag|label_joined|label_unmatched|deployed|shadow", line)
            and not line.startswith("#")]
        log = var / f"{device}.log"
        out += [line[:300] for line in (log.read_text() if log.exists() else "").split("\n")
                if "WARNING" in line or " lag" in line]
    return "\n".join(out)


def _line_accuracy(predictions: Path, conveyor: Line, seconds: float = 60.0) -> float | None:
    """What the line measures of the cameras' predictions over the last ``seconds``: each
    against the item in front of the camera when its frame was filmed (a frame is read
    about 0.15 s after: sources.md, label_lag); None before one."""
    lines = predictions.read_text().splitlines() if predictions.exists() else []
    recent = [p for p in map(json.loads, lines[:-1]) if p["t"] > time.time() - seconds]
    return float(np.mean([conveyor.item_at(p["t"] - 0.15) == p["label"] for p in recent])) \
        if recent else None


def _learnt(curve: list[tuple[float, dict[str, tuple[float, float]]]], device: str) -> bool:
    """From its first 50 labelled frames to now, the device rose 0.2 (or to 0.95, where it
    started higher than 0.75) and is at the target.

    The wait stops on this same rule: stopping on the target alone left a device that started
    at 0.41 short of its rise, with most of the line's time unused.  A device whose first
    prediction came late (27 s into a loaded make test) was at 0.86 by its first 50 labelled
    frames, the head solved from the fleet's first frames, and rose to 1.00.  A reading before
    the device's first prediction has no accuracy (NaN: 55 frames labelled, none predicted
    yet, in a loaded make test) and counts for neither end."""
    values = [acc[device][0] for _, acc in curve
              if acc[device][1] >= 50 and not np.isnan(acc[device][0])]
    return bool(values) and values[-1] >= TARGET and values[-1] >= min(values[0] + 0.2, 0.95)


def _product_accuracy(predictions: Path, conveyor: Line, product: int, since: float,
                      seconds: float = 30.0) -> tuple[float, int, float]:
    """Of the cameras' predictions over the last ``seconds`` (and after ``since``) made
    with an item of ``product`` in front of them, the share that named it (its class and its
    name) and how many there were; and the share right of the rest (the other products)."""
    lines = predictions.read_text().splitlines() if predictions.exists() else []
    start = max(since, time.time() - seconds)
    recent = [(p, conveyor.item_at(p["t"] - 0.15)) for p in map(json.loads, lines[:-1])
              if p["t"] > start]
    right = [p["label"] == product and p.get("product") == NAMES[product]
             for p, item in recent if item == product]
    rest = [p["label"] == item for p, item in recent if item not in (product, None)]
    return (float(np.mean(right)) if right else 0.0), len(right), \
        (float(np.mean(rest)) if rest else 0.0)


def _add_a_product(block: str, root: Path, work: Path, conveyor: Line, predictions: Path,
                   device_ports: dict[str, int]) -> dict[str, float]:
    """Section 8: the line starts making gears, whose labels the cameras hold; the product is
    added as the page says, and the cameras come to name the gears in front of them."""
    conveyor.classes = (*CLASSES, GEAR)
    began = time.monotonic()
    held = 0.0
    while time.monotonic() - began < 120.0 and held < HELD:
        time.sleep(3.0)
        held = sum(_metrics(p).get("safl_labels_held", 0.0) for p in device_ports.values())
    assert held >= HELD, f"the cameras hold {held} labels of the product to come"
    out = run_block(localise(block, root), work)
    assert out.returncode == 0, (block, out.stdout, out.stderr)
    localise_files(root)
    added, since = time.monotonic(), time.time()
    gear, seen, others = 0.0, 0, 0.0
    while time.monotonic() - added < NEW_PRODUCT_S:
        time.sleep(5.0)
        gear, seen, others = _product_accuracy(predictions, conveyor, GEAR, since)
        if seen >= 10 and gear >= GEAR_TARGET:
            break
    joined = sum(_metrics(p).get("safl_label_held_joined_total", 0.0)
                 for p in device_ports.values())
    return {"held": held, "joined": joined, "gear": gear, "seen": seen, "others": others,
            "held_s": added - began, "learnt_s": time.monotonic() - added}


def _flagged(predictions: Path, conveyor: Line, since: float) -> dict[str, float]:
    """Of the predictions since ``since`` that carry a flag: the share flagged unknown of
    those made with a foreign part in view, and of those with one of the first products."""
    lines = predictions.read_text().splitlines() if predictions.exists() else []
    judged = [(p["unknown"], conveyor.item_at(p["t"] - 0.15)) for p in map(json.loads, lines[:-1])
              if p["t"] > since and p.get("unknown") is not None]
    foreign = [flag for flag, item in judged if item == FOREIGN]
    known = [flag for flag, item in judged if item in CLASSES]
    gear = [flag for flag, item in judged if item == GEAR]
    return {"gear": float(np.mean(gear)) if gear else float("nan"),
            "foreign": float(np.mean(foreign)) if foreign else 0.0, "foreign_n": len(foreign),
            "known": float(np.mean(known)) if known else 1.0, "known_n": len(known)}


def _foreign_part(block: str, root: Path, work: Path, conveyor: Line, predictions: Path,
                  device_port: int) -> dict[str, float]:
    """Section 9: once the cameras flag parts, foreign ones pass them with no verdict; the
    line acts on ``unknown`` and a device counts them."""
    began, since = time.monotonic(), time.time()
    while time.monotonic() - began < DETECTOR_S and not _flagged(
            predictions, conveyor, since)["known_n"]:
        time.sleep(5.0)
    waited, since = time.monotonic() - began, time.time()
    conveyor.foreign, conveyor.classes = (FOREIGN,), (*conveyor.classes, FOREIGN)
    time.sleep(FOREIGN_S)
    conveyor.classes = conveyor.classes[:-1]
    time.sleep(2.0)  # the last foreign part leaves the picture
    flagged = _flagged(predictions, conveyor, since)
    out = run_block(localise(block, root).replace("127.0.0.1:9103/",
                                                  f"127.0.0.1:{device_port}/"), work)
    counted = re.search(r'^safl_predictions_total\{kind="unknown".* (\S+)$', out.stdout, re.M)
    return {**flagged, "waited_s": waited, "counted": float(counted[1]) if counted else 0.0}


def _new_lamp(picture: np.ndarray) -> np.ndarray:
    """The lighting change of docs/camera-line.md's table: lower contrast, brighter, and a
    gradient left to right (0.45 g x + 0.35, g from 0.7 to 1.0)."""
    g = np.linspace(0.7, 1.0, picture.shape[1])[None, :, None]
    return np.clip(0.45 * g * picture + 0.35 * 255, 0, 255).astype(np.uint8)


def _change_the_lamp(conveyor: Line, predictions: Path) -> tuple[float, float]:
    """"Lamps that change": the line's accuracy over the 30 s before the new lamp and over
    the 30 s after its first 5 (frames stretched before the body: the fleet file's
    body_input)."""
    def accuracy(start: float, end: float) -> float:
        lines = predictions.read_text().splitlines()
        on = [(p["label"], item) for p in map(json.loads, lines[:-1]) if start < p["t"] <= end
              and (item := conveyor.item_at(p["t"] - 0.15)) not in (None, *conveyor.foreign)]
        print("  by product:", {c: round(float(np.mean([label == c for label, item in on
                                                         if item == c])), 3)
                                for c in sorted({item for _, item in on})})
        return float(np.mean([label == item for label, item in on]))
    changed = time.time()
    conveyor.lamp = _new_lamp
    time.sleep(35.0)
    return accuracy(changed - 30.0, changed), accuracy(changed + 5.0, changed + 35.0)


def _feed(path: Path, devices: tuple[str, ...]):
    """The line's label feed: each verdict of the inspection station, for both cameras, the
    product by its name."""
    fifo = open(path, "w", buffering=1)  # noqa: SIM115 - open while the line runs
    lock = threading.Lock()

    def publish(_topic: str, payload: bytes) -> None:
        label = json.loads(payload)
        label["label"] = NAMES[label["label"]]
        with lock:
            for device in devices:
                fifo.write(json.dumps({"device": device, **label}) + "\n")
    return fifo, publish


# the line's own budget, a new product's, a foreign part's, and the set-up beside them
@pytest.mark.timeout(int(SECONDS + NEW_PRODUCT_S + DETECTOR_S + FOREIGN_S) + 360)
def test_camera_line_md_runs_as_written(digits):
    began = time.monotonic()
    text, deploy = (DOCS / "camera-line.md").read_text(), (DOCS / "deploy.md").read_text()
    export, body, evaluation, start, line_app, watch, add_product, unknowns = blocks_of(text)
    _, cloud_host, factory, board, _, _ = blocks_of(deploy)
    root = Path(tempfile.mkdtemp(prefix="safl-line-"))
    root.chmod(0o755)
    work = root / "work"
    work.mkdir()
    ports = {"cloud": free_port(), "station": free_port(), "metrics": free_port()}
    device_ports = {"cam-01": ports["metrics"] + 2, "cam-02": ports["metrics"] + 3}
    servers = [StreamServer("mjpeg", free_port(), work / f"cam{k}.log") for k in (1, 2)]
    (work / "fleet.toml").write_text(_fleet_file(text, root, ports, [s.uri for s in servers]))
    (work / "line_app.py").write_text(files_of(text)["line_app.py"])
    conveyor = Line(digits.x_train, digits.y_train, CLASSES, topic="", publish=None, seed=3)
    import cv2
    for label in CLASSES:  # the factory's photos of its products, a folder per class
        (work / "photos" / str(label)).mkdir(parents=True)
        for k in range(40):
            cv2.imwrite(str(work / "photos" / str(label) / f"{k}.png"), conveyor.photo(label))
    feed_path = work / "press-1-labels"
    os.mkfifo(feed_path)
    shell = {"pids": []}
    as_safl = venv_runs_as_safl()

    def background(block: str) -> None:
        block = localise(block, root).replace("/opt/safl/bin/python", sys.executable)
        block = block.replace("/run/press-1-labels", str(feed_path))
        if not as_safl:  # this checkout's Python lies where only root may look
            block = block.replace("runuser -u safl -- ", "")
        proc = subprocess.Popen(["bash", "-euo", "pipefail", "-c", block], cwd=work,
                                start_new_session=True)
        shell["pids"].append(proc.pid)
        assert proc.wait(60) == 0, block

    fifo = None
    cloud_curve: list[tuple[float, float]] = []
    cloud_watch = _watch_the_cloud(ports["metrics"], cloud_curve)
    try:
        for block in (export, cloud_host, factory, body):
            out = run_block(localise(block, root), work)
            assert out.returncode == 0, (block, out.stdout, out.stderr)
        for device in device_ports:
            out = run_block(localise(board.replace("cam-01", device), root), work)
            assert out.returncode == 0, (device, out.stderr)
        localise_files(root)
        out = run_block(localise(evaluation, root), work)
        assert out.returncode == 0, out.stderr
        last = start.strip().splitlines()[-1]
        assert "cam-01" in last
        second = last.replace("cam-01", "cam-02").replace(
            " --keep-running", f" --keep-running --metrics-port {device_ports['cam-02']}")
        started = time.monotonic()
        background(start + second + "\n")
        background(line_app)
        fifo, publish = _feed(feed_path, tuple(device_ports))
        conveyor.publish_fn = publish
        conveyor.run(servers)
        curve: list[tuple[float, dict[str, float]]] = []
        predictions = work / "predictions.jsonl"
        first_prediction = cloud = line = None
        var = root / "var" / "lib" / "safl"
        while time.monotonic() - started < SECONDS:
            time.sleep(5.0)
            failed = [p for p in var.glob("*.log") if "safl: error" in p.read_text()]
            assert not failed, {p.name: p.read_text()[-2000:] for p in failed}
            if first_prediction is None and predictions.exists() and predictions.stat().st_size:
                first_prediction = time.monotonic() - started
            read = {d: _metrics(p) for d, p in device_ports.items()}
            now = {d: (m.get("safl_prequential_accuracy", float("nan")),
                       m.get("safl_label_joined_total", 0)) for d, m in read.items()}
            curve.append((time.monotonic() - started, now))
            cloud = _metrics(ports["metrics"]).get("safl_last_accuracy")
            line = _line_accuracy(predictions, conveyor)
            if len(curve) > 6 and all(_learnt(curve, d) for d in device_ports) \
                    and cloud is not None and line is not None and line >= cloud - FLEET_GAP:
                break
        new_product = _add_a_product(add_product, root, work, conveyor, predictions,
                                     device_ports)
        foreign = _foreign_part(unknowns, root, work, conveyor, predictions,
                                device_ports["cam-01"])
        cloud_watch.set()  # its photos show the old lamp: the curve ends here
        use = _device_use(root, device_ports, time.monotonic() - started)
        lamp = _change_the_lamp(conveyor, predictions)
        out = run_block(localise(watch, root).replace(
            "127.0.0.1:9103/", f"127.0.0.1:{device_ports['cam-01']}/"), work)
        status = out.stdout + out.stderr
        diagnosis = _diagnosis(device_ports, var)
        logs = {p.name: p.read_text() for p in var.glob("*.log")}
    finally:
        cloud_watch.set()
        conveyor.stop()
        if fifo is not None:
            fifo.close()
        for pid in shell["pids"]:
            try:
                os.killpg(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for server in servers:
            server.stop()
        time.sleep(2)
        subprocess.run(["pkill", "-f", str(root)], capture_output=True)
        time.sleep(0.5)
    seen = [json.loads(line) for line in predictions.read_text().splitlines()]
    print(f"\ncamera-line.md: {time.monotonic() - began:.0f} s in all; the first prediction "
          f"reached the line {first_prediction} s after the roles started; "
          f"{len(seen)} predictions ({Counter(p['device'] for p in seen)}); the line's "
          f"accuracy over the last 60 s {line or float('nan'):.3f}, the cloud's on its photos "
          f"{cloud or float('nan'):.3f}")
    print("  prequential accuracy: " + ", ".join(
        f"{t:.0f}s " + "/".join(f"{v:.2f}" for v, _ in acc.values()) for t, acc in curve))
    print("  a new product (section 8): {held:.0f} labels of gears held in {held_s:.0f} s; "
          "added, {joined:.0f} held frames trained on, and {gear:.3f} of the last {seen} "
          "predictions with a gear in view named it, {learnt_s:.0f} s after, and {others:.3f} "
          "of the rest their product".format(
              **new_product))
    print("  a foreign part (section 9): flags came {waited_s:.0f} s after the gears; "
          "{foreign:.3f} of {foreign_n} predictions with one in view flagged unknown, "
          "{known:.3f} of {known_n} with a first product, {gear:.3f} with a gear; cam-01 "
          "counted {counted:.0f}".format(
              **foreign))
    print(f"  the cloud's accuracy on its photos, a round a point: "
          f"{' '.join(f'{a:.3f}' for _, a in cloud_curve)}; at most "
          f"{_largest_fall(cloud_curve):.3f} below its best so far")
    print("  each camera device: " + "; ".join(
        f"{camera} {u['mb']:.0f} MB peak{' with libtorch' if u['torch'] else ''}, "
        f"{u['cores']:.2f} cores, {u['out_kbs']:.1f} KB/s out and {u['in_kbs']:.1f} in"
        for camera, u in sorted(use.items())))
    print(f"  a new lamp: the line's accuracy {lamp[0]:.3f} over the 30 s before it, "
          f"{lamp[1]:.3f} over the 30 s after its first 5")
    shutil.rmtree(root, ignore_errors=True)
    assert {p["device"] for p in seen} == set(device_ports), "predictions from both cameras"
    for device in device_ports:
        assert _learnt(curve, device), f"{device} did not learn:\n{diagnosis}"
    assert line is not None and cloud is not None and line >= cloud - FLEET_GAP, \
        f"the cameras' predictions {line} against the cloud's accuracy {cloud}"
    assert out.returncode == 0, status
    assert "devices online: 2 of 2" in status and "ERROR" not in status, status
    assert "products: bolt, nut, washer, bracket, gear; 1 of 6 classes free" in status, status
    assert new_product["joined"] >= HELD and new_product["seen"] >= 10 \
        and new_product["gear"] >= GEAR_TARGET, (new_product, diagnosis)
    # The products the line had are predicted as well as before (the new class takes none).
    assert new_product["others"] >= line - FLEET_GAP, (new_product, line)
    assert foreign["foreign_n"] >= 20 and foreign["foreign"] >= FOREIGN_FLAGGED \
        and foreign["known"] <= KNOWN_FLAGGED and foreign["counted"] > 0, (foreign, diagnosis)
    assert lamp[1] >= lamp[0] - LAMP_COST, lamp
    # A camera device never loads torch, though it is installed beside it (install-edge.md).
    assert set(use) == set(device_ports) and not any(u["torch"] for u in use.values()), use
    assert all(u["mb"] <= DEVICE_MB for u in use.values()), use
    assert len(cloud_curve) >= 10 and _largest_fall(cloud_curve) <= CLOUD_FALL, cloud_curve
    assert "safl_prequential_accuracy" in status and "safl_body_ms_per_frame" in status, status
    # The head is solved from the devices' statistics (docs/bodies.md), not learnt by SGD
    # alone: the statistics cross the provisioned brokers' ACLs.
    assert "head solved from the statistics" in logs["cloud.log"], logs["cloud.log"][-3000:]
    for name, log in logs.items():
        assert "Traceback" not in log and "lost the broker" not in log, (name, log[-3000:])

