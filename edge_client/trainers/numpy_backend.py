"""Numpy trainers with hand-written gradients, so a device runs on numpy alone.

Softmax regression and a one-hidden-layer MLP.  Parameters live in one flat
float32 vector; tensors are views into it, laid out as torch's ``nn.Linear``
would be (``weight`` (out, in) then ``bias``), so vectors cross backends.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..errors import ConfigError, ShapeError
from .base import Trainer, check_flat

__all__ = ["NumpyTrainer", "FlatParameters", "build"]


def _softmax_xent(logits: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
    shifted = logits - logits.max(axis=1, keepdims=True)
    expd = np.exp(shifted)
    probs = expd / expd.sum(axis=1, keepdims=True)
    n = len(y)
    loss = float(-np.log(probs[np.arange(n), y] + 1e-12).mean())
    probs[np.arange(n), y] -= 1.0
    return loss, probs / n


class FlatParameters:
    """Parameters in one flat float32 vector, each tensor a view into it, drawn as torch's
    default initialisation draws Linear and Conv2d tensors: uniform in +-1/sqrt(fan_in)."""

    layout: tuple[tuple[str, tuple[int, ...]], ...]
    input_shape: tuple[int, ...]
    eval_chunk: int | None = None  # samples a forward pass takes at most when evaluating

    def _allocate(self, layout: list[tuple[str, tuple[int, ...]]], fan_ins: list[int],
                  seed: int) -> None:
        self.layout = tuple(layout)
        self._flat = np.empty(sum(math.prod(s) for _, s in layout), dtype=np.float32)
        self._params = self._views(self._flat)
        rng = np.random.default_rng(seed)
        for p, fan_in in zip(self._params, fan_ins, strict=True):
            bound = 1.0 / math.sqrt(fan_in)
            p[...] = rng.uniform(-bound, bound, p.shape)

    @property
    def num_params(self) -> int:
        return self._flat.size

    def get_flat(self) -> np.ndarray:
        return self._flat.copy()

    def set_flat(self, flat: np.ndarray) -> None:
        self._flat[...] = check_flat(flat, self._flat.size)

    def _views(self, flat: np.ndarray) -> list[np.ndarray]:
        """The tensors of ``flat`` (this layout), as views: no copy."""
        views: list[np.ndarray] = []
        offset = 0
        for _, shape in self.layout:
            size = math.prod(shape)
            views.append(flat[offset:offset + size].reshape(shape))
            offset += size
        return views

    def logits(self, x: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
        raise NotImplementedError  # each model's forward pass

    def evaluate(self, x: np.ndarray, y: np.ndarray,
                 weights: np.ndarray | None = None) -> tuple[float, float]:
        """Mean cross-entropy and accuracy on ``(x, y)``, of ``weights`` if given (else of
        the trainer's own parameters, which stay as they are either way)."""
        y = np.asarray(y)
        if len(y) == 0:
            return float("nan"), float("nan")
        step = self.eval_chunk or len(y)
        logits = np.concatenate([self.logits(x[i:i + step], weights)
                                 for i in range(0, len(y), step)])
        loss, _ = _softmax_xent(logits, y)
        return loss, float((logits.argmax(axis=1) == y).mean())

    def _onnx(self, weights: np.ndarray, nodes: list[Any], current: str, dense: int) -> bytes:
        """An ONNX model of ``nodes`` (from ``input`` to ``current``) followed by the layout's
        last ``dense`` layers as Gemm (ReLU between them), initializers named as the layout
        (``trainers/onnx_export.py``)."""
        from onnx import TensorProto, helper, numpy_helper

        from .onnx_export import OPSET

        views = self._views(check_flat(weights, self.num_params))
        inits = [numpy_helper.from_array(np.ascontiguousarray(v), name)
                 for (name, _), v in zip(self.layout, views, strict=True)]
        names = [name for name, _ in self.layout][-2 * dense:]
        for j in range(dense):
            out = "logits" if j == dense - 1 else f"dense{j}"
            pre = out if out == "logits" else out + "_pre"
            nodes.append(helper.make_node("Gemm", [current, names[2 * j], names[2 * j + 1]],
                                          [pre], transB=1))
            if out != "logits":
                nodes.append(helper.make_node("Relu", [pre], [out]))
            current = out
        classes = self.layout[-1][1][0]
        graph = helper.make_graph(
            nodes, "safl_numpy",
            [helper.make_tensor_value_info("input", TensorProto.FLOAT,
                                           ["batch", *self.input_shape])],
            [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", classes])],
            inits)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                                 ir_version=8).SerializeToString()


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
        loss, grad = _softmax_xent(acts[-1], np.asarray(y))
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
    """``softmax`` (regression) or ``mlp`` (one hidden layer, ReLU)."""
    from .numpy_cnn import CNN_MODELS, build_cnn
    if model in CNN_MODELS:
        return build_cnn(model, input_shape=input_shape, num_classes=num_classes, lr=lr,
                         seed=seed)
    d = math.prod(input_shape)
    trainer = _build(model, d, num_classes, lr=lr, seed=seed, hidden=hidden)
    trainer.input_shape = tuple(input_shape)  # what an exported graph takes
    return trainer


def _build(model: str, d: int, num_classes: int, *, lr: float, seed: int,
           hidden: int) -> NumpyTrainer:
    if model == "softmax":
        return NumpyTrainer([d, num_classes], lr=lr, seed=seed, names=["fc"])
    if model == "mlp":
        return NumpyTrainer([d, hidden, num_classes], lr=lr, seed=seed, names=["fc1", "fc2"])
    raise ConfigError("model", "numpy backend offers 'softmax', 'mlp', 'small_cnn', "
                      f"'femnist_cnn' and 'camera_cnn', not {model!r}")
