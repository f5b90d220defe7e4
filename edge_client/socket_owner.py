"""The one thread that may touch an MQTT connection's socket, and the outbox to it.

paho writes to the socket from whichever thread calls ``publish()`` when its own loop
thread is not used, and an ``ssl`` socket written on one thread while another reads it
corrupts its records ("bad record mac" at the broker, then heap corruption in the client:
paho.mqtt.python issues 722 and 891).  So every call into the paho client made by another
thread (a role's publishes, a camera's predictions, a late subscription) is handed to the
owning thread through the *outbox*, with a byte on a wake-up socket that the owner's
``select`` watches beside the broker's: publishes leave at once, and no lock is held
across the wait.
"""

from __future__ import annotations

import logging
import queue
import select
import socket
import ssl
import threading
from collections import Counter
from collections.abc import Callable

import paho.mqtt.client as paho

log = logging.getLogger(__name__)


class SocketOwner:
    """Who may call into one paho client now, and the calls waiting for that thread."""

    def __init__(self, name: str, counters: Counter[str]) -> None:
        self.name, self.counters = name, counters
        self._outbox: queue.SimpleQueue[Callable[[], object]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._owner: int | None = None

    def take(self) -> None:
        """The calling thread owns the socket from now on."""
        self._owner = threading.get_ident()

    def release(self) -> None:
        """Nobody owns it until the next :meth:`take`: calls wait in the outbox."""
        self._owner = None

    def submit(self, call: Callable[[], object]) -> None:
        """Run ``call`` now if this thread owns the socket, else hand it to the owner and
        wake it."""
        if self._owner == threading.get_ident():
            call()
            return
        self._outbox.put(call)
        try:
            self._wake_w.send(b"\0")
        except OSError:  # already woken (buffer full), or closed
            pass

    def drain(self) -> None:
        """Run the waiting calls, in the order they were submitted (owner only)."""
        while True:
            try:
                call = self._outbox.get_nowait()
            except queue.Empty:
                return
            try:
                call()
            except Exception:  # a refused publish must not stop the network thread
                self.counters["errors.publish"] += 1
                log.exception("%s could not hand a call to the broker", self.name)

    def turn(self, client: paho.Client, *, connected: threading.Event, timeout: float
             ) -> paho.MQTTErrorCode:
        """One turn of the network loop (owner only): wait for the broker's bytes, room to
        write or a call in the outbox; then read, run the calls, write, and keep the
        connection alive, in the order of paho's own ``loop()``.  Calls wait while the
        connection is down (``connected`` unset, read after this turn's bytes, so a CONNACK
        read now lets them out now): a publish then leaves after the reconnect, as paho's
        own queue would send it."""
        sock = client.socket()
        if sock is None:
            return paho.MQTT_ERR_NO_CONN
        # Bytes already decrypted and buffered inside an ssl socket do not wake select.
        pending = sock.pending() if isinstance(sock, ssl.SSLSocket) else 0
        try:
            readable, _, _ = select.select([sock, self._wake_r],
                                           [sock] if client.want_write() else [], [],
                                           0.0 if pending else timeout)
        except (OSError, ValueError, TypeError):  # the socket closed under us
            return paho.MQTT_ERR_CONN_LOST
        if self._wake_r in readable:
            try:
                self._wake_r.recv(4096)
            except BlockingIOError:
                pass
        if sock in readable or pending:
            rc = client.loop_read()
            if rc != paho.MQTT_ERR_SUCCESS or client.socket() is None:
                return rc or paho.MQTT_ERR_CONN_LOST
        if connected.is_set():
            self.drain()
        if client.want_write():
            rc = client.loop_write()
            if rc != paho.MQTT_ERR_SUCCESS:
                return rc
        return client.loop_misc()

    def close(self) -> None:
        self._wake_r.close()
        self._wake_w.close()
