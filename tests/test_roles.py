"""Role tests: device, station and cloud state machines, alone and over the LocalBus."""

from __future__ import annotations

import numpy as np
import pytest

from aggregator.cloud import Cloud, CloudState
from aggregator.config import CloudConfig, StationConfig
from aggregator.station import Station
from edge_client import messages as m
from edge_client.config import DeviceConfig
from edge_client.device import Device
from edge_client.errors import ShapeError
from edge_client.runner import RoleRunner
from edge_client.topics import global_model_topic, station_model_topic
from edge_client.trainers import build_trainer
from edge_client.transport import LocalBus

CLOCK = lambda: 0.0  # noqa: E731
F = 10


def _trainer(lr=0.5, seed=0):
    return build_trainer("softmax", input_shape=(8, 8), num_classes=F, lr=lr, seed=seed)


def _fleet(digits, *, n_devices=4, device_kw=None, station_kw=None, rounds=1, feed=None):
    """Cloud, one station and devices on a LocalBus, each device holding ``feed[k]`` samples."""
    bus = LocalBus()
    ids = tuple(f"d{k}" for k in range(n_devices))
    w0 = _trainer().get_flat()
    cloud = Cloud(CloudConfig(fleet="t", stations=("s",), rounds=rounds), initial_weights=w0,
                  num_classes=F)
    station = Station(StationConfig(fleet="t", station_id="s", devices=ids,
                                    **{"super_node_size": n_devices, "rand_per_group": 0,
                                       "sync_period": 1, **(station_kw or {})}),
                      num_params=w0.size, num_classes=F, rng=np.random.default_rng(0))
    devices = []
    start = 0
    for k, did in enumerate(ids):
        cfg = DeviceConfig(device_id=did, station="s", fleet="t",
                           **{"lr": 0.5, "mix": 1.0, "holdout_every": 0, **(device_kw or {})})
        dev = Device(cfg, _trainer(seed=k + 1), num_classes=F, sample_shape=(8, 8),
                     rng=np.random.default_rng(k))
        n = (feed or [200] * n_devices)[k]
        dev.buffer.push(digits.x_train[start:start + n], digits.y_train[start:start + n])
        start += n
        devices.append(dev)
    globals_: list[m.GlobalModel] = []
    bus.subscribe(global_model_topic("t"), lambda topic, msg: globals_.append(msg))
    runners = [RoleRunner(r, bus, CLOCK) for r in (cloud, station, *devices)]
    return bus, runners, cloud, station, devices, globals_, w0


def _run(bus, runners):
    for r in runners:
        r.start()
    bus.deliver()


def test_one_fedgs_iteration_equals_one_synchronous_sgd_step(digits):
    # One group, T = 1, mix = 1: the new global model is one SGD step over the union of
    # the selected batches, each device weighted by its batch size.
    sizes = [8, 16, 24, 32]
    bus, runners, cloud, station, devices, globals_, w0 = _fleet(
        digits, feed=sizes, device_kw={"batch_size": 32})
    _run(bus, runners)
    assert [g.round for g in globals_] == [0, 1] and globals_[-1].final
    ref = _trainer()
    ref.set_flat(w0)
    ref.train_step(digits.x_train[:sum(sizes)], digits.y_train[:sum(sizes)])
    np.testing.assert_allclose(globals_[-1].weights, ref.get_flat(), atol=1e-6)
    assert not np.allclose(globals_[-1].weights, w0)


def test_gated_devices_are_counted_not_waited_for(digits):
    bus, runners, cloud, station, devices, globals_, _ = _fleet(
        digits, rounds=6, feed=[300] * 4,
        device_kw={"nu": 200.0, "holdout_every": 4, "batch_size": 8,
                       "gate_min_holdout": 10},
        station_kw={"sync_period": 2})
    _run(bus, runners)  # no tick: only skip notices can close iterations that lack uploads
    assert cloud.state == "done" and globals_[-1].round == 6
    skips = sum(d.counters["skipped.gate"] for d in devices)
    uploads = sum(d.counters["uploads"] for d in devices)
    assert skips > 0 and uploads > 0
    assert station.counters["received_skips"] == skips == bus.messages["SkipNotice"]
    assert station.counters["received_updates"] == uploads
    assert uploads + skips == 6 * 2 * len(devices)  # every member replied every iteration


def _station(n=3, **kw):
    cfg = StationConfig(fleet="t", station_id="s", devices=tuple(f"d{k}" for k in range(n)),
                        **{"super_node_size": n, "rand_per_group": 0, "sync_period": 2,
                           "iteration_timeout": 10.0, "update_norm_factor": 0.0, **kw})
    return Station(cfg, num_params=4, num_classes=2, rng=np.random.default_rng(0))


def _stats(did, station="s", fleet="t", width=2):
    return m.DeviceStats(fleet=fleet, sender=did, round=0, iteration=0, station=station,
                         seen_counts=np.ones(width, int), next_batch_counts=np.ones(width, int))


def _upd(did, it, w, station="s", fleet="t", n=10):
    return m.DeviceUpdate(fleet=fleet, sender=did, round=0, iteration=it, station=station,
                          weights=np.full(4, w), num_samples=n)


def _start_station(st, now=0.0):
    for k in range(len(st.config.devices)):
        st.handle(_stats(f"d{k}"), now)
    out = st.handle(m.GlobalModel(fleet="t", sender="cloud", round=0, iteration=0,
                                  weights=np.zeros(4), p_real=[0.5, 0.5]), now)
    return out


def test_station_proceeds_at_the_deadline_and_drops_late_replies():
    st = _station(straggler_factor=0.0)  # the timeout alone (stragglers: the test below)
    out = _start_station(st)
    sel = next(x for x in out if isinstance(x, m.Selection))
    assert sel.members == ("d0", "d1", "d2") and sel.deadline == 10.0
    st.handle(_upd("d0", 0, 1.0), 1.0)
    st.handle(_upd("d1", 0, 3.0), 2.0)
    assert st.tick(5.0) == [] and st.iteration == 0
    out = st.tick(10.0)
    assert st.iteration == 1 and st.counters["replies_missed"] == 1
    np.testing.assert_allclose(st.weights, 2.0)
    assert any(isinstance(x, m.Selection) and x.iteration == 1 for x in out)
    st.handle(_upd("d2", 0, 100.0), 11.0)  # the straggler of iteration 0: timed, not fused
    assert st.counters["late_replies"] == 1 and "rejected.stale_iteration" not in st.counters
    assert st.stragglers.reply_s["d2"] == 11.0  # asked at 0, answered at 11
    np.testing.assert_allclose(st.weights, 2.0)


def test_a_straggler_is_cut_at_a_multiple_of_its_peers_and_benched():
    st = _station(n=4, super_node_size=3, straggler_sit_out=2)
    sel = next(x for x in _start_station(st) if isinstance(x, m.Selection))
    assert sel.deadline == 10.0  # nothing timed yet: the timeout
    first, second, slow = sel.members
    st.handle(_upd(first, 0, 1.0), 1.0)
    assert st.deadline == 10.0  # one answer of three: not yet half the super node
    st.handle(_upd(second, 0, 3.0), 1.2)
    assert st.deadline == pytest.approx(3 * 1.1)  # 3 x the median of its peers' answers
    out = st.tick(3.4)
    assert st.iteration == 1 and st.counters["replies_missed"] == 1
    assert st.counters["stragglers_benched"] == 1
    sel = next(x for x in out if isinstance(x, m.Selection))
    assert slow not in sel.members  # benched while three others are ready
    st.handle(_upd(slow, 0, 100.0), 9.0)  # its answer, late: timed, not fused
    assert st.counters["late_replies"] == 1 and st.stragglers.reply_s[slow] == 9.0
    np.testing.assert_allclose(st.weights, 2.0)


def test_updates_of_an_interrupted_iteration_are_not_fused_later():
    st = _station()
    _start_station(st)
    st.handle(_upd("d0", 0, 5.0), 1.0)
    st.handle(_upd("d1", 0, 7.0), 1.0)  # folded; d2 still awaited
    for k in range(3):  # no device has a batch ready any more
        st.handle(m.DeviceStats(fleet="t", sender=f"d{k}", round=0, iteration=0, station="s",
                                seen_counts=np.ones(2, int), next_batch_counts=np.zeros(2, int)),
                  2.0)
    # The cloud moves on: a new global model, too few devices ready, the station gathers.
    st.handle(m.GlobalModel(fleet="t", sender="cloud", round=1, iteration=0,
                            weights=np.full(4, 1.0), p_real=[0.5, 0.5]), 2.0)
    st.tick(100.0)  # the gathering iteration closes at its deadline
    assert st.counters["iterations_without_data"] == 1
    np.testing.assert_allclose(st.weights, 1.0)  # not round 0's updates folded into round 1


def test_station_below_quorum_keeps_its_model():
    st = _station(min_quorum=2)
    _start_station(st)
    st.handle(_upd("d0", 0, 5.0), 1.0)
    st.tick(10.0)
    assert st.counters["iterations_below_quorum"] == 1
    np.testing.assert_allclose(st.weights, 0.0)


def test_station_counts_bad_input_and_keeps_accepted_data():
    st = _station()
    _start_station(st)
    st.handle(_upd("d0", 0, 1.0), 1.0)
    bad = [
        (_upd("intruder", 0, 9.0), "rejected.unknown_sender"),
        (_upd("d1", 0, 9.0, fleet="other"), "rejected.wrong_fleet"),
        (m.DeviceUpdate(fleet="t", sender="d1", round=0, iteration=0, station="s",
                        weights=np.ones(7), num_samples=1), "rejected.wrong_length"),
        (_upd("d1", 5, 9.0), "rejected.stale_iteration"),
        (_upd("d0", 0, 9.0), "duplicates"),
        (_stats("d1", width=3), "rejected.wrong_length"),
        (m.GlobalModel(fleet="t", sender="mallory", round=9, iteration=0, weights=np.ones(4),
                       p_real=[0.5, 0.5]), "rejected.unknown_sender"),
    ]
    for msg, counter in bad:
        before = st.counters[counter]
        assert st.handle(msg, 1.0) == []
        assert st.counters[counter] == before + 1, counter
    assert st.handle(_upd("d1", 0, 9.0, station="other"), 1.0) == []  # another factory's
    st.handle(_upd("d1", 0, 3.0), 1.0)
    st.handle(_upd("d2", 0, 5.0), 1.0)
    np.testing.assert_allclose(st.weights, 3.0)  # d0's first update counted exactly once


def test_station_reports_to_cloud_every_T_iterations():
    st = _station()
    _start_station(st)
    outs = []
    for it in range(2):
        for k in range(3):
            # Each iteration's update is new: the same weights again would be a replay.
            outs += st.handle(_upd(f"d{k}", it, float(k + it), n=k + 1), 1.0)
    ups = [x for x in outs if isinstance(x, m.StationUpdate)]
    assert len(ups) == 1 and ups[0].iteration == 2 and ups[0].num_samples == 2 * 6
    np.testing.assert_allclose(ups[0].weights, (1 * 1 + 2 * 2 + 3 * 3) / 6)
    assert st.state == "waiting"


def test_cloud_p_real_and_station_weighting():
    for weighting, expected in (("samples", 2.5), ("equal", 2.0)):
        cloud = Cloud(CloudConfig(stations=("a", "b"), rounds=2, fleet="t",
                                  station_weighting=weighting),
                      initial_weights=np.zeros(2), num_classes=2)
        assert cloud.handle(m.StationStats(fleet="t", sender="a", round=0, iteration=0,
                                           seen_counts=[3, 1]), 0) == []
        out = cloud.handle(m.StationStats(fleet="t", sender="b", round=0, iteration=0,
                                          seen_counts=[1, 3]), 0)
        np.testing.assert_allclose(out[0].p_real, [0.5, 0.5])
        for sid, w, n in (("a", 1.0, 1), ("b", 3.0, 3)):
            out = cloud.handle(m.StationUpdate(fleet="t", sender=sid, round=0, iteration=5,
                                               weights=np.full(2, w), num_samples=n,
                                               seen_counts=[6, 2] if sid == "a" else [1, 3]), 0)
        g = out[0]
        assert g.round == 1 and g.iteration == 5
        np.testing.assert_allclose(g.weights, expected)
        np.testing.assert_allclose(g.p_real, [7 / 12, 5 / 12])


def test_cloud_deadline_needs_a_quorum():
    cloud = Cloud(CloudConfig(stations=("a", "b"), rounds=3, fleet="t", min_stations=1,
                              round_timeout=10.0),
                  initial_weights=np.zeros(2), num_classes=2)
    for sid in "ab":
        cloud.handle(m.StationStats(fleet="t", sender=sid, round=0, iteration=0,
                                    seen_counts=[1, 1]), 0)
    assert cloud.tick(10.0) == [] and cloud.counters["rounds_below_quorum"] == 1
    cloud.handle(m.StationUpdate(fleet="t", sender="a", round=0, iteration=5,
                                 weights=np.ones(2), num_samples=4, seen_counts=[1, 1]), 12.0)
    out = cloud.tick(20.0)
    assert out[0].round == 1 and cloud.counters["stations_missed"] == 1


def test_device_rejects_foreign_and_malformed_models(digits):
    cfg = DeviceConfig(device_id="d0", station="s", fleet="t", holdout_every=0)
    dev = Device(cfg, _trainer(), num_classes=F, sample_shape=(8, 8),
                 rng=np.random.default_rng(0))
    n = dev.trainer.num_params
    cases = [
        (m.StationModel(fleet="t", sender="s", round=0, iteration=0, weights=np.zeros(n - 1)),
         "rejected.wrong_length"),
        (m.StationModel(fleet="t", sender="other", round=0, iteration=0, weights=np.zeros(n)),
         "rejected.unknown_sender"),
        (m.StationModel(fleet="x", sender="s", round=0, iteration=0, weights=np.zeros(n)),
         "rejected.wrong_fleet"),
    ]
    for msg, counter in cases:
        assert dev.handle(msg, 0) == [] and dev.counters[counter] == 1
    with pytest.raises(ShapeError):
        dev.buffer.push(np.zeros((1, 3)), np.array([0]))


def test_a_selection_ahead_of_its_model_waits_for_it(digits):
    """MQTT orders per topic only: the selection may overtake the model published first."""
    cfg = DeviceConfig(device_id="d0", station="s", fleet="t", holdout_every=0, batch_size=16)
    dev = Device(cfg, _trainer(), num_classes=F, sample_shape=(8, 8),
                 rng=np.random.default_rng(0))
    dev.buffer.push(digits.x_train[:64], digits.y_train[:64])
    w = dev.trainer.get_flat()

    def model(it):
        return dev.handle(m.StationModel(fleet="t", sender="s", round=0, iteration=it,
                                         weights=w), 0)

    def select(it):
        return dev.handle(m.Selection(fleet="t", sender="s", round=0, iteration=it,
                                      members=("d0",), deadline=1), 0)

    assert select(0) == [] and dev.counters["selection.before_model"] == 1  # no model yet
    out = model(0)
    assert [type(x) for x in out] == [m.DeviceStats, m.DeviceUpdate] and out[1].iteration == 0
    assert select(2) == [] and model(1) == []  # still waiting for the model of 2
    out = model(2)
    assert isinstance(out[1], m.DeviceUpdate) and out[1].iteration == 2
    # A selection whose model never comes is dropped when a later model passes it, and a
    # selection behind the model is stale: neither trains.
    assert select(4) == [] and model(5) == [] and dev.counters["rejected.no_model"] == 1
    assert select(3) == [] and dev.counters["rejected.no_model"] == 2
    assert dev.counters["steps"] == 2


def _selected_twice(digits, iterations=(0, 1), **device_kw):
    """A device selected at two iterations; returns (zbar, first z, second z, device)."""
    cfg = DeviceConfig(device_id="d0", station="s", fleet="t", holdout_every=0, batch_size=16,
                       lr=0.5, **device_kw)
    dev = Device(cfg, _trainer(), num_classes=F, sample_shape=(8, 8),
                 rng=np.random.default_rng(0))
    dev.buffer.push(digits.x_train[:32], digits.y_train[:32])
    zbar = _trainer(seed=9).get_flat()
    zs = []
    for it in iterations:
        dev.handle(m.StationModel(fleet="t", sender="s", round=0, iteration=it, weights=zbar), 0)
        out = dev.handle(m.Selection(fleet="t", sender="s", round=0, iteration=it,
                                     members=("d0",), deadline=1.0), 0)
        assert isinstance(out[0], m.DeviceStats) and isinstance(out[1], m.DeviceUpdate)
        zs.append(np.array(out[1].weights))
    return zbar, zs, dev


def _one_step(start, x, y):
    ref = _trainer()
    ref.set_flat(start)
    ref.train_step(x, y)
    return ref.get_flat()


def test_device_starts_from_its_annealed_merge(digits):
    x2, y2 = digits.x_train[16:32], digits.y_train[16:32]
    # mix = 0 and a huge temperature: every entry keeps the local model (p_t ~ 1).
    zbar, (z1, z2), _ = _selected_twice(digits, mix=0.0, temperature=1e12)
    np.testing.assert_allclose(z1, _one_step(zbar, digits.x_train[:16], digits.y_train[:16]),
                               atol=1e-6)
    np.testing.assert_allclose(z2, _one_step(z1, x2, y2), atol=1e-6)
    # mix = 1: the merge is the aggregate, so the device starts from zbar (FedGS exactly).
    zbar, (_, z2), _ = _selected_twice(digits, mix=1.0)
    np.testing.assert_allclose(z2, _one_step(zbar, x2, y2), atol=1e-6)
    # mix = 0.5 with p_t ~ 1: halfway between the local model and the aggregate.
    zbar, (z1, z2), _ = _selected_twice(digits, mix=0.5, temperature=1e12)
    np.testing.assert_allclose(z2, _one_step(0.5 * (z1 + zbar), x2, y2), atol=1e-5)


def test_a_stale_local_model_is_not_merged(digits):
    x2, y2 = digits.x_train[16:32], digits.y_train[16:32]
    # Selected again 3 iterations later, within merge_max_age: the merge keeps z1.
    zbar, (z1, z2), dev = _selected_twice(digits, (0, 3), mix=0.0, temperature=1e12,
                                          merge_max_age=3)
    np.testing.assert_allclose(z2, _one_step(z1, x2, y2), atol=1e-6)
    # 4 iterations later the local model is too old: the device starts from the aggregate.
    zbar, (_, z2), dev = _selected_twice(digits, (0, 4), mix=0.0, temperature=1e12,
                                         merge_max_age=3)
    np.testing.assert_allclose(z2, _one_step(zbar, x2, y2), atol=1e-6)
    assert dev.counters["merge.stale_local"] == 1


def test_the_learning_rate_decays_from_its_iteration_on(digits):
    x2, y2 = digits.x_train[16:32], digits.y_train[16:32]
    zbar, (_, z2), dev = _selected_twice(digits, (0, 3), mix=1.0, lr_decay_at=3,
                                         lr_decay=0.1)
    assert dev.trainer.lr == pytest.approx(0.05)
    slow = _trainer(lr=0.05)
    slow.set_flat(zbar)
    slow.train_step(x2, y2)
    np.testing.assert_allclose(z2, slow.get_flat(), atol=1e-6)
    _, _, dev = _selected_twice(digits, (0, 2), lr_decay_at=3, lr_decay=0.1)
    assert dev.trainer.lr == 0.5


def test_the_upload_gate_waits_for_enough_held_out_samples(digits):
    def gated(min_holdout):
        cfg = DeviceConfig(device_id="d0", station="s", fleet="t", holdout_every=2,
                           batch_size=8, lr=0.5, nu=1e6, gate_min_holdout=min_holdout)
        dev = Device(cfg, _trainer(), num_classes=F, sample_shape=(8, 8),
                     rng=np.random.default_rng(0))
        dev.buffer.push(digits.x_train[:160], digits.y_train[:160])  # 80 held out
        zbar = _trainer(seed=9).get_flat()
        for it in range(5):
            dev.handle(m.StationModel(fleet="t", sender="s", round=0, iteration=it,
                                      weights=zbar), 0)
            dev.handle(m.Selection(fleet="t", sender="s", round=0, iteration=it,
                                   members=("d0",), deadline=1.0), 0)
        return dev.counters

    warming = gated(100)  # 80 < 100: too few for a stable accuracy, every step uploads
    assert warming["uploads"] == 5 and warming["gate.warming_up"] == 5
    assert gated(50)["skipped.gate"] > 0  # enough: nu = 1e6 holds back any gap


class _Recording:
    """A real trainer that also keeps the labels of every batch it trained on."""

    def __init__(self, trainer):
        self.inner, self.trained = trainer, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def train_step(self, x, y):
        self.trained.append(np.bincount(y, minlength=F))
        return self.inner.train_step(x, y)


def test_a_picked_device_trains_on_the_batch_it_reported(digits):
    cfg = DeviceConfig(device_id="d0", station="s", fleet="t", holdout_every=0, batch_size=16,
                       buffer_capacity=48, lr=0.5, mix=1.0)
    trainer = _Recording(_trainer())
    dev = Device(cfg, trainer, num_classes=F, sample_shape=(8, 8), rng=np.random.default_rng(0))
    zbar = trainer.get_flat()
    dev.ingest(digits.x_train[:48], digits.y_train[:48], 0)
    for it in range(4):
        reported = dev._stats(0, it).next_batch_counts
        # Arrivals between the report and the selection overwrite the whole FIFO.
        start = 48 + 64 * it
        dev.ingest(digits.x_train[start:start + 64], digits.y_train[start:start + 64], 0)
        dev.handle(m.StationModel(fleet="t", sender="s", round=0, iteration=it, weights=zbar), 0)
        out = dev.handle(m.Selection(fleet="t", sender="s", round=0, iteration=it,
                                     members=("d0",), deadline=1.0), 0)
        np.testing.assert_array_equal(trainer.trained[-1], reported)
        assert out[0].next_batch_counts.sum() == 16  # the next batch is pinned in turn


def test_devices_report_the_local_accuracy_of_their_deployable_model(digits):
    cfg = DeviceConfig(device_id="d0", station="s", fleet="t", holdout_every=2, batch_size=8,
                       lr=0.5, gate_min_holdout=20, local_eval_interval=3)
    dev = Device(cfg, _trainer(), num_classes=F, sample_shape=(8, 8), rng=np.random.default_rng(0))
    dev.buffer.push(digits.x_train[:200], digits.y_train[:200])
    zbar = _trainer(seed=9).get_flat()
    hx, hy = dev.buffer.holdout()
    probe = _trainer()
    probe.set_flat(zbar)
    for it in range(5):
        dev.handle(m.StationModel(fleet="t", sender="s", round=0, iteration=it, weights=zbar), 0)
        stats = dev.handle(m.Selection(fleet="t", sender="s", round=0, iteration=it,
                                       members=("d0",), deadline=1.0), 0)[0]
        if it == 0:  # the first deployable model is the aggregate: no local model yet
            # Measured after the reply has left (the serve loop's next tick), not before:
            # under emulation the held-out pass made that iteration's reply miss its deadline.
            assert stats.local_samples == 0
            assert dev.tick(0) == [] and dev.counters["local_evaluations"] == 1
            stats = dev._stats(0, it)
            assert stats.local_samples == len(hy)
            assert stats.local_accuracy == pytest.approx(probe.evaluate(hx, hy)[1])
    # iterations 0 and 3: the second measured when iteration 4 begins, with no tick between
    assert dev.counters["local_evaluations"] == 2
    st = Station(StationConfig(fleet="t", station_id="s", devices=("d0",), super_node_size=1,
                               rand_per_group=0), num_params=4,
                 num_classes=F, rng=np.random.default_rng(0))
    st.handle(stats, 0.0)
    assert st.roster.local_accuracies() == [stats.local_accuracy]


def test_device_with_no_data_sends_a_skip_notice(digits):
    cfg = DeviceConfig(device_id="d0", station="s", fleet="t", holdout_every=0)
    dev = Device(cfg, _trainer(), num_classes=F, sample_shape=(8, 8),
                 rng=np.random.default_rng(0))
    n = dev.trainer.num_params
    dev.handle(m.StationModel(fleet="t", sender="s", round=0, iteration=0, weights=np.zeros(n)),
               0)
    out = dev.handle(m.Selection(fleet="t", sender="s", round=0, iteration=0, members=("d0",),
                                 deadline=1.0), 0)
    assert isinstance(out[-1], m.SkipNotice) and dev.counters["skipped.no_data"] == 1


def test_late_joiner_gets_the_model_and_becomes_selectable():
    st = _station(min_devices=2)
    st.handle(_stats("d0"), 0.0)
    out = st.handle(_stats("d1"), 0.0)
    assert isinstance(out[0], m.StationStats)  # started without d2
    out = st.handle(m.GlobalModel(fleet="t", sender="cloud", round=0, iteration=0,
                                  weights=np.zeros(4), p_real=[0.5, 0.5]), 0.0)
    assert next(x for x in out if isinstance(x, m.Selection)).members == ("d0", "d1")
    out = st.handle(_stats("d2"), 1.0)
    assert [type(x) for x in out] == [m.StationModel] and st.counters["late_joins"] == 1
    st.handle(_upd("d0", 0, 1.0), 1.0)
    out = st.handle(_upd("d1", 0, 1.0), 1.0)
    assert next(x for x in out if isinstance(x, m.Selection)).members == ("d0", "d1", "d2")


def test_offline_device_is_not_waited_for_nor_selected():
    st = _station()
    _start_station(st)
    st.handle(_upd("d0", 0, 1.0), 1.0)
    st.handle(_upd("d1", 0, 3.0), 1.0)
    out = st.handle(m.Presence(fleet="t", sender="d2", round=0, iteration=0, role="dev",
                               online=False), 2.0)
    assert st.iteration == 1  # closed at once, not at the deadline
    assert next(x for x in out if isinstance(x, m.Selection)).members == ("d0", "d1")
    np.testing.assert_allclose(st.weights, 2.0)
    st.handle(_stats("d2"), 3.0)  # back online: selectable again
    assert "d2" not in st.offline


def _cloud_with_a_vanished_station(grace: float) -> tuple[Cloud, list[m.Message]]:
    """Stations a and b; a sends round 0's update at 1 s, b's Last Will fires at 2 s."""
    cloud = Cloud(CloudConfig(stations=("a", "b"), rounds=3, fleet="t", station_grace=grace),
                  initial_weights=np.zeros(2), num_classes=2)
    for sid in "ab":
        cloud.handle(m.StationStats(fleet="t", sender=sid, round=0, iteration=0,
                                    seen_counts=[1, 1]), 0)
    cloud.handle(m.StationUpdate(fleet="t", sender="a", round=0, iteration=5,
                                 weights=np.ones(2), num_samples=4, seen_counts=[1, 1]), 1.0)
    out = cloud.handle(m.Presence(fleet="t", sender="b", round=0, iteration=0, role="station",
                                  online=False), 2.0)
    return cloud, out


def test_cloud_stops_waiting_for_a_station_whose_last_will_fired():
    cloud, out = _cloud_with_a_vanished_station(grace=0.0)
    assert out[0].round == 1 and cloud.counters["stations_offline"] == 1
    assert cloud.counters["stations_missed"] == 1
    np.testing.assert_allclose(out[0].weights, 1.0)
    # The next round does not wait for it either.
    out = cloud.handle(m.StationUpdate(fleet="t", sender="a", round=1, iteration=8,
                                       weights=np.ones(2), num_samples=4,
                                       seen_counts=[2, 2]), 3.0)
    assert out[0].round == 2


def test_cloud_waits_its_grace_for_a_vanished_station_to_come_back():
    """A station killed and restarted (systemd, RestartSec=5) resumes within the grace: the
    round takes its update.  One that stays away costs one round the grace, no more."""
    cloud, out = _cloud_with_a_vanished_station(grace=30.0)
    assert out == [] and cloud.wakeup() == 32.0 and cloud.tick(31.9) == []
    back = cloud.handle(m.Presence(fleet="t", sender="b", round=0, iteration=0,
                                   role="station", online=True), 9.0)
    assert back[0].round == 0  # the round's model again, for the restarted station
    assert cloud.tick(40.0) == [] and cloud.wakeup() == cloud.deadline
    out = cloud.handle(m.StationUpdate(fleet="t", sender="b", round=0, iteration=5,
                                       weights=np.full(2, 3.0), num_samples=4,
                                       seen_counts=[1, 1]), 41.0)
    assert out[0].round == 1 and not cloud.counters["stations_missed"]
    np.testing.assert_allclose(out[0].weights, 2.0)  # both stations' updates
    # Gone for good: round 1 closes at its grace, round 2 at a's update.
    cloud, _ = _cloud_with_a_vanished_station(grace=30.0)
    assert cloud.tick(32.0)[0].round == 1
    out = cloud.handle(m.StationUpdate(fleet="t", sender="a", round=1, iteration=8,
                                       weights=np.ones(2), num_samples=4,
                                       seen_counts=[2, 2]), 33.0)
    assert out[0].round == 2


def test_a_device_whose_training_diverges_skips_instead_of_going_silent(digits):
    trainer = _trainer(lr=0.5)
    dev = Device(DeviceConfig(device_id="d0", station="s", fleet="t", holdout_every=0),
                 trainer, num_classes=F, sample_shape=(8, 8), rng=np.random.default_rng(0))
    dev.buffer.push(digits.x_train[:64], digits.y_train[:64])
    huge = np.full(trainer.num_params, 3e38, np.float32)  # finite, but training overflows
    dev.handle(m.StationModel(fleet="t", sender="s", round=0, iteration=0, weights=huge), 0.0)
    with np.errstate(all="ignore"):
        out = dev.handle(m.Selection(fleet="t", sender="s", round=0, iteration=0,
                                     members=("d0",), deadline=1.0), 0.0)
    assert [type(x) for x in out] == [m.DeviceStats, m.SkipNotice]
    assert dev.counters["skipped.non_finite"] == 1 and dev.local.weights is None


def test_a_role_bug_is_counted_every_time_and_logged_once(caplog):
    class Broken:
        counters = __import__("collections").Counter()

        def subscriptions(self):
            return ["t/x"]

        def handle(self, message, now):
            raise ZeroDivisionError("a bug")

        def tick(self, now):
            raise KeyError("another")

    bus, role = LocalBus(), Broken()
    runner = RoleRunner(role, bus, CLOCK)
    msg = m.SkipNotice(fleet="t", sender="d0", round=0, iteration=0, station="s", gap=0.0)
    with caplog.at_level("ERROR", logger="edge_client.transport"):
        for _ in range(50):
            bus.publish("t/x", msg)
            bus.deliver()
            runner.tick()
    assert role.counters["rejected.internal"] == 50 and role.counters["errors.tick"] == 50
    assert len(caplog.records) == 2  # one traceback per kind of failure a minute


def _stepping_clock(step=0.5):
    now = [0.0]

    def clock():
        now[0] += step
        return now[0]
    return clock


def test_a_role_whose_every_tick_fails_ends_naming_why_and_says_so_last(caplog):
    """A tick that fails on every try for the watchdog's window ends the service with
    RoleStalled (exit code 9), logged at error level and in the last summary; one that
    fails only now and then never ends it."""
    from collections import Counter

    from edge_client.errors import RoleStalled
    from edge_client.runner import STALL_AFTER_S, StopFlag, serve

    class Ticks:
        def __init__(self, fail_every):
            self.counters, self.n, self.fail_every = Counter(), 0, fail_every

        def subscriptions(self):
            return []

        def start(self, now):
            return []

        def tick(self, now):
            self.n += 1
            if self.n % self.fail_every == 0:
                raise OSError("the state folder is read-only")
            return []

    summaries = []
    runner = RoleRunner(Ticks(fail_every=1), LocalBus(), _stepping_clock())
    with caplog.at_level("ERROR", logger="edge_client.runner"), \
            pytest.raises(RoleStalled, match="tick failed on every one of .* read-only") as err:
        serve(runner, runner.transport, stop=StopFlag(install=False), idle_sleep=0.0,
              on_stop=lambda: summaries.append(runner.last_error))
    assert err.value.exit_code == 9
    assert STALL_AFTER_S <= runner.role.n <= STALL_AFTER_S + 2  # a turn reads the clock twice
    assert "cannot go on and ends (exit code 9)" in caplog.text
    assert summaries and summaries[0].startswith("stalled: tick failed")

    runner = RoleRunner(Ticks(fail_every=2), LocalBus(), _stepping_clock())
    turns = iter(range(1000))
    serve(runner, runner.transport, stop=StopFlag(install=False), idle_sleep=0.0, linger=0.0,
          done=lambda: next(turns) == 999)  # 500 failures over 1,000 s, a success between each
    assert runner.role.counters["errors.tick"] == runner.role.n // 2 >= 499


def test_only_a_parents_model_that_always_fails_ends_a_role_never_a_participants_message():
    """A device that cannot take its station's model on any try ends (RoleStalled); a station
    whose handler fails on every device message keeps serving: one compromised device must
    not be able to stop it."""
    from edge_client.errors import RoleStalled

    dev = Device(DeviceConfig(device_id="d0", station="s", fleet="t", holdout_every=0),
                 _trainer(), num_classes=F, sample_shape=(8, 8), rng=np.random.default_rng(0))
    bus, clock = LocalBus(), _stepping_clock(10.0)
    runner = RoleRunner(dev, bus, clock)

    def broken(*args):
        raise MemoryError("no room for the model")
    dev.line.offer = broken
    with pytest.raises(RoleStalled, match="handling StationModel failed .* no room"):
        for i in range(20):
            bus.publish(station_model_topic("t", "s"), m.StationModel(
                fleet="t", sender="s", round=0, iteration=i,
                weights=np.zeros(dev.trainer.num_params, np.float32)))
            bus.deliver()
            runner.watchdog.check(clock())
    assert 3 <= dev.counters["rejected.internal"] <= 8  # 60 s of models 10 s apart

    station = Station(StationConfig(fleet="t", station_id="s", devices=("d0", "d1"),
                                    super_node_size=2),
                      num_params=10, num_classes=F, rng=np.random.default_rng(0))
    runner = RoleRunner(station, LocalBus(), _stepping_clock(10.0))
    station.handle = lambda message, now: 1 / 0
    for _ in range(50):
        runner._on_message("t/s/stats", m.SkipNotice(fleet="t", sender="d0", round=0,
                                                     iteration=0, station="s", gap=0.0))
        runner.tick()
        runner.watchdog.check(runner.clock())
    assert station.counters["rejected.internal"] == 50


def test_a_role_that_cannot_start_ends_naming_why():
    from collections import Counter

    from edge_client.errors import RoleStalled
    from edge_client.runner import StopFlag, serve

    class NoStart:
        counters = Counter()

        def subscriptions(self):
            return []

        def start(self, now):
            raise KeyError("first model")

    with pytest.raises(RoleStalled, match="NoStart could not start: KeyError: 'first model'"):
        serve(RoleRunner(NoStart(), LocalBus()), LocalBus(), stop=StopFlag(install=False))


def test_with_rounds_0_the_cloud_never_marks_a_model_final(digits):
    """A field fleet learns until it is stopped: past any number of rounds, every global
    model leads to the next round, none is final."""
    bus, runners, cloud, station, devices, globals_, _ = _fleet(
        digits, rounds=0, feed=[2000] * 4, device_kw={"batch_size": 8})
    for r in runners:
        r.start()
    while len(globals_) < 12:
        assert bus.deliver(limit=50) > 0, "the fleet stopped by itself"
    assert [g.round for g in globals_[:12]] == list(range(12))
    assert not any(g.final for g in globals_) and cloud.state != CloudState.DONE


def test_an_observer_that_fails_neither_holds_the_round_back_nor_goes_unseen(digits, caplog):
    """The cloud's evaluation is an observer of its global models: one that raises (an
    evaluation set the model cannot take) used to keep round 0 from going out, and the
    fleet waited in silence.  The model goes out; the error is counted, logged at error
    level and kept for the role's summary (``safl status``, the page)."""
    from aggregator.status import FleetStatus, format_status
    from edge_client.documents import CloudSummary

    bus, runners, cloud, station, devices, globals_, _ = _fleet(digits, rounds=2)

    def evaluate(message):
        if isinstance(message, m.GlobalModel):
            raise ValueError("input has 12288 features, model expects 1280")
    runners[0].observers.append(evaluate)
    with caplog.at_level("ERROR", logger="edge_client.runner"):
        _run(bus, runners)
    assert globals_ and globals_[-1].final  # the federation ran to its end
    assert cloud.counters["errors.observer"] == len(globals_)
    assert runners[0].last_error == ("errors.observer: ValueError: input has 12288 features, "
                                     "model expects 1280")
    assert any(r.levelname == "ERROR" and "observer" in r.getMessage() for r in caplog.records)
    found = FleetStatus(cloud=CloudSummary(state=cloud.state, round=cloud.round,
                                           iteration=cloud.iteration, stations=("s",),
                                           error=runners[0].last_error))
    assert "ERROR cloud: errors.observer: ValueError: input has 12288" in format_status(
        found, "t")


def _whole(role) -> dict:
    """Everything a station or cloud exposes about where it is."""
    doc = {"state": role.state, "round": role.round, "iteration": role.iteration,
           "deadline": role.deadline, "offline": sorted(role.offline),
           "weights": None if role.weights is None else role.weights.tolist(),
           "counters": dict(role.counters)}
    if isinstance(role, Station):
        doc.update(members=role.members, replies=sorted(role.sync.replies))
    return doc


def _walk(role, base: dict, steps) -> None:
    """Feed ``(event or "tick", time, changes from base)`` steps, checking the whole state."""
    for event, now, expected in steps:
        if event == "tick":
            role.tick(now)
        else:
            role.handle(event, now)
        assert _whole(role) == {**base, **expected}, (event, now)


def _global(rnd, w, final=False):
    return m.GlobalModel(fleet="t", sender="cloud", round=rnd, iteration=2 * rnd,
                         weights=np.full(4, float(w)), p_real=[0.5, 0.5], final=final)


def test_the_station_moves_through_its_states_as_its_table_says():
    from aggregator.station import StationState as S
    st = _station(n=2, sync_period=2)
    base = {"round": 0, "iteration": 0, "deadline": 0.0, "offline": [], "weights": None,
            "counters": {}, "members": (), "replies": []}
    # asked: the seats of each super node filled (two iterations of two members).
    missed = {"asked": 4, "received_updates": 2, "replies_missed": 2, "stragglers_benched": 2,
              "iterations_below_quorum": 1}
    steps = [  # (event, time, the whole state after it)
        (_stats("d0"), 0.0, {"state": S.JOINING}),
        (_stats("d1"), 0.0, {"state": S.WAITING}),
        (_global(0, 1.0), 1.0, {"state": S.COLLECTING, "weights": [1.0] * 4,
                                "members": ("d0", "d1"), "deadline": 11.0,
                                "counters": {"asked": 2}}),
        # Half the super node answered in 1 s: the other has straggler_factor (3) times that.
        (_upd("d0", 0, 3.0), 2.0, {"state": S.COLLECTING, "weights": [1.0] * 4,
                                   "members": ("d0", "d1"), "deadline": 4.0,
                                   "replies": ["d0"],
                                   "counters": {"asked": 2, "received_updates": 1}}),
        (_upd("d1", 0, 5.0), 3.0, {"state": S.COLLECTING, "iteration": 1,
                                   "weights": [4.0] * 4, "members": ("d0", "d1"),
                                   "deadline": 13.0,
                                   "counters": {"asked": 4, "received_updates": 2}}),
        ("tick", 13.0, {"state": S.WAITING, "iteration": 2, "weights": [4.0] * 4,
                        "members": ("d0", "d1"), "deadline": 13.0, "counters": missed}),
        (_global(1, 7.0, final=True), 14.0, {
            "state": S.DONE, "round": 1, "iteration": 2, "weights": [7.0] * 4,
            "members": ("d0", "d1"), "deadline": 13.0, "counters": missed}),
        (_global(2, 9.0), 15.0, {  # nothing moves a station that is done: the table refuses
            "state": S.DONE, "round": 1, "iteration": 2, "weights": [7.0] * 4,
            "members": ("d0", "d1"), "deadline": 13.0,
            "counters": {**missed, "rejected.bad_transition": 1}}),
    ]
    _walk(st, base, steps)


def test_the_cloud_moves_through_its_states_as_its_table_says():
    from aggregator.cloud import CloudState as C
    cloud = Cloud(CloudConfig(fleet="t", stations=("a", "b"), rounds=2, round_timeout=5.0),
                  initial_weights=np.zeros(4), num_classes=2)

    def counts(sid):
        return m.StationStats(fleet="t", sender=sid, round=0, iteration=0,
                              seen_counts=np.array([1, 3]))

    def update(sid, rnd, w):
        return m.StationUpdate(fleet="t", sender=sid, round=rnd, iteration=2 * (rnd + 1),
                               weights=np.full(4, float(w)), num_samples=10,
                               seen_counts=np.array([50, 50]))
    base = {"round": 0, "iteration": 0, "deadline": float("inf"), "offline": [],
            "weights": [0.0] * 4, "counters": {}}
    steps = [
        (counts("a"), 0.0, {"state": C.JOINING}),
        (counts("b"), 1.0, {"state": C.COLLECTING, "deadline": 6.0}),
        (update("a", 0, 2.0), 2.0, {"state": C.COLLECTING, "deadline": 6.0}),
        (update("b", 0, 4.0), 3.0, {"state": C.COLLECTING, "round": 1, "iteration": 2,
                                    "weights": [3.0] * 4, "deadline": 8.0}),
        ("tick", 8.0, {"state": C.COLLECTING, "round": 1, "iteration": 2,  # no quorum yet
                       "weights": [3.0] * 4, "deadline": 13.0,
                       "counters": {"rounds_below_quorum": 1}}),
        (update("a", 1, 5.0), 9.0, {"state": C.COLLECTING, "round": 1, "iteration": 2,
                                    "weights": [3.0] * 4, "deadline": 13.0,
                                    "counters": {"rounds_below_quorum": 1}}),
        (update("b", 1, 7.0), 10.0, {"state": C.DONE, "round": 2, "iteration": 4,
                                     "weights": [6.0] * 4, "deadline": 15.0,
                                     "counters": {"rounds_below_quorum": 1}}),
    ]
    _walk(cloud, base, steps)


def test_a_move_the_table_lacks_is_refused_naming_role_state_and_event():
    from aggregator.station import StationEvent as E
    from aggregator.station import StationState as S
    from edge_client.role import TransitionError
    st = _station(n=1)
    with pytest.raises(TransitionError, match="station s in state joining has no move on "
                       "restarted"):
        st.next_state(E.RESTARTED)
    with pytest.raises(TransitionError, match="in state waiting has no move on sync_due"):
        st.next_state(E.DEVICES_REPORTED, E.SYNC_DUE)  # a chain is checked the whole way
    assert st.next_state(E.DEVICES_REPORTED, E.SUPER_NODE_SELECTED) == S.COLLECTING
    assert st.state == S.JOINING


@pytest.mark.parametrize("mix, keeps", [(1.0, False), (0.5, True)])
def test_a_device_keeps_its_local_model_only_for_a_merge(digits, mix, keeps):
    # 1,000 simulated devices of a 100k-parameter model would otherwise hold 400 MB of local
    # models that FedGS (mix = 1) never reads.
    bus, runners, cloud, station, devices, globals_, _ = _fleet(
        digits, rounds=2, device_kw={"mix": mix, "temperature": 50.0})
    _run(bus, runners)
    assert globals_[-1].final and all(d.counters["steps"] for d in devices)
    assert all((d.local.weights is not None) == keeps for d in devices)


def test_a_device_nobody_answers_says_so_then_at_each_doubling(caplog):
    """A wrong broker, or an ACL that drops its stats, looks like a station not yet up:
    after unanswered_warning seconds of hellos the device says which it may be."""
    cfg = DeviceConfig(device_id="d0", station="s", fleet="t", holdout_every=0,
                       hello_interval=2.0, unanswered_warning=30.0)
    dev = Device(cfg, _trainer(), num_classes=F, sample_shape=(8, 8),
                 rng=np.random.default_rng(0))
    with caplog.at_level("WARNING", logger="edge_client.device"):
        for t in range(0, 130, 2):
            assert len(dev.tick(float(t))) == 1  # a hello every 2 s
    warnings = [r.getMessage() for r in caplog.records if "no answer" in r.getMessage()]
    assert [w.split(" for ")[1].split(" s")[0] for w in warnings] == ["30", "60", "120"]
    assert dev.counters["hellos_unanswered"] == 3 and "ACL" in warnings[0]
    # Once a model came, the silence is over: a later wait counts from its own start.
    n = dev.trainer.num_params
    dev.handle(m.StationModel(fleet="t", sender="s", round=0, iteration=0,
                              weights=np.zeros(n)), 130.0)
    assert dev.tick(131.0) == [] and dev.silence.since is None
    quiet = DeviceConfig(device_id="d1", station="s", fleet="t", unanswered_warning=0)
    silent = Device(quiet, _trainer(), num_classes=F, sample_shape=(8, 8),
                    rng=np.random.default_rng(0))
    for t in range(0, 300, 2):
        silent.tick(float(t))
    assert silent.counters["hellos_unanswered"] == 0


def test_a_device_whose_station_is_online_but_silent_blames_the_wait_not_the_broker(caplog):
    """The station's retained presence came through, so the broker and its ACL work: a
    station still without a model (its roster, its quorum, a cloud that never published
    round 0) is what the warning names."""
    cfg = DeviceConfig(device_id="d0", station="s", fleet="t", holdout_every=0,
                       hello_interval=2.0, unanswered_warning=30.0)
    dev = Device(cfg, _trainer(), num_classes=F, sample_shape=(8, 8),
                 rng=np.random.default_rng(0))
    dev.handle(m.Presence(fleet="t", sender="s", round=0, iteration=0,
                          role=m.Participant.STATION, online=True), 0.0)
    with caplog.at_level("WARNING", logger="edge_client.device"):
        for t in range(0, 40, 2):
            dev.tick(float(t))
    warnings = [r.getMessage() for r in caplog.records if "has sent no model" in r.getMessage()]
    assert len(warnings) == 1 and "cloud" in warnings[0] and "ACL" not in warnings[0], warnings


def test_peers_say_when_a_station_or_the_cloud_goes_away(caplog):
    """A Last Will is logged by whoever depended on the one that vanished."""
    dev = Device(DeviceConfig(device_id="d0", station="s", fleet="t", holdout_every=0),
                 _trainer(), num_classes=F, sample_shape=(8, 8), rng=np.random.default_rng(0))
    station = Station(StationConfig(station_id="s", devices=("d0",), fleet="t",
                                    super_node_size=1, rand_per_group=0),
                      num_params=dev.trainer.num_params, num_classes=F,
                      rng=np.random.default_rng(0))
    cloud = Cloud(CloudConfig(stations=("s",), rounds=3, fleet="t"),
                  initial_weights=dev.trainer.get_flat(), num_classes=F)
    gone, back = ({role: m.Presence(fleet="t", sender=sender, round=0, iteration=0, role=role,
                                    online=online)
                   for role, sender in ((m.Participant.STATION, "s"),
                                        (m.Participant.CLOUD, "cloud"))}
                  for online in (False, True))
    # Heard first as the broker's retained history (a restarted station or device, its peer
    # not yet up): no Last Will fired, so none is claimed.
    with caplog.at_level("WARNING"):
        dev.handle(gone[m.Participant.STATION], 0.5)
        station.handle(gone[m.Participant.CLOUD], 0.5)
    assert not caplog.records and station.counters["cloud_offline"] == 0
    dev.handle(back[m.Participant.STATION], 0.6)
    station.handle(back[m.Participant.CLOUD], 0.6)
    with caplog.at_level("WARNING"):
        dev.handle(gone[m.Participant.STATION], 1.0)
        cloud.handle(gone[m.Participant.STATION], 1.0)
        station.handle(gone[m.Participant.CLOUD], 1.0)
    said = " | ".join(r.getMessage() for r in caplog.records)
    assert "station s went offline" in said and "the cloud went offline" in said
    assert said.count("went offline") == 3
    assert dev.counters["station_offline"] == 1 and station.counters["cloud_offline"] == 1


def test_a_device_away_when_the_final_model_went_out_finishes_on_the_final_presence(caplog):
    """The flake of test_a_broker_restart_is_survived[False], on demand: a broker without
    persistence restarts near the end, the station's final model goes out while a device is
    still reconnecting (no session to queue it in), and the device waited forever.  The
    station's retained offline presence at a normal end says final: nothing more will come."""
    cfg = DeviceConfig(device_id="d0", station="s", fleet="t", holdout_every=0)
    dev = Device(cfg, _trainer(), num_classes=F, sample_shape=(8, 8),
                 rng=np.random.default_rng(0))
    n = dev.trainer.num_params

    def presence(online, final=False):
        return m.Presence(fleet="t", sender="s", round=0, iteration=0,
                          role=m.Participant.STATION, online=online, final=final)

    # Before any model of this station: a final presence retained from an earlier run ends
    # nothing (a fresh device waits for the new federation's station).
    assert dev.handle(presence(False, final=True), 0.0) == [] and not dev.finished
    dev.handle(m.StationModel(fleet="t", sender="s", round=7, iteration=21,
                              weights=np.zeros(n)), 1.0)
    dev.handle(presence(False), 2.0)  # a Last Will: it waits for the station
    assert not dev.finished
    with caplog.at_level("INFO", logger="edge_client.device"):
        dev.handle(presence(False, final=True), 3.0)
    assert dev.finished and dev.counters["final_missed"] == 1
    assert "finished while this device was away" in caplog.text and "round 7" in caplog.text


def test_a_service_ended_by_its_federation_says_final_one_stopped_does_not(tmp_path):
    """``serve`` closes with a final presence only when ``done()`` ended it."""
    from edge_client.runner import StopFlag, serve

    class Recording(LocalBus):
        def close(self, final: bool = False) -> None:
            self.final = final
            super().close(final)

    dev = Device(DeviceConfig(device_id="d0", station="s", fleet="t", holdout_every=0),
                 _trainer(), num_classes=F, sample_shape=(8, 8), rng=np.random.default_rng(0))
    for done, stopped, final in ((True, False, True), (False, True, False)):
        bus = Recording()
        stop = StopFlag(install=False)
        if stopped:
            stop.event.set()
        serve(RoleRunner(dev, bus), bus, stop=stop, done=lambda d=done: d, linger=0.0)
        assert bus.final is final


def test_devices_coming_back_together_get_one_model_broadcast_a_second():
    """A broker restart fires every Last Will, and a thousand devices come back within
    seconds: one broadcast reaches them all, so the model goes out at most once a second
    however many come back (one a device put 1,000 x 51 MB through a thousand-camera
    station's broker), and once more for those that came after it."""
    st = _station(n=40, min_devices=2)
    st.handle(_stats("d0"), 0.0)
    st.handle(_stats("d1"), 0.0)
    st.handle(m.GlobalModel(fleet="t", sender="cloud", round=0, iteration=0,
                            weights=np.zeros(4), p_real=[0.5, 0.5]), 0.0)
    models = lambda out: sum(isinstance(x, m.StationModel) for x in out)  # noqa: E731
    sent = [models(st.handle(_stats(f"d{k}"), 1.0 + k / 100)) for k in range(2, 40)]
    assert sent[0] == 1 and sum(sent) == 1 and st.counters["late_joins"] == 38
    assert st.wakeup() == pytest.approx(2.02)  # a second after the first, at 1.02
    assert models(st.tick(1.9)) == 0
    assert models(st.tick(2.02)) == 1  # for those after the first broadcast
    assert models(st.tick(3.5)) == 0  # and no more while none come
    for k in range(5):  # back after their Last Wills
        st.handle(m.Presence(fleet="t", sender=f"d{k}", round=0, iteration=0, role="dev",
                             online=False), 4.0)
    assert sum(models(st.handle(_stats(f"d{k}"), 5.0)) for k in range(5)) == 1


def test_a_late_joiners_owed_model_does_not_put_off_the_iteration_deadline():
    """The station wakes for whichever comes first: its deadline or the model it owes late
    joiners (the virtual clock jumps to ``wakeup``, a service sleeps until it)."""
    st = _station(n=6, min_devices=2, iteration_timeout=0.5)
    st.handle(_stats("d0"), 0.0)
    st.handle(_stats("d1"), 0.0)
    st.handle(m.GlobalModel(fleet="t", sender="cloud", round=0, iteration=0,
                            weights=np.zeros(4), p_real=[0.5, 0.5]), 0.0)
    st.handle(_stats("d2"), 0.1)
    st.handle(_stats("d3"), 0.2)  # owed at 1.1
    assert st.roster.late.due_at == pytest.approx(1.1) and st.deadline <= 0.5
    assert st.wakeup() == st.deadline
    st.tick(st.deadline)  # the next iteration's deadline is later than what is owed
    assert st.wakeup() == pytest.approx(min(st.deadline, 1.1))
