"""Trainers: models as flat float32 vectors, behind one small interface.

``build_trainer`` picks a backend lazily: the numpy backend never imports torch
or onnxruntime, and the ORT backend never imports torch.  All backends share the
flat layout (torch ``parameters()`` order), so a vector from one loads into
another for the same model; ``layout_hash`` proves it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from ..errors import ArtifactError, ConfigError
from .base import BodyTail, Trainer, proximal_step
from .manifest import layout_hash

__all__ = ["Trainer", "BodyTail", "build_trainer", "pretrained_embedding", "proximal_step",
           "layout_hash", "BACKENDS"]

BACKENDS = ("numpy", "torch", "ort")


def build_trainer(model: str, *, backend: str = "numpy", input_shape: tuple[int, ...] = (),
                  num_classes: int = 0, lr: float, seed: int = 0,
                  artifacts: str | Path | None = None,
                  expected_layout_hash: str | None = None, device: str = "auto",
                  hidden: int = 128, tail: BodyTail | None = None) -> Trainer:
    """Build a trainer for a zoo model on the chosen backend.

    ``numpy`` and ``torch`` build the model from ``input_shape`` and
    ``num_classes``; ``ort`` loads it from the ``artifacts`` folder.  A trainer
    whose layout hash differs from ``expected_layout_hash`` is refused.  ``device``
    places the torch backend's model (``auto``: CUDA where available); numpy runs on
    the CPU, and so does ORT, whose training build has only the CPU execution provider.
    ``hidden`` sizes the ``mlp``'s hidden layer.  ``tail`` (torch only) puts a body's
    last blocks before the model, which is then their head; ``input_shape`` is what the
    body's frozen prefix makes of a frame.
    """
    if tail is not None and backend != "torch":
        raise ConfigError("train_body_blocks", f"training a body's blocks needs backend = "
                          f"'torch', not {backend!r} (the numpy and ort backends train a head "
                          "on a frozen body)")
    if device != "auto" and device != "cpu" and backend != "torch":
        raise ConfigError("device", f"{device!r} needs the torch backend: the {backend} "
                          "backend trains on the CPU only")
    if backend == "ort":
        if not artifacts:
            raise ConfigError("artifacts", "the ort backend needs the exported artifacts folder")
        from .ort_backend import build as build_ort
        return build_ort(model, artifacts=artifacts, lr=lr,
                         expected_layout_hash=expected_layout_hash)
    trainer: Trainer
    if backend == "numpy":
        from .numpy_backend import build
        trainer = build(model, input_shape=tuple(input_shape), num_classes=num_classes, lr=lr,
                        seed=seed, hidden=hidden)
    elif backend == "torch":
        from .torch_backend import build as build_torch
        trainer = build_torch(model, input_shape=tuple(input_shape), num_classes=num_classes,
                              lr=lr, seed=seed, device=device, hidden=hidden, tail=tail)
    else:
        raise ConfigError("backend", f"must be one of {BACKENDS}, got {backend!r}")
    if expected_layout_hash and layout_hash(trainer.layout) != expected_layout_hash:
        raise ArtifactError(f"{backend} model {model!r} has layout {layout_hash(trainer.layout)}, "
                            f"the federation uses {expected_layout_hash}")
    return trainer


def pretrained_embedding(tail: BodyTail | None) -> Callable[[np.ndarray], np.ndarray] | None:
    """Where a body's last blocks train, what makes a buffered sample (the activation before
    them) the pretrained body's embedding, for a closed-form head's statistics (torch,
    imported here only then); None where the body stays frozen."""
    if tail is None:
        return None
    from .bodies import pretrained_tail
    return pretrained_tail(tail)
