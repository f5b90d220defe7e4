"""Loopback ports for brokers a process starts and restarts: below the kernel's ephemeral
range, and waited for until the broker listens (tests/brokers.py, lab/fleet_load.py)."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import numpy as np

__all__ = ["ephemeral_low", "free_port", "wait_for_port"]

_GIVEN: set[int] = set()


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default where unreadable)."""
    with contextlib.suppress(OSError, ValueError):
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    return 32768


def free_port() -> int:
    """A free loopback port below the kernel's ephemeral range.  A port from bind(0) is in
    that range, and a broker restarted on it found it taken once in 40 runs ("Address
    already in use"): while the broker is down, any process asking for an ephemeral port
    (paho's wake-up socket pair listens on one at each reconnect) may be handed it."""
    low = ephemeral_low()
    below = range(max(1024, low - 12000), low)
    if len(below) < 1000:  # the ephemeral range starts near 1024: take what bind(0) gives
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    # Each process draws its own ports (seeded from it): two test workers must not collide.
    rng = np.random.default_rng([os.getpid(), time.monotonic_ns()])
    for port in (int(p) for p in rng.choice(below, size=min(200, len(below)), replace=False)):
        if port in _GIVEN:  # not bound yet by whoever asked for it
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            _GIVEN.add(port)
            return port
    raise RuntimeError(f"no free port below the ephemeral range ({low})")


def wait_for_port(port: int, proc: subprocess.Popen, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            # Who holds the port, when that is why (a broker restarted on its port).
            held = subprocess.run(["ss", "-tanpe", f"sport = :{port}"], capture_output=True,
                                  text=True).stdout if shutil.which("ss") else ""
            raise RuntimeError(f"broker exited with {proc.returncode}; port {port}: {held}")
        if _listening(port):
            return
        time.sleep(0.05)
    raise RuntimeError(f"broker did not listen on {port} within {timeout} s")


def _listening(port: int) -> bool:
    """Whether a socket listens on ``port``, read from the kernel's table where it can be, so
    that nothing connects: a probe that connected and hung up was, to a TLS broker, a client
    that closed in its handshake ("unexpected eof while reading", a protocol error), which
    the TLS tests count as a broken record (seen in 2 of 4 clean-clone runs beside the
    camera tests).  Elsewhere, a connection."""
    wanted, read = f":{port:04X}", False
    for table in (Path("/proc/net/tcp"), Path("/proc/net/tcp6")):
        with contextlib.suppress(OSError):
            rows = [line.split() for line in table.read_text().splitlines()[1:]]
            read = True
            if any(r[1].endswith(wanted) and r[3] == "0A" for r in rows):  # TCP_LISTEN
                return True
    if read:
        return False
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False
