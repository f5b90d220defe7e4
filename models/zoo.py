"""Torch definitions of the zoo models, with names matching the numpy backend.

``femnist_cnn`` is the FedGS reference CNN (conv32 5x5, pool, conv64 5x5, pool,
dense 2048, dense classes); ``small_cnn`` is a ~114k-parameter CNN for 28x28
grayscale; ``mlp`` matches :mod:`edge_client.trainers.numpy_backend` exactly.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from edge_client.errors import ConfigError

__all__ = ["MODELS", "build_module"]


class MLP(nn.Module):
    def __init__(self, in_features: int, num_classes: int, hidden: int = 128) -> None:
        super().__init__()
        self.input_shape = (in_features,)
        self.fc1 = nn.Linear(in_features, hidden)
        self.fc2 = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


class ConvNet(nn.Module):
    """Two 5x5 conv + 2x2 max-pool blocks, then two dense layers."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, *,
                 channels: tuple[int, int], dense: int) -> None:
        super().__init__()
        c, h, w = input_shape
        self.input_shape = (c, h, w)
        self.conv1 = nn.Conv2d(c, channels[0], 5, padding=2)
        self.conv2 = nn.Conv2d(channels[0], channels[1], 5, padding=2)
        self.fc1 = nn.Linear(channels[1] * (h // 4) * (w // 4), dense)
        self.fc2 = nn.Linear(dense, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.max_pool2d(torch.relu(self.conv1(x)), 2)
        x = nn.functional.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


def _image_shape(input_shape: tuple[int, ...]) -> tuple[int, int, int]:
    if len(input_shape) == 2:
        return (1, *input_shape)
    if len(input_shape) == 3:
        return tuple(input_shape)
    raise ConfigError("input_shape", f"CNNs need (H, W) or (C, H, W), got {input_shape}")


MODELS = {
    "mlp": lambda shape, classes: MLP(math.prod(shape), classes),
    "small_cnn": lambda shape, classes: ConvNet(_image_shape(shape), classes,
                                                channels=(16, 32), dense=64),
    "femnist_cnn": lambda shape, classes: ConvNet(_image_shape(shape), classes,
                                                  channels=(32, 64), dense=2048),
}


def build_module(name: str, *, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Instantiate a zoo model by name."""
    if name not in MODELS:
        raise ConfigError("model", f"unknown model {name!r}; choose from {sorted(MODELS)}")
    return MODELS[name](tuple(input_shape), num_classes)
