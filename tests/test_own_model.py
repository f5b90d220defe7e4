"""docs/own-model.md, run as written: a user's CNN from a Python file to a federation of
torch and ONNX Runtime devices; also an ONNX file exported straight to artifacts."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

DOC = Path(__file__).resolve().parents[1] / "docs" / "own-model.md"


def _blocks(marker: str) -> list[str]:
    text = DOC.read_text()
    return re.findall(re.escape(marker) + r"\n```\w+\n(.*?)```", text, flags=re.S)


def _env(folder: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), *sys.path])}


@pytest.mark.slow
def test_the_own_model_tutorial_runs_as_written(tmp_path):
    (tmp_path / "my_models.py").write_text(_blocks("<!-- file: my_models.py -->")[0])
    export, federate = _blocks("<!-- run -->")
    command = export.replace("\\\n", " ").replace("safl ", f"{sys.executable} -m safl ")
    out = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=_env(tmp_path),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "exported my_models:tiny_cnn" in out.stdout
    out = subprocess.run([sys.executable, "-c", federate], cwd=tmp_path, env=_env(tmp_path),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    accuracy = float(out.stdout.split(":")[-1])
    assert accuracy > 0.6  # a mixed torch + ORT fleet of the user's model learns digits


def test_a_users_module_builds_on_torch_and_refuses_a_bad_spec(tmp_path, monkeypatch):
    from edge_client.config import ModelConfig
    from edge_client.errors import ConfigError
    from edge_client.trainers import build_trainer, layout_hash

    (tmp_path / "my_models.py").write_text(_blocks("<!-- file: my_models.py -->")[0])
    monkeypatch.syspath_prepend(str(tmp_path))
    trainer = build_trainer("my_models:tiny_cnn", backend="torch", input_shape=(8, 8),
                            num_classes=10, lr=0.1, device="cpu")
    assert trainer.num_params == 8 * 9 + 8 + 8 * 16 * 10 + 10
    assert layout_hash(trainer.layout)
    with pytest.raises(ConfigError, match="cannot import 'nowhere'"):
        build_trainer("nowhere:model", backend="torch", input_shape=(8, 8), num_classes=10,
                      lr=0.1)
    with pytest.raises(ConfigError, match="'module'"):
        ModelConfig(module="not a spec")
    with pytest.raises(ConfigError, match="backend = 'torch'"):
        ModelConfig(module="my_models:tiny_cnn", backend="numpy")


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch's legacy exporter, on purpose
def test_an_onnx_file_becomes_training_artifacts(tmp_path):
    import torch

    from edge_client.trainers import build_trainer
    from edge_client.trainers.zoo import build_module
    from models.export import export_onnx

    module = build_module("small_cnn", input_shape=(1, 8, 8), num_classes=10)
    path = tmp_path / "user.onnx"
    torch.onnx.export(module, (torch.zeros(2, 1, 8, 8),), str(path), input_names=["x"],
                      output_names=["scores"], dynamic_axes={"x": {0: "n"}, "scores": {0: "n"}},
                      opset_version=17, dynamo=False)
    manifest = export_onnx(path, tmp_path / "art")
    assert manifest.input_shape == (1, 8, 8) and manifest.num_classes == 10
    assert manifest.num_params == sum(p.numel() for p in module.parameters())
    trainer = build_trainer("user", backend="ort", artifacts=tmp_path / "art", lr=0.1)
    rng = np.random.default_rng(0)
    x, y = rng.random((32, 1, 8, 8), dtype=np.float32), rng.integers(0, 10, 32)
    losses = [trainer.train_step(x, y) for _ in range(20)]
    assert losses[-1] < losses[0]  # it trains
