"""Frozen pretrained bodies: the export and its checks, the body's hash in the federation's
layout, one forward per frame at ingest, the exported body-plus-head graph, the lab's
embedding cache and the clock's price for a body (docs/bodies.md)."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from test_inference import _Frames
from user_bodies import exported_device_model, exported_user_body

from edge_client import messages as m
from edge_client.admission import Admission
from edge_client.body import (
    BODY_FILE,
    BODY_MANIFEST,
    Body,
    load_body_manifest,
    open_body,
    open_exported,
    probe_frames,
)
from edge_client.codec import encode
from edge_client.config import DeviceConfig, InferenceConfig, ModelConfig
from edge_client.device import Device
from edge_client.errors import ArtifactError, ConfigError
from edge_client.serving import StreamFeed
from edge_client.sources.pump import SourcePump
from edge_client.topics import station_model_topic

pytest.importorskip("torch")
pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

TINY = (3, 16, 16)
TINY_BODY = '''
import torch
from torch import nn


class Tiny(nn.Module):
    """A body as a user writes one: frames in [0, 1] -> 8 features, normalised inside."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)

    def forward(self, x):
        return torch.relu(self.bn(self.conv((x - 0.5) / 0.5))).mean(dim=(2, 3))


def make(input_shape):
    return Tiny()
'''


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A user's own body (``package.module:factory``), exported: its folder."""
    yield from exported_user_body(tmp_path_factory, "tiny_bodies", TINY_BODY, "make", TINY)


@pytest.fixture(scope="module")
def tiny_centred(tmp_path_factory):
    """The same body exported with a centre: a fleet on it solves its head in closed form."""
    yield from exported_user_body(tmp_path_factory, "tiny_centred", TINY_BODY, "make", TINY,
                                  centred=True)


@pytest.fixture(scope="module")
def lite0(tmp_path_factory):
    """EfficientNet-Lite0 exported as ``safl models export-body`` does, checked on real frames."""
    pytest.importorskip("efficientnet_lite_pytorch")
    pytest.importorskip("sklearn")
    from safl.bodies import export_checked

    folder = tmp_path_factory.mktemp("lite0")
    export_checked("efficientnet-lite0", folder, (3, 64, 64))
    return folder


def _model(folder, **kw) -> ModelConfig:
    manifest = load_body_manifest(folder)
    return ModelConfig(name=kw.pop("name", "linear"), body=manifest.factory,
                       body_dir=str(folder), input_shape=manifest.input_shape, **kw)


def test_the_pretrained_body_exports_checked_against_torch_on_real_frames(lite0, tmp_path):
    from lab.datasets import FASHION_MNIST_DIR
    from safl.bodies import export_checked

    doc = json.loads((lite0 / BODY_MANIFEST).read_text())
    checked = doc["checked_against_torch"]
    assert "scikit-learn photos" in checked
    if (FASHION_MNIST_DIR / "t10k-images-idx3-ubyte.gz").exists():
        assert "Fashion-MNIST frames" in checked
    assert all(v <= 1e-4 for v in checked.values()), checked
    assert doc["embedding"] == 1280 and doc["input_shape"] == [3, 64, 64]
    # The same body exported again is the same body: the hash names it, not the export.
    again = export_checked("efficientnet-lite0", tmp_path / "again", (3, 64, 64))
    assert again.hash == doc["hash"] == load_body_manifest(lite0).hash
    # Its features tell the two photos apart (a temple, a flower): the weights are real.
    from lab.datasets import sample_photos
    emb = open_exported(lite0).embed(sample_photos((3, 64, 64)))
    assert emb.shape == (2, 1280) and np.abs(emb[0] - emb[1]).max() > 1.0


def test_a_body_that_is_not_the_exported_one_is_refused(tiny, tmp_path):
    import shutil

    folder = tmp_path / "body"
    shutil.copytree(tiny, folder)
    assert open_exported(folder).check_probe() <= 1e-6
    # A graph that is not the manifest's file.
    graph = (folder / BODY_FILE).read_bytes()
    (folder / BODY_FILE).write_bytes(graph + b"\0")
    with pytest.raises(ArtifactError, match="SHA-256"):
        open_exported(folder)
    (folder / BODY_FILE).write_bytes(graph)
    # A manifest edited by hand.
    doc = json.loads((folder / BODY_MANIFEST).read_text())
    (folder / BODY_MANIFEST).write_text(json.dumps({**doc, "embedding": 9}))
    with pytest.raises(ArtifactError, match="hash"):
        open_exported(folder)
    # A consistent manifest whose probe another body computed: the graph computes otherwise.
    manifest = load_body_manifest(tiny)
    other = type(manifest)(**{**vars(manifest), "probe": tuple(
        tuple(2 * v for v in p) for p in manifest.probe)})
    (folder / BODY_MANIFEST).write_text(json.dumps(other.to_json()))
    with pytest.raises(ArtifactError, match="other embeddings"):
        open_exported(folder)


def test_the_body_is_part_of_the_federation_layout(tiny, lite0):
    from edge_client.service import federation_layout, model_trainer

    plain = ModelConfig(name="linear", input_shape=(8,))
    with_tiny = _model(tiny)
    t_plain, t_tiny = model_trainer(plain, 0.1), model_trainer(with_tiny, 0.1)
    assert t_plain.layout == t_tiny.layout  # the same head on 8 features ...
    ours = federation_layout(with_tiny, t_tiny)
    assert ours != federation_layout(plain, t_plain)  # ... is another federation with a body
    lite = _model(lite0)
    assert model_trainer(lite, 0.1).num_params == 1280 * 10 + 10
    # A device of the tiny body refuses the model of a federation without it.
    device = Admission(fleet="f", layout_hash=ours, num_params=t_tiny.num_params,
                       max_message=1 << 20, reassembly_memory=1 << 22, chunk_timeout=10.0)
    model = m.StationModel(fleet="f", sender="s0", round=0, iteration=0,
                           weights=np.zeros(t_plain.num_params, np.float32))
    frame = encode(model, layout_hash=federation_layout(plain, t_plain))
    refused = device.admit(station_model_topic("f", "s0"), frame, 0.0)
    assert isinstance(refused, m.Refusal) and refused.reason == "wrong_layout"
    assert device.counters["rejected.wrong_layout"] == 1
    accepted = device.admit(station_model_topic("f", "s0"), encode(model, layout_hash=ours), 0.0)
    assert isinstance(accepted, m.StationModel)


class _Counting(Body):
    """The tiny body, counting its forward calls and the frames in each."""

    def __init__(self, body: Body) -> None:
        super().__init__(body.manifest, body.runtime, body._forward)
        self.calls: list[int] = []

    def embed(self, frames):
        self.calls.append(len(frames))
        return super().embed(frames)


def test_each_frame_is_embedded_once_for_its_prediction_and_its_training(tiny, digits):
    from edge_client.service import model_trainer
    from edge_client.sources import LiveLabels

    cfg = _model(tiny)
    body = _Counting(open_body(cfg))
    trainer = model_trainer(cfg, 0.1)
    dev = Device(DeviceConfig(device_id="d0", station="s0", batch_size=4), trainer,
                 num_classes=10, sample_shape=(8,), rng=np.random.default_rng(0),
                 inference=InferenceConfig(max_batch=64))
    dev.handle(m.StationModel(fleet="default", sender="s0", round=0, iteration=0,
                              weights=trainer.get_flat()), 0.0)
    frames = np.random.default_rng(1).random((12, *TINY), dtype=np.float32)
    # Eight labelled frames, four waiting for their label from the line.
    now = time.time()
    items = [(frames[i], i % 10 if i < 8 else None, i, now + 0.01 * i) for i in range(12)]
    pump = SourcePump(_Frames(items), capacity=13).start()
    pump.finished.wait(5)
    labels = LiveLabels(10, window=60.0, delay_max=60.0)
    feed = StreamFeed(dev, pump, inference=dev.inference, labels=labels, body=body)
    feed(0.0)
    assert body.calls == [12]  # one forward pass, every frame in it once
    assert dev.buffer.samples_seen == 8 and dev.counters["predictions"] == 12
    stored = dev.buffer._train.take(0, 8)[0]
    assert dev.buffer.sample_shape == (8,)  # embeddings are buffered, not frames
    np.testing.assert_allclose(stored, open_body(cfg).embed(frames[:8]), rtol=1e-6)
    # A label for a parked frame trains on its embedding, with no second forward pass.
    feed.on_label(json.dumps({"label": 3, "t": now + 0.095}).encode(), 0.0)
    assert dev.buffer.samples_seen == 9 and body.calls == [12]


def test_a_body_device_never_loads_torch_where_torch_is_installed(tiny):
    """The training build of onnxruntime (what the body extra installs on x86 under Python
    3.12) imports torch from its own ``import onnxruntime`` wherever torch is installed, as it
    is here (microsoft/onnxruntime#22070): a camera device then held libtorch in memory.  The
    device's body is opened and run as the service does, in a fresh interpreter."""
    import subprocess
    import sys

    pytest.importorskip("torch")
    pytest.importorskip("onnxruntime")
    code = f"""
import sys, numpy as np
from edge_client.body import open_body, load_body_manifest
from edge_client.config import ModelConfig
manifest = load_body_manifest({str(tiny)!r})
body = open_body(ModelConfig(name="linear", body=manifest.factory, body_dir={str(tiny)!r},
                             input_shape=manifest.input_shape))
x = body.embed(np.random.default_rng(0).random((3, *manifest.input_shape), dtype=np.float32))
print(x.shape[0], sorted(m for m in ("torch", "onnxruntime") if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split(maxsplit=1) == ["3", "['onnxruntime']\n"], out.stdout


def test_the_export_is_one_graph_from_frames_through_the_body_and_head(tiny, tmp_path):
    from edge_client.service import model_trainer

    cfg = _model(tiny, seed=3)
    trainer = model_trainer(cfg, 0.1)
    weights = np.random.default_rng(2).normal(0, 0.5, trainer.num_params).astype(np.float32)
    frames = np.random.default_rng(3).random((5, *TINY), dtype=np.float32)
    logits, out = exported_device_model(
        tmp_path, cfg, trainer, weights, f'name = "linear"\ninput_shape = {list(TINY)}\n'
        f'seed = 3\nbody = "tiny_bodies:make"\nbody_dir = "{tiny}"\n', frames)
    want = trainer.logits(open_body(cfg).embed(frames), weights)
    np.testing.assert_allclose(logits, want, rtol=1e-4, atol=1e-5)
    import onnx
    meta = {p.key: p.value for p in onnx.load(str(out)).metadata_props}
    assert meta["safl.body"].endswith(load_body_manifest(tiny).hash)
    assert meta["safl.input_shape"] == "3,16,16"


def test_a_body_misconfigured_is_refused_with_the_key_named(tiny, tmp_path):
    with pytest.raises(ConfigError, match="body_dir"):
        ModelConfig(name="linear", body="efficientnet-lite0", input_shape=(3, 64, 64))
    with pytest.raises(ConfigError, match="holds body"):
        open_body(ModelConfig(name="linear", body="efficientnet-lite0", body_dir=str(tiny),
                              input_shape=TINY))
    with pytest.raises(ConfigError, match="input_shape"):
        open_body(ModelConfig(name="linear", body="tiny_bodies:make", body_dir=str(tiny),
                              input_shape=(3, 32, 32)))
    with pytest.raises(ArtifactError, match="export-body"):
        open_body(ModelConfig(name="linear", body="x", body_dir=str(tmp_path),
                              input_shape=TINY))
    # A camera delivers BGR; a pretrained body takes RGB.
    from edge_client.config import BrokerConfig, SourceConfig
    from edge_client.service import DeviceService
    service = DeviceService(device=DeviceConfig(device_id="d0", station="s0"),
                            broker=BrokerConfig(),
                            model=_model(tiny), source=SourceConfig(
                                kind="camera", uri="http://127.0.0.1:9/x.mjpg",
                                resize=(16, 16), label_topic="line/s0/labels"))
    with pytest.raises(ConfigError, match="rgb"):
        service.build()


def test_numpy_and_torch_heads_share_a_layout_and_the_hidden_size():
    from edge_client.trainers import build_trainer, layout_hash

    for name, hidden, params in (("linear", 128, 1280 * 10 + 10),
                                 ("mlp", 32, 1280 * 32 + 32 + 32 * 10 + 10)):
        heads = [build_trainer(name, backend=b, input_shape=(1280,), num_classes=10, lr=0.1,
                               hidden=hidden) for b in ("numpy", "torch")]
        assert {h.num_params for h in heads} == {params}
        assert layout_hash(heads[0].layout) == layout_hash(heads[1].layout)


def test_the_lab_embeds_a_dataset_once_per_body_and_reuses_it(tiny, digits, tmp_path):
    from lab.datasets import camera_frames, embedded

    body = _Counting(open_exported(tiny))
    first = embedded(digits, TINY, body, tmp_path)
    assert first.x_train.shape == (len(digits.y_train), 8) and first.sample_shape == (8,)
    assert sum(body.calls) == len(digits.y_train) + len(digits.y_test)
    again = embedded(digits, TINY, body, tmp_path)  # from the cache: no forward pass
    assert sum(body.calls) == len(digits.y_train) + len(digits.y_test)
    np.testing.assert_array_equal(first.x_test, again.x_test)
    np.testing.assert_allclose(first.x_test[:5], body.embed(camera_frames(
        digits.x_test[:5], TINY)), rtol=1e-6)
    assert [p.suffix for p in tmp_path.iterdir()] == [".npz"]  # no pickle, no part left


def test_the_clock_prices_the_body_on_every_arriving_frame():
    from lab.clock import PI4_OVER_HOST, PROFILES

    x86, pi4 = PROFILES["x86-numpy"], PROFILES["pi4-numpy"]
    assert pi4.body_seconds("efficientnet-lite0") == pytest.approx(
        PI4_OVER_HOST * x86.body_seconds("efficientnet-lite0"))
    assert x86.body_seconds("none") == 0.0
    with pytest.raises(ConfigError, match="no figure for body"):
        x86.body_seconds("resnet50")


def test_a_clocked_run_with_a_body_spends_the_body_per_frame(digits):
    from lab.clock import ClockConfig
    from lab.datasets import assign_groups, dirichlet_label_skew
    from lab.experiment import ExperimentConfig
    from lab.simulation import FleetSpec, run_federation
    from lab.strategies import build_strategy

    settings = ExperimentConfig(name="t", factories=1, devices_per_factory=3, super_node=2,
                                rand_per_group=0, sync_period=2, rounds=2).settings
    rng = np.random.default_rng(0)
    spec = FleetSpec(partitions=tuple(dirichlet_label_skew(digits.y_train, 3, 1.0, rng)),
                     groups=tuple(assign_groups(3, 1, rng)), rounds=2, model="linear",
                     eval_samples=100, clock=ClockConfig(profiles=(("pi4-numpy", 1.0),)))
    virtual = {}
    for body in ("none", "efficientnet-lite0"):
        import dataclasses
        result = run_federation(digits, build_strategy("fedgs", settings),
                                dataclasses.replace(spec, body=body))
        virtual[body] = result.rows[-1]["virtual_s"]
    assert virtual["efficientnet-lite0"] > virtual["none"] + 0.1, virtual


@pytest.mark.skipif("not __import__('torch').cuda.is_available()",
                    reason="needs a CUDA GPU (a Jetson, or the device machine)")
def test_on_cuda_the_body_runs_on_torch_and_agrees_with_its_export(tiny):
    cfg = _model(tiny, backend="torch", device="cuda")
    body = open_body(cfg)
    assert body.runtime.startswith("torch")
    frames = probe_frames(TINY, 4)
    np.testing.assert_allclose(body.embed(frames), open_exported(tiny).embed(frames),
                               rtol=1e-4, atol=1e-5)


def test_a_cnn_on_camera_frames_is_priced_at_their_size():
    from lab.clock import PROFILES

    torch_pi = PROFILES["pi4-torch"]
    assert torch_pi.step_seconds("small_cnn", (3, 64, 64)) > \
        5 * torch_pi.step_seconds("small_cnn", (1, 28, 28))
    assert torch_pi.step_seconds("linear", (1280,)) == torch_pi.step_seconds("linear")


def test_a_users_own_onnx_body_is_copied_probed_and_named_by_its_file(tiny, tmp_path):
    from models.body import export_body

    own = tmp_path / "line_features.onnx"
    own.write_bytes((tiny / BODY_FILE).read_bytes())
    manifest = export_body(str(own), tmp_path / "exported")
    assert manifest.name == "line_features" and manifest.input_shape == TINY
    assert manifest.factory == ""  # no torch definition: it runs on ONNX Runtime everywhere
    cfg = ModelConfig(name="linear", body="line_features", body_dir=str(tmp_path / "exported"),
                      input_shape=TINY, backend="torch", device="cuda")
    body = open_body(cfg)
    assert body.runtime == "onnxruntime"
    np.testing.assert_allclose(body.embed(probe_frames(TINY)), open_exported(tiny).embed(
        probe_frames(TINY)), rtol=1e-6)


@pytest.mark.parametrize("error, accepted", [(0.9e-4, True), (1.1e-4, False)])
def test_the_probe_is_held_to_its_tolerance_at_its_edge(tiny, tmp_path, error, accepted):
    import shutil

    from edge_client.body import PROBE_TOLERANCE

    folder = tmp_path / "body"
    shutil.copytree(tiny, folder)
    manifest = load_body_manifest(tiny)
    want = np.asarray(manifest.probe)
    # One coordinate moved by error x the probe's largest magnitude: relative error = error.
    moved = want.copy()
    moved.flat[0] += error * np.abs(want).max()
    edited = type(manifest)(**{**vars(manifest), "probe": tuple(map(tuple, moved.tolist()))})
    (folder / BODY_MANIFEST).write_text(json.dumps(edited.to_json()))
    if accepted:
        assert open_exported(folder).check_probe() <= PROBE_TOLERANCE
    else:
        with pytest.raises(ArtifactError, match="other embeddings"):
            open_exported(folder)


def test_a_head_needs_a_hidden_unit():
    ModelConfig(name="mlp", input_shape=(8,), hidden=1)
    with pytest.raises(ConfigError, match="hidden"):
        ModelConfig(name="mlp", input_shape=(8,), hidden=0)


def test_a_cached_run_is_not_reused_for_another_body_in_the_same_folder(tiny, tmp_path):
    import shutil

    from lab.experiment import ExperimentConfig, _RunCache
    from models.body import export_body

    folder = tmp_path / "body"
    shutil.copytree(tiny, folder)
    cfg = ExperimentConfig(name="t", body="tiny_bodies:make", body_dir=str(folder),
                           camera_shape=TINY, model="linear")
    before = _RunCache(tmp_path, cfg, False)._key("fedgs", 0, "none")
    assert _RunCache(tmp_path, cfg, False)._key("fedgs", 0, "none") == before
    own = tmp_path / "other.onnx"
    own.write_bytes((tiny / BODY_FILE).read_bytes())
    export_body(str(own), folder)  # exported again into the same folder: another hash
    assert _RunCache(tmp_path, cfg, False)._key("fedgs", 0, "none") != before


_IMPORTS_OF_OUR_CODE = '''
import builtins, sys, tempfile
ours = ("edge_client", "aggregator", "lab", "models", "safl")
seen = set()
real = builtins.__import__


def record(name, globals=None, locals=None, fromlist=(), level=0):
    caller = (globals or {}).get("__name__", "")
    if level == 0 and caller.split(".")[0] in ours:
        seen.add(name.split(".")[0])
    return real(name, globals, locals, fromlist, level)


builtins.__import__ = record
from safl.bodies import export_checked
export_checked("efficientnet-lite0", tempfile.mkdtemp(), (3, 32, 32))
print(" ".join(sorted(seen)))
'''


@pytest.mark.slow
def test_the_pretrained_extra_holds_everything_export_body_imports():
    """``pip install '...[pretrained]'`` then ``safl models export-body``: every package our
    code imports on that path (scikit-learn's photos need Pillow, the frames OpenCV, the
    checks ONNX Runtime) is required by the extra, directly or through what it requires."""
    import importlib.metadata as md
    import subprocess
    import sys

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    out = subprocess.run([sys.executable, "-c", _IMPORTS_OF_OUR_CODE], capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    dists = md.packages_distributions()
    imported = {canonicalize_name(d) for name in out.stdout.split()
                for d in dists.get(name, ())} - {"safl-edge"}
    assert {"torch", "onnx", "scikit-learn"} <= imported, imported

    needed: set[str] = set()
    todo, done = [("safl-edge", frozenset({"pretrained"}))], set()
    while todo:
        name, extras = todo.pop()
        if (name, extras) in done:
            continue
        done.add((name, extras))
        try:
            requires = md.requires(name) or []
        except md.PackageNotFoundError:
            continue  # not installed here: it cannot have been imported either
        for line in requires:
            req = Requirement(line)
            if req.marker is not None and not any(
                    req.marker.evaluate({"extra": e}) for e in (extras or {""})):
                continue
            needed.add(canonicalize_name(req.name))
            todo.append((canonicalize_name(req.name), frozenset(req.extras)))
    assert imported <= needed, f"[pretrained] lacks {sorted(imported - needed)}"
    # scikit-learn reads its photos with Pillow, which it does not require itself.
    assert "pillow" in needed


def test_the_cloud_embeds_frames_for_its_evaluation_and_refuses_what_the_model_cannot_take(
        tiny, tmp_path):
    """A body fleet's cloud scores each round on embeddings: an ``--eval`` of frames is
    embedded at start-up, one of embeddings taken as it is, samples of the right size
    reshaped; anything
    else stops the cloud in seconds naming the evaluation set, before it connects (it used
    to fail in every round's evaluation and never publish round 0)."""
    import subprocess
    import sys

    from aggregator.services import evaluation_set

    model = _model(tiny)
    frames, y = probe_frames(TINY, 6), np.arange(6) % 2
    want = open_body(model).embed(frames)
    # Samples of the right size in another shape are reshaped, as a device's replay does:
    # a CNN's (1, 28, 28) fleet evaluated on the 28x28 images its devices replay.
    for name, x in (("frames", frames), ("flat", frames.reshape(6, -1)),
                    ("unchannelled", frames.reshape(6, TINY[0] * TINY[1], TINY[2])),
                    ("embedded", want)):
        np.savez(tmp_path / f"{name}.npz", x=x, y=y)
        got, labels = evaluation_set(str(tmp_path / f"{name}.npz"), model)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        assert labels.tolist() == y.tolist()
    # Photos, a sub-folder per class, as a factory keeps them: read as a camera's frames.
    import cv2
    for k, frame in enumerate(frames):
        (tmp_path / "photos" / str(y[k])).mkdir(parents=True, exist_ok=True)
        bgr = (frame.transpose(1, 2, 0)[:, :, ::-1] * 255).round().astype(np.uint8)
        cv2.imwrite(str(tmp_path / "photos" / str(y[k]) / f"{k}.png"), bgr)
    got, labels = evaluation_set(str(tmp_path / "photos"), model)
    assert got.shape == want.shape and sorted(labels.tolist()) == sorted(y.tolist())
    order = [int(np.argmin(np.abs(want - g).sum(axis=1))) for g in got]
    np.testing.assert_allclose(got, want[order], atol=0.05)  # 8-bit pixels, the same frames
    assert [y[i] for i in order] == labels.tolist()
    (tmp_path / "photos" / "cat").mkdir()
    with pytest.raises(ConfigError, match=r"'eval'.*cat is not one of the classes"):
        evaluation_set(str(tmp_path / "photos"), model)
    np.savez(tmp_path / "wrong.npz", x=probe_frames((3, 8, 8), 6), y=y)
    with pytest.raises(ConfigError, match=r"'eval'.*wrong\.npz holds samples of shape "
                                          r"\(3, 8, 8\).*frames of \(3, 16, 16\)"):
        evaluation_set(str(tmp_path / "wrong.npz"), model)

    config = tmp_path / "cloud.toml"
    config.write_text(f'[cloud]\nstations = ["s0"]\nrounds = 1\n[model]\nname = "linear"\n'
                      f'body = "{model.body}"\nbody_dir = "{tiny}"\ninput_shape = [3, 16, 16]\n'
                      '[broker]\nurl = "mqtt://127.0.0.1:9"\n')
    began = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "safl", "cloud", "--config", str(config),
                          "--eval", str(tmp_path / "wrong.npz")], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "'eval'" in out.stderr and "wrong.npz" in out.stderr, out.stderr[-2000:]
    assert time.monotonic() - began < 60


def test_the_demos_fleet_out_with_a_body_writes_a_body_fleet(tiny, tmp_path):
    """``safl demo --fleet-out DIR --body NAME`` used to write the MLP fleet on 28x28 frames,
    silently: every role's ``[model]`` now names the body, each device replays camera frames
    (uint8 pixels) and embeds them itself, and the cloud's test frames are embedded at its
    start-up.  An option the written fleet cannot honour is refused."""
    import subprocess
    import sys

    from aggregator.services import evaluation_set
    from edge_client.config import SourceConfig
    from edge_client.service import DEVICE_TABLES, SHARED_TABLES, DeviceService, load_role_file
    from lab.demo import write_demo_fleet

    body = load_body_manifest(tiny).factory
    paths = write_demo_fleet(tmp_path / "fleet", broker="mqtt://127.0.0.1:9", rounds=2,
                             body=body, body_dir=str(tiny))
    devices = [p for name, p in paths.items() if name.startswith("dev")]
    assert len(devices) == 12
    from aggregator.config import CloudConfig
    cloud = load_role_file(paths["cloud"], {"cloud": CloudConfig, **SHARED_TABLES}, {})
    assert (cloud["model"].body, cloud["model"].input_shape) == (body, TINY)
    x, y = evaluation_set(str(paths["_test"]), cloud["model"])
    assert x.shape == (len(y), 8) and len(y) > 100
    for path in devices[:2]:
        cfg = load_role_file(path, DEVICE_TABLES, {})
        assert cfg["model"] == cloud["model"]
        with np.load(cfg["source"].path) as replay:
            assert replay["x"].dtype == np.uint8 and replay["x"].shape[1:] == TINY
        service = DeviceService(**cfg)
        runner, transport, _ = service.build()
        buffered = runner.role.buffer  # the initial frames, embedded as they were replayed
        assert buffered.sample_shape == (8,) and buffered.samples_seen == cfg["source"].initial
        assert isinstance(cfg["source"], SourceConfig) and transport.layout_hash
        # What the body costs a frame, as /metrics reports it.
        assert service.body.frames == cfg["source"].initial and service.body.ms_per_frame > 0
        from edge_client.metrics import render
        page = render("device", {}, {"body_ms_per_frame": service.body.ms_per_frame})
        assert "# HELP safl_body_ms_per_frame the frozen body's mean wall time" in page
    out = subprocess.run([sys.executable, "-m", "safl", "demo", "--fleet-out",
                          str(tmp_path / "again"), "--bus", "local"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and "'bus'" in out.stderr, out.stderr[-1000:]


@pytest.mark.slow
@pytest.mark.skipif(__import__("shutil").which("mosquitto") is None,
                    reason="Mosquitto is installed by .ci/run")
def test_a_device_started_before_its_station_has_its_first_frames_in_the_solve(tiny_centred,
                                                                               tmp_path):
    """A broker drops a publish nobody has subscribed to: a device that started before its
    station sent the statistics of the frames it started with into nothing, once, and no
    solve ever held them.  Over the broker its first statistics wait for the station's
    presence, and reach the station's sums whole."""
    import dataclasses
    import threading

    import paho.mqtt.client as paho
    from brokers import Mosquitto
    from paho.mqtt.enums import CallbackAPIVersion

    from aggregator.config import StationConfig
    from aggregator.services import StationService
    from edge_client.runner import StopFlag
    from edge_client.service import DEVICE_TABLES, SHARED_TABLES, DeviceService, load_role_file
    from edge_client.topics import prefix
    from lab.demo import write_demo_fleet

    (tmp_path / "mq").mkdir()
    broker = Mosquitto(tmp_path / "mq", ["u"], ["user u", "topic readwrite #"])
    login = {"username": "u", "password": Mosquitto.PASSWORD}
    paths = write_demo_fleet(tmp_path / "fleet", broker=broker.url, rounds=2,
                             body=load_body_manifest(tiny_centred).factory,
                             body_dir=str(tiny_centred))
    device = load_role_file(next(p for n, p in paths.items() if n.startswith("dev")),
                            DEVICE_TABLES, {})
    device["broker"] = dataclasses.replace(device["broker"], **login)
    dev, fleet = device["device"].device_id, device["device"].fleet
    station = load_role_file(paths[device["device"].station],
                             {"station": StationConfig, **SHARED_TABLES}, {})
    station["broker"] = dataclasses.replace(station["broker"], **login)
    heard: list[tuple[float, str]] = []
    watch = paho.Client(CallbackAPIVersion.VERSION2, client_id="watch")
    watch.username_pw_set(**login)
    watch.on_message = lambda c, u, msg: heard.append((time.monotonic(), msg.topic))
    watch.connect("127.0.0.1", broker.port)
    watch.subscribe(f"{prefix(fleet, m.Participant.DEVICE, dev)}/#", qos=1)
    watch.loop_start()
    stop, roles = StopFlag(install=False), []
    threads = [threading.Thread(target=lambda: roles.append(DeviceService(**device).run(
        stop, exit_when_done=False)), daemon=True)]
    try:
        threads[0].start()
        deadline = time.monotonic() + 60
        while not any(t.endswith("/stats") for _, t in heard) and time.monotonic() < deadline:
            time.sleep(0.05)  # the device's first hello: what it sends at its start
        time.sleep(1.0)  # and whatever came with it
        before = [t for _, t in heard if "/head" in t]
        started = time.monotonic()
        threads.append(threading.Thread(
            target=lambda: roles.append(StationService(**station).run(stop)), daemon=True))
        threads[1].start()
        while not any(at > started and "/head" in t for at, t in heard) and \
                time.monotonic() < started + 30:
            time.sleep(0.05)
        time.sleep(1.0)  # for the station to admit what it was sent
    finally:
        stop.event.set()
        for t in threads:
            t.join(30)
        watch.loop_stop()
        broker.stop()
    assert before == [], "the device sent its statistics before its station was there"
    assert len(roles) == 2, "a service did not stop when asked"
    sent = next(r for r in roles if r.id == dev).head.sent  # the labelled frames it started with
    claimed = next(r for r in roles if r.id != dev).heads.claimed
    assert sent > 0 and claimed == {dev: sent}, (sent, claimed)


def test_a_device_services_personal_head_is_decomposed_off_its_prediction_path(tiny_centred,
                                                                              tmp_path):
    """The service a board runs gives a personal head its background decomposition
    (personal_head.py): a solve on the prediction path costs seconds on a board."""
    import dataclasses

    from edge_client.service import DEVICE_TABLES, DeviceService, load_role_file
    from lab.demo import write_demo_fleet

    body = load_body_manifest(tiny_centred).factory
    paths = write_demo_fleet(tmp_path / "fleet", broker="mqtt://127.0.0.1:9", rounds=2,
                             body=body, body_dir=str(tiny_centred))
    cfg = load_role_file(paths["dev000"], DEVICE_TABLES, {})
    cfg["model"] = dataclasses.replace(cfg["model"], head_init="ridge")
    cfg["inference"] = dataclasses.replace(cfg["inference"], personal=True)
    runner, _, _ = DeviceService(**cfg).build()
    personal = runner.role.head.personal
    assert personal is not None and personal.background


def test_a_lamp_that_dims_or_brightens_the_picture_leaves_the_stretched_embedding_as_it_was(
        tiny):
    """[model] body_input = "autocontrast": each frame stretched between its 1st and 99th
    percentiles before the body, so a frame under a dimmer or brighter lamp (any a x + b
    that does not saturate) is embedded as it was; as_is, it is not.  Roles that stretch
    and roles that do not name different layouts, and refuse each other's frames."""
    from edge_client.body import body_id, open_body

    frames = np.random.default_rng(0).random((6, *TINY), dtype=np.float32)
    lamps = (0.45 * frames + 0.35, 0.6 * frames, 0.8 * frames + 0.15)
    stretched = open_body(_model(tiny, body_input="autocontrast"))
    as_is = open_body(_model(tiny))
    assert stretched.autocontrast and not as_is.autocontrast
    before = stretched.embed(frames)
    for lit in lamps:
        np.testing.assert_allclose(stretched.embed(lit), before, rtol=1e-4,
                                   atol=1e-4)
    assert not np.allclose(as_is.embed(lamps[0]), as_is.embed(frames), atol=1e-3)
    assert body_id(_model(tiny, body_input="autocontrast")) != body_id(_model(tiny))
    assert stretched.key != as_is.key  # the lab's cache keeps them apart
    with pytest.raises(ConfigError, match="body_input"):
        _model(tiny, body_input="equalise")


def test_a_device_service_runs_its_body_on_the_threads_its_service_table_gives(tiny_centred,
                                                                               tmp_path):
    """[service] body_threads = 1: no pool threads beside the caller's.  ONNX Runtime's own
    choice (a thread a core) spins waiting for work: 250 body sessions in the load bench's
    one process idled at a whole core.  Counted in a fresh process each (the suite's own
    threads come and go)."""
    import os
    import subprocess
    import sys

    from lab.demo import write_demo_fleet

    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: ONNX Runtime's own choice is one thread too")
    body = load_body_manifest(tiny_centred).factory
    paths = write_demo_fleet(tmp_path / "fleet", broker="mqtt://127.0.0.1:9", rounds=2,
                             body=body, body_dir=str(tiny_centred))
    script = (
        "import dataclasses, os, sys\n"
        "from edge_client.service import DEVICE_TABLES, DeviceService, load_role_file\n"
        "cfg = load_role_file(sys.argv[1], DEVICE_TABLES, {})\n"
        "cfg['service'] = dataclasses.replace(cfg['service'], body_threads=int(sys.argv[2]))\n"
        "before = len(os.listdir('/proc/self/task'))\n"
        "kept = [DeviceService(**cfg).build() for _ in range(4)]\n"
        "print(len(os.listdir('/proc/self/task')) - before)\n")

    def grown(threads: int) -> int:
        done = subprocess.run([sys.executable, "-c", script, str(paths["dev000"]), str(threads)],
                              capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONPATH": os.getcwd()})
        assert done.returncode == 0, done.stderr[-2000:]
        return int(done.stdout.split()[-1])

    assert grown(1) == 0 and grown(0) >= 4  # a pool thread or more a session, against none
