"""``safl broker``: the embedded amqtt broker, on loopback, for demos and development.

amqtt is pure Python (about 5x slower than Mosquitto, SPEC §6), speaks MQTT 3.1.1
only, and has no message size limit; use Mosquitto in production.
"""

from __future__ import annotations

import asyncio
import logging
import signal

from edge_client.errors import SaflError

__all__ = ["run_broker"]

log = logging.getLogger(__name__)


def _config(host: str, port: int) -> dict:
    return {
        "listeners": {"default": {"type": "tcp", "bind": f"{host}:{port}"}},
        "plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin":
                    {"allow_anonymous": True}},
    }


async def _serve(host: str, port: int) -> None:
    try:
        from amqtt.broker import Broker
    except ImportError as exc:
        raise SaflError("the embedded broker needs amqtt: pip install 'safl-edge[broker]'") from exc
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    broker = Broker(_config(host, port))
    quiet = logging.getLogger("amqtt")
    level, quiet.level = quiet.level, logging.CRITICAL  # it logs a traceback, then raises
    try:
        await broker.start()
        quiet.setLevel(level)
    except Exception as exc:  # amqtt wraps the OSError of a busy port in its BrokerError
        raise SaflError(f"cannot serve MQTT on {host}:{port}: {exc.__cause__ or exc} (is "
                        "the port taken? choose another with --port)") from exc
    log.warning("amqtt broker listening on mqtt://%s:%d (anonymous, loopback only)", host, port)
    await stop.wait()
    await broker.shutdown()


def run_broker(host: str = "127.0.0.1", port: int = 1883) -> int:
    """Serve until SIGTERM or SIGINT."""
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise SaflError(f"the embedded broker is anonymous and only binds loopback, not {host}")
    for noisy in ("amqtt", "transitions"):  # amqtt's state machine logs every transition
        logging.getLogger(noisy).setLevel(logging.WARNING)
    asyncio.run(_serve(host, port))
    return 0
