"""TLS that holds: one MQTT connection used by several threads of a role at once.

A role publishes from its own thread (updates, stats, a camera's predictions, summaries)
while the transport's network thread reads what arrives.  An ``ssl`` socket does not
survive a send on one thread beside a receive on another: the record layer corrupts
("decryption failed or bad record mac" at the broker), the connection drops, and the
process can die of heap corruption.  These tests drive exactly that traffic over a real
Mosquitto with client certificates and count what the broker and the transport saw.
"""

from __future__ import annotations

import shutil
import threading
import time

import numpy as np
import paho.mqtt.client as paho
import pytest
from brokers import Mosquitto, acl_lines, make_certs
from paho.mqtt.enums import CallbackAPIVersion

from edge_client import messages as m
from edge_client.config import BrokerConfig
from edge_client.documents import DeviceSummary
from edge_client.mqtt import MqttTransport
from edge_client.states import DeviceState
from edge_client.topics import topic_for

pytestmark = [pytest.mark.skipif(shutil.which("mosquitto") is None,
                                 reason="Mosquitto is installed by .ci/run"),
              pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")]

TLS_ERRORS = ("OpenSSL Error", "Protocol error", "bad record mac", "wrong version number")


@pytest.fixture
def tls_broker(tmp_path):
    certs = make_certs(tmp_path)
    # Errors and notices: a corrupted record shows as an OpenSSL error, the disconnect that
    # follows as a notice.
    server = Mosquitto(tmp_path, ["d0", "st0", "tester"], acl_lines("f", {"st0": ["d0"]}),
                       tls={"ca": certs["ca"], "cert": certs["server_cert"],
                            "key": certs["server_key"]}, log_types=("error", "notice"))
    yield server, certs
    server.stop()


def _config(server: Mosquitto, certs, user: str) -> BrokerConfig:
    return BrokerConfig(url=f"mqtts://127.0.0.1:{server.port}", username=user,
                        password=Mosquitto.PASSWORD, ca=str(certs["ca"]),
                        cert=str(certs["cert"]), key=str(certs["key"]), connect_timeout=5)


def _tls_errors(server: Mosquitto) -> list[str]:
    text = (server.folder / "mosquitto.log").read_text(errors="replace")
    return [line for line in text.splitlines() if any(e in line for e in TLS_ERRORS)]


def _bare(server: Mosquitto, certs, user: str, name: str) -> paho.Client:
    """A paho client in its own threaded mode (publishes only queue there): the flood of
    inbound traffic, and the counter of what arrived."""
    client = paho.Client(CallbackAPIVersion.VERSION2, client_id=name)
    client.username_pw_set(user, Mosquitto.PASSWORD)
    client.tls_set(ca_certs=str(certs["ca"]), certfile=str(certs["cert"]),
                   keyfile=str(certs["key"]))
    client.connect("127.0.0.1", server.port)
    client.loop_start()
    return client


def test_publishes_from_several_threads_while_messages_arrive_keep_tls_intact(tls_broker):
    """Four threads publish (QoS 1 frames and QoS 0 documents, as a camera device's updates
    and predictions) on one transport while a flood arrives on it.  Before the transport
    owned its socket from one thread, this broke the TLS session within a second or two."""
    server, certs = tls_broker
    station = MqttTransport(_config(server, certs, "st0"), client_id="st0", fleet="f")
    arrived = [0]
    station.subscribe_raw("safl/f/station/st0/flood", lambda _t, _p: arrived.__setitem__(
        0, arrived[0] + 1))
    station.connect()
    received: list[str] = []
    counter = _bare(server, certs, "tester", "counter")
    counter.on_message = lambda _c, _u, msg: received.append(msg.topic)
    counter.subscribe("safl/f/station/st0/#", qos=1)
    flood = _bare(server, certs, "tester", "flood")
    time.sleep(0.3)

    stop = threading.Event()
    sent = [0] * 4

    # An update of 25,000 weights (100 kB: the record layer needs several writes for it,
    # which leaves the reading thread time to interleave) and a stream of small documents.
    update = m.DeviceUpdate(fleet="f", sender="st0", round=0, iteration=0, station="st0",
                            weights=np.ones(25_000, np.float32), num_samples=32)

    def publisher(k: int) -> None:
        while not stop.is_set():
            if k % 2:
                station.publish(f"safl/f/station/st0/update/t{k}", update)
            else:
                station.publish_document(f"safl/f/station/st0/summary/t{k}", DeviceSummary(
                    device="d0", station="st0", state=DeviceState.READY, round=sent[k],
                    iteration=0), retain=False, qos=1)
            sent[k] += 1
            time.sleep(0.002)

    def flooder() -> None:
        payload = b"x" * 50_000
        while not stop.is_set():
            flood.publish("safl/f/station/st0/flood", payload, qos=1)
            time.sleep(0.002)

    threads = [threading.Thread(target=publisher, args=(k,)) for k in range(4)]
    threads.append(threading.Thread(target=flooder))
    for t in threads:
        t.start()
    deadline = time.monotonic() + 4.0
    while time.monotonic() < deadline:
        station.deliver()
        time.sleep(0.005)
    stop.set()
    for t in threads:
        t.join()
    station.close()
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and \
            sum("/flood" not in t for t in received) < sum(sent):
        time.sleep(0.1)
    counter.loop_stop()
    flood.loop_stop()

    log = (server.folder / "mosquitto.log").read_text(errors="replace").splitlines()
    assert _tls_errors(server) == [], "\n".join(log[-40:])  # which client, what came before
    assert station.counters["disconnects"] == 0
    assert station.counters["reconnects"] == 0
    assert arrived[0] > 100
    # Every QoS 1 publish reached a subscriber: nothing was lost on the way out.
    published = [t for t in received if "/flood" not in t]
    assert len(published) == sum(sent), (len(published), sum(sent))


def test_a_publish_from_another_thread_goes_out_at_once(tls_broker):
    """The socket's own thread sends what others publish without waiting for its select to
    time out: one round trip of a QoS 1 frame stays well below the loop's poll period."""
    server, certs = tls_broker
    device = MqttTransport(_config(server, certs, "d0"), client_id="d0", fleet="f")
    device.connect()
    arrived = threading.Event()
    counter = _bare(server, certs, "tester", "counter")
    counter.on_message = lambda _c, _u, _msg: arrived.set()
    counter.subscribe("safl/f/dev/d0/update", qos=1)
    time.sleep(0.3)
    waits = []
    for i in range(20):
        arrived.clear()
        msg = m.SkipNotice(fleet="f", sender="d0", round=0, iteration=i, station="st0",
                           gap=0.0)
        started = time.monotonic()
        device.publish(topic_for(msg), msg)
        assert arrived.wait(2.0)
        waits.append(time.monotonic() - started)
    device.close()
    counter.loop_stop()
    waits.sort()
    assert waits[len(waits) // 2] < 0.05, waits
