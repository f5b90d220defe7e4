"""Frozen bodies for the ``safl`` command: ``safl models export-body`` and the exports the
lab's runs and the demo need, checked on real frames.  Here because it joins ``models`` (the
export) with ``lab`` (the frames it is checked on), which import neither each other."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from edge_client.body import BODY_MANIFEST, BodyManifest, default_body_dir, load_body_manifest

__all__ = ["check_frames", "export_checked", "ensure_body"]


def check_frames(shape: tuple[int, ...]) -> dict[str, np.ndarray]:
    """Real frames to check an export on: 64 Fashion-MNIST test images as a camera delivers
    them (where the dataset is installed) and scikit-learn's two photos."""
    from lab.datasets import FASHION_MNIST_DIR, camera_frames, load_dataset, sample_photos

    frames = {"scikit-learn photos": sample_photos(shape)}
    if (FASHION_MNIST_DIR / "t10k-images-idx3-ubyte.gz").exists():
        frames["Fashion-MNIST frames"] = camera_frames(
            load_dataset("fashion-mnist").x_test[:64], shape)
    return frames


def export_checked(name: str, out: str | Path, shape: tuple[int, ...] = (3, 64, 64)
                   ) -> BodyManifest:
    from lab.datasets import photo_crops
    from models.body import export_body

    frames = {} if name.endswith(".onnx") else check_frames(shape)
    return export_body(name, out, input_shape=shape, check_frames=frames,
                       centre_frames=photo_crops)


def ensure_body(name: str, shape: tuple[int, ...], body_dir: str = "") -> Path:
    """The folder holding body ``name`` at ``shape``: ``body_dir`` as given, else the cache,
    exported there first if it is not yet."""
    folder = Path(body_dir) if body_dir else default_body_dir(name, shape)
    if not (folder / BODY_MANIFEST).exists():
        print(f"exporting body {name} at {shape} to {folder} (once)", file=sys.stderr)
        export_checked(name, folder, shape)
    load_body_manifest(folder)
    return folder
