"""What the benchmarks share: a past commit checked out beside this one, and a probe run in a
fresh process inside either tree, so a figure and its baseline come from the same run."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@contextmanager
def checkout(commit: str) -> Iterator[Path]:
    """``commit`` in a temporary git worktree, removed afterwards."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "baseline"
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), commit], cwd=ROOT,
                       check=True, capture_output=True)
        try:
            yield tree
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT,
                           check=False, capture_output=True)


def probe(tree: Path, code: str, *args: str, env: dict[str, str] | None = None) -> str:
    """Run ``code`` with ``tree`` importable (one BLAS/OpenMP thread unless ``env`` says
    otherwise); its last line of output."""
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=tree, check=True,
                          capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {}),
                               "PYTHONPATH": str(tree)})
    return done.stdout.strip().splitlines()[-1]
