"""The one reconnect loop of an MQTT connection: jittered exponential backoff, and which
refusals of a broker no retry can cure."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
from paho.mqtt.reasoncodes import ReasonCode

from .config import BrokerConfig
from .errors import BrokerRefused, ConnectError

# CONNACK reason codes (MQTT 5; paho maps 3.1.1's return codes onto them) that no retry
# can cure: a client id refused, bad credentials, not authorised, banned, a bad
# authentication method.
REFUSED_FOR_GOOD = frozenset({0x85, 0x86, 0x87, 0x8A, 0x8C})
# Refusals a broker that binds client ids to identities gives a client connecting as
# someone else (or as no one): said as such, not as a bare reason code.
_IDENTITY_REFUSALS = frozenset({0x85, 0x87})


def backoff(config: BrokerConfig, jitter: np.random.Generator) -> Iterator[float]:
    """Pauses between connection attempts: doubling from ``backoff_min`` to
    ``backoff_max``, each drawn in 50-100% of that (jitter: a fleet that lost its broker
    does not come back at once), from this participant's own generator."""
    delay = config.backoff_min
    while True:
        yield delay * float(jitter.uniform(0.5, 1.0))
        delay = min(delay * 2, config.backoff_max)


def retry(attempt: Callable[[], bool], *, pauses: Iterator[float], stop: threading.Event,
          refused: Callable[[], ReasonCode | None], config: BrokerConfig, client_id: str,
          deadline: float | None = None) -> bool:
    """``attempt`` until it connects (True) or ``stop`` is set (False).  With a
    ``deadline`` (the first connection) it tries at once and gives up when the broker
    refuses for good (:class:`BrokerRefused`) or the next pause would pass the deadline
    (:class:`ConnectError`).  A running service that lost its broker pauses before each
    try, the first too (a fleet that lost its broker together must not come back
    together), and keeps trying (credentials may be fixed meanwhile)."""
    if deadline is None and stop.wait(next(pauses)):
        return False
    for pause in pauses:
        if attempt():
            return True
        code = refused()
        if deadline is not None and code is not None and code.value in REFUSED_FOR_GOOD:
            hint = ""
            if code.value in _IDENTITY_REFUSALS:
                hint = ("; a broker that binds client ids to identities refuses a client "
                        "id that is not the certificate's (or username's) name, and a "
                        "client with neither")
            raise BrokerRefused(f"{config.url} refused {client_id}: {code}{hint}")
        if deadline is not None and time.monotonic() + pause > deadline:
            raise ConnectError(f"cannot connect to {config.url} as {client_id} within "
                               f"{config.connect_timeout:.0f} s"
                               + (f" ({code})" if code else ""))
        if stop.wait(pause):
            return False
    return False  # pragma: no cover - the backoff never ends
