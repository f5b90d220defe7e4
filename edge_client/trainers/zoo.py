"""The model registry of the torch backend: the zoo's factories, and any user's.

A model is a factory ``(input_shape, num_classes) -> torch.nn.Module``.  The zoo registers
its own under short names; anything else is named ``"package.module:factory"`` and imported
when first built, so a user's model is trained exactly like the zoo's (``docs/own-model.md``).
Imported only by the torch backend and by ``models`` (artifact export): torch is heavy.

The zoo, with names matching the numpy backend:

- ``linear``: softmax regression (``fc``), the numpy backend's ``linear``: a body's usual head;
- ``mlp``: one hidden layer (``[model] hidden``, 128), parameter for parameter the numpy
  backend's MLP;
- ``small_cnn``: ~114k parameters for 28x28 grayscale;
- ``femnist_cnn``: the FedGS reference CNN (conv32 5x5, pool, conv64 5x5, pool, dense 2048,
  dense classes);
- ``camera_cnn``: ~24k parameters for 3-channel camera crops (64x64 by default).
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from ..errors import ConfigError

__all__ = ["MODELS", "DEFAULT_INPUT", "build_module", "register_model", "is_module_spec"]

Factory = Callable[[tuple[int, ...], int], nn.Module]
_SPEC = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


class MLP(nn.Module):
    def __init__(self, in_features: int, num_classes: int, hidden: int = 128) -> None:
        super().__init__()
        self.input_shape = (in_features,)
        self.fc1 = nn.Linear(in_features, hidden)
        self.fc2 = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


class Linear(nn.Module):
    def __init__(self, in_features: int, num_classes: int) -> None:
        super().__init__()
        self.input_shape = (in_features,)
        self.fc = nn.Linear(in_features, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.flatten(1))


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
        return input_shape[0], input_shape[1], input_shape[2]
    raise ConfigError("input_shape", f"CNNs need (H, W) or (C, H, W), got {input_shape}")


MODELS: dict[str, Factory] = {
    "linear": lambda shape, classes: Linear(math.prod(shape), classes),
    "mlp": lambda shape, classes: MLP(math.prod(shape), classes),
    "small_cnn": lambda shape, classes: ConvNet(_image_shape(shape), classes,
                                                channels=(16, 32), dense=64),
    "femnist_cnn": lambda shape, classes: ConvNet(_image_shape(shape), classes,
                                                  channels=(32, 64), dense=2048),
    "camera_cnn": lambda shape, classes: CameraNet(_image_shape(shape), classes),
}

DEFAULT_INPUT: dict[str, tuple[int, ...]] = {
    "linear": (28, 28), "mlp": (28, 28), "small_cnn": (1, 28, 28), "femnist_cnn": (1, 28, 28),
    "camera_cnn": (3, 64, 64),
}


def is_module_spec(name: str) -> bool:
    """True for ``"package.module:factory"``, a user's model."""
    return _SPEC.fullmatch(name) is not None


def register_model(name: str, factory: Factory,
                   default_input: tuple[int, ...] | None = None) -> None:
    """Add a factory to the registry under ``name`` (the zoo's own entries are added so)."""
    MODELS[name] = factory
    if default_input is not None:
        DEFAULT_INPUT[name] = tuple(default_input)


def _import_factory(spec: str) -> Factory:
    module_name, _, attr = spec.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError("module", f"cannot import {module_name!r} for {spec!r}: {exc} (is "
                          "its folder on PYTHONPATH?)") from exc
    for part in attr.split("."):
        target = getattr(target, part, None)
    if not callable(target):
        raise ConfigError("module", f"{spec!r}: {attr!r} is not a callable in {module_name}")
    return target


def build_module(name: str, *, input_shape: tuple[int, ...], num_classes: int,
                 hidden: int = 128) -> nn.Module:
    """Instantiate a registered model, or a user's ``"package.module:factory"``."""
    factory: Factory
    if name == "mlp" and hidden != 128:
        factory = lambda shape, classes: MLP(math.prod(shape), classes, hidden)  # noqa: E731
    elif name in MODELS:
        factory = MODELS[name]
    elif is_module_spec(name):
        factory = _import_factory(name)
    else:
        raise ConfigError("model", f"unknown model {name!r}; choose from {sorted(MODELS)} or "
                          "name your own as 'package.module:factory'")
    if not input_shape:
        raise ConfigError("input_shape", f"{name!r} needs the input shape of one sample")
    module = factory(tuple(input_shape), num_classes)
    if not isinstance(module, nn.Module):
        raise ConfigError("module", f"{name!r} returned {type(module).__name__}, not a "
                          "torch.nn.Module")
    if not hasattr(module, "input_shape"):
        cast(Any, module).input_shape = tuple(input_shape)  # how trainers reshape samples
    return module
