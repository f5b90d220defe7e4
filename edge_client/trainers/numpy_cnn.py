"""The zoo's convolutional models on numpy alone: a CNN trainer for boards without torch.

``small_cnn``/``femnist_cnn`` (two 5x5 convolutions with 2x2 max-pool, then two dense
layers) and ``camera_cnn`` (three 3x3 convolutions with max-pool, global average pool, one
dense layer), parameter for parameter and in the flat order of the torch backend's modules
(``trainers/zoo.py``), so the layout hash is the same and a mixed numpy/torch fleet is one
fleet.  Inside, activations are channels-last; convolutions run as one matrix product over
im2col windows (a strided view: one copy), an input's gradient as the forward
convolution with the flipped kernel; gradients are written by hand and checked against
torch's in ``tests/test_numpy_cnn.py``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..errors import ConfigError, ShapeError
from .base import check_flat
from .numpy_layers import FlatParameters, softmax_xent

__all__ = ["ConvTrainer", "build_cnn", "CNN_MODELS"]

CNN_MODELS = ("small_cnn", "femnist_cnn", "camera_cnn")
# Bytes of im2col columns and activations one forward pass of an evaluation may hold (one
# layer's at a time): 24 samples of small_cnn, whose 5x5 columns over 16 channels take 313
# KB a sample.  Measured on one x86 thread, evaluating in chunks of 24 took 121 ms per 1,000
# samples against 237 ms in chunks of 512 (whose columns no longer fit a cache).
EVAL_WORKSPACE = 8 << 20


ConvCache = tuple[np.ndarray, int, int]  # im2col columns, padding, kernel size
PoolCache = tuple[list[np.ndarray], tuple[int, ...]]  # each offset's winners, input shape


def _conv(x: np.ndarray, w: np.ndarray, b: np.ndarray,
          pad: int) -> tuple[np.ndarray, ConvCache]:
    """Stride-1 convolution (torch's cross-correlation) of NHWC ``x`` (channels last: the
    im2col windows and the product need no transposes); returns the NHWC output and what
    the backward pass needs."""
    n, h, wd, c = x.shape
    o, _, k, _ = w.shape
    xp = np.ascontiguousarray(np.pad(x, ((0, 0), (pad, pad), (pad, pad), (0, 0))))
    sn, sh, sw, sc = xp.strides
    # Windows as (n, h, w, ki, kj, c): within a window row, kj and c are one contiguous run
    # of k*c floats, so the one copy (windows overlap) moves runs, not single values.
    win = np.lib.stride_tricks.as_strided(xp, (n, h, wd, k, k, c), (sn, sh, sw, sh, sw, sc),
                                          writeable=False)
    cols = win.reshape(n * h * wd, k * k * c)
    out = cols @ w.transpose(2, 3, 1, 0).reshape(k * k * c, o)
    out += b  # in place: one pass over the largest activation, not a second array
    return out.reshape(n, h, wd, o), (cols, pad, k)


def _first_conv(x: np.ndarray, w: np.ndarray, b: np.ndarray,
                pad: int) -> tuple[np.ndarray, ConvCache]:
    """:func:`_conv` of the NCHW input samples, with its im2col windows built as the
    columns of their transpose: one copy of a shifted image plane per kernel offset and
    channel, runs of a whole image row.  NHWC windows of a one-channel image would be runs
    of ``k`` values, and their copy cost more than the layer's product."""
    n, c, h, wd = x.shape
    o, _, k, _ = w.shape
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    planes = np.empty((k, k, c, n, h, wd), dtype=np.float32)
    for i in range(k):
        for j in range(k):
            planes[i, j] = xp[:, :, i:i + h, j:j + wd].transpose(1, 0, 2, 3)
    cols = planes.reshape(k * k * c, n * h * wd).T  # (n*h*w, k*k*c), as _conv's, F-ordered
    out = cols @ w.transpose(2, 3, 1, 0).reshape(k * k * c, o)
    out += b
    return out.reshape(n, h, wd, o), (cols, pad, k)


def _conv_back(grad: np.ndarray, w: np.ndarray, cache: ConvCache,
               need_input: bool = True) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
    cols, pad, k = cache
    n, h, wd, o = grad.shape
    g = grad.reshape(n * h * wd, o)
    gw = (g.T @ cols).reshape(o, k, k, w.shape[1]).transpose(0, 3, 1, 2)
    gb = g.sum(axis=0)
    if not need_input:  # the first layer: nothing below it to train
        return None, gw, gb
    # The input's gradient is the forward convolution of the output's gradient with the
    # kernel flipped and its channels swapped ("same" padding, stride 1: the same padding).
    flipped = np.ascontiguousarray(w.transpose(1, 0, 2, 3)[:, :, ::-1, ::-1])
    dx, _ = _conv(np.ascontiguousarray(grad), flipped, np.zeros(w.shape[1], grad.dtype),
                  k - 1 - pad)
    return dx, gw, gb


_OFFSETS = ((0, 0), (0, 1), (1, 0), (1, 1))  # row-major in the window: torch's tie order


def _pool_relu(x: np.ndarray) -> tuple[np.ndarray, PoolCache]:
    """ReLU then 2x2 max-pool of NHWC ``x``, stride 2, floor (as torch), computed as the
    pool then the ReLU on a quarter of the values: the maximum commutes with the ReLU, and
    a window whose maximum is not positive passes no gradient either way.  Returns the
    output and, per offset, where it won a window with a positive maximum (the first
    maximum, as torch's)."""
    n, h, w, c = x.shape
    h2, w2 = h // 2, w // 2
    parts = [x[:, i:2 * h2:2, j:2 * w2:2] for i, j in _OFFSETS]
    out = np.maximum(np.maximum(parts[0], parts[1]), np.maximum(parts[2], parts[3]))
    taken = out <= 0  # as if already won: no offset of such a window gets the gradient
    masks = []
    for part in parts:
        won = (part == out) & ~taken
        taken |= won
        masks.append(won)
    np.maximum(out, 0.0, out=out)
    return out, (masks, x.shape)


def _pool_back(grad: np.ndarray, cache: PoolCache) -> np.ndarray:
    masks, shape = cache
    dx = np.zeros(shape, dtype=grad.dtype)
    h2, w2 = grad.shape[1], grad.shape[2]
    for (i, j), won in zip(_OFFSETS, masks, strict=True):
        dx[:, i:2 * h2:2, j:2 * w2:2] = grad * won
    return dx


class ConvTrainer(FlatParameters):
    """Convolution blocks (conv, ReLU, 2x2 max-pool), then global average pool or flatten,
    then dense layers (ReLU between them), trained with plain SGD."""

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int, *, kernel: int,
                 channels: tuple[int, ...], dense: tuple[int, ...], global_pool: bool,
                 lr: float, seed: int) -> None:
        c, h, w = input_shape
        self.input_shape, self.lr = (c, h, w), lr
        self.kernel, self.pad, self.global_pool = kernel, kernel // 2, global_pool
        layout, fan_ins, workspace = [], [], 0
        for i, out in enumerate(channels):
            layout += [(f"conv{i + 1}.weight", (out, c, kernel, kernel)),
                       (f"conv{i + 1}.bias", (out,))]
            fan_ins += [c * kernel * kernel] * 2
            workspace = max(workspace, 4 * h * w * (kernel * kernel * c + out))
            c, h, w = out, h // 2, w // 2
        # An evaluation (the held-out slice for the upload gate and the device-local
        # accuracy, 256 samples) in one pass held small_cnn's im2col columns for all of
        # them: 144 MB over a 90 MB device.  Chunked to EVAL_WORKSPACE it is not slower.
        self.eval_chunk = max(1, EVAL_WORKSPACE // workspace)
        features = c if global_pool else c * h * w
        sizes = [features, *dense, num_classes]
        names = ["fc"] if len(sizes) == 2 else [f"fc{i + 1}" for i in range(len(sizes) - 1)]
        for name, (fin, fout) in zip(names, zip(sizes[:-1], sizes[1:], strict=True),
                                     strict=True):
            layout += [(f"{name}.weight", (fout, fin)), (f"{name}.bias", (fout,))]
            fan_ins += [fin] * 2
        self._convs, self._dense = len(channels), len(sizes) - 1
        self._allocate(layout, fan_ins, seed)

    def _inputs(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float32)
        if len(x) and x[0].size != math.prod(self.input_shape):
            raise ShapeError(f"input samples have {x[0].size} values, model expects shape "
                             f"{self.input_shape}")
        return x.reshape(len(x), *self.input_shape)

    def _forward(self, x: np.ndarray, params: list[np.ndarray]
                 ) -> tuple[list[np.ndarray], list[Any], tuple[int, ...]]:
        caches: list[Any] = []
        for i in range(self._convs):  # NCHW samples in, channels last from the first layer on
            z, conv = (_conv if i else _first_conv)(x, params[2 * i], params[2 * i + 1],
                                                    self.pad)
            x, pool = _pool_relu(z)
            caches.append((conv, pool))
        flat_shape = x.shape
        # torch flattens NCHW: the dense layer's columns are in that order.
        x = x.mean(axis=(1, 2)) if self.global_pool else x.transpose(0, 3, 1, 2).reshape(
            len(x), -1)
        acts = [x]
        base = 2 * self._convs
        for j in range(self._dense):
            z = acts[-1] @ params[base + 2 * j].T + params[base + 2 * j + 1]
            acts.append(np.maximum(z, 0.0) if j < self._dense - 1 else z)
        return acts, caches, flat_shape

    def logits(self, x: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
        """Logits of ``x``, ``eval_chunk`` samples a forward pass: a replaying device
        predicts what a loop turn drained (up to 256 samples), and small_cnn's columns for
        64 of them took 28 MB more than for 32 (158 MB more for 256); the emulated Pi's
        demo device peaked at 199.8 and 200.5 MB against its 200 MB bound, 178.1 MB with
        its predictions chunked (deploy/check_aarch64.py)."""
        params = self._params if weights is None else self._views(
            check_flat(weights, self.num_params))
        inputs, step = self._inputs(x), self.eval_chunk or len(x)
        if len(inputs) <= step:
            return self._forward(inputs, params)[0][-1]
        return np.concatenate([self._forward(inputs[i:i + step], params)[0][-1]
                               for i in range(0, len(inputs), step)])

    def gradients(self, x: np.ndarray, y: np.ndarray) -> tuple[float, list[np.ndarray]]:
        """Mean cross-entropy on the batch and its gradient, one array per layout entry."""
        params = self._params
        acts, caches, flat_shape = self._forward(self._inputs(x), params)
        loss, grad = softmax_xent(acts[-1], np.asarray(y))
        grads: list[np.ndarray] = [None] * len(params)  # type: ignore[list-item]
        base = 2 * self._convs
        for j in reversed(range(self._dense)):
            w = params[base + 2 * j]
            grads[base + 2 * j], grads[base + 2 * j + 1] = grad.T @ acts[j], grad.sum(axis=0)
            grad = grad @ w
            if j:
                grad = grad * (acts[j] > 0)
        n, h, wd, c = flat_shape
        if self.global_pool:
            grad = np.broadcast_to(grad[:, None, None, :] / (h * wd), flat_shape)
        else:
            grad = grad.reshape(n, c, h, wd).transpose(0, 2, 3, 1)
        for i in reversed(range(self._convs)):
            conv, pool = caches[i]
            below = _pool_back(np.ascontiguousarray(grad, dtype=np.float32), pool)
            dx, grads[2 * i], grads[2 * i + 1] = _conv_back(below, params[2 * i], conv,
                                                            need_input=i > 0)
            if dx is not None:
                grad = dx
        return loss, grads

    def train_step(self, x: np.ndarray, y: np.ndarray) -> float:
        """One SGD step on a batch; returns the batch loss before the step."""
        loss, grads = self.gradients(x, y)
        step = np.float32(self.lr)
        for p, g in zip(self._params, grads, strict=True):
            p -= step * g.astype(np.float32, copy=False)
        return loss

    def inference_onnx(self, weights: np.ndarray) -> bytes:
        """The model with ``weights`` as an ONNX graph (``trainers/onnx_export.py``)."""
        from onnx import helper

        names = [name for name, _ in self.layout]
        nodes, cur = [], "input"
        for i in range(self._convs):
            nodes += [helper.make_node("Conv", [cur, names[2 * i], names[2 * i + 1]],
                                       [f"c{i}"], pads=[self.pad] * 4,
                                       kernel_shape=[self.kernel] * 2),
                      helper.make_node("Relu", [f"c{i}"], [f"r{i}"]),
                      helper.make_node("MaxPool", [f"r{i}"], [f"p{i}"], kernel_shape=[2, 2],
                                       strides=[2, 2])]
            cur = f"p{i}"
        if self.global_pool:
            nodes.append(helper.make_node("GlobalAveragePool", [cur], ["gap"]))
            cur = "gap"
        nodes.append(helper.make_node("Flatten", [cur], ["flat"], axis=1))
        return self._onnx(weights, nodes, "flat", self._dense)


def build_cnn(model: str, *, input_shape: tuple[int, ...], num_classes: int, lr: float,
              seed: int) -> ConvTrainer:
    """The zoo's CNN ``model`` on numpy (shapes as ``trainers/zoo.py`` builds them)."""
    if len(input_shape) == 2:
        input_shape = (1, *input_shape)
    if len(input_shape) != 3:
        raise ConfigError("input_shape", f"CNNs need (H, W) or (C, H, W), got {input_shape}")
    shape = (int(input_shape[0]), int(input_shape[1]), int(input_shape[2]))
    if model == "camera_cnn":
        return ConvTrainer(shape, num_classes, kernel=3, channels=(16, 32, 64), dense=(),
                           global_pool=True, lr=lr, seed=seed)
    channels, dense = ((16, 32), 64) if model == "small_cnn" else ((32, 64), 2048)
    return ConvTrainer(shape, num_classes, kernel=5, channels=channels, dense=(dense,),
                       global_pool=False, lr=lr, seed=seed)
