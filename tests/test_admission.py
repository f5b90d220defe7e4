"""Frame admission: hostile headers refused by reason, a fuzzed decoder, refusals, log limits."""

from __future__ import annotations

import json
import logging
import time

import numpy as np
import pytest
from fuzz_frames import FLEET, assemble, base_messages, chunked, encoded, frame_parts, mutate

from edge_client import messages as m
from edge_client.admission import Admission, LogLimiter
from edge_client.codec import decode, encode
from edge_client.errors import MessageError


def _admission(**kw):
    return Admission(fleet=FLEET, layout_hash="ab12", num_params=6, max_message=1 << 20,
                     reassembly_memory=1 << 20, chunk_timeout=5.0, **kw)


def _with_header(frame: bytes, edit) -> bytes:
    """``frame`` with its JSON header rewritten by ``edit(text) -> text``, resealed."""
    prefix, header, payload = frame_parts(frame)
    return assemble(prefix, edit(header.decode()).encode(), payload)


def _update_frame() -> bytes:
    return encoded(base_messages()[1][1])


def _field(name, raw):
    """An edit that sets header field ``name`` to the raw JSON text ``raw``."""
    def edit(text: str) -> str:
        doc = json.loads(text)
        doc["fields"][name] = "__RAW__"
        return json.dumps(doc, separators=(",", ":")).replace('"__RAW__"', raw)
    return edit


@pytest.mark.parametrize("edit, reason", [
    (_field("num_samples", "-1"), "out_of_range"),
    (_field("num_samples", "NaN"), "bad_header"),
    (_field("num_samples", "1.5"), "bad_field"),
    (_field("num_samples", "true"), "bad_field"),
    (_field("round", str(2**60)), "out_of_range"),
    (_field("round", "1" + "0" * 5000), "bad_header"),
    (_field("sender", '"a/b"'), "bad_id"),
    (_field("station", '"+"'), "bad_id"),
    (_field("sender", "7"), "bad_id"),
    (_field("round", "[1]"), "bad_header"),
    (lambda t: t.replace('"fields":{', '"fields":{"deep":' + "[" * 20000 + "]" * 20000 + ",",
                         1), "bad_header"),
    (lambda t: t.replace('"<f4",6]', '"<f4",Infinity]'), "bad_header"),
    (lambda t: t.replace('"<f4",6]', '"<f4",1e30]'), "bad_header"),
    (lambda t: t.replace('"<f4",6]', '"|O",6]'), "bad_header"),
    (lambda t: t.replace('"weights","<f4"', '"round","<f4"'), "bad_header"),
    (lambda t: t.replace('{"id"', '{"x":1,"id"'), "bad_header"),
    (lambda t: "[" + t + "]", "bad_header"),
])
def test_hostile_headers_are_refused_with_their_reason(edit, reason):
    frame = _with_header(_update_frame(), edit)
    with pytest.raises(MessageError) as err:
        decode(frame, max_size=1 << 20)
    assert err.value.reason == reason


def test_presence_flag_must_be_a_boolean():
    presence = encoded(base_messages()[-1][1])
    frame = _with_header(presence, lambda t: t.replace('"online":true', '"online":1'))
    with pytest.raises(MessageError) as err:
        decode(frame, max_size=1 << 20)
    assert err.value.reason == "bad_field"


def test_admission_refuses_by_topic_and_names_the_sender():
    adm = _admission()
    topic, msg = base_messages()[1]
    got = adm.admit(topic, encoded(msg), 0.0)
    assert got.sender == "d0" and np.array_equal(got.weights, msg.weights)
    assert adm.admit(topic, encoded(msg)[:-3], 0.0) == m.Refusal(
        fleet=FLEET, sender="d0", round=0, iteration=0, reason="wrong_length", role="dev",
        leaf="update")
    # On a topic no participant owns there is nobody to tell, only a counter.
    assert adm.admit("safl/f/cloud/model", b"junk", 0.0) is None
    short = m.DeviceUpdate(fleet=FLEET, sender="d0", round=0, iteration=0, station="s0",
                           weights=np.zeros(5, np.float32), num_samples=1)
    assert adm.admit(topic, encode(short), 0.0).reason == "wrong_length"  # the model has 6
    assert adm.admit(topic, encode(msg, layout_hash="ffff"), 0.0).reason == "wrong_layout"
    assert adm.admit("safl/f/dev/d1/update", encoded(msg), 0.0).reason == "topic_mismatch"
    assert adm.counters["rejected.wrong_length"] == 2 and adm.counters["messages_in"] == 1


def test_an_unexpected_error_is_counted_as_internal_not_raised(monkeypatch):
    adm = _admission()
    import edge_client.admission as admission

    def broken(*a, **k):
        raise ZeroDivisionError("a bug")
    monkeypatch.setattr(admission, "decode", broken)
    topic, msg = base_messages()[1]
    got = adm.admit(topic, encoded(msg), 0.0)
    assert got.reason == "internal" and adm.counters["rejected.internal"] == 1


def test_a_flood_of_bad_frames_logs_once_per_sender_and_reason(caplog):
    adm = _admission()
    topic, msg = base_messages()[1]
    bad = encoded(msg)[:-3]
    with caplog.at_level(logging.WARNING, logger="edge_client.admission"):
        for _ in range(500):
            adm.admit(topic, bad, 0.0)
    assert adm.counters["rejected.wrong_length"] == 500
    assert len(caplog.records) == 1


def test_log_limiter_allows_again_after_its_period():
    now = [0.0]
    limiter = LogLimiter(period=60.0, clock=lambda: now[0])
    assert limiter.allow("d0", "x") and not limiter.allow("d0", "x")
    assert limiter.allow("d1", "x") and limiter.allow("d0", "y")
    now[0] = 61.0
    assert limiter.allow("d0", "x")


def _fuzz(n: int, seed: int) -> tuple[dict[str, int], float]:
    rng = np.random.default_rng(seed)
    bases = [(t, encoded(msg, version)) for t, msg in base_messages() for version in (1, 2)]
    adm = _admission()
    outcomes: dict[str, int] = {}
    slowest = 0.0
    for i in range(n):
        topic, frame = bases[i % len(bases)]
        frames = chunked(frame, rng) if i % 50 == 0 else [mutate(frame, rng)]
        for data in frames:
            # CPU seconds of this thread: what a crafted frame costs, whatever else the
            # machine runs beside the suite (its other workers).
            started = time.thread_time()
            try:
                decode(data, max_size=1 << 20)
                outcome = "decoded"
            except MessageError as exc:
                outcome = exc.reason
            got = adm.admit(topic, data, float(i))  # never raises, whatever it is fed
            assert got is None or isinstance(got, m.Message)
            slowest = max(slowest, time.thread_time() - started)
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
    return outcomes, slowest


def test_fuzzed_frames_raise_only_the_projects_error():
    outcomes, slowest = _fuzz(4000, seed=1)
    assert sum(outcomes.values()) >= 4000 and slowest < 1.0
    assert len(outcomes) > 8  # the mutations reach many different checks


@pytest.mark.slow
def test_one_hundred_thousand_fuzzed_frames(capsys):
    outcomes, slowest = _fuzz(100_000, seed=2)
    with capsys.disabled():
        print(f"\nfuzz: {sum(outcomes.values())} frames, slowest {slowest * 1e3:.1f} ms, "
              + json.dumps(dict(sorted(outcomes.items(), key=lambda kv: -kv[1]))))
    assert sum(outcomes.values()) >= 100_000 and slowest < 1.0
