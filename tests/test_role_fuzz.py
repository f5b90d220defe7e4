"""Roles fed long random streams of well-formed but hostile messages: nothing raises, the
accepted model stays finite, and a compromised device never moves it far."""

from __future__ import annotations

import numpy as np

from aggregator.cloud import Cloud
from aggregator.config import CloudConfig, StationConfig
from aggregator.station import Station
from edge_client import messages as m
from edge_client.pipeline import UpdatePipeline

STATES = {"joining", "waiting", "collecting", "gathering", "done"}


def _random_encoded(rng, common, n):
    """An update whose encoding is hostile: foreign stages, positions out of range or out of
    order, values of the wrong carrier or count, huge or negative scales."""
    k = int(rng.integers(0, n + 2))
    idx = np.sort(rng.choice(n + 3, size=min(k, n + 3), replace=False)).astype(np.uint32)
    if rng.random() < 0.3:
        idx = idx[::-1].copy()
    codes = rng.integers(-128, 128, int(rng.integers(0, n + 2))).astype(np.int8)
    scales = (10.0 ** rng.integers(-3, 39, int(rng.integers(0, 4)))).astype(np.float32)
    if rng.random() < 0.2:
        scales = -scales
    half = rng.normal(size=int(rng.integers(0, 3))).astype(np.float16)
    encoding = str(rng.choice(["topk:0.5-int8:2", "int8:2", "float16", "model"]))
    return m.DeviceUpdate(**common, station="s", weights=np.zeros(0, np.float32),
                          num_samples=8, encoding=encoding, indices=idx, codes=codes,
                          scales=scales, half=half)


def _random_message(rng, devices, it, rnd, w):
    kind = rng.integers(9)
    if kind == 8:
        sender = devices[rng.integers(len(devices))]
        return _random_encoded(rng, dict(fleet="t", sender=sender, round=int(rnd),
                                         iteration=int(it)), w.size)
    sender = devices[rng.integers(len(devices))] if rng.random() < 0.9 else "intruder"
    common = dict(fleet="t", sender=sender, round=int(rng.integers(0, 3)),
                  iteration=int(it + rng.integers(-2, 3)) if it >= 2 else int(it))
    if kind == 0:
        counts = rng.integers(0, 10**int(rng.integers(1, 16)), 2)
        return m.DeviceStats(**common, station="s", seen_counts=counts,
                             next_batch_counts=rng.integers(0, 6, 2))
    if kind in (1, 2):
        scale = 10.0 ** rng.integers(-3, 7)
        return m.DeviceUpdate(**common, station="s", weights=w + rng.normal(size=w.size) * scale,
                              num_samples=int(rng.choice([0, 1, 8, 16, 17, 10**12])))
    if kind == 3:
        return m.SkipNotice(**common, station="s", gap=float(rng.random()))
    if kind == 4:
        return m.Presence(**common, role="dev", online=bool(rng.random() < 0.5))
    if kind == 5:
        return m.Refusal(**common, reason="non_finite", role="dev", leaf="update")
    if kind == 6:
        return m.Presence(fleet="t", sender="cloud", round=0, iteration=0, role="cloud",
                          online=True)
    return m.GlobalModel(fleet="t", sender="cloud", round=int(rnd + rng.integers(0, 2)),
                         iteration=int(it), weights=w, p_real=[0.5, 0.5])


def test_a_station_survives_twenty_thousand_hostile_messages():
    rng = np.random.default_rng(7)
    devices = ("d0", "d1", "d2", "d3")
    st = Station(StationConfig(fleet="t", station_id="s", devices=devices, super_node_size=3,
                               rand_per_group=1, sync_period=2, batch_size=8, local_steps=2,
                               min_quorum=2, iteration_timeout=5.0),
                 num_params=6, num_classes=2, rng=np.random.default_rng(0))
    w = np.zeros(6, np.float32)
    now = 0.0
    for _ in range(20_000):
        now += float(rng.exponential(0.5))
        msg = _random_message(rng, devices, st.iteration, st.round, w)
        for out in (st.handle(msg, now), st.tick(now)):  # handle never raises
            assert all(isinstance(x, m.Message) for x in out)
        assert st.state in STATES
        if st.weights is not None:
            assert np.isfinite(st.weights).all()
            # Every fused update was within 10x the median accepted distance of w^m.
            assert np.abs(st.weights).max() < 1e4
    assert st.counters["rejected.bad_count"] > 0 and st.counters["rejected.update_norm"] > 0
    assert st.counters["clipped.seen_counts"] > 0 and st.counters["rejected.unknown_sender"] > 0


def test_a_station_decoding_steps_survives_hostile_encodings():
    rng = np.random.default_rng(11)
    devices = ("d0", "d1", "d2")
    stages = ("topk:0.5", "int8:2")
    pipe = UpdatePipeline(stages)
    st = Station(StationConfig(fleet="t", station_id="s", devices=devices, super_node_size=2,
                               rand_per_group=0, sync_period=3, batch_size=8, local_steps=2,
                               min_quorum=1, iteration_timeout=5.0, update_stages=stages),
                 num_params=6, num_classes=2, rng=np.random.default_rng(0))
    w = np.zeros(6, np.float32)
    now = 0.0
    for i in range(20_000):
        now += float(rng.exponential(0.5))
        if i % 4 == 0:  # an honest member's encoded step, so the decoding path is taken
            sender = st.members[0] if st.members else devices[0]
            enc, _ = pipe.encode(rng.normal(0, 0.01, 6).astype(np.float32), None, rng)
            msg = m.DeviceUpdate(fleet="t", sender=sender, round=st.round,
                                 iteration=st.iteration, station="s", num_samples=8,
                                 encoding=pipe.id, weights=enc.values, indices=enc.indices,
                                 codes=enc.codes, scales=enc.scales)
        elif i % 4 == 1:
            sender = devices[rng.integers(len(devices))]
            msg = _random_encoded(rng, dict(fleet="t", sender=sender, round=st.round,
                                            iteration=st.iteration), 6)
        else:
            msg = _random_message(rng, devices, st.iteration, st.round, w)
        for out in (st.handle(msg, now), st.tick(now)):  # handle never raises
            assert all(isinstance(x, m.Message) for x in out)
        if st.weights is not None:
            assert np.isfinite(st.weights).all() and np.abs(st.weights).max() < 1e4
    assert st.counters["received_updates"] > 100
    for reason in ("bad_encoding", "wrong_encoding"):
        assert st.counters[f"rejected.{reason}"] > 0, reason


def test_a_cloud_survives_hostile_station_reports():
    rng = np.random.default_rng(3)
    cloud = Cloud(CloudConfig(fleet="t", stations=("a", "b"), rounds=10**6, min_stations=1,
                              round_timeout=5.0, fusion="median"),
                  initial_weights=np.zeros(4), num_classes=2)
    now = 0.0
    for _ in range(5_000):
        now += float(rng.exponential(1.0))
        sender = ("a", "b", "x")[rng.integers(3)]
        common = dict(fleet="t", sender=sender, round=int(cloud.round + rng.integers(-1, 2)
                                                           if cloud.round else 0),
                      iteration=int(rng.integers(0, 50)))
        kind = rng.integers(4)
        if kind == 0:
            msg = m.StationStats(**common, seen_counts=rng.integers(0, 10**12, 2))
        elif kind == 1:
            msg = m.StationUpdate(**common, weights=rng.normal(size=4) * 10.0 ** rng.integers(0, 8),
                                  num_samples=int(rng.integers(0, 10**12)),
                                  seen_counts=rng.integers(0, 1000, 2))
        elif kind == 2:
            msg = m.Presence(**common, role="station", online=bool(rng.random() < 0.5))
        else:
            msg = m.Refusal(**common, reason="bad_header", role="station", leaf="update")
        cloud.handle(msg, now)
        cloud.tick(now)
        assert np.isfinite(cloud.weights).all() and cloud.state in STATES
    assert cloud.round > 10 and cloud.counters["clipped.station_samples"] > 0


def test_a_device_survives_a_confused_station(digits):
    from edge_client.config import DeviceConfig
    from edge_client.device import Device
    from edge_client.trainers import build_trainer

    trainer = build_trainer("softmax", input_shape=(8, 8), num_classes=10, lr=0.1, seed=0)
    dev = Device(DeviceConfig(device_id="d0", station="s", fleet="t", mix=0.5, nu=1.0,
                              holdout_every=4), trainer, num_classes=10, sample_shape=(8, 8),
                 rng=np.random.default_rng(0))
    rng = np.random.default_rng(5)
    w = trainer.get_flat()
    for i in range(2_000):
        x = digits.x_train[(i * 7) % 1000:(i * 7) % 1000 + 5]
        dev.ingest(x, digits.y_train[(i * 7) % 1000:(i * 7) % 1000 + 5], float(i))
        it = int(rng.integers(0, 50))
        kind = rng.integers(4)
        if kind == 0:
            msg = m.StationModel(fleet="t", sender="s", round=0, iteration=it,
                                 weights=w * 10.0 ** rng.integers(-2, 3),
                                 final=bool(rng.random() < 0.01))
        elif kind == 1:
            msg = m.Selection(fleet="t", sender="s", round=0, iteration=it,
                              members=("d0", "d1") if rng.random() < 0.7 else ("d1",),
                              deadline=1.0)
        elif kind == 2:
            msg = m.Presence(fleet="t", sender="s", round=0, iteration=0, role="station",
                             online=bool(rng.random() < 0.5))
        else:
            msg = m.GlobalModel(fleet="t", sender="cloud", round=1, iteration=it, weights=w,
                                p_real=np.full(10, 0.1))
        out = dev.handle(msg, float(i)) + dev.tick(float(i))
        assert all(isinstance(x, m.Message) for x in out)
        assert np.isfinite(trainer.get_flat()).all()
    assert dev.counters["uploads"] + dev.counters["skipped.gate"] > 0
