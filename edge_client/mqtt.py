"""The MQTT transport (paho-mqtt 2.x): the same interface as the in-process bus.

QoS 1 with persistent sessions, MQTT 5 where the broker speaks it (else 3.1.1), reconnects
with jittered exponential backoff inside the transport, a retained presence per participant
with a Last Will saying offline, and the wire codec with chunking.  Inbound frames are queued
by the network thread and admitted (:class:`~edge_client.admission.Admission`) in
:meth:`deliver` on the caller's thread, so roles stay single-threaded.  No frame and no
handler error stops the service: each is counted by reason.  The socket belongs to one thread
at a time (:class:`~edge_client.socket_owner.SocketOwner`): the caller's while it connects,
the network thread's after.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from . import messages as m
from .admission import Admission
from .codec import encode, stream
from .config import BrokerConfig
from .documents import Document, decode_document, encode_document
from .errors import BrokerRefused, ConfigError, ConnectError, MessageError
from .metrics import count_published
from .reconnect import REFUSED_FOR_GOOD, backoff, retry
from .socket_owner import SocketOwner
from .tls import broker_identity, check_pair
from .topics import Routes, is_document_topic, topic_for

__all__ = ["MqttTransport", "ConnectError", "BrokerRefused", "REFUSED_FOR_GOOD"]

log = logging.getLogger(__name__)

Handler = Callable[[str, m.Message], None]
DocumentHandler = Callable[[str, Document], None]
RawHandler = Callable[[str, bytes], None]
# Seconds one deliver() admits frames for: a flood it cannot keep up with must not starve ticks.
DELIVER_BUDGET_S = 0.25


class MqttTransport:
    """One MQTT connection for one role.

    Parameters
    ----------
    config : BrokerConfig
    client_id : str
        Stable id: the broker keeps the persistent session under it.  Where the client
        certificate is the identity (``tls.broker_identity``), the transport connects with
        exactly the certificate's name instead: provisioned brokers bind the two, so that
        nobody can take over another participant's session.
    fleet, layout_hash : str
        Frames of another fleet or model layout are refused.
    presence : Presence, optional
        This participant's online status; its offline twin becomes the Last Will.
    num_params : int
        Length of every weights vector admitted (0: not checked).
    persistent : bool
        Keep a session on the broker across disconnects (a role); an observer such as
        ``safl status`` leaves none behind.
    jitter : numpy.random.Generator, optional
        Draws the reconnect pauses; by default one seeded from ``client_id``, so that each
        participant's pauses are its own and repeat from run to run.
    """

    def __init__(self, config: BrokerConfig, *, client_id: str, fleet: str,
                 layout_hash: str = "", presence: m.Presence | None = None,
                 num_params: int = 0, clock: Callable[[], float] = time.monotonic,
                 persistent: bool = True, jitter: np.random.Generator | None = None) -> None:
        if config.cert:
            check_pair(config.ca, config.cert, config.key)  # refuse bad files before connecting
        identity = broker_identity(config)
        if identity and presence is not None and presence.sender != identity:
            # The ACL would confine it to that identity's topics: every message lost, silently.
            raise ConfigError("cert", f"the broker knows this connection as {identity!r}, but it "
                              f"speaks for {presence.sender!r}")
        if identity and identity != client_id:
            log.info("%s connects as %s, the identity its broker knows it by", client_id, identity)
        client_id = identity or client_id
        self.config, self.client_id, self.fleet, self.persistent = config, client_id, fleet, \
            persistent
        self.layout_hash, self.presence, self.clock = layout_hash, presence, clock
        self._jitter = jitter if jitter is not None else np.random.default_rng(
            zlib.crc32(client_id.encode()))
        self.counters: Counter[str] = Counter()
        self._subs: Routes[Handler] = Routes()
        self._doc_subs: Routes[DocumentHandler] = Routes()
        self._raw_subs: Routes[RawHandler] = Routes()
        self._inbox: queue.SimpleQueue[tuple[str, bytes, float]] = queue.SimpleQueue()
        self.arrived_at = 0.0  # monotonic: when the frame being delivered came off the socket
        self._socket = SocketOwner(client_id, self.counters)
        self.admission = Admission(fleet=fleet, layout_hash=layout_hash, num_params=num_params,
                                   max_message=config.max_message,
                                   reassembly_memory=config.reassembly_memory,
                                   chunk_timeout=config.chunk_timeout, owner=client_id,
                                   counters=self.counters, seen_ids=config.dedupe_window)
        self._connected, self._arrived, self._stop = (threading.Event() for _ in range(3))
        self._refused: ReasonCode | None = None
        self._thread: threading.Thread | None = None
        self._last_info: paho.MQTTMessageInfo | None = None
        self._closing = False  # close() began: a disconnect now is ours, not lost
        self._v5 = config.protocol in ("auto", "5")
        self._client = self._make_client()

    # -- connection ----------------------------------------------------------------------
    def _make_client(self) -> paho.Client:
        cfg = self.config
        client = paho.Client(CallbackAPIVersion.VERSION2, client_id=self.client_id,
                             protocol=paho.MQTTv5 if self._v5 else paho.MQTTv311,
                             clean_session=None if self._v5 else not self.persistent,
                             reconnect_on_failure=False)
        if cfg.username:
            client.username_pw_set(cfg.username, cfg.password or None)
        if cfg.tls:
            client.tls_set(ca_certs=cfg.ca or None, certfile=cfg.cert or None,
                           keyfile=cfg.key or None)
        self._set_will(client)
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_message = self._on_message
        client.max_queued_messages_set(0)
        return client

    def _on_connect(self, client: paho.Client, userdata: Any, flags: Any,
                    reason_code: ReasonCode, properties: Any) -> None:
        sock = client.socket()
        if isinstance(sock, socket.socket):  # TLS sockets are socket.socket too
            # paho leaves Nagle on: back-to-back small frames (stats, then the update) would
            # wait for the broker's delayed ACK, about 40 ms a hop.
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if reason_code.is_failure:
            self._refused = reason_code
            log.error("broker refused %s: %s", self.client_id, reason_code)
            return
        self._refused = None
        for topic_filter in self._subs.filters() | self._doc_subs.filters() \
                | self._raw_subs.filters():
            client.subscribe(topic_filter, qos=1)
        if self.presence is not None:
            client.publish(topic_for(self.presence), self._presence_frame(online=True), qos=1,
                           retain=True)
        self._connected.set()
        log.info("%s connected (MQTT %s)", self.client_id, "5" if self._v5 else "3.1.1")

    def _on_disconnect(self, client: paho.Client, userdata: Any, flags: Any,
                       reason_code: ReasonCode, properties: Any) -> None:
        if self._connected.is_set() and not self._closing:
            self.counters["disconnects"] += 1
            log.warning("%s lost the broker: %s", self.client_id, reason_code)
        self._connected.clear()

    def _on_message(self, client: paho.Client, userdata: Any, msg: paho.MQTTMessage) -> None:
        self._inbox.put((msg.topic, bytes(msg.payload), time.monotonic()))
        self._arrived.set()

    def wait(self, timeout: float) -> None:
        """Block until a frame arrives or ``timeout`` passes (an idle service sleeps here)."""
        self._arrived.wait(timeout)

    def _try_connect(self) -> bool:
        host, port = self.config.host_port
        try:
            if self._v5:
                props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
                props.SessionExpiryInterval = self.config.session_expiry if self.persistent else 0
                self._client.connect(host, port, self.config.keepalive,
                                     clean_start=not self.persistent, properties=props)
            else:
                self._client.connect(host, port, self.config.keepalive)
        except (OSError, ValueError) as exc:
            log.warning("%s cannot reach %s: %s", self.client_id, self.config.url, exc)
            return False
        deadline = time.monotonic() + self.config.handshake_timeout
        while time.monotonic() < deadline and not self._connected.is_set():
            if self._pump(0.1) != paho.MQTT_ERR_SUCCESS or self._refused:
                break
        if not self._connected.is_set() and self._v5 and self.config.protocol == "auto":
            # A 3.1.1-only broker (amqtt) refuses or drops an MQTT 5 CONNECT.
            log.info("%s: no MQTT 5 from %s, trying 3.1.1", self.client_id, self.config.url)
            self._v5 = False
            self._client = self._make_client()
            self._refused = None
            return self._try_connect()
        return self._connected.is_set()

    def _backoff(self) -> Iterator[float]:
        return backoff(self.config, self._jitter)

    def _retry(self, attempt: Callable[[], bool], deadline: float | None = None) -> bool:
        """The one reconnect loop (:func:`~edge_client.reconnect.retry`)."""
        return retry(attempt, pauses=self._backoff(), stop=self._stop,
                     refused=lambda: self._refused, config=self.config,
                     client_id=self.client_id, deadline=deadline)

    def connect(self) -> None:
        """Connect (retrying with backoff until ``connect_timeout``) and start the network loop.

        The caller's thread owns the socket until the network thread takes it over; calls
        from other threads meanwhile wait in the outbox."""
        self._socket.take()
        try:
            self._retry(self._try_connect,
                        deadline=time.monotonic() + self.config.connect_timeout)
        finally:
            self._socket.release()
        self._thread = threading.Thread(target=self._network_loop, daemon=True,
                                        name=f"mqtt-{self.client_id}")
        self._thread.start()

    def _set_will(self, client: paho.Client) -> None:
        """A will frame of its own a connection: a peer that took one will (a broker restart
        fires them all) dropped the next of the same frame as a duplicate, silently."""
        if self.presence is not None:
            client.will_set(topic_for(self.presence), self._presence_frame(online=False),
                            qos=1, retain=True)

    def _try_reconnect(self) -> bool:
        self.counters["reconnects"] += 1
        self._set_will(self._client)
        try:
            self._client.reconnect()
        except (OSError, ValueError) as exc:
            log.warning("%s reconnect failed: %s", self.client_id, exc)
            return False
        deadline = time.monotonic() + self.config.handshake_timeout
        while not self._connected.is_set() and time.monotonic() < deadline:
            if self._pump(0.1) != paho.MQTT_ERR_SUCCESS:
                break
        return self._connected.is_set()

    def _network_loop(self) -> None:
        self._socket.take()
        while not self._stop.is_set():
            if self._pump(0.2) == paho.MQTT_ERR_SUCCESS and self._connected.is_set():
                continue
            self._connected.clear()
            if not self._retry(self._try_reconnect):
                break
        self._socket.drain()  # what close() handed over last (the offline presence)
        self._client.disconnect()

    def _pump(self, timeout: float) -> paho.MQTTErrorCode:
        return self._socket.turn(self._client, connected=self._connected, timeout=timeout)

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    # -- the transport interface ------------------------------------------------------
    def _add_subscription(self, subs: Routes[Any], topic_filter: str, handler: Any) -> None:
        subs.add(topic_filter, handler)
        if self._connected.is_set():  # else _on_connect subscribes it
            self._socket.submit(lambda: self._client.subscribe(topic_filter, qos=1))

    def subscribe(self, topic_filter: str, handler: Handler) -> None:
        self._add_subscription(self._subs, topic_filter, handler)

    def subscribe_documents(self, topic_filter: str, handler: DocumentHandler) -> None:
        """Deliver the JSON documents (``documents.py``) published under ``topic_filter``."""
        self._add_subscription(self._doc_subs, topic_filter, handler)

    def subscribe_raw(self, topic_filter: str, handler: RawHandler) -> None:
        """Deliver the payloads published under ``topic_filter`` as they are: another
        system's messages (the line's labels), which the handler parses and bounds."""
        self._add_subscription(self._raw_subs, topic_filter, handler)

    def publish(self, topic: str, message: m.Message) -> None:
        retain = isinstance(message, m.Presence)
        parts = list(stream(message, chunk_size=self.config.chunk_size, fp16=self.config.fp16,
                            layout_hash=self.layout_hash, wire_version=self.config.wire_version))
        count_published(self.counters, message, sum(len(part) for part in parts))
        self._socket.submit(lambda: self._send(topic, parts, qos=1, retain=retain))

    def publish_raw(self, topic: str, payload: bytes, *, qos: int = 1,
                    retain: bool = False) -> None:
        """Publish bytes as they are (another system's format, such as the line's labels)."""
        self._socket.submit(lambda: self._send(topic, [payload], qos=qos, retain=retain))

    def _send(self, topic: str, parts: list[bytes], *, qos: int, retain: bool) -> None:
        """On the socket's thread: the parts of one message, back to back."""
        for part in parts:
            info = self._client.publish(topic, part, qos=qos, retain=retain)
            if qos:
                self._last_info = info  # what close() waits for

    def _presence_frame(self, *, online: bool, final: bool = False) -> bytes:
        """This participant's presence (or its Last Will), in its wire version and without
        a layout: anyone may read it, whatever model it runs."""
        p = self.presence
        if p is None:
            raise ValueError(f"{self.client_id} has no presence to publish")
        if not online:
            p = m.Presence(fleet=p.fleet, sender=p.sender, round=0, iteration=0, role=p.role,
                           online=False, final=final)
        return encode(p, wire_version=self.config.wire_version)

    def publish_document(self, topic: str, doc: Document, *, retain: bool = True,
                         qos: int = 1) -> None:
        """Publish a JSON document: retained (a manifest, a summary for ``safl status``), or
        a stream of them at QoS 0 (predictions: the next one supersedes a lost one)."""
        payload = encode_document(doc)
        self._socket.submit(lambda: self._send(topic, [payload], qos=qos, retain=retain))

    def deliver(self) -> int:
        """Admit queued frames for up to ``DELIVER_BUDGET_S`` and call their handlers;
        returns how many were delivered (frames left wake the next wait at once)."""
        delivered, end = 0, time.monotonic() + DELIVER_BUDGET_S
        self._arrived.clear()
        now = self.clock()
        self.admission.expire(now)
        while time.monotonic() < end:
            try:
                topic, payload, self.arrived_at = self._inbox.get_nowait()
            except queue.Empty:
                return delivered
            raw = self._raw_subs.handlers(topic)
            if raw:
                self._dispatch(raw, topic, payload)
                delivered += 1
                continue
            if is_document_topic(topic):
                delivered += self._deliver_document(topic, payload)
                continue
            message = self.admission.admit(topic, payload, now)
            if message is None:
                continue
            self._dispatch(self._subs.handlers(topic), topic, message)
            delivered += 1
        self._arrived.set()
        return delivered

    def _dispatch(self, handlers: list[Any], topic: str, item: m.Message | Document | bytes
                  ) -> None:
        for handler in handlers:
            try:
                handler(topic, item)
            except Exception:  # a handler bug must not stop the service
                self.counters["rejected.internal"] += 1
                log.exception("handler failed on %s", topic)

    def _deliver_document(self, topic: str, payload: bytes) -> int:
        handlers = self._doc_subs.handlers(topic)
        if not handlers or not payload:  # an empty retained payload clears a document
            return 0
        try:
            doc = decode_document(payload)
        except MessageError as exc:
            self.counters["rejected.document"] += 1
            log.warning("%s dropped a document on %s: %s", self.client_id, topic, exc)
            return 0
        self._dispatch(handlers, topic, doc)
        return 1

    def close(self, final: bool = False) -> None:
        """Flush what was published, say offline (retained; ``final`` where this
        participant's part of the federation is over), disconnect, stop the thread."""
        self._closing = True
        flushed = threading.Event()
        sent: list[paho.MQTTMessageInfo | None] = []

        def say_offline() -> None:  # on the socket's thread, after every earlier call
            sent.append(self._last_info)
            if self.presence is not None and self._connected.is_set():
                sent.append(self._client.publish(topic_for(self.presence), self._presence_frame(
                    online=False, final=final), qos=1, retain=True))
            flushed.set()
        self._socket.submit(say_offline)
        if self._connected.is_set():
            flushed.wait(self.config.close_timeout)
        for info, timeout in zip(sent, (self.config.close_timeout, 2.0), strict=False):
            if info is None:
                continue
            try:
                info.wait_for_publish(timeout=timeout)
            except (RuntimeError, ValueError):
                log.warning("%s closed with unacknowledged messages", self.client_id)
        self._stop.set()
        self._socket.submit(lambda: None)  # wake the network thread out of its select
        if self._thread is not None:
            self._thread.join(timeout=3.0)
        else:
            self._client.disconnect()
        self._socket.close()
