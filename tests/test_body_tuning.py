"""Fine-tuning a body's last blocks (``[model] train_body_blocks``): the split, the tuned model
as the federated vector, the device's prefix at ingest, the export, the refusals and the
lab's fleet (docs/bodies.md)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from user_bodies import exported_device_model, exported_user_body

from edge_client.body import body_tail, load_body_manifest, open_body, open_exported, probe_frames
from edge_client.config import ModelConfig
from edge_client.errors import ConfigError

torch = pytest.importorskip("torch")
pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

TINY = (3, 16, 16)
SPLIT_BODY = '''
import torch
from torch import nn


def block(c):
    return nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU())


class Tiny(nn.Module):
    """A user's body that can be cut: a stem and two blocks, 128 features (8 channels
    pooled to 4x4, so that a head can tell digits apart on them)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = nn.Sequential(block(8), block(8))
        with torch.no_grad():  # weights that keep the digits apart, like a trained body's
            for conv in (self.stem, self.blocks[0][0], self.blocks[1][0]):
                conv.weight.normal_(0.0, 0.15)
            for bn in (self.blocks[0][1], self.blocks[1][1]):  # statistics a batch would move
                bn.running_mean.uniform_(-0.5, 0.5)
                bn.running_var.uniform_(0.5, 2.0)

    def forward(self, x):
        return pool(self.blocks(torch.relu(self.stem((x - 0.5) / 0.5))))

    def split(self, blocks):
        if not 1 <= blocks <= 2:
            from edge_client.errors import ConfigError
            raise ConfigError("train_body_blocks", f"tiny has 2 blocks, got {blocks}")
        cut = 2 - blocks
        prefix = nn.Sequential(Normalise(), self.stem, nn.ReLU(), *self.blocks[:cut])
        return prefix, nn.Sequential(*self.blocks[cut:], MeanPool())


class Normalise(nn.Module):
    def forward(self, x):
        return (x - 0.5) / 0.5


def pool(x):
    return nn.functional.adaptive_avg_pool2d(x, 4).flatten(1)


class MeanPool(nn.Module):
    def forward(self, x):
        return pool(x)


def make(input_shape):
    return Tiny()


class Whole(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Tiny()

    def forward(self, x):
        return self.inner(x)


def uncut(input_shape):
    return Whole()
'''


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A user's splittable body, exported with a centre (a closed-form head can start its
    tuned blocks): its folder."""
    yield from exported_user_body(tmp_path_factory, "split_bodies", SPLIT_BODY, "make", TINY,
                                  centred=True)


def _model(folder, blocks=1, **kw) -> ModelConfig:
    kw.setdefault("device", "cpu")
    return ModelConfig(name="linear", backend="torch",
                       body="split_bodies:make", body_dir=str(folder), input_shape=TINY,
                       train_body_blocks=blocks, **kw)


def _frames(n=12, seed=3):
    return np.random.default_rng(seed).random((n, *TINY), dtype=np.float32)


def test_the_tuned_model_starts_where_the_frozen_body_and_head_start(tiny):
    from edge_client.service import model_trainer

    frozen, tuned = _model(tiny, blocks=0), _model(tiny, blocks=1)
    head, model = model_trainer(frozen, 0.1), model_trainer(tuned, 0.1)
    frames = _frames()
    assert open_body(tuned).out_shape == (8, 16, 16)  # the activation the last block takes
    np.testing.assert_allclose(model.logits(open_body(tuned).embed(frames)),
                               head.logits(open_body(frozen).embed(frames)),
                               rtol=1e-4, atol=1e-5)
    names = [name for name, _ in model.layout]
    assert names[:2] == ["tail.0.0.weight", "tail.0.0.bias"] and names[-2:] == [
        "head.fc.weight", "head.fc.bias"]
    # The block's conv (8x8x3x3 + 8) and BatchNorm scale and shift (8 + 8), then the head.
    assert model.num_params == 8 * 8 * 9 + 8 + 16 + head.num_params
    np.testing.assert_array_equal(model.get_flat()[-head.num_params:], head.get_flat())


def test_the_last_blocks_train_and_keep_their_pretrained_statistics(tiny):
    from edge_client.service import model_trainer

    cfg = _model(tiny, blocks=2)
    trainer = model_trainer(cfg, 0.1)
    bns = [mod for mod in trainer.module.modules() if isinstance(mod, torch.nn.BatchNorm2d)]
    stats = [(bn.running_mean.clone(), bn.running_var.clone()) for bn in bns]
    x = open_body(cfg).embed(_frames(32))
    y = np.arange(32) % 10
    start = trainer.get_flat()
    for _ in range(3):
        trainer.train_step(x, y)
    moved = np.abs(trainer.get_flat() - start)
    tail = sum(int(np.prod(s)) for name, s in trainer.layout if name.startswith("tail."))
    assert len(bns) == 2 and moved[:tail].max() > 1e-4  # both blocks' weights trained
    for bn, (mean, var) in zip(bns, stats, strict=True):
        assert torch.equal(bn.running_mean, mean) and torch.equal(bn.running_var, var)
    # The lab's batched steps (vmap over members) take the same step as one by one.
    trainer.set_flat(start)
    trainer.train_step(x, y)
    (batched,) = trainer.train_members([start], [[(x, y)]], [0.1])
    np.testing.assert_allclose(batched, trainer.get_flat(), rtol=1e-4, atol=1e-6)


def test_a_device_embeds_each_frame_once_into_the_activation_before_the_trained_blocks(tiny):
    from edge_client.body import head_input_shape

    cfg = _model(tiny, blocks=1)
    body = open_body(cfg)
    assert body.runtime == "onnxruntime" and body.blocks == 1  # the prefix, exported on a CPU
    assert head_input_shape(cfg) == body.out_shape == (8, 16, 16)
    assert body.bytes_per_sample == 4 * 8 * 16 * 16
    assert body.key == load_body_manifest(tiny).hash + "-tail1"
    assert body.check_probe() <= 1e-4  # the torch prefix and pretrained tail are the export
    assert body.embed(_frames(5)).shape == (5, 8, 16, 16)
    assert body.embed(np.zeros((0, *TINY), np.float32)).shape == (0, 8, 16, 16)


def test_a_frozen_body_device_and_a_tuned_fleet_are_different_federations(tiny):
    from edge_client.service import federation_layout, model_trainer

    layouts = {federation_layout(cfg, model_trainer(cfg, 0.1))
               for cfg in (_model(tiny, 0), _model(tiny, 1), _model(tiny, 2))}
    assert len(layouts) == 3


@pytest.mark.parametrize("change, key, message", [
    ({"backend": "numpy", "device": "auto"}, "train_body_blocks", "torch only"),
    ({"body": "none", "body_dir": ""}, "train_body_blocks", "needs a body"),
    ({"train_body_blocks": -1}, "train_body_blocks", ">= 0"),
])
def test_train_body_blocks_is_refused_where_it_cannot_run(tiny, change, key, message):
    kw = {"name": "linear", "backend": "torch", "device": "cpu", "body": "split_bodies:make",
          "body_dir": str(tiny), "input_shape": TINY, "train_body_blocks": 1, **change}
    with pytest.raises(ConfigError, match=message) as err:
        ModelConfig(**kw)
    assert err.value.key == key


def test_a_body_that_cannot_be_cut_or_has_too_few_blocks_is_refused_by_name(tiny, tmp_path):
    from edge_client.service import model_trainer
    from models.body import export_body

    with pytest.raises(ConfigError, match="tiny has 2 blocks, got 3"):
        model_trainer(_model(tiny, blocks=3), 0.1)
    uncut = tmp_path / "uncut"
    export_body("split_bodies:uncut", uncut, input_shape=TINY,
                check_frames={"noise": _frames(4)})
    with pytest.raises(ConfigError, match="cannot be cut into blocks"):
        model_trainer(ModelConfig(name="linear", backend="torch", device="cpu",
                                  body="split_bodies:uncut", body_dir=str(uncut),
                                  input_shape=TINY, train_body_blocks=1), 0.1)
    own = tmp_path / "own"  # a body exported from an ONNX file has no torch definition
    assert safl_main(["models", "export-body", str(tiny / "body.onnx"),
                             "--out", str(own)]) == 0
    name = load_body_manifest(own).name
    with pytest.raises(ConfigError, match="no torch definition"):
        model_trainer(ModelConfig(name="linear", backend="torch", device="cpu", body=name,
                                  body_dir=str(own), input_shape=TINY,
                                  train_body_blocks=1), 0.1)


def safl_main(argv):
    from safl.cli import main
    return main(argv)


def test_the_export_carries_the_trained_blocks_in_one_graph_from_frames(tiny, tmp_path):
    from edge_client.service import model_trainer

    cfg = _model(tiny, blocks=1, seed=3)
    trainer = model_trainer(cfg, 0.1)
    weights = trainer.get_flat() + np.random.default_rng(2).normal(
        0, 0.05, trainer.num_params).astype(np.float32)  # a federation's trained blocks
    frames = _frames(5)
    logits, _ = exported_device_model(
        tmp_path, cfg, trainer, weights, f'name = "linear"\ninput_shape = {list(TINY)}\n'
        'seed = 3\nbackend = "torch"\ndevice = "cpu"\ntrain_body_blocks = 1\n'
        f'body = "split_bodies:make"\nbody_dir = "{tiny}"\n', frames)
    want = trainer.logits(open_body(cfg).embed(frames), weights)
    np.testing.assert_allclose(logits, want, rtol=1e-4, atol=1e-5)
    frozen = _model(tiny, blocks=0, seed=3)  # the frozen body's graph would answer otherwise
    head = model_trainer(frozen, 0.1)
    stale = head.logits(open_body(frozen).embed(frames), weights[-head.num_params:])
    assert np.abs(logits - stale).max() > 1e-3


def test_a_lab_fleet_fine_tunes_the_blocks_it_federates(tiny, digits, tmp_path):
    from edge_client.trainers import BodyTail
    from lab.datasets import assign_groups, dirichlet_label_skew, embedded
    from lab.experiment import ExperimentConfig
    from lab.simulation import FleetSpec, run_federation
    from lab.strategies import build_strategy

    data = embedded(digits, TINY, open_exported(tiny, blocks=1), tmp_path)
    assert data.sample_shape == (8, 16, 16)
    settings = ExperimentConfig(name="t", factories=1, devices_per_factory=4, super_node=2,
                                rand_per_group=0, sync_period=2, rounds=20).settings
    rng = np.random.default_rng(0)
    spec = FleetSpec(partitions=tuple(dirichlet_label_skew(digits.y_train, 4, 1.0, rng)),
                     groups=tuple(assign_groups(4, 1, rng)), rounds=20, model="linear",
                     backends=("torch",), torch_device="cpu", lr=0.1, eval_samples=200,
                     tail=BodyTail("split_bodies:make", TINY, 1))
    result = run_federation(data, build_strategy("fedgs", settings), spec)
    # 0.80 here, where the frozen body's head reaches 0.49 in the same 20 rounds.
    assert result.rows[-1]["accuracy"] > 0.6, [r["accuracy"] for r in result.rows]


def test_efficientnet_lite0_cuts_into_a_prefix_and_tail_that_are_the_body():
    pytest.importorskip("efficientnet_lite_pytorch")
    from edge_client.trainers.bodies import build_body_module, split_body

    body = build_body_module("efficientnet-lite0", (3, 64, 64))
    frames = torch.from_numpy(probe_frames((3, 64, 64), 2))
    with torch.no_grad():
        want = body(frames)
        for blocks in (1, 3):
            prefix, tail = split_body("efficientnet-lite0", (3, 64, 64), blocks)
            torch.testing.assert_close(tail(prefix(frames)), want, rtol=1e-5, atol=1e-5)
            assert all(p.requires_grad for p in tail.parameters())
            assert not any(p.requires_grad for p in prefix.parameters())
    with pytest.raises(ConfigError, match="16 blocks, got 17"):
        split_body("efficientnet-lite0", (3, 64, 64), 17)


def test_the_clock_prices_a_tuned_body_where_torch_runs_it():
    from edge_client.trainers import BodyTail
    from lab.clock import PROFILES
    from lab.simulation import FleetSpec

    spec = FleetSpec(partitions=(), groups=(), rounds=1, model="linear",
                     tail=BodyTail("efficientnet-lite0", (3, 64, 64), 1))
    assert spec.priced_model == "efficientnet-lite0[-1:]+linear"
    for board in ("x86-torch", "pi4-torch", "jetson-orin-cuda"):
        assert PROFILES[board].step_seconds(spec.priced_model, (192, 2, 2)) > \
            PROFILES[board].step_seconds("linear")
    with pytest.raises(ConfigError, match="no figure for model"):
        PROFILES["pi4-numpy"].step_seconds(spec.priced_model)
    # A rehearsed (launched) fleet paces its devices at the same price.
    from lab.clock import ClockConfig
    from lab.launch import _rehearsed

    clocked = dataclasses.replace(spec, clock=ClockConfig(profiles=(("jetson-orin-cuda", 1.0),)))
    paced = _rehearsed(clocked, {"_profile": "jetson-orin-cuda", "_k": 0}, (192, 2, 2))
    assert paced["service"]["emulate_step_s"] == PROFILES["jetson-orin-cuda"].step_seconds(
        spec.priced_model)


@pytest.mark.skipif("not __import__('torch').cuda.is_available()",
                    reason="needs a CUDA GPU (a Jetson, or the device machine)")
def test_on_cuda_the_prefix_and_the_tuned_blocks_run_on_the_gpu_and_agree_with_the_cpu(tiny):
    from edge_client.service import model_trainer

    gpu, cpu = _model(tiny, blocks=1, device="cuda"), _model(tiny, blocks=1)
    body = open_body(gpu)
    assert body.runtime.startswith("torch (cuda")
    frames = _frames(8)
    x = body.embed(frames)
    np.testing.assert_allclose(x, open_body(cpu).embed(frames), rtol=1e-4, atol=1e-5)
    on_gpu, on_cpu = model_trainer(gpu, 0.1), model_trainer(cpu, 0.1)
    y = np.arange(8) % 10
    on_gpu.train_step(x, y)
    on_cpu.train_step(x, y)
    np.testing.assert_allclose(on_gpu.get_flat(), on_cpu.get_flat(), rtol=1e-3, atol=1e-5)


def test_a_tuned_fleet_starts_from_a_head_solved_on_the_pretrained_embeddings(tiny, digits,
                                                                              tmp_path):
    """Fed3R+FT with tuned blocks: the devices finish each buffered activation with the
    pretrained blocks for their statistics, the cloud solves the head once on them and
    places it after the blocks' pretrained weights; round 0 predicts from that start, and
    the fleet tunes the blocks under it, fixed (no second solve)."""
    from lab.datasets import dirichlet_label_skew, embedded
    from lab.experiment import ExperimentConfig, closed_form_head
    from lab.simulation import FleetSpec, run_federation
    from lab.strategies import build_strategy

    data = embedded(digits, TINY, open_exported(tiny, blocks=1), tmp_path)
    settings = ExperimentConfig(name="t", factories=1, devices_per_factory=4, super_node=2,
                                rand_per_group=0, sync_period=2, rounds=6).settings
    spec = FleetSpec(partitions=tuple(dirichlet_label_skew(digits.y_train, 4, 0.3,
                                                           np.random.default_rng(0))),
                     groups=(np.arange(4),), rounds=6, model="linear", backends=("torch",),
                     torch_device="cpu", lr=0.05, eval_samples=300,
                     tail=body_tail(_model(tiny)),  # as a field device's: the head fixed
                     head=closed_form_head("linear", "split_bodies:make", TINY, str(tiny), 10,
                                           "ridge", "once", train_body_blocks=1))
    solved = run_federation(data, build_strategy("fedgs", settings), spec)
    random = run_federation(data, build_strategy("fedgs", settings), dataclasses.replace(
        spec, head=None, tail=body_tail(_model(tiny, head_init="random"))))
    assert solved.rows[0]["accuracy"] > 0.45 > 0.25 > random.rows[0]["accuracy"], \
        (solved.rows[0], random.rows[0])
    assert solved.counters["head_solves"] == 1, solved.counters  # once: the blocks move on


def test_a_solved_head_stays_fixed_while_the_tuned_blocks_train(tiny):
    """Fed3R+FT's fixed classifier: SGD, one model or several at once, moves the blocks and
    leaves the head a solve started; a random head trains with them."""
    from edge_client.service import model_trainer

    x, y = np.random.default_rng(1).random((16, 8, 16, 16), dtype=np.float32), np.arange(16) % 10
    for head_init, fixed in (("ridge", True), ("random", False)):
        trainer = model_trainer(_model(tiny, head_init=head_init), 0.5)
        head = sum(int(np.prod(shape)) for name, shape in trainer.layout
                   if name.startswith("head."))
        start = trainer.get_flat()
        together = trainer.train_members([start, start], [[(x, y)], [(x[:8], y[:8])]],
                                         [0.5, 0.5])
        trainer.train_step(x, y)
        for after in (trainer.get_flat(), *together):
            assert np.abs(after[:-head] - start[:-head]).max() > 1e-4
            assert np.array_equal(after[-head:], start[-head:]) == fixed, head_init


def test_a_solved_start_for_tuned_blocks_is_solved_once_and_never_personal(tiny):
    from edge_client.config import DeviceConfig, InferenceConfig
    from edge_client.device import Device
    from edge_client.head_stats import HeadStatsPath, head_spec
    from edge_client.personal_head import attach_personal
    from edge_client.service import model_trainer
    from edge_client.trainers import pretrained_embedding

    with pytest.raises(ConfigError, match="solved once, on the pretrained body") as err:
        _model(tiny, head_resolve="every")
    assert err.value.key == "head_resolve"
    cfg = _model(tiny)  # auto: a ridge head, solved once
    assert (cfg.head_kind, cfg.head_resolution) == ("ridge", "once")
    assert _model(tiny, head_init="random", head_resolve="every").head_kind == "random"
    dev = Device(DeviceConfig(device_id="d", station="s", fleet="t"), model_trainer(cfg, 0.1),
                 num_classes=cfg.num_classes, sample_shape=(8, 16, 16),
                 inference=InferenceConfig(personal=True), rng=np.random.default_rng(0))
    embed = pretrained_embedding(body_tail(cfg))
    HeadStatsPath.attach(dev, head_spec(cfg), 1, embed=embed)
    frames = _frames(6)
    dev.sense(open_body(cfg).embed(frames), np.arange(6) % 3)
    want = open_body(_model(tiny, 0)).embed(frames)  # the frozen body's embeddings
    np.testing.assert_allclose(embed(open_body(cfg).embed(frames)), want, rtol=1e-4, atol=1e-5)
    dev.head._flush()
    assert dev.head.sums.n == 6 and dev.head.sums.gram.shape == (129, 129)
    with pytest.raises(ConfigError, match="frozen body") as err:
        attach_personal(dev)
    assert err.value.key == "personal"
