"""The trainer interface every backend implements, and FedProx's device-side term."""

from __future__ import annotations

from typing import NamedTuple, Protocol, runtime_checkable

import numpy as np

from ..errors import ConfigError, ShapeError

__all__ = ["Trainer", "BodyTail", "check_flat", "proximal_step"]


class BodyTail(NamedTuple):
    """A body's last ``blocks`` blocks that train with the head (``[model]
    train_body_blocks``): the body's torch definition and the frames it takes."""

    body: str  # the registry name or "package.module:factory"
    frame_shape: tuple[int, ...]
    blocks: int
    # A closed-form solve starts the head, which then stays fixed while the blocks train:
    # Fed3R+FT's fixed classifier, stabler under label skew (docs/bodies.md).
    fixed_head: bool = False

    @property
    def cut(self) -> tuple[str, tuple[int, ...], int]:
        """Where the body is cut: what its prefix and tail depend on."""
        return self.body, tuple(self.frame_shape), self.blocks


@runtime_checkable
class Trainer(Protocol):
    """A model trained through flat float32 parameter vectors.

    ``layout`` lists ``(name, shape)`` per tensor in flat order; ``lr`` is the
    SGD learning rate and may be changed between steps.
    """

    layout: tuple[tuple[str, tuple[int, ...]], ...]
    lr: float

    @property
    def num_params(self) -> int: ...

    def get_flat(self) -> np.ndarray: ...

    def set_flat(self, flat: np.ndarray) -> None: ...

    def train_step(self, x: np.ndarray, y: np.ndarray) -> float: ...

    def logits(self, x: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
        """The model's outputs ``(n, classes)`` on ``x``, of ``weights`` if given; every
        backend predicts through this one method (inference, prequential accuracy)."""

    def evaluate(self, x: np.ndarray, y: np.ndarray,
                 weights: np.ndarray | None = None) -> tuple[float, float]:
        """Loss and accuracy on ``(x, y)`` of ``weights`` (a flat vector) if given, else of
        the trainer's parameters; the trainer's parameters are unchanged either way."""


def check_flat(flat: np.ndarray, size: int) -> np.ndarray:
    """Validate a flat parameter vector before it replaces a model's weights."""
    flat = np.asarray(flat)
    if flat.shape != (size,):
        raise ShapeError(f"flat vector has shape {flat.shape}, model needs ({size},)")
    if not np.isfinite(flat).all():
        raise ShapeError("flat vector contains NaN or Inf")
    return flat.astype(np.float32, copy=False)


def proximal_step(before: np.ndarray, after: np.ndarray, anchor: np.ndarray, *,
                  lr: float, mu: float) -> np.ndarray:
    """Add FedProx's proximal term to one SGD step taken from ``before``.

    The gradient of ``mu/2 ||w - anchor||^2`` at ``before`` is
    ``mu (before - anchor)``, so the proximal SGD step is the plain step minus
    ``lr * mu * (before - anchor)`` (Li et al., "Federated Optimization in
    Heterogeneous Networks", MLSys 2020).
    """
    if mu < 0:
        raise ConfigError("prox_mu", f"must be >= 0, got {mu!r}")
    stepped: np.ndarray = (after - np.float32(lr * mu) * (before - anchor)).astype(np.float32)
    return stepped
