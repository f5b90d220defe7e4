"""Numpy trainers with hand-written gradients, so a device runs on numpy alone.

Softmax regression (``linear``, also called ``softmax``) and a one-hidden-layer MLP.
Parameters live in one flat float32 vector; tensors are views into it, laid out as torch's
``nn.Linear`` would be (``weight`` (out, in) then ``bias``), so vectors cross backends.
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import ConfigError, ShapeError
from .base import Trainer, check_flat
from .numpy_cnn import CNN_MODELS, build_cnn
from .numpy_layers import FlatParameters, softmax_xent

__all__ = ["NumpyTrainer", "build"]


class NumpyTrainer(FlatParameters):
    """A stack of dense layers (ReLU between them) trained with plain SGD."""

    def __init__(self, sizes: list[int], *, lr: float, seed: int, names: list[str]) -> None:
        self.lr = lr
        self._dims = list(zip(sizes[:-1], sizes[1:], strict=True))
        layout, fan_ins = [], []
        for name, (fan_in, fan_out) in zip(names, self._dims, strict=True):
            layout += [(f"{name}.weight", (fan_out, fan_in)), (f"{name}.bias", (fan_out,))]
            fan_ins += [fan_in, fan_in]
        self._allocate(layout, fan_ins, seed)

    def _inputs(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float32).reshape(len(x), -1)
        if x.shape[1] != self._dims[0][0]:
            raise ShapeError(f"input has {x.shape[1]} features, model expects {self._dims[0][0]}")
        return x

    def _forward(self, x: np.ndarray, params: list[np.ndarray] | None = None
                 ) -> list[np.ndarray]:
        params = self._params if params is None else params
        acts = [x]
        for i in range(len(self._dims)):
            z = acts[-1] @ params[2 * i].T + params[2 * i + 1]
            acts.append(np.maximum(z, 0.0) if i < len(self._dims) - 1 else z)
        return acts

    def logits(self, x: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
        params = None if weights is None else self._views(check_flat(weights, self.num_params))
        return self._forward(self._inputs(x), params)[-1]

    def inference_onnx(self, weights: np.ndarray) -> bytes:
        """The model with ``weights`` as an ONNX graph: Flatten, then its dense layers."""
        from onnx import helper

        return self._onnx(weights, [helper.make_node("Flatten", ["input"], ["flat"], axis=1)],
                          "flat", len(self._dims))

    def train_step(self, x: np.ndarray, y: np.ndarray) -> float:
        """One SGD step on a batch; returns the batch loss before the step."""
        acts = self._forward(self._inputs(x))
        loss, grad = softmax_xent(acts[-1], np.asarray(y))
        for i in reversed(range(len(self._dims))):
            w = self._params[2 * i]
            gw, gb = grad.T @ acts[i], grad.sum(axis=0)
            if i:
                grad = (grad @ w) * (acts[i] > 0)
            w -= np.float32(self.lr) * gw
            self._params[2 * i + 1] -= np.float32(self.lr) * gb
        return loss


def build(model: str, *, input_shape: tuple[int, ...], num_classes: int, lr: float,
          seed: int, hidden: int = 128) -> Trainer:
    """``linear`` (softmax regression), ``mlp`` (one hidden layer, ReLU), or a CNN of the zoo
    (``numpy_cnn``)."""
    if model in CNN_MODELS:
        return build_cnn(model, input_shape=input_shape, num_classes=num_classes, lr=lr,
                         seed=seed)
    d = math.prod(input_shape)
    trainer = _build(model, d, num_classes, lr=lr, seed=seed, hidden=hidden)
    trainer.input_shape = tuple(input_shape)  # what an exported graph takes
    return trainer


def _build(model: str, d: int, num_classes: int, *, lr: float, seed: int,
           hidden: int) -> NumpyTrainer:
    if model in ("linear", "softmax"):
        return NumpyTrainer([d, num_classes], lr=lr, seed=seed, names=["fc"])
    if model == "mlp":
        return NumpyTrainer([d, hidden, num_classes], lr=lr, seed=seed, names=["fc1", "fc2"])
    raise ConfigError("model", "numpy backend offers 'linear', 'mlp', 'small_cnn', "
                      f"'femnist_cnn' and 'camera_cnn', not {model!r}")
