"""The live monitor: its history of the fleet, its HTTP answers to good and bad requests,
and its page rendered by a real browser (headless Chromium) over a real fleet."""

from __future__ import annotations

import dataclasses
import http.client
import json
import shutil
import socket
import subprocess
import threading
import time
from collections import Counter

import numpy as np
import pytest

from aggregator.monitor import MAX_CLIENTS, FleetHistory, MonitorServer
from edge_client import messages as m
from edge_client.documents import CloudSummary, DeviceSummary, StationSummary
from edge_client.runner import StopFlag
from edge_client.states import CloudState, DeviceState, StationState


def _history() -> FleetHistory:
    clock = iter(np.arange(0.0, 1000.0, 1.5))
    history = FleetHistory("f", clock=lambda: float(next(clock)))
    st = history.status
    st.presence[(m.Participant.DEVICE, "d0")] = True
    st.presence[(m.Participant.DEVICE, "d1")] = False
    st.presence[(m.Participant.STATION, "st0")] = True
    for k in range(1, 4):
        for doc in (
                DeviceSummary(device="d0", station="st0", state=DeviceState.READY, round=k,
                              iteration=3 * k, local_accuracy=0.2 * k, counters={"uploads": k},
                              transport={"bytes_out": 1000 * k, "bytes_in": 4000 * k},
                              source={"frames_dropped": 2, "label_joined": 7 * k,
                                      "label_unmatched": 1, "label_expired": k},
                              label_lag=0.8, label_lag_estimate=0.85, body_ms_per_frame=3.5),
                StationSummary(station="st0", state=StationState.COLLECTING, round=k,
                               iteration=3 * k, devices=2, online=1, quorum=1,
                               counters={"received_updates": 5, "rejected.update_norm": 1},
                               device_refused={"d1": 1}, device_clipped={"d0": k}),
                CloudSummary(state=CloudState.COLLECTING, round=k, iteration=3 * k,
                             stations=("st0",), accuracy=0.3 + 0.1 * k,
                             accuracy_rounds=tuple(range(1, k + 1)),
                             accuracies=tuple(0.3 + 0.1 * r for r in range(1, k + 1)))):
            st.take(doc)
            history.take(doc)
    return history


def _row(doc: dict, did: str) -> dict:
    return next(r for r in doc["devices"] if r["id"] == did)


def test_the_history_keeps_each_series_and_the_tables():
    doc = _history().snapshot(Counter())
    assert [(r, round(a, 6)) for r, a in doc["global_accuracy"]] == [(1, 0.4), (2, 0.5),
                                                                     (3, 0.6)]
    assert [p[1] for p in doc["device_accuracy"]["d0"]] == pytest.approx([0.2, 0.4, 0.6])
    d1, d0 = doc["devices"]  # the offline one first
    assert (d0["presence"], d0["uploads"], d0["clipped"], d0["frames_dropped"]) == \
        (True, 3, 3, 2)
    # The line's labels as the device counted them: joined, unmatched, expired.
    assert (d0["label_joined"], d0["label_unmatched"], d0["label_expired"]) == (21, 1, 3)
    # How late its frames come and what its body costs a frame (sources.md, bodies.md).
    assert (d0["label_lag"], d0["label_lag_estimate"], d0["body_ms_per_frame"]) == \
        (0.8, 0.85, 3.5)
    assert (d1["id"], d1["presence"]) == ("d1", False)  # seen only by its presence
    (st0,) = doc["stations"]
    assert (st0["presence"], st0["online"], st0["uploads"], st0["refused"]) == (True, 1, 5, 1)
    sent = [p[1] for p in doc["traffic"]]
    assert sent == sorted(sent) and sent[-1] == 3000
    json.dumps(doc)  # the page's JSON


def test_each_roles_last_error_reaches_the_page():
    history = _history()
    for doc in (StationSummary(station="st0", state=StationState.COLLECTING, round=4,
                               iteration=12, devices=2, online=1, quorum=1,
                               error="rejected.internal: KeyError: 'x'"),
                DeviceSummary(device="d0", station="st0", state=DeviceState.READY, round=4,
                              iteration=12, error="errors.tick: OSError: disk full"),
                CloudSummary(state=CloudState.COLLECTING, round=4, iteration=12,
                             stations=("st0",), error="errors.observer: ShapeError: eval")):
        history.status.take(doc)
        history.take(doc)
    doc = history.snapshot(Counter())
    assert doc["cloud"]["error"] == "errors.observer: ShapeError: eval"
    assert doc["stations"][0]["error"] == "rejected.internal: KeyError: 'x'"
    assert _row(doc, "d0")["error"] == "errors.tick: OSError: disk full"
    from aggregator.monitor_page import SCRIPT
    assert "'ERROR ' + who" in SCRIPT and "c.error" in SCRIPT


@pytest.mark.parametrize("error, accepted", [
    ("x" * 300, True), ("x" * 301, False),  # at the bound, and one past it
    ("errors.tick: \x1b[2J\x1b[Hall is well", False), ("two\nlines", False)])
def test_a_summarys_error_is_one_printable_line_of_bounded_length(error, accepted):
    """A device's ``error`` reaches operators' terminals (``safl status``) and pages: a
    hostile one may not clear a screen, forge lines or fill it."""
    from edge_client.documents import decode_document, encode_document
    from edge_client.errors import MessageError

    payload = encode_document(DeviceSummary(device="d0", station="st0",
                                            state=DeviceState.READY, round=1, iteration=1,
                                            error=error))
    if accepted:
        assert decode_document(payload).error == error
    else:
        with pytest.raises(MessageError, match="'error' must be one printable line"):
            decode_document(payload)


def test_a_roles_own_error_is_kept_as_one_printable_line():
    from edge_client.runner import RoleRunner
    from edge_client.transport import LocalBus

    class Role:
        counters = Counter()

        def subscriptions(self):
            return []

        def tick(self, now):
            raise ValueError("first\nsecond \x1b[2J" + "y" * 400)

    runner = RoleRunner(Role(), LocalBus())
    runner.tick()
    assert runner.last_error.startswith("errors.tick: ValueError: first second  ")
    assert len(runner.last_error) == 300 and runner.last_error.isprintable()


def test_what_devices_claim_is_checked_before_it_is_shown(monkeypatch):
    from aggregator import monitor
    from aggregator.status import _from_its_subject

    history = _history()
    liar = DeviceSummary(device="d0", station="st0", state=DeviceState.READY, round=4,
                         iteration=12, local_accuracy=5.0, prequential_accuracy=-1.0)
    history.status.take(liar)
    history.take(liar)
    doc = history.snapshot(Counter())
    assert _row(doc, "d0")["local_accuracy"] is None  # shown as not measured, and counted
    assert doc["monitor"]["fleet.implausible_local_accuracy"] == 1
    assert doc["monitor"]["fleet.implausible_prequential_accuracy"] == 1
    # Lags on their bound are shown, one past it not; a body time may not be negative.
    from edge_client.config.sources import MAX_LABEL_LAG
    on_bound = dataclasses.replace(liar, label_lag=MAX_LABEL_LAG, label_lag_estimate=0.0,
                                   body_ms_per_frame=0.0)
    past = dataclasses.replace(liar, label_lag=MAX_LABEL_LAG + 0.01,
                               label_lag_estimate=-MAX_LABEL_LAG - 0.01,
                               body_ms_per_frame=-0.01)
    for claim, shown in ((on_bound, (MAX_LABEL_LAG, 0.0, 0.0)), (past, (None, None, None))):
        history.status.take(claim)
        history.take(claim)
        row = _row(history.snapshot(Counter()), "d0")
        assert (row["label_lag"], row["label_lag_estimate"], row["body_ms_per_frame"]) == shown
    counted = history.snapshot(Counter())["monitor"]
    assert [counted[f"fleet.implausible_{k}"] for k in (
        "label_lag", "label_lag_estimate", "body_ms_per_frame")] == [1, 1, 1]
    monkeypatch.setattr(monitor, "MAX_DEVICES", 1)
    for k in range(3):  # an open broker's flood of made-up ids
        flood = dataclasses.replace(liar, device=f"x{k}", local_accuracy=0.5)
        history.status.take(flood)
        history.take(flood)
    assert set(history.device_accuracy) == set(history.status.devices) == {"d0"}
    assert history.counters["fleet.too_many_devices"] == 3
    # A summary counts only on its subject's own topic (the broker lets only it write there).
    assert _from_its_subject("safl/f/dev/d0/summary", "f", liar)
    assert not _from_its_subject("safl/f/dev/d1/summary", "f", liar)
    station = StationSummary(station="st0", state=StationState.COLLECTING, round=1,
                             iteration=1, devices=1, online=1, quorum=1)
    assert _from_its_subject("safl/f/station/st0/summary", "f", station)
    assert not _from_its_subject("safl/f/dev/st0/summary", "f", station)
    cloud = CloudSummary(state=CloudState.COLLECTING, round=1, iteration=1, stations=())
    assert _from_its_subject("safl/f/cloud/summary", "f", cloud)
    assert not _from_its_subject("safl/f/station/st0/summary", "f", cloud)


def test_a_device_that_is_not_predicting_now_is_shown_first_and_in_safl_status():
    """Online and ready is not enough for a line: a device whose camera is lost, or whose
    last prediction is older than STALE_PREDICTION_S on the reader's clock, comes first
    on the page and is named by safl status; a claimed outage below zero is not shown."""
    from aggregator.monitor_page import trouble
    from aggregator.status import STALE_PREDICTION_S, format_status

    history = _history()
    history.status.presence[(m.Participant.DEVICE, "d1")] = True
    now = time.time()
    for did, last, outage in (("d0", now - 100.0, 42.0), ("d1", now - 1.0, 0.0)):
        doc = DeviceSummary(device=did, station="st0", state=DeviceState.READY, round=4,
                            iteration=12, last_prediction=last, camera_outage=outage)
        history.status.take(doc)
        history.take(doc)
    snap = history.snapshot(Counter())
    d0, d1 = _row(snap, "d0"), _row(snap, "d1")
    assert d0["prediction_age"] >= 100.0 > STALE_PREDICTION_S and d0["camera_outage"] == 42.0
    assert d1["prediction_age"] < STALE_PREDICTION_S
    assert trouble(d0) < trouble(d1) and snap["devices"][0]["id"] == "d0"
    text = format_status(history.status, "f")
    assert "not predicting now: d0 (camera lost 42 s, last 100 s ago)" in text
    assert "d1 (" not in text
    liar = DeviceSummary(device="d1", station="st0", state=DeviceState.READY, round=4,
                         iteration=12, camera_outage=-5.0)
    history.status.take(liar)
    history.take(liar)
    assert _row(history.snapshot(Counter()), "d1")["camera_outage"] is None
    assert history.counters["fleet.implausible_camera_outage"] == 1


def test_a_station_counts_each_devices_refused_and_clipped_claims():
    from test_pipeline import _station

    st = _station()
    for sender, weights in (("d0", np.ones(5)), ("intruder", np.ones(8)), ("d1", np.ones(8))):
        st.handle(m.DeviceUpdate(fleet="t", sender=sender, round=0, iteration=0, station="s",
                                 weights=weights, num_samples=8), 1.0)
    st.handle(m.DeviceStats(fleet="t", sender="d1", round=0, iteration=1, station="s",
                            seen_counts=np.array([9, 9]), next_batch_counts=np.array([4, 4]),
                            local_accuracy=1.5), 1.0)  # not an accuracy: dropped, counted
    assert dict(st.tally.refused) == {"d0": 1}  # the intruder is only in the totals
    assert dict(st.tally.clipped) == {"d1": 1}
    again = _station()
    again.restore(*st.snapshot())
    assert again.tally.state() == st.tally.state()


def _get(port: int, path: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def _raw(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        return s.recv(4096)


def test_the_monitor_answers_bad_requests_and_keeps_serving():
    server = MonitorServer(_history())
    port = server.port
    try:
        status, page = _get(port, "/")
        assert status == 200 and b"/monitor.js" in page and b"http" not in page.split(
            b"<body>")[1].replace(b"http://www.w3.org", b"")  # nothing from elsewhere
        status, body = _get(port, "/api/fleet")
        assert status == 200 and json.loads(body)["fleet"] == "f"
        status, body = _get(port, "/etc/passwd")
        assert status == 404 and b"no such page" in body
        assert _get(port, "/api/fleet?" + "x" * 5000)[0] == 414
        assert _get(port, "/api/fleet?%zz&&==%%")[0] == 200  # a query is not parsed
        assert b" 400 " in _raw(port, b"GET /\x00\xff HTTP/x.y\r\n\r\n")
        assert b" 501 " in _raw(port, b"DELETE / HTTP/1.1\r\nHost: x\r\n\r\n")
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(MAX_CLIENTS)]
        time.sleep(0.5)  # each holds a slot, waiting for a request line
        assert _get(port, "/api/fleet")[0] == 503
        for s in idle:
            s.close()
        deadline = time.monotonic() + 10
        while _get(port, "/api/fleet")[0] != 200:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        counters = json.loads(_get(port, "/api/fleet")[1])["monitor"]
        assert counters["http.not_found"] == 1 and counters["http.too_long"] == 1
        assert counters["http.busy"] >= 1 and counters["http.error_400"] == 1
        with pytest.raises(Exception, match="cannot serve the monitor"):
            MonitorServer(_history(), port=port)
    finally:
        server.close()


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _chromium(*args: str) -> str:
    out = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
                          "--virtual-time-budget=8000", *args],
                         capture_output=True, text=True, timeout=120)
    return out.stdout


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None or shutil.which("mosquitto") is None,
                    reason="Chromium and Mosquitto are installed by .ci/run")
def test_a_browser_shows_the_running_fleet(tmp_path, digits):
    from brokers import Mosquitto, free_port
    from PIL import Image
    from test_mqtt import STRATEGY, _creds, _mosquitto, _spec

    from aggregator.monitor import run_monitor
    from edge_client.config import BrokerConfig
    from lab.launch import launch_fleet
    from lab.simulation import plan_fleet

    spec = _spec(digits, rounds=8)
    plan = plan_fleet(STRATEGY, spec)
    server = _mosquitto(tmp_path, spec)
    port = free_port()
    stop = StopFlag(install=False)
    broker = BrokerConfig(url=server.url, username="tester", password=Mosquitto.PASSWORD)
    record = tmp_path / "field-test"
    watcher = threading.Thread(target=run_monitor, args=(broker, plan.fleet, "127.0.0.1", port,
                                                         stop, record, 1.0), daemon=True)
    watcher.start()
    try:
        rows = launch_fleet(tmp_path / "run", digits, STRATEGY, spec, server.url,
                            credentials=_creds, timeout=240)
        time.sleep(4)  # the devices' last summaries
        url = f"http://127.0.0.1:{port}/"
        dom = _chromium("--dump-dom", "--window-size=1400,1100", url)
        shot = tmp_path / "run" / "monitor.png"
        _chromium(f"--screenshot={shot}", "--window-size=1400,1100", url)
    finally:
        stop.event.set()
        watcher.join(10)
        server.stop()
    assert rows[-1]["round"] == spec.rounds
    devices = [d for s in plan.stations for d in s["devices"]]
    for sid in (s["station_id"] for s in plan.stations):
        assert f'id="stations-{sid}"' in dom, sid
    for did in devices:
        assert f'id="devices-{did}"' in dom, did
    assert f"of {len(devices)}</span>" in dom  # devices online: k of n
    start = dom.index('id="global-accuracy"')
    values = dom[dom.index('data-values="', start) + 13:]
    series = [float(v) for v in values[:values.index('"')].split(",")]
    assert len(series) >= spec.rounds - 1 and series[-1] > series[0] + 0.2  # it learned
    start = dom.index('id="device-accuracy"')
    lines = dom[start:dom.index("</svg>", start)].count("<polyline")
    assert lines >= len(devices)  # a held-out accuracy line per device, at least
    legend = dom[dom.index('id="device-legend"'):]
    legend = legend[:legend.index("</div>")]
    assert all(did in legend for did in devices), legend  # a legend entry per device
    for table in ("stations", "devices"):  # wide tables scroll inside the page's width
        assert f'<div class="scroll"><table id="{table}">' in dom
    # ... and the devices' fits a 1,400 px window (its margins 2 x 1.2em) without scrolling
    width = int(dom[dom.index('data-devices-width="') + 20:].split('"')[0])
    assert 0 < width <= 1400 - 2 * 17, width
    table = dom[dom.index('<table id="devices">'):]
    table = table[:table.index("</table>")]
    assert " kB<" in table or " MB<" in table, table[-600:]  # bytes with their units
    picture = np.asarray(Image.open(shot).convert("RGB"))
    assert picture.shape[0] > 500 and len(np.unique(picture.reshape(-1, 3), axis=0)) > 50

    # What the monitor recorded makes a report with every device in it.
    from lab.run_report import write_run_report

    page = write_run_report(record).read_text()
    assert page.count("data:image/png;base64,") >= 3  # accuracy, devices, uploads
    assert all(d in page for d in devices)  # the devices as last seen


def _thousand(points: int = 3) -> FleetHistory:
    """A thousand devices, each with ``points`` accuracies: d0500 offline, d0777 in error."""
    clock = iter(np.arange(0.0, 1e6, 0.5))
    history = FleetHistory("f", clock=lambda: float(next(clock)))
    st = history.status
    for i in range(1000):
        did = f"d{i:04d}"
        st.presence[(m.Participant.DEVICE, did)] = did != "d0500"
        for k in range(points):
            doc = DeviceSummary(device=did, station=f"st{i % 4}", state=DeviceState.READY,
                                round=k, iteration=k, local_accuracy=0.5 + (i % 97) / 200,
                                prequential_accuracy=0.6, counters={"uploads": k},
                                transport={"bytes_out": 1000 * k, "bytes_in": 4000 * k},
                                error="errors.tick: OSError: disk full" if did == "d0777"
                                else "")
            st.take(doc)
            history.take(doc)
    return history


def test_a_thousand_devices_make_a_page_of_rows_the_lowest_series_and_counts(tmp_path):
    """At a thousand devices the page's JSON holds a page of rows, those in trouble first,
    the ten lowest series and the counts of all; ``?page=`` pages through every device, and
    the record keeps every row."""
    from aggregator.monitor_page import CHART_DEVICES, PAGE_ROWS

    history = _thousand()
    doc = history.snapshot(Counter())
    assert (len(doc["devices"]), doc["devices_total"], doc["pages"]) == (PAGE_ROWS, 1000, 10)
    assert [r["id"] for r in doc["devices"][:2]] == ["d0500", "d0777"]  # offline, in error
    assert doc["devices_online"] == 999
    assert doc["device_errors"] == [["d0777", "errors.tick: OSError: disk full"]]
    lowest = sorted(doc["device_accuracy"])
    assert len(lowest) == CHART_DEVICES and all(int(d[1:]) % 97 == 0 for d in lowest)
    server = MonitorServer(history, port=0)
    try:
        seen = set()
        for page in range(10):
            status, _, body = server.answer(f"/api/fleet?page={page}")
            seen |= {r["id"] for r in json.loads(body)["devices"]}
        assert status == 200 and len(seen) == 1000
        assert json.loads(server.answer("/api/fleet?page=99")[2])["page"] == 9  # the last
        status, _, body = server.answer("/api/fleet?page=x")
        assert status == 200 and json.loads(body)["page"] == 0
        assert server.counters["http.bad_query"] == 1
        # Six digits are a page (the last one); seven are refused like any bad query.
        assert json.loads(server.answer("/api/fleet?page=999999")[2])["page"] == 9
        assert json.loads(server.answer("/api/fleet?page=1000000")[2])["page"] == 0
        assert server.counters["http.bad_query"] == 2
    finally:
        server.close()
    history.save(tmp_path)
    assert len(json.loads((tmp_path / "fleet.json").read_text())["devices"]) == 1000


def test_safl_status_of_a_thousand_devices_stays_a_page():
    """``safl status`` names at most 20 devices a line (offline, in error, missing from a
    joining roster) and counts the rest."""
    from aggregator.status import format_status

    history = _thousand(points=1)
    st = history.status
    for i in range(0, 1000, 10):
        st.presence[(m.Participant.DEVICE, f"d{i:04d}")] = False
    for i in range(30):
        st.devices[f"d{i:04d}"] = dataclasses.replace(st.devices[f"d{i:04d}"],
                                                      error="errors.tick: OSError: full")
    st.take(StationSummary(station="st0", state=StationState.JOINING, round=0, iteration=0,
                           devices=1000, online=900, quorum=1,
                           missing=tuple(f"d{i:04d}" for i in range(0, 1000, 2))))
    text = format_status(st, "f")
    assert len(text.splitlines()) < 40 and len(text) < 6000, len(text)
    # Exactly SHOWN names are all named; one more and the rest is a count.
    from aggregator.status import SHOWN
    twenty = dataclasses.replace(st, presence={
        (m.Participant.DEVICE, f"d{i:04d}"): i >= SHOWN for i in range(1000)})
    assert "d0019" in format_status(twenty, "f") and "1 more" not in format_status(twenty, "f")
    twenty.presence[(m.Participant.DEVICE, "d0020")] = False
    assert "d0020" not in format_status(twenty, "f").split("devices offline:")[1].split("\n")[0]
    assert "and 1 more" in format_status(twenty, "f")
    assert "devices online: 900 of 1000 seen" in text
    assert "devices offline: d0000, d0010" in text and "and 80 more" in text
    assert "ERROR and 11 devices more in error" in text  # d0777 too
    assert "missing d0000, d0002" in text and "and 480 more" in text
    # A roster that large may be waiting on a broker that refuses it: the line says where to look.
    assert "file descriptors refuses the rest: docs/deploy.md" in text


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is installed by .ci/run")
def test_a_browser_pages_through_a_thousand_devices():
    """The page of a thousand-device fleet, as a browser renders it: a hundred rows with
    the offline device first, the counts of all, the ten lowest series with their legend."""
    server = MonitorServer(_thousand(), port=0)
    try:
        dom = _chromium("--dump-dom", f"http://127.0.0.1:{server.port}/")
    finally:
        server.close()
    rows = dom[dom.index('<table id="devices">'):]
    rows = rows[:rows.index("</table>")]
    assert rows.count('id="devices-d') == 100 and rows.index("devices-d0500") < \
        rows.index("devices-d0001")
    assert "devices online: 999 of 1000" in dom and "devices 1-100 of 1000" in dom
    assert "the 10 of 1000 lowest now" in dom
    chart = dom[dom.index('id="device-accuracy"'):]
    assert chart[:chart.index("</svg>")].count("<polyline") == 20  # held-out, prequential
