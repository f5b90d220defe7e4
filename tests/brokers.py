"""Real brokers for tests: Mosquitto with a generated password file and ACL, and amqtt.

Each broker runs as its own process on a free loopback port and is stopped by the fixture.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from lab.ports import ephemeral_low, free_port, wait_for_port

# The ports are lab.ports' (the load fleet restarts brokers on them too); the brokers below.
__all__ = ["ephemeral_low", "free_port", "wait_for_port", "acl_lines", "fleet_mosquitto",
           "Mosquitto", "Amqtt", "make_certs"]


def acl_lines(fleet: str, stations: dict[str, list[str]]) -> list[str]:
    """Each device writes only its own dev/<id>/ tree and reads only its station's topics."""
    root = f"safl/{fleet}"
    lines = ["user cloud", f"topic readwrite {root}/#", ""]
    for sid, devices in stations.items():
        lines += [f"user {sid}", f"topic readwrite {root}/station/{sid}/#",
                  f"topic read {root}/dev/#", f"topic read {root}/cloud/#", ""]
        for did in devices:
            lines += [f"user {did}", f"topic readwrite {root}/dev/{did}/#",
                      f"topic read {root}/station/{sid}/#", ""]
    lines += ["user tester", "topic readwrite #", ""]
    return lines


def fleet_mosquitto(folder: Path, plan: Any, *, extra_users: tuple[str, ...] = ("tester",),
                    **options: Any) -> Mosquitto:
    """A Mosquitto for a planned fleet (``lab.simulation.plan_fleet``): a login for every
    participant and ``extra_users``, the fleet's ACL, and :class:`Mosquitto`'s ``options``."""
    stations = {s["station_id"]: list(s["devices"]) for s in plan.stations}
    users = ["cloud", *extra_users, *stations, *(d for ds in stations.values() for d in ds)]
    return Mosquitto(folder, users, acl_lines(plan.fleet, stations), **options)


class _BrokerProcess:
    port: int
    proc: subprocess.Popen
    log: object

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


class Mosquitto(_BrokerProcess):
    """A Mosquitto process with password authentication and an ACL."""

    PASSWORD = "secret"

    def __init__(self, folder: Path, users: list[str], acl: list[str], *,
                 message_size_limit: int = 0, tls: dict[str, Path] | None = None,
                 persistence: bool = False, log_types: tuple[str, ...] = ("error",)) -> None:
        self.folder, self.port = Path(folder), free_port()
        passwd, aclfile, conf = (self.folder / n for n in ("passwd", "acl", "mosquitto.conf"))
        passwd.write_text("")
        for user in users:
            subprocess.run(["mosquitto_passwd", "-b", str(passwd), user, self.PASSWORD],
                           check=True, capture_output=True)
        aclfile.write_text("\n".join(acl) + "\n")
        lines = [f"listener {self.port} 127.0.0.1", "allow_anonymous false",
                 f"password_file {passwd}", f"acl_file {aclfile}",
                 f"persistence {'true' if persistence else 'false'}",
                 f"persistence_location {self.folder}/",
                 "max_queued_messages 10000", "set_tcp_nodelay true", "log_dest stderr",
                 *(f"log_type {t}" for t in log_types)]
        if os.geteuid() == 0:
            lines.append("user root")  # else it drops to 'mosquitto' and cannot read tmp files
        if message_size_limit:
            lines.append(f"message_size_limit {message_size_limit}")
        if tls:
            lines += [f"cafile {tls['ca']}", f"certfile {tls['cert']}",
                      f"keyfile {tls['key']}", "require_certificate true"]
        conf.write_text("\n".join(lines) + "\n")
        self.conf = conf
        self.start()

    def start(self) -> None:
        """(Re)start the broker on the same port with the same files."""
        self.log = open(self.folder / "mosquitto.log", "a")
        self.proc = subprocess.Popen([shutil.which("mosquitto") or "mosquitto", "-c",
                                      str(self.conf)], stdout=self.log, stderr=subprocess.STDOUT)
        wait_for_port(self.port, self.proc)


class Amqtt(_BrokerProcess):
    """The embedded amqtt broker as `safl broker` runs it."""

    def __init__(self, folder: Path) -> None:
        self.port = free_port()
        self.log = open(Path(folder) / "amqtt.log", "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "safl", "broker",
                                      "--port", str(self.port)],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        wait_for_port(self.port, self.proc, timeout=30)


def make_certs(folder: Path) -> dict[str, Path]:
    """A throw-away CA, a server certificate for 127.0.0.1 and a client certificate."""
    folder = Path(folder)

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=folder)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=test-ca",
        "-keyout", "ca.key", "-out", "ca.pem")
    (folder / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        run("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout",
            f"{name}.key", "-out", f"{name}.csr")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "2", "-out", f"{name}.pem",
            *(["-extfile", "san.ext"] if name == "server" else []))
    return {k: folder / v for k, v in (("ca", "ca.pem"), ("server_cert", "server.pem"),
                                       ("server_key", "server.key"), ("cert", "client.pem"),
                                       ("key", "client.key"))}
