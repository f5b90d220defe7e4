"""Torch definitions of the zoo models, with names matching the numpy backend.

- ``mlp``: one hidden layer of 128, parameter for parameter the numpy backend's MLP;
- ``small_cnn``: ~114k parameters for 28x28 grayscale;
- ``femnist_cnn``: the FedGS reference CNN (conv32 5x5, pool, conv64 5x5, pool, dense 2048,
  dense classes);
- ``camera_cnn``: ~24k parameters for 3-channel camera crops (64x64 by default).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from edge_client.errors import ConfigError

__all__ = ["MODELS", "DEFAULT_INPUT", "build_module"]


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


class CameraNet(nn.Module):
    """Three 3x3 conv + pool blocks and global average pooling: size-independent, small."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        c, h, w = input_shape
        self.input_shape = (c, h, w)
        self.conv1 = nn.Conv2d(c, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.conv3 = nn.Conv2d(32, 64, 3, padding=1)
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv in (self.conv1, self.conv2, self.conv3):
            x = nn.functional.max_pool2d(torch.relu(conv(x)), 2)
        return self.fc(x.mean(dim=(2, 3)))


def _image_shape(input_shape: tuple[int, ...]) -> tuple[int, int, int]:
    if len(input_shape) == 2:
        return (1, *input_shape)
    if len(input_shape) == 3:
        return tuple(input_shape)
    raise ConfigError("input_shape", f"CNNs need (H, W) or (C, H, W), got {input_shape}")


MODELS: dict[str, Callable[[tuple[int, ...], int], nn.Module]] = {
    "mlp": lambda shape, classes: MLP(math.prod(shape), classes),
    "small_cnn": lambda shape, classes: ConvNet(_image_shape(shape), classes,
                                                channels=(16, 32), dense=64),
    "femnist_cnn": lambda shape, classes: ConvNet(_image_shape(shape), classes,
                                                  channels=(32, 64), dense=2048),
    "camera_cnn": lambda shape, classes: CameraNet(_image_shape(shape), classes),
}

DEFAULT_INPUT: dict[str, tuple[int, ...]] = {
    "mlp": (28, 28), "small_cnn": (1, 28, 28), "femnist_cnn": (1, 28, 28),
    "camera_cnn": (3, 64, 64),
}


def build_module(name: str, *, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Instantiate a zoo model by name."""
    if name not in MODELS:
        raise ConfigError("model", f"unknown model {name!r}; choose from {sorted(MODELS)}")
    return MODELS[name](tuple(input_shape), num_classes)
