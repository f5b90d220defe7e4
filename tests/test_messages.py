"""Messages are validated and frozen; topics map one-to-one from message types."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from edge_client import messages as m
from edge_client.errors import MessageError
from edge_client.topics import matches, topic_for


def _update(**kw):
    base = dict(fleet="f", sender="d1", round=0, iteration=3, station="s1",
                weights=np.ones(4), num_samples=32)
    return m.DeviceUpdate(**{**base, **kw})


def test_messages_are_frozen_and_arrays_read_only():
    msg = _update()
    assert msg.weights.dtype == np.float32
    with pytest.raises(dataclasses.FrozenInstanceError):
        msg.iteration = 4
    with pytest.raises(ValueError):
        msg.weights[0] = 5.0


def test_source_array_changes_do_not_leak_into_a_message():
    w = np.ones(4, np.float32)
    msg = _update(weights=w)
    w[0] = 9
    assert msg.weights[0] == 1.0


@pytest.mark.parametrize("kw, reason", [
    (dict(weights=np.array([1.0, np.nan])), "non_finite"),
    (dict(weights=np.array([1.0, np.inf])), "non_finite"),
    (dict(weights=np.ones((2, 2))), "wrong_shape"),
    (dict(fleet=""), "bad_id"),
    (dict(iteration=-1), "out_of_range"),
    (dict(version=99), "version"),
    (dict(round=1.0), "bad_field"),
    (dict(round=2**53), "out_of_range"),
    (dict(num_samples=True), "bad_field"),
    (dict(num_samples=-1), "out_of_range"),
    (dict(sender="a/b"), "bad_id"),
    (dict(sender="+"), "bad_id"),
    (dict(station=7), "bad_id"),
])
def test_malformed_messages_are_refused_with_a_reason(kw, reason):
    with pytest.raises(MessageError) as err:
        _update(**kw)
    assert err.value.reason == reason


def test_negative_counts_are_refused():
    with pytest.raises(MessageError, match="negative"):
        m.DeviceStats(fleet="f", sender="d", round=0, iteration=0, station="s",
                      seen_counts=[1, -1], next_batch_counts=[0, 0])


def test_topics():
    assert topic_for(_update()) == "safl/f/dev/d1/update"
    sel = m.Selection(fleet="f", sender="s1", round=0, iteration=0, members=("d1",), deadline=1)
    assert topic_for(sel) == "safl/f/station/s1/select"
    assert matches("safl/f/dev/+/update", "safl/f/dev/d1/update")
    assert not matches("safl/f/dev/+/update", "safl/f/dev/d1/stats")
    assert matches("safl/#", "safl/f/cloud/model")
    assert not matches("safl/f/cloud", "safl/f/cloud/model")
    assert m.payload_nbytes(_update()) == 16


def test_documents_round_trip_and_refuse_what_they_do_not_describe():
    from edge_client.documents import (
        CloudSummary,
        ModelManifest,
        StationSummary,
        decode_document,
        encode_document,
    )
    docs = [ModelManifest(round=3, iteration=30, size=1024, final=False, layout="ab12"),
            StationSummary(station="st0", state="collecting", round=1, iteration=12, devices=4,
                           online=3, quorum=2, missing=("d3",), local_mean=0.8,
                           counters={"received_updates": 9}),
            CloudSummary(state="done", round=5, iteration=50, stations=("st0",),
                         accuracy=None)]
    for doc in docs:
        assert decode_document(encode_document(doc)) == doc
    newer = json.loads(encode_document(docs[0]))
    newer["added_later"] = 1  # a newer writer's extra field is ignored
    assert decode_document(json.dumps(newer).encode()) == docs[0]
    bad = [b"not json", b"[1, 2]", b'{"kind": "Nope", "version": 1}',
           json.dumps({**newer, "version": 2}).encode(),
           json.dumps({k: v for k, v in newer.items() if k != "size"}).encode(),
           json.dumps({**newer, "round": True}).encode(),  # a bool is no round number
           json.dumps({**newer, "size": "1024"}).encode(),
           json.dumps({**json.loads(encode_document(docs[1])), "counters": {"a": 1.5}}).encode(),
           b"{" + b" " * (1 << 16) + b"}"]
    for payload in bad:
        with pytest.raises(MessageError, match="document"):
            decode_document(payload)


def test_roles_and_states_are_enums_on_the_wire_and_in_documents():
    from edge_client.codec import decode, encode
    from edge_client.documents import CloudSummary, decode_document, encode_document
    from edge_client.states import CloudState

    presence = m.Presence(fleet="f", sender="s1", round=0, iteration=0, role="station",
                          online=True)
    assert presence.role is m.Participant.STATION
    back = decode(encode(presence), max_size=1 << 16).message
    assert back.role is m.Participant.STATION and f"{back.role}" == "station"
    with pytest.raises(MessageError) as err:
        m.Presence(fleet="f", sender="s1", round=0, iteration=0, role="boss", online=True)
    assert err.value.reason == "bad_field"
    doc = decode_document(encode_document(CloudSummary(state=CloudState.DONE, round=3,
                                                       iteration=9, stations=("s1",))))
    assert doc.state is CloudState.DONE
    forged = json.loads(encode_document(doc))
    forged["state"] = "sleeping"
    with pytest.raises(MessageError, match="state"):
        decode_document(json.dumps(forged).encode())


def test_routes_find_every_subscription_a_topic_reaches_in_subscription_order():
    """Exact topics and wildcards together, in the order they were subscribed, against
    every filter matched by hand; a new subscription reaches topics already routed."""
    from edge_client.topics import Routes, matches

    routes: Routes[str] = Routes()
    filters = ["safl/f/dev/+/stats", *(f"safl/f/dev/d{k}/update" for k in range(500)),
               "safl/f/#", "safl/f/dev/d7/update", "safl/f/dev/+/+"]
    for k, f in enumerate(filters):
        routes.add(f, f"h{k}")
    topics = ["safl/f/dev/d7/update", "safl/f/dev/d7/stats", "safl/f/cloud/model",
              "safl/g/dev/d7/update", "safl/f/dev/d499/update"]
    for topic in topics:
        want = [f"h{k}" for k, f in enumerate(filters) if matches(f, topic)]
        assert routes.handlers(topic) == want
    routes.add("safl/f/dev/d7/update", "late")  # after the topic was routed once
    assert routes.handlers("safl/f/dev/d7/update")[-1] == "late"
    assert routes.filters() == set(filters)


def test_routes_keep_at_most_their_bound_of_topics_and_route_the_rest_all_the_same(
        monkeypatch):
    """A wildcard on an open broker sees topics without end: the index keeps MAX_ROUTED of
    them found (exactly the bound), and finds every later one afresh, the same."""
    from edge_client import topics

    monkeypatch.setattr(topics, "MAX_ROUTED", 3)
    routes: topics.Routes[str] = topics.Routes()
    routes.add("safl/f/dev/+/stats", "wild")
    routes.add("safl/f/dev/d1/stats", "exact")
    for k in range(5):
        assert routes.handlers(f"safl/f/dev/d{k}/stats") == (["wild", "exact"] if k == 1
                                                             else ["wild"])
    assert len(routes._found) == 3
