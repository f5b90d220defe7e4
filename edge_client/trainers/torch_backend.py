"""Torch trainer for the zoo's CNNs (imported only when chosen: torch is heavy)."""

from __future__ import annotations

import numpy as np
import torch

from models.zoo import build_module

from ..errors import ShapeError
from .base import check_flat

__all__ = ["TorchTrainer", "build"]


class TorchTrainer:
    """Plain-SGD trainer over a torch module, exposed as flat float32 vectors."""

    def __init__(self, module: torch.nn.Module, *, lr: float):
        self.module = module
        self.lr = lr
        self.input_shape = tuple(module.input_shape)
        self._params = list(module.parameters())
        self.layout = tuple((name, tuple(p.shape)) for name, p in module.named_parameters())

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self._params)

    def get_flat(self) -> np.ndarray:
        with torch.no_grad():
            return torch.cat([p.reshape(-1) for p in self._params]).numpy().copy()

    def set_flat(self, flat: np.ndarray) -> None:
        vec = torch.from_numpy(check_flat(flat, self.num_params).copy())
        torch.nn.utils.vector_to_parameters(vec, self._params)

    def _inputs(self, x: np.ndarray) -> torch.Tensor:
        x = np.asarray(x, dtype=np.float32)
        if x[0].size != np.prod(self.input_shape):
            raise ShapeError(f"input samples have {x[0].size} values, model expects "
                             f"shape {self.input_shape}")
        return torch.from_numpy(x.reshape(len(x), *self.input_shape))

    def train_step(self, x: np.ndarray, y: np.ndarray) -> float:
        self.module.train()
        loss = torch.nn.functional.cross_entropy(self.module(self._inputs(x)),
                                                 torch.as_tensor(y, dtype=torch.long))
        for p in self._params:
            p.grad = None
        loss.backward()
        with torch.no_grad():
            for p in self._params:
                p -= self.lr * p.grad
        return float(loss.detach())

    def logits(self, x: np.ndarray) -> np.ndarray:
        self.module.eval()
        with torch.no_grad():
            return self.module(self._inputs(x)).numpy()

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        if len(y) == 0:
            return float("nan"), float("nan")
        logits = torch.from_numpy(self.logits(x))
        target = torch.as_tensor(y, dtype=torch.long)
        loss = torch.nn.functional.cross_entropy(logits, target)
        return float(loss), float((logits.argmax(1) == target).float().mean())


def build(model: str, *, input_shape: tuple[int, ...], num_classes: int, lr: float,
          seed: int) -> TorchTrainer:
    torch.manual_seed(seed)
    module = build_module(model, input_shape=input_shape, num_classes=num_classes)
    return TorchTrainer(module, lr=lr)
