"""Running a page of docs/ as written: its ``<!-- run -->`` shell blocks, its
``<!-- file: NAME -->`` blocks, and the few things a test on one machine must change (the
folders ``/etc/safl`` and ``/var/lib/safl``, and ``safl``, this checkout's command)."""

from __future__ import annotations

import fcntl
import re
import subprocess
import sys
from pathlib import Path

SAFL = Path(sys.executable).with_name("safl")


def blocks_of(text: str) -> list[str]:
    return re.findall(r"<!-- run -->\n```sh\n(.*?)```", text, re.S)


def localise(block: str, root: Path) -> str:
    block = block.replace("/etc/safl", f"{root}/etc/safl")
    block = block.replace("/var/lib/safl", f"{root}/var/lib/safl")
    commands = "provision|cloud|station|device|status|monitor|models|predictions"
    return re.sub(rf"(?<![\w/-])safl ({commands})\b", rf"{SAFL} \1", block)


def localise_files(root: Path) -> None:
    """The role files ``safl provision`` wrote under the test's ``/etc/safl``, with the
    test's ``/var/lib/safl`` in them: a device's state (the model it predicts with) kept
    in the machine's own folder would outlive the test and start the next run with it."""
    for path in (root / "etc" / "safl").rglob("*.toml"):
        text = path.read_text()
        if "/var/lib/safl" in text:
            path.write_text(re.sub(r'"/var/lib/safl', f'"{root}/var/lib/safl', text))


# Pages run as root in two sessions at once (make test) may each create deploy.md's system
# user: useradd beside useradd fails on /etc/passwd's lock, so one block at a time does.
USERS_LOCK = Path("/tmp/safl-doc-useradd.lock")


def run_block(block: str, cwd: Path, **kw) -> subprocess.CompletedProcess:
    def run() -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=cwd,
                              capture_output=True, text=True, timeout=120, **kw)
    if "useradd" not in block:
        return run()
    with USERS_LOCK.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return run()


def venv_runs_as_safl() -> bool:
    probe = subprocess.run(["runuser", "-u", "safl", "--", str(SAFL), "--version"],
                           capture_output=True, timeout=60)
    return probe.returncode == 0


def files_of(text: str) -> dict[str, str]:
    """The page's ``<!-- file: NAME -->`` blocks: what a reader saves as NAME."""
    return dict(re.findall(r"<!-- file: (\S+) -->\n```\w*\n(.*?)```", text, re.S))
