"""The roles' transition tables: every move a table lacks is refused and changes nothing,
and ``docs/states.md`` is drawn from the tables as they are."""

from __future__ import annotations

import copy
import functools
import importlib.util
import types
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from aggregator.cloud import Cloud, CloudEvent, CloudState
from aggregator.config import CloudConfig, StationConfig
from aggregator.station import Station, StationEvent, StationState
from edge_client import messages as m
from edge_client.config import DeviceConfig
from edge_client.device import Device, DeviceEvent
from edge_client.role import TransitionError
from edge_client.states import DeviceState
from edge_client.trainers import build_trainer

ROOT = Path(__file__).parent.parent


def _everything(value):
    """A role's whole state as plain comparable values (arrays by content, generators by
    their state, objects by their attributes); counters and the log limiter left out."""
    if isinstance(value, np.ndarray):
        return ("array", value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, np.random.Generator):
        return ("rng", repr(value.bit_generator.state))
    if isinstance(value, functools.partial):
        return ("partial", value.func.__name__, _everything(value.keywords))
    if isinstance(value, types.MethodType):  # a part's view of its role: the object is there
        return ("method", value.__func__.__qualname__)
    if isinstance(value, dict):
        return {k: _everything(v) for k, v in value.items()
                if k not in ("counters", "_limiter", "_sender")}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
        return (type(value).__name__, [_everything(v) for v in items])
    if hasattr(value, "__dict__") and not isinstance(value, type) and not callable(value):
        return (type(value).__name__, _everything(vars(value)))
    return value


def _station() -> Station:
    cfg = StationConfig(fleet="t", station_id="s", devices=("d0", "d1"), super_node_size=2,
                        rand_per_group=0, sync_period=2, iteration_timeout=10.0)
    st = Station(cfg, num_params=4, num_classes=2, rng=np.random.default_rng(0))
    for d in cfg.devices:  # stats in hand, the model and P_real known: ready to select
        st.stats[d] = _stats(d)
    st.weights, st.p_real = np.zeros(4, np.float32), np.array([0.5, 0.5])
    return st


def _stats(d):
    return m.DeviceStats(fleet="t", sender=d, round=0, iteration=0, station="s",
                         seen_counts=np.ones(2, int), next_batch_counts=np.ones(2, int))


def _gather(st):
    st.offline.update(st.config.devices)


def _at_sync(st):
    st.iteration = st.config.sync_period - 1


def _global(final):
    return lambda st: st.handle(m.GlobalModel(fleet="t", sender="cloud", round=st.round + 1,
                                              iteration=0, weights=np.ones(4),
                                              p_real=[0.5, 0.5], final=final), 0.0)


STATION = {  # event: (what makes it this event, what sets it off)
    StationEvent.DEVICES_REPORTED: (None, lambda st: st._devices_reported(_stats("d1"), 0.0)),
    StationEvent.SUPER_NODE_SELECTED: (None, lambda st: st._begin_iteration(0.0)),
    StationEvent.TOO_FEW_READY: (_gather, lambda st: st._begin_iteration(0.0)),
    StationEvent.SYNC_DUE: (_at_sync, lambda st: st._close_iteration(0.0)),
    StationEvent.FINAL_MODEL: (None, _global(final=True)),
    StationEvent.RESTARTED: (None, lambda st: st._resume(0.0)),
}


def _cloud() -> Cloud:
    cloud = Cloud(CloudConfig(fleet="t", stations=("a", "b"), rounds=3),
                  initial_weights=np.zeros(4), num_classes=2)
    cloud._counts = {"a": np.array([1, 1]), "b": np.array([1, 1])}
    return cloud


def _last_round(cloud):
    cloud.round = cloud.config.rounds - 1


CLOUD = {
    CloudEvent.STATIONS_JOINED: (None, lambda c: c.handle(
        m.StationStats(fleet="t", sender="b", round=0, iteration=0, seen_counts=[1, 1]), 0.0)
        if c.state == CloudState.JOINING else c._broadcast(
            c.next_state(CloudEvent.STATIONS_JOINED), 0.0)),
    CloudEvent.ROUND_CLOSED: (None, lambda c: c._close_round(0.0)),
    CloudEvent.LAST_ROUND_CLOSED: (_last_round, lambda c: c._close_round(0.0)),
}


def _device() -> Device:
    trainer = build_trainer("softmax", input_shape=(8, 8), num_classes=10, lr=0.1, seed=0)
    dev = Device(DeviceConfig(device_id="d0", station="s", fleet="t", holdout_every=0,
                              batch_size=4), trainer, num_classes=10, sample_shape=(8, 8),
                 rng=np.random.default_rng(0))
    dev.buffer.push(np.zeros((8, 8, 8)), np.arange(8))
    return dev


def _model(it, final=False):
    return m.StationModel(fleet="t", sender="s", round=0, iteration=it,
                          weights=np.zeros(650, np.float32), final=final)


def _holding(dev):
    dev._model = _model(3)


def _select(it):
    return lambda dev: dev.handle(m.Selection(fleet="t", sender="s", round=0, iteration=it,
                                              members=("d0",), deadline=1.0), 0.0)


DEVICE = {
    DeviceEvent.MODEL: (None, lambda dev: dev.handle(_model(5), 0.0)),
    DeviceEvent.FINAL_MODEL: (None, lambda dev: dev.handle(_model(5, final=True), 0.0)),
    DeviceEvent.SELECTED: (_holding, _select(3)),
    DeviceEvent.SELECTED_AHEAD: (None, _select(9)),
    DeviceEvent.STATION_BACK: (None, lambda dev: dev.handle(m.Presence(
        fleet="t", sender="s", round=0, iteration=0, role="station", online=True), 0.0)),
}

# Every (state, event) pair a role's table has no move for.
CASES = [(build, events, state, event)
         for role, build, events, states in ((Station, _station, STATION, StationState),
                                             (Cloud, _cloud, CLOUD, CloudState),
                                             (Device, _device, DEVICE, DeviceState))
         for state in states for event in events if (state, event) not in role.TRANSITIONS]


def test_every_event_of_every_role_has_a_way_to_set_it_off():
    for role, events in ((Station, STATION), (Cloud, CLOUD), (Device, DEVICE)):
        assert {e for _, e in role.TRANSITIONS} <= set(events), role.__name__


@pytest.mark.parametrize("build, events, state, event", CASES,
                         ids=[f"{b.__name__[1:]}-{s.value}-{e.value}" for b, _, s, e in CASES])
def test_a_refused_event_leaves_the_role_exactly_as_it_was(build, events, state, event):
    role = build()
    role.state = state
    prepare, fire = events[event]
    if prepare is not None:
        prepare(role)
    before, counters = copy.deepcopy(_everything(vars(role))), Counter(role.counters)
    try:
        fire(role)
    except TransitionError:
        pass
    else:  # a message handled: the refusal is counted, not raised
        assert role.counters["rejected.bad_transition"] == counters["rejected.bad_transition"] + 1
    assert _everything(vars(role)) == before
    assert {k: v for k, v in role.counters.items() if k != "rejected.bad_transition"} \
        == {k: v for k, v in counters.items() if k != "rejected.bad_transition"}


def test_the_state_diagrams_in_docs_are_drawn_from_the_tables():
    spec = importlib.util.spec_from_file_location("diagrams", ROOT / "docs" /
                                                  "make_state_diagrams.py")
    diagrams = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(diagrams)
    assert (ROOT / "docs" / "states.md").read_text() == diagrams.render(), \
        "docs/states.md is stale: run python docs/make_state_diagrams.py"
