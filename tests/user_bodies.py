"""Export a body a user wrote (``package.module:factory``) for the body tests: the module is
written beside the export and put on ``sys.path``, as a user's own package would be."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np


def exported_user_body(tmp_path_factory, module: str, source: str, factory: str,
                       shape: tuple[int, ...], *, centred: bool = False) -> Iterator[Path]:
    """A fixture's body: ``module`` (``source``) written and importable, ``module:factory``
    exported with its checks on noise frames (``centred``: and their mean embedding as the
    centre of a closed-form head); yields the export's folder."""
    from models.body import export_body

    where = tmp_path_factory.mktemp(f"{module}_module")
    (where / f"{module}.py").write_text(source)
    sys.path.insert(0, str(where))
    folder = tmp_path_factory.mktemp(module)
    frames = np.random.default_rng(0).random((6, *shape), dtype=np.float32)
    export_body(f"{module}:{factory}", folder, input_shape=shape, check_frames={"noise": frames},
                centre_frames=(lambda _: frames) if centred else None)
    yield folder
    sys.path.remove(str(where))


def exported_device_model(tmp_path: Path, cfg, trainer, weights: np.ndarray,
                          model_toml: str, frames: np.ndarray) -> tuple[np.ndarray, Path]:
    """``weights`` kept as a device's deployable model in its state directory, exported by
    ``safl-device export`` from a device file whose ``[model]`` table is ``model_toml``; the
    file's logits on ``frames`` in ONNX Runtime, and the file."""
    import onnxruntime as ort

    from edge_client import messages as m
    from edge_client.body import open_body
    from edge_client.cli import main as device_main
    from edge_client.config import DeviceConfig, InferenceConfig
    from edge_client.device import Device
    from edge_client.service import federation_layout
    from edge_client.serving import save_deployable

    dev = Device(DeviceConfig(device_id="cam1", station="s0"), trainer, num_classes=10,
                 sample_shape=open_body(cfg).out_shape, rng=np.random.default_rng(0),
                 inference=InferenceConfig())
    dev.handle(m.StationModel(fleet="default", sender="s0", round=4, iteration=9,
                              weights=weights), 0.0)
    state = tmp_path / "state"
    save_deployable(state, dev, federation_layout(cfg, trainer))
    toml = tmp_path / "dev.toml"
    toml.write_text('[device]\ndevice_id = "cam1"\nstation = "s0"\n[model]\n' + model_toml
                    + f'[source]\nkind = "synthetic"\n[service]\nstate_dir = "{state}"\n')
    out = tmp_path / "line.onnx"
    assert device_main(["export", "--config", str(toml), "--out", str(out)]) == 0
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert session.get_outputs()[0].name == "logits"
    (logits,) = session.run(None, {session.get_inputs()[0].name: frames})
    return logits, out
