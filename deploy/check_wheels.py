"""Which wheels a board can install from PyPI: the claims of docs/install-edge.md, checked.

For each package and platform it runs ``pip download --no-deps --only-binary=:all:
--platform ... --python-version ...`` (a real resolution against the index, nothing
installed) and prints what it found; for torch it also reads the wheel's dependencies.
Needs network access to PyPI and about 500 MB of temporary disk (the aarch64 torch wheel).

    python deploy/check_wheels.py
"""

from __future__ import annotations

import glob
import subprocess
import sys
import tempfile
import zipfile

# (package, platform, python version, what the docs claim)
CHECKS = [
    ("onnxruntime-training-cpu==1.19.2", "manylinux2014_aarch64", "3.11", "no aarch64 wheel"),
    ("onnxruntime-training", "manylinux2014_aarch64", "3.10", "no aarch64 wheel"),
    ("onnxruntime-training-cpu==1.19.2", "manylinux_2_28_x86_64", "3.11", "x86_64 wheel"),
    ("torch", "manylinux_2_28_aarch64", "3.11", "aarch64 wheel that pulls CUDA packages"),
    ("numpy", "manylinux_2_17_aarch64", "3.11", "aarch64 wheel"),
    ("numpy", "manylinux_2_17_aarch64", "3.10", "aarch64 wheel (JetPack 6's Python)"),
    ("paho-mqtt>=2.0", "any", "3.10", "pure Python"),
    ("opencv-python-headless", "manylinux_2_17_aarch64", "3.11", "aarch64 wheel"),
    # safl-device export on the board, and the line's application running what it wrote
    ("onnx>=1.16,<1.18", "manylinux_2_17_aarch64", "3.11", "aarch64 wheel"),
    ("onnxruntime", "manylinux_2_27_aarch64", "3.11", "aarch64 wheel"),
]


def check(package: str, platform: str, python: str) -> tuple[str, list[str]]:
    with tempfile.TemporaryDirectory() as folder:
        args = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                "--python-version", python, "-d", folder, package]
        if platform != "any":
            args[5:5] = ["--platform", platform]
        out = subprocess.run(args, capture_output=True, text=True)
        wheels = glob.glob(f"{folder}/*.whl")
        if out.returncode or not wheels:
            return "none", []
        cuda = []
        with zipfile.ZipFile(wheels[0]) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            cuda = [line.split(":", 1)[1].strip() for line in z.read(meta).decode().splitlines()
                    if line.startswith("Requires-Dist") and "nvidia" in line]
        return wheels[0].rsplit("/", 1)[1], cuda


def main() -> None:
    for package, platform, python, claim in CHECKS:
        found, cuda = check(package, platform, python)
        print(f"{package:<34} {platform:<24} py{python:<5} claim: {claim:<40} found: {found}")
        for dep in cuda:
            print(f"{'':>67}requires {dep}")


if __name__ == "__main__":
    main()
