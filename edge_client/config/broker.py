"""``BrokerConfig``: the ``[broker]`` table, how a role reaches MQTT."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ..codec import WIRE_VERSION, WIRE_VERSIONS
from ..errors import ConfigError
from .loading import check_range

__all__ = ["BrokerConfig"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class BrokerConfig:
    """How a role reaches its MQTT broker (the ``[broker]`` table).

    ``url`` is ``mqtt://host:port`` (or ``mqtts://`` with TLS). ``protocol`` is
    ``auto`` (MQTT 5, falling back to 3.1.1), ``5`` or ``3.1.1``.
    """

    url: str = "mqtt://127.0.0.1:1883"
    # Login where the broker uses passwords (provisioned brokers: the certificate).
    username: str = ""
    password: str = ""  # its password; prefer SAFL_BROKER_PASSWORD to writing it here
    ca: str = ""  # CA bundle that signed the broker's certificate (TLS)
    cert: str = ""  # this participant's client certificate: its identity on a provisioned broker
    key: str = ""  # the certificate's private key (0600)
    protocol: str = "auto"
    keepalive: int = 30  # seconds between pings; a silent peer is dropped after 1.5x
    session_expiry: int = 3600  # seconds the broker keeps a disconnected session (MQTT 5)
    chunk_size: int = 256 * 1024  # bytes per MQTT packet of a chunked frame
    max_message: int = 64 * 1024 * 1024  # largest reassembled frame accepted
    reassembly_memory: int = 256 * 1024 * 1024  # bytes of chunks held awaiting their frames
    chunk_timeout: float = 60.0  # seconds a partial frame waits for its chunks
    dedupe_window: int = 8192  # message ids remembered for exactly-once delivery
    handshake_timeout: float = 5.0  # seconds one CONNECT may take to be answered
    close_timeout: float = 10.0  # seconds to flush what was published before disconnecting
    fp16: bool = False  # send weights as float16 (half the bytes)
    # The frame format this role writes: 1 while receivers older than wire version 2 remain
    # (every receiver reads both); see docs/protocol.md.
    wire_version: int = WIRE_VERSION
    connect_timeout: float = 30.0  # seconds to reach the broker at start-up before giving up
    backoff_min: float = 0.5  # seconds before the first reconnect attempt (doubles, with jitter)
    backoff_max: float = 30.0  # longest pause between reconnect attempts

    @property
    def host_port(self) -> tuple[str, int]:
        rest = self.url.split("://", 1)[1]
        host, _, port = rest.rstrip("/").rpartition(":")
        return host.strip("[]"), int(port)

    @property
    def tls(self) -> bool:
        return self.url.startswith("mqtts://") or bool(self.ca)

    def __post_init__(self) -> None:
        scheme = self.url.split("://", 1)[0] if "://" in self.url else ""
        if scheme not in ("mqtt", "mqtts"):
            raise ConfigError("url", f"must look like mqtt://host:port, got {self.url!r}")
        try:
            host, port = self.host_port
        except ValueError as exc:
            raise ConfigError("url", f"needs a host and a numeric port: {self.url!r}") from exc
        if not host or not 0 < port < 65536:
            raise ConfigError("url", f"needs a host and a port in 1..65535: {self.url!r}")
        if self.protocol not in ("auto", "5", "3.1.1"):
            raise ConfigError("protocol", "must be 'auto', '5' or '3.1.1'")
        if bool(self.cert) != bool(self.key):
            raise ConfigError("cert", "a client certificate needs its key, and the reverse")
        for key in ("ca", "cert", "key"):
            if getattr(self, key) and not Path(getattr(self, key)).is_file():
                raise ConfigError(key, f"file {getattr(self, key)} does not exist")
        if self.wire_version not in WIRE_VERSIONS:
            raise ConfigError("wire_version", f"must be one of {WIRE_VERSIONS}, got "
                              f"{self.wire_version!r}")
        check_range("keepalive", self.keepalive, 5)
        check_range("chunk_size", self.chunk_size, 1024)
        check_range("max_message", self.max_message, self.chunk_size)
        check_range("reassembly_memory", self.reassembly_memory, self.chunk_size)
        check_range("chunk_timeout", self.chunk_timeout, 0, low_open=True)
        check_range("dedupe_window", self.dedupe_window, 1)
        check_range("handshake_timeout", self.handshake_timeout, 0, low_open=True)
        check_range("close_timeout", self.close_timeout, 0)
        check_range("connect_timeout", self.connect_timeout, 0, low_open=True)
        check_range("backoff_min", self.backoff_min, 0, low_open=True)
        check_range("backoff_max", self.backoff_max, self.backoff_min)
