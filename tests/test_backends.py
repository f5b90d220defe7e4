"""`safl-device backends`, and the extras that resolve per platform (issue 23).

The real check of both on aarch64 is ``deploy/check_aarch64.py`` (an arm64 root filesystem
under qemu, in CI); these tests pin the rules on the host.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement

from edge_client.trainers import availability

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
PI = {"platform_machine": "aarch64", "sys_platform": "linux", "python_version": "3.11"}
PC = {"platform_machine": "x86_64", "sys_platform": "linux", "python_version": "3.11"}


def _extra(name: str, env: dict[str, str]) -> list[Requirement]:
    """The requirements of one extra that apply on a platform (as pip evaluates markers)."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    reqs = [Requirement(r) for r in extras[name]]
    return [r for r in reqs if r.marker is None or r.marker.evaluate({**env, "extra": ""})]


def test_the_torch_extra_takes_the_cpu_only_wheel_that_runs_on_a_pi_4():
    (torch,) = _extra("torch", PI)
    # 2.11 on need CUDA 13 on aarch64; 2.10.0 dies of SIGILL on a Cortex-A72
    assert torch.specifier.contains("2.9.1")
    assert not torch.specifier.contains("2.10.0") and not torch.specifier.contains("2.11.0")
    assert availability.TORCH_AARCH64_CPU == "2.9.1"
    (torch,) = _extra("torch", PC)
    assert torch.specifier.contains("2.13.0")


def test_the_ort_extra_installs_only_where_its_wheels_exist():
    assert {r.name for r in _extra("ort", PC)} == {"onnxruntime-training-cpu", "onnx"}
    assert _extra("ort", PI) == []
    assert _extra("ort", {**PC, "python_version": "3.12"}) == []


def test_backends_lists_each_backend_with_a_real_step():
    out = subprocess.run([sys.executable, "-m", "edge_client", "backends", "--json"],
                         capture_output=True, text=True, check=True)
    found = {b["backend"]: b for b in json.loads(out.stdout)}
    assert set(found) == {"numpy", "torch", "ort"}
    assert found["numpy"]["usable"] and found["numpy"]["step_ms"] > 0
    text = subprocess.run([sys.executable, "-m", "edge_client", "backends"],
                          capture_output=True, text=True, check=True).stdout
    assert "numpy  yes" in text


def test_backends_says_why_on_a_board(monkeypatch):
    """What a Pi without torch sees (the packages hidden, the machine's name changed)."""
    import importlib.metadata

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(availability, "_machine", lambda: "aarch64")
    monkeypatch.setattr(availability, "_ort_platform_ok", lambda: False)
    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    real = availability.importlib.util.find_spec
    monkeypatch.setattr(availability.importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch" else real(name, *a))
    torch = availability.probe("torch")
    assert not torch.usable and "2.9.1" in torch.why and "JetPack" in torch.why
    ort = availability.probe("ort")
    assert not ort.usable and "x86_64" in ort.why and "deprecated" in ort.why
