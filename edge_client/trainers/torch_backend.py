"""Torch trainer for the zoo's CNNs (imported only when chosen: torch is heavy).

The model lives on ``device``: ``"cpu"``, ``"cuda"``/``"cuda:N"`` (a Jetson's or a server's
GPU), or ``"auto"`` (CUDA where torch sees one).  Weights still cross the interface as flat
float32 numpy vectors, so a CUDA device federates with CPU, numpy and ORT devices alike.
"""

from __future__ import annotations

import io
import warnings
from typing import Any, cast

import numpy as np
import torch

from ..errors import ConfigError, ShapeError
from .base import BodyTail, check_flat
from .onnx_export import OPSET
from .zoo import build_module

__all__ = ["TorchTrainer", "build", "resolve_device", "module_to_onnx"]


def module_to_onnx(module: torch.nn.Module, *, training: bool = False, output: str = "logits",
                   input_shape: tuple[int, ...] | None = None) -> bytes:
    """The module as an ONNX graph (batch-dynamic ``input`` -> ``output``): the artifacts'
    graphs (``models``), a device's exported model and a frozen body (``embedding``)."""
    shape = input_shape or input_shape_of(module)
    dummy = torch.zeros(2, *shape, device=next(module.parameters()).device)
    buf = io.BytesIO()
    mode = torch.onnx.TrainingMode.TRAINING if training else torch.onnx.TrainingMode.EVAL
    # The TorchScript exporter keeps parameter names as initializer names, which the
    # artifacts and the manifest's layout rely on.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the legacy exporter is deliberate
        warnings.filterwarnings("ignore", "Constant folding", UserWarning)  # a body's slices
        torch.onnx.export(module, (dummy,), cast(Any, buf), input_names=["input"],
                          output_names=[output],
                          dynamic_axes={"input": {0: "batch"}, output: {0: "batch"}},
                          opset_version=OPSET, dynamo=False, training=mode,
                          do_constant_folding=not training, export_params=True)
    return buf.getvalue()


def input_shape_of(module: torch.nn.Module) -> tuple[int, ...]:
    """The sample shape a zoo module (or your own) declares as ``input_shape``."""
    return tuple(cast(Any, module).input_shape)


def resolve_device(name: str) -> torch.device:
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N`` as a torch device this machine has."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError("device", f"{name!r} asked for, but torch sees no CUDA device "
                              "(a CPU-only torch build, or no driver); use 'auto' or 'cpu'")
        dev = torch.device(name)
        if (dev.index or 0) >= torch.cuda.device_count():
            raise ConfigError("device", f"{name!r}: this machine has "
                              f"{torch.cuda.device_count()} CUDA device(s)")
        return dev
    raise ConfigError("device", f"must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {name!r}")


class TorchTrainer:
    """Plain-SGD trainer over a torch module, exposed as flat float32 vectors."""

    def __init__(self, module: torch.nn.Module, *, lr: float, device: str = "cpu"):
        self.device = resolve_device(device)
        self.input_shape = input_shape_of(module)
        # Image models run channels-last: oneDNN's convolutions and pooling are 1.4x faster
        # per step in that layout on CPUs (bench/simulator.py).  The flat vector stays in
        # each tensor's logical (torch ``parameters()``) order whatever the memory layout.
        self._layout = (torch.channels_last if len(self.input_shape) == 3
                        and any(isinstance(mod, torch.nn.Conv2d) for mod in module.modules())
                        else torch.contiguous_format)
        self.module: torch.nn.Module = cast(Any, module).to(self.device,
                                                            memory_format=self._layout)
        self.lr = lr
        self._params = list(module.parameters())
        self.layout = tuple((name, tuple(p.shape)) for name, p in module.named_parameters())
        # Tensors that ride in the vector but do not train (a tuned body's fixed head).
        self._fixed = {name for name, p in module.named_parameters() if not p.requires_grad}

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self._params)

    @property
    def renders_body(self) -> bool:
        """True where :meth:`inference_onnx` already has the body in it (a tuned body)."""
        return hasattr(self.module, "deployable")

    def get_flat(self) -> np.ndarray:
        # torch.cat already made a new tensor; its numpy view is the caller's to keep.
        with torch.no_grad():
            return torch.cat([p.reshape(-1) for p in self._params]).cpu().numpy()

    def _wrap(self, flat: np.ndarray) -> torch.Tensor:
        """A received vector as a tensor on the model's device, without a copy on the CPU.
        Frozen message vectors are read-only and torch only reads them here, so its warning
        about wrapping a read-only buffer does not apply."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(flat).to(self.device)

    def set_flat(self, flat: np.ndarray) -> None:
        vec = self._wrap(check_flat(flat, self.num_params))
        offset = 0
        with torch.no_grad():
            for p in self._params:  # copy_ keeps each parameter's memory layout
                p.copy_(vec[offset:offset + p.numel()].view_as(p))
                offset += p.numel()

    def _inputs(self, x: np.ndarray) -> torch.Tensor:
        x = np.asarray(x, dtype=np.float32)
        if x[0].size != np.prod(self.input_shape):
            raise ShapeError(f"input samples have {x[0].size} values, model expects "
                             f"shape {self.input_shape}")
        t = torch.from_numpy(x.reshape(len(x), *self.input_shape)).to(self.device)
        return t.contiguous(memory_format=self._layout) if t.dim() == 4 else t

    def _targets(self, y: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(np.asarray(y), dtype=torch.long).to(self.device)

    def train_step(self, x: np.ndarray, y: np.ndarray) -> float:
        self.module.train()
        loss = torch.nn.functional.cross_entropy(self.module(self._inputs(x)), self._targets(y))
        for p in self._params:
            p.grad = None
        loss.backward()  # type: ignore[no-untyped-call]
        with torch.no_grad():
            for p in self._params:
                if p.grad is not None:  # a parameter the forward pass did not use
                    p.sub_(self.lr * p.grad)
        return float(loss.detach())

    def train_members(self, starts: list[np.ndarray],
                      batches: list[list[tuple[np.ndarray, np.ndarray]]],
                      lrs: list[float]) -> list[np.ndarray]:
        """Plain SGD for several models at once, as :meth:`train_step` would take them one
        after another: member ``i`` from ``starts[i]`` over ``batches[i]`` at ``lrs[i]``.

        Each step is one call for every member that still has a batch: ``torch.func``'s
        ``grad`` of the loss through ``functional_call``, ``vmap``-ed over the members'
        weights, so members that start from different (annealed-merge) models batch too.
        Shorter batches are padded and masked out of their member's mean loss.  The
        trainer's own parameters are left as they were.
        """
        from torch.func import functional_call, grad, vmap

        names = [name for name, _ in self.layout]
        flat = torch.stack([self._wrap(check_flat(z, self.num_params)) for z in starts])
        params, offset = {}, 0
        for (name, shape), p in zip(self.layout, self._params, strict=True):
            params[name] = flat[:, offset:offset + p.numel()].reshape(len(starts), *shape)
            offset += p.numel()
        rates = torch.tensor(lrs, dtype=flat.dtype, device=self.device)

        def loss(weights: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor,
                 mask: torch.Tensor) -> torch.Tensor:
            logits = functional_call(self.module, weights, (x,))
            per_sample = torch.nn.functional.cross_entropy(logits, y, reduction="none")
            return (per_sample * mask).sum() / mask.sum()

        step_grads = vmap(grad(loss))
        trained = [n for n in names if n not in self._fixed]
        self.module.train()
        for step in range(max((len(b) for b in batches), default=0)):
            active = [i for i, b in enumerate(batches) if len(b) > step]
            x, y, mask = self._padded([batches[i][step] for i in active])
            idx = torch.tensor(active, device=self.device)
            grads = step_grads({n: params[n][idx] for n in names}, x, y, mask)
            for n in trained:
                scale = rates[idx].view(-1, *([1] * (params[n].dim() - 1)))
                params[n] = params[n].index_add(0, idx, -scale * grads[n])
        out = torch.cat([params[n].reshape(len(starts), -1) for n in names], dim=1)
        return list(out.detach().cpu().numpy())

    def _padded(self, members: list[tuple[np.ndarray, np.ndarray]]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Members' batches stacked, the shorter padded with their first sample, masked."""
        width = max(len(y) for _, y in members)
        xs, ys, masks = [], [], []
        for x, y in members:
            pad = width - len(y)
            take = np.concatenate([np.arange(len(y)), np.zeros(pad, dtype=np.int64)])
            xs.append(self._inputs(np.asarray(x)[take]))
            ys.append(self._targets(np.asarray(y)[take]))
            masks.append(torch.cat([torch.ones(len(y)), torch.zeros(pad)]).to(self.device))
        return torch.stack(xs), torch.stack(ys), torch.stack(masks)

    def _logits(self, x: np.ndarray, weights: np.ndarray | None = None) -> torch.Tensor:
        self.module.eval()
        with torch.no_grad():
            if weights is None:
                return self.module(self._inputs(x))
            # The given vector's views stand in for the parameters: nothing is swapped.
            vec, offset, params = self._wrap(check_flat(weights, self.num_params)), 0, {}
            for (name, shape), p in zip(self.layout, self._params, strict=True):
                view = vec[offset:offset + p.numel()].view(shape)
                # Conv kernels (a small share of the vector) copied into the parameter's own
                # strides: oneDNN runs a kernel view of another layout 1.3x slower.
                params[name] = torch.empty_like(p).copy_(view) if view.dim() == 4 else view
                offset += p.numel()
            return torch.func.functional_call(self.module, params, (self._inputs(x),))

    def logits(self, x: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
        return self._logits(x, weights).cpu().numpy()

    def inference_onnx(self, weights: np.ndarray) -> bytes:
        """The model with ``weights`` as an ONNX graph (``trainers/onnx_export.py``)."""
        own = self.get_flat()
        self.set_flat(weights)
        try:
            self.module.eval()
            # A tuned body's model is exported with its frozen prefix: frames to logits.
            deployable = getattr(self.module, "deployable", None)
            return module_to_onnx(deployable() if deployable else self.module)
        finally:
            self.set_flat(own)

    def evaluate(self, x: np.ndarray, y: np.ndarray,
                 weights: np.ndarray | None = None) -> tuple[float, float]:
        if len(y) == 0:
            return float("nan"), float("nan")
        logits, target = self._logits(x, weights), self._targets(y)
        loss = torch.nn.functional.cross_entropy(logits, target)
        return float(loss), float((logits.argmax(1) == target).float().mean())


def build(model: str, *, input_shape: tuple[int, ...], num_classes: int, lr: float,
          seed: int, device: str = "auto", hidden: int = 128,
          tail: BodyTail | None = None) -> TorchTrainer:
    # Initial weights are drawn on the CPU, so they are the same whatever the device.
    torch.manual_seed(seed)
    if tail is None:
        module = build_module(model, input_shape=input_shape, num_classes=num_classes,
                              hidden=hidden)
        return TorchTrainer(module, lr=lr, device=device)
    from .bodies import tuned_module

    module = tuned_module(tail.body, tail.frame_shape, tail.blocks, lambda shape: build_module(
        model, input_shape=shape, num_classes=num_classes, hidden=hidden))
    if tail.fixed_head:
        module.head.requires_grad_(False)
    if module.input_shape != tuple(input_shape):
        raise ShapeError(f"the body's last {tail.blocks} block(s) take {module.input_shape}, "
                         f"the model was given {tuple(input_shape)}")
    return TorchTrainer(module, lr=lr, device=device)
