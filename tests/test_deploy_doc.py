"""docs/deploy.md, run as written: its fleet file and every command block marked
``<!-- run -->``, in order, as root in a fresh folder on one machine, brokers included.

What the test changes, and only this: the hosts and ports of the fleet file (loopback, free
ports and no metrics port, since the cloud and the factory share this machine),
``/etc/safl`` and ``/var/lib/safl`` (folders of the test), and ``safl`` (this checkout's
command).  The board
block runs once per device of the fleet, and the dry run starts every device.  Mosquitto
drops to its own user and the roles run as ``safl``: a file either cannot read fails here.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from brokers import free_port
from doc_blocks import blocks_of, localise, localise_files, run_block, venv_runs_as_safl

DOC = Path(__file__).resolve().parents[1] / "docs" / "deploy.md"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="deploy.md is run as root, as on a server"),
    pytest.mark.skipif(shutil.which("mosquitto") is None,
                       reason="Mosquitto is installed by .ci/run"),
    pytest.mark.skipif(shutil.which("runuser") is None or shutil.which("useradd") is None,
                       reason="needs runuser and useradd (util-linux, passwd)"),
]


def _fleet_file(text: str, cloud: int, station: int) -> str:
    block = re.search(r"## 1\. Describe the fleet\n\n```toml\n(.*?)```", text, re.S)
    assert block, "deploy.md lost its fleet file"
    fleet = block.group(1)
    for host in ("cloud.example.com", "10.1.0.2"):
        fleet = fleet.replace(f'"{host}"', '"127.0.0.1"')
    fleet = fleet.replace("cloud_port = 8883", f"cloud_port = {cloud}")
    # Every service of the fleet shares this one machine: no common /metrics port.
    fleet = re.sub(r"^metrics_port = \d+", "metrics_port = 0", fleet, flags=re.M)
    return fleet.replace("\nport = 8883", f"\nport = {station}")


def test_deploy_md_runs_as_written():
    text = DOC.read_text()
    blocks = blocks_of(text)
    assert len(blocks) == 6, "provision, cloud host, factory server, board, dry run, watch"
    provision_cmd, cloud_host, factory, board, dry_run, watch = blocks
    root = Path(tempfile.mkdtemp(prefix="safl-deploy-"))
    root.chmod(0o755)  # Mosquitto and the safl user must reach /etc/safl inside it
    work = root / "work"
    work.mkdir()
    ports = free_port(), free_port()
    (work / "fleet.toml").write_text(_fleet_file(text, *ports))
    devices = re.findall(r'devices = \["([^"]+)", "([^"]+)"\]', _fleet_file(text, *ports))[0]
    dry = None
    try:
        for block in (provision_cmd, cloud_host, factory):
            out = run_block(localise(block, root), work)
            assert out.returncode == 0, (block, out.stdout, out.stderr)
        for device in devices:
            out = run_block(localise(board.replace("cam-01", device), root), work)
            assert out.returncode == 0, (device, out.stderr)
        localise_files(root)
        etc = root / "etc" / "safl"
        # Each key belongs to the one user that reads it.
        owner = {p: pwd.getpwuid(p.stat().st_uid).pw_name for p in (
            etc / "cloud" / "broker" / "server.key", etc / "stations" / "hall-1" / "broker" /
            "bridge.key", etc / "stations" / "hall-1" / "client.key",
            etc / "cloud" / "client" / "client.key", etc / "devices" / devices[0] / "client.key")}
        assert [owner[p] for p in owner] == ["mosquitto", "mosquitto", "safl", "safl", "safl"]
        # Every file a role reads, read as the user its unit runs it as.
        for config in (etc / "cloud" / "cloud.toml", etc / "stations" / "hall-1" /
                       "station.toml", *(etc / "devices" / d / "device.toml" for d in devices)):
            paths = [config, *re.findall(r'^(?:ca|cert|key) = "(.*)"$', config.read_text(),
                                         re.M)]
            out = subprocess.run(["runuser", "-u", "safl", "--", "cat", *map(str, paths)],
                                 capture_output=True, text=True)
            assert out.returncode == 0, (config, out.stderr)
        last = dry_run.strip().splitlines()[-1]
        dry_all = dry_run + "".join(last.replace("cam-01", d) + "\n" for d in devices[1:])
        if not venv_runs_as_safl():
            # This checkout's Python lies where only root may look (a pyenv under /root):
            # the roles run as root here, after the reads above proved the unit's user can.
            dry_all = dry_all.replace("runuser -u safl -- ", "")
        dry = subprocess.Popen(["bash", "-euo", "pipefail", "-c", localise(dry_all, root)],
                               cwd=work, start_new_session=True)
        deadline, status = time.monotonic() + 120, ""
        while time.monotonic() < deadline:
            out = run_block(localise(watch, root), work)
            status = out.stdout + out.stderr
            found = re.search(r"cloud: online, state \w+, round (\d+)", status)
            if out.returncode == 0 and found and int(found.group(1)) >= 1 \
                    and "devices online: 2 of 2" in status:
                break
            time.sleep(3)
        logs = {p.name: p.read_text() for p in (root / "var" / "lib" / "safl").glob("*.log")}
        assert found and int(found.group(1)) >= 1, (status, logs)
        assert "hall-1" in status and "devices online: 2 of 2" in status, status
        for name, log in logs.items():
            assert "Traceback" not in log and "lost the broker" not in log, (name, log)
    finally:
        if dry is not None:
            try:
                os.killpg(dry.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            time.sleep(2)
        subprocess.run(["pkill", "-f", str(root)], capture_output=True)
        time.sleep(0.5)
        shutil.rmtree(root, ignore_errors=True)
