"""The body on torch (``body.py``): a Jetson's CUDA forward, and the frozen prefix before
the blocks that train (on ONNX Runtime on a CPU, exported from torch at start-up).  torch is
imported inside each function, so a numpy or ONNX Runtime device that imports this module
(``open_body`` does, to ask) never loads it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import numpy as np

from .trainers.base import BodyTail

Forward = Callable[[np.ndarray], np.ndarray]

__all__ = ["torch_forward", "cuda_forward", "frozen_prefix"]


def torch_forward(module: Any, where: Any) -> Forward:
    """``module`` on ``where`` as a function of a batch of frames (numpy in, numpy out)."""
    import torch

    module = module.to(where)

    def forward(x: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return module(torch.from_numpy(x).to(where)).cpu().numpy()
    return forward


def cuda_forward(factory: str, input_shape: tuple[int, ...], device: str) -> Forward | None:
    """The body ``factory`` makes on torch where ``device`` resolves to a CUDA device, else
    None."""
    from .trainers.bodies import build_body_module
    from .trainers.torch_backend import resolve_device

    where = resolve_device(device)
    if where.type != "cuda":
        return None
    return torch_forward(build_body_module(factory, input_shape), where)


def frozen_prefix(tail: BodyTail, input_shape: tuple[int, ...], device: str, threads: int,
                  onnx: Callable[[bytes, int], Forward]
                  ) -> tuple[Forward, str, tuple[int, ...], Forward]:
    """The frozen prefix before the blocks that train, as ``(forward, runtime, its output's
    shape, the whole body)``: on the GPU, in torch; on a CPU, on ONNX Runtime (``onnx``)
    where it is installed (exported from torch at start-up, in memory: 1.25 against 8 ms a
    64x64 frame on one core).  The probe runs the pretrained tail on its output, so it
    checks the path the frames take."""
    from .trainers.bodies import prefix_shape, split_body
    from .trainers.torch_backend import module_to_onnx, resolve_device

    where = resolve_device(device)
    prefix, pretrained_tail = split_body(*tail.cut)
    if where.type == "cpu" and importlib.util.find_spec("onnxruntime") is not None:
        forward = onnx(module_to_onnx(prefix, output="activation", input_shape=input_shape),
                       threads)
        runtime = "onnxruntime"
    else:
        forward, runtime = torch_forward(prefix, where), f"torch ({where})"
    run_tail = torch_forward(pretrained_tail, where)
    return forward, runtime, prefix_shape(*tail.cut), lambda x: run_tail(forward(x))
