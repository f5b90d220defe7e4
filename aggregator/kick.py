"""``safl provision --kick``: end a revoked participant's live sessions on every broker it
uses, with a ten-minute certificate of its own name minted by the fleet CA."""

from __future__ import annotations

import tempfile
from pathlib import Path

from edge_client.config import BrokerConfig
from edge_client.errors import ConfigError, SaflError
from edge_client.mqtt import MqttTransport

from .fleet_file import FleetFile, load_fleet_file
from .pki import issue, serial_of, write_crl
from .provision import ProvisionState

__all__ = ["kick"]


# A kick's certificate lives ten minutes and its key only in a temporary folder; its serial
# joins the CRL at once, so the next reload refuses it too.
_KICK_DAYS = 10 / (24 * 60)


def _brokers_of(fleet: FleetFile, user: str) -> list[str]:
    """Where ``user`` holds sessions: a device on its station's broker; a station on its own
    broker (the service) and on the cloud broker (its bridge)."""
    cloud = f"mqtts://{fleet.cloud_host}:{fleet.cloud_port}"
    for s in fleet.stations:
        if user == s.id:
            return [f"mqtts://{s.host}:{s.port}", cloud]
        if user in s.devices:
            return [f"mqtts://{s.host}:{s.port}"]
    return []


def kick(fleet_path: str | Path, out: str | Path, users: tuple[str, ...], *,
         timeout: float = 10.0) -> tuple[dict[str, list[str]], dict[str, str]]:
    """End the live sessions of revoked participants on every broker they use.

    A revoked certificate fails the handshake once a broker reloaded the CRL, but a
    connection opened before stays up.  With client ids bound to certificate names, the CA
    can end it: a short-lived certificate of the same name connects with a clean start,
    which makes the broker close the old connection and drop its session, and leaves at
    once.  Run it after the reload, or the revoked participant simply reconnects.  Returns
    the broker URLs where each user's session was ended, and the brokers that could not be
    reached with why.
    """
    fleet = load_fleet_file(fleet_path)
    out = Path(out).resolve()
    state = ProvisionState(out / "state.json")
    for user in users:
        if user not in state.doc["revoked"]:
            raise ConfigError("kick", f"{user!r} is not revoked: revoke it, reload the "
                              "brokers, then kick it")
    kicked: dict[str, list[str]] = {}
    failed: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        cert, key = Path(tmp) / "kick.pem", Path(tmp) / "kick.key"
        for user in users:
            issue(out / "ca", cert, key, user, days=_KICK_DAYS)
            state.doc["revoked_serials"].append(serial_of(cert))
            kicked[user] = []
            for url in _brokers_of(fleet, user):
                config = BrokerConfig(url=url, ca=str(out / "ca" / "ca.pem"), cert=str(cert),
                                      key=str(key), connect_timeout=timeout,
                                      handshake_timeout=min(5.0, timeout))
                transport = MqttTransport(config, client_id=user, fleet=fleet.name,
                                          persistent=False)
                try:
                    transport.connect()
                except SaflError as exc:
                    failed[url] = str(exc)
                    continue
                transport.close()
                kicked[user].append(url)
    write_crl(out / "ca", state.doc["revoked_serials"])
    state.save()
    return kicked, failed
