"""Trainers: models as flat float32 vectors, behind one small interface.

``build_trainer`` picks a backend lazily, so the numpy backend never imports
torch.  Backends share the flat layout (torch ``parameters()`` order), so a
vector from one loads into another for the same model.
"""

from __future__ import annotations

from .base import Trainer, proximal_step

__all__ = ["Trainer", "build_trainer", "proximal_step", "BACKENDS"]

BACKENDS = ("numpy", "torch")


def build_trainer(model: str, *, backend: str = "numpy", input_shape: tuple[int, ...],
                  num_classes: int, lr: float, seed: int = 0) -> Trainer:
    """Build a trainer for a zoo model on the chosen backend."""
    if backend == "numpy":
        from .numpy_backend import build
    elif backend == "torch":
        from .torch_backend import build
    else:
        from ..errors import ConfigError
        raise ConfigError("backend", f"must be one of {BACKENDS}, got {backend!r}")
    return build(model, input_shape=tuple(input_shape), num_classes=num_classes, lr=lr, seed=seed)
