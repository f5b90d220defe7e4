"""Which training backends this install can run, and why not the others (``safl-device
backends``).

Each probe does what a device would: numpy and torch build the zoo's MLP and take one
training step on the CPU (and torch reports the CUDA devices it sees); ORT loads its
training API the way the backend does, without torch.  A backend that cannot run gets the
reason for this machine and the command that would fix it, because on a board the usual
cause is a wheel that does not exist for its platform (docs/install-edge.md).
"""

from __future__ import annotations

import importlib.util
import platform
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from ..errors import SaflError
from . import BACKENDS

__all__ = ["BackendStatus", "probe", "probe_all", "ORT_PLATFORM", "TORCH_AARCH64_CPU"]

# onnxruntime-training-cpu 1.19.2, the last release (deprecated upstream), was built for these.
ORT_PLATFORM = "Linux x86_64 with Python 3.8-3.11"
# The newest torch whose aarch64 wheel on PyPI is CPU-only and runs on a Raspberry Pi 4: 2.11
# and later need CUDA 13, and 2.10.0 uses LSE atomics that the Pi 4's Cortex-A72 lacks.
TORCH_AARCH64_CPU = "2.9.1"


@dataclass
class BackendStatus:
    name: str
    usable: bool
    version: str = ""
    devices: list[str] = field(default_factory=list)
    step_ms: float | None = None  # one MLP step on the CPU, first call included
    why: str = ""  # what is wrong, or what to know, on this machine

    def as_dict(self) -> dict[str, object]:
        return {"backend": self.name, "usable": self.usable, "version": self.version,
                "devices": self.devices, "step_ms": self.step_ms, "why": self.why}


def _machine() -> str:
    return platform.machine().lower()


def _ort_platform_ok() -> bool:
    return (sys.platform == "linux" and _machine() in ("x86_64", "amd64")
            and sys.version_info < (3, 12))


def _one_step(backend: str) -> float:
    """Milliseconds for one real training step of the zoo's MLP (8x8 inputs, 32 samples)."""
    from . import build_trainer

    trainer = build_trainer("mlp", backend=backend, input_shape=(8, 8), num_classes=10,
                            lr=0.05, seed=0, device="cpu")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 8, 8)).astype(np.float32)
    y = rng.integers(0, 10, 32)
    started = time.perf_counter()
    loss = trainer.train_step(x, y)
    spent = (time.perf_counter() - started) * 1e3
    if not np.isfinite(loss):
        raise SaflError(f"one training step gave loss {loss}")
    return spent


def _probe_numpy() -> BackendStatus:
    return BackendStatus("numpy", True, np.__version__, ["cpu"], _one_step("numpy"),
                         "mlp, softmax and the zoo's CNNs; nothing more to install")


def _torch_missing() -> str:
    if _machine() in ("aarch64", "arm64"):
        return (f"not installed: pip install 'safl-edge[torch]' takes torch "
                f"{TORCH_AARCH64_CPU}, CPU-only, which runs on a Pi 4 and a Pi 5; on a Jetson "
                "install NVIDIA's JetPack wheel instead (docs/install-edge.md)")
    return ("not installed: pip install 'safl-edge[torch]', or PyTorch's CPU wheel "
            "(pip install torch --index-url https://download.pytorch.org/whl/cpu)")


def _probe_torch() -> BackendStatus:
    if importlib.util.find_spec("torch") is None:
        return BackendStatus("torch", False, why=_torch_missing())
    try:
        import torch
    except Exception as exc:  # a wheel for another platform, a missing CUDA library
        return BackendStatus("torch", False, why=f"installed but does not import: {exc}")
    devices = ["cpu"]
    if torch.cuda.is_available():
        devices += [f"cuda:{i} {torch.cuda.get_device_name(i)}"
                    for i in range(torch.cuda.device_count())]
    why = "the zoo's models and your own torch modules"
    if torch.version.cuda and len(devices) == 1:
        why = (f"a CUDA {torch.version.cuda} build with no GPU here: it trains on the CPU, "
               "carrying CUDA libraries it cannot use")
        if _machine() in ("aarch64", "arm64"):
            why += f"; torch {TORCH_AARCH64_CPU} is PyPI's CPU-only aarch64 wheel for a Pi"
    try:
        step = _one_step("torch")
    except Exception as exc:
        return BackendStatus("torch", False, torch.__version__, devices,
                             why=f"imports but cannot train: {exc}")
    return BackendStatus("torch", True, torch.__version__, devices, step, why)


def _probe_ort() -> BackendStatus:
    from importlib.metadata import PackageNotFoundError, version

    deprecated = "deprecated upstream (1.19.2 of 2024-09 is the last release)"
    installed = ""
    for dist in ("onnxruntime-training-cpu", "onnxruntime-training"):  # the CPU and GPU builds
        try:
            installed = installed or version(dist)
        except PackageNotFoundError:
            pass
    if not installed and not _ort_platform_ok():
        here = f"{platform.system()} {platform.machine()} with Python {sys.version.split()[0]}"
        return BackendStatus("ort", False, why=f"onnxruntime-training has wheels for "
                             f"{ORT_PLATFORM} only, not {here}; it is {deprecated}: use "
                             "numpy or torch here")
    if not installed:
        return BackendStatus("ort", False, why=f"not installed: pip install 'safl-edge[ort]' "
                             f"({deprecated}; {ORT_PLATFORM} only)")
    from .ort_backend import load_training_api

    try:
        load_training_api()
    except Exception as exc:
        return BackendStatus("ort", False, installed, why=f"installed but cannot load its "
                             f"training API: {exc}")
    return BackendStatus("ort", True, installed, ["cpu"], None,
                         f"trains exported artifacts (safl models export) on the CPU; "
                         f"{deprecated}")


PROBES = {"numpy": _probe_numpy, "torch": _probe_torch, "ort": _probe_ort}
assert tuple(PROBES) == BACKENDS


def probe(name: str) -> BackendStatus:
    """What one backend can do here; never raises for a backend that is merely missing."""
    return PROBES[name]()


def probe_all() -> list[BackendStatus]:
    return [probe(name) for name in BACKENDS]
