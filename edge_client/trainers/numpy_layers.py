"""What the numpy models share: parameters as views into one flat float32 vector, drawn as
torch draws them, and the softmax cross-entropy with its gradient.  Below the dense models
(``numpy_backend``) and the convolutional ones (``numpy_cnn``), which import it and not each
other's modules, so the numpy trainers import in one direction.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .base import check_flat

__all__ = ["FlatParameters", "softmax_xent"]


def softmax_xent(logits: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
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
    eval_chunk: int | None = None  # samples a forward pass (logits) takes at most

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
        logits = self.logits(x, weights)  # in chunks of eval_chunk where the model has one
        loss, _ = softmax_xent(logits, y)
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
