"""Crash and restart: atomic checkpoints, roles that resume bit for bit, and presence that
drives re-announcement between device, station and cloud."""

from __future__ import annotations

import numpy as np
import pytest

from aggregator.checkpoint import (
    CheckpointError,
    StationCheckpoint,
    load_checkpoint,
    save_checkpoint,
)
from aggregator.cloud import Cloud
from aggregator.config import CloudConfig, StationConfig
from aggregator.station import Station
from edge_client import messages as m
from edge_client.config import DeviceConfig
from edge_client.device import Device
from edge_client.trainers import build_trainer


def test_checkpoints_round_trip_atomically_and_refuse_a_corrupt_file(tmp_path):
    path = tmp_path / "state" / "cloud.ckpt.npz"
    assert load_checkpoint(path) is None
    w = np.random.default_rng(0).normal(size=1000).astype(np.float32)
    save_checkpoint(path, {"weights": w}, {"round": 3, "rng": {"state": 2**100}})
    save_checkpoint(path, {"weights": w + 1}, {"round": 4, "rng": {"state": 2**100}})
    arrays, meta = load_checkpoint(path)
    assert np.array_equal(arrays["weights"], w + 1) and meta["round"] == 4
    assert meta["rng"]["state"] == 2**100
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left over
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="cannot be read"):
        load_checkpoint(path)


def test_a_checkpoints_role_is_a_participant_and_a_strange_one_is_refused():
    from aggregator.checkpoint import CloudCheckpoint, StationCheckpoint
    doc = {"role": "cloud", "state": "collecting", "round": 1, "iteration": 2,
           "counters": {}, "consumed": {}}
    meta = CloudCheckpoint.from_doc(doc)
    assert meta.role is m.Participant.CLOUD
    assert StationCheckpoint.from_doc({**doc, "id": "s", "consumed": 0, "upload_samples": None,
                                       "seen_at": {}, "norms": [], "recent": [],
                                       "rng": {}}).role is m.Participant.CLOUD  # as written
    with pytest.raises(CheckpointError, match="role 'gateway'"):
        CloudCheckpoint.from_doc({**doc, "role": "gateway"})


def _cloud(w0, optimizer="fedavgm"):
    cfg = CloudConfig(fleet="t", stations=("a", "b"), rounds=4, server_optimizer=optimizer,
                      server_lr=1.0)
    return Cloud(cfg, initial_weights=w0, num_classes=2)


def _station_update(s, r, w, n=10):
    return m.StationUpdate(fleet="t", sender=s, round=r, iteration=5 * (r + 1),
                           weights=w, num_samples=n, seen_counts=np.array([400, 400]))


def _play(cloud, rounds, rng_seed=1):
    rng = np.random.default_rng(rng_seed)
    out = []
    for r in rounds:
        for s in ("a", "b"):
            out = cloud.handle(_station_update(s, r, rng.normal(size=8).astype(np.float32)), 0.0)
    return out


def test_a_restored_cloud_continues_bit_for_bit():
    w0 = np.zeros(8, np.float32)
    original = _cloud(w0)
    for s in ("a", "b"):
        original.handle(m.StationStats(fleet="t", sender=s, round=0, iteration=0,
                                       seen_counts=np.array([400, 400])), 0.0)
    _play(original, [0])
    arrays, meta = original.snapshot()  # taken as round 1 is broadcast
    snapshot_weights = arrays["weights"].copy()
    final = _play(original, [1, 2], rng_seed=2)[0]

    resumed = _cloud(np.ones(8, np.float32))
    resumed.restore(arrays, meta)
    repeat = resumed.start(0.0)
    assert repeat[0].round == 1 and repeat[0].weights.tobytes() == snapshot_weights.tobytes()
    again = _play(resumed, [1, 2], rng_seed=2)[0]
    assert again.round == final.round == 3
    assert again.weights.tobytes() == final.weights.tobytes()  # momentum state came back too


def test_a_cloud_repeats_its_model_to_a_station_that_comes_back():
    cloud = _cloud(np.zeros(8, np.float32))
    for s in ("a", "b"):
        cloud.handle(m.StationStats(fleet="t", sender=s, round=0, iteration=0,
                                    seen_counts=np.array([400, 400])), 0.0)
    back = m.Presence(fleet="t", sender="a", round=0, iteration=0, role="station", online=True)
    out = cloud.handle(back, 1.0)
    assert [type(x) for x in out] == [m.GlobalModel] and out[0].round == 0
    assert cloud.counters["rebroadcasts"] == 1


def _station():
    cfg = StationConfig(fleet="t", station_id="s", devices=("d0", "d1"), super_node_size=2,
                        rand_per_group=0, sync_period=1, batch_size=8)
    return Station(cfg, num_params=4, num_classes=2, rng=np.random.default_rng(0))


def test_a_restored_station_repeats_its_unanswered_upload_and_reannounces(tmp_path):
    st = _station()
    for d in ("d0", "d1"):
        st.handle(m.DeviceStats(fleet="t", sender=d, round=0, iteration=0, station="s",
                                seen_counts=np.array([40, 40]),
                                next_batch_counts=np.array([4, 4])), 0.0)
    st.handle(m.GlobalModel(fleet="t", sender="cloud", round=0, iteration=0,
                            weights=np.zeros(4), p_real=[0.5, 0.5]), 0.0)
    for d in ("d0", "d1"):
        out = st.handle(m.DeviceUpdate(fleet="t", sender=d, round=0, iteration=0, station="s",
                                       weights=np.full(4, 0.1), num_samples=8), 0.0)
    upload = out[0]
    assert isinstance(upload, m.StationUpdate) and st.state == "waiting"
    arrays, meta = st.snapshot()
    # Through the file, as a restarted service reads it; a checkpoint written before a field
    # was added still loads (the field takes its default), one without a required field not.
    save_checkpoint(tmp_path / "s.ckpt.npz", arrays, meta)
    arrays, doc = load_checkpoint(tmp_path / "s.ckpt.npz")
    older = {k: v for k, v in doc.items() if k not in ("sitting_out", "consumed_before")}
    assert StationCheckpoint.from_doc(older).sitting_out == {}
    with pytest.raises(CheckpointError, match="seen_at"):
        StationCheckpoint.from_doc({k: v for k, v in doc.items() if k != "seen_at"})
    meta = StationCheckpoint.from_doc(doc)

    resumed = _station()
    resumed.restore(arrays, meta)
    again = resumed.start(0.0)
    assert [type(x) for x in again] == [m.StationStats, m.StationUpdate]
    assert again[1].weights.tobytes() == upload.weights.tobytes()
    assert again[1].num_samples == upload.num_samples == 16
    assert resumed.rng.bit_generator.state == st.rng.bit_generator.state
    cloud_back = m.Presence(fleet="t", sender="cloud", round=0, iteration=0, role="cloud",
                            online=True)
    assert [type(x) for x in resumed.handle(cloud_back, 1.0)] == [m.StationStats,
                                                                  m.StationUpdate]
    # The repeated global model of a round already applied is a duplicate, not an error.
    resumed.handle(m.GlobalModel(fleet="t", sender="cloud", round=1, iteration=1,
                                 weights=np.zeros(4), p_real=[0.5, 0.5]), 2.0)
    resumed.handle(m.GlobalModel(fleet="t", sender="cloud", round=1, iteration=1,
                                 weights=np.zeros(4), p_real=[0.5, 0.5]), 2.0)
    assert resumed.counters["duplicates"] == 1
    assert not any(k.startswith("rejected.") for k in resumed.counters)


def test_a_device_follows_its_station_back_to_an_older_iteration(digits):
    trainer = build_trainer("softmax", input_shape=(8, 8), num_classes=10, lr=0.1, seed=0)
    dev = Device(DeviceConfig(device_id="d0", station="s", fleet="t"), trainer,
                 num_classes=10, sample_shape=(8, 8), rng=np.random.default_rng(0))
    dev.buffer.push(digits.x_train[:100], digits.y_train[:100])

    def model(it):
        return m.StationModel(fleet="t", sender="s", round=0, iteration=it,
                              weights=trainer.get_flat())
    dev.handle(model(7), 0.0)
    dev.handle(model(3), 0.0)
    assert dev.counters["rejected.stale_iteration"] == 1  # an old model out of order
    out = dev.handle(m.Presence(fleet="t", sender="s", round=0, iteration=0, role="station",
                                online=True), 1.0)
    assert [type(x) for x in out] == [m.DeviceStats]  # the station asked for stats
    dev.handle(model(3), 1.0)  # it resumed from an older checkpoint
    assert dev.counters["station_rewinds"] == 1
    out = dev.handle(m.Selection(fleet="t", sender="s", round=0, iteration=3, members=("d0",),
                                 deadline=10.0), 1.0)
    assert any(isinstance(x, m.DeviceUpdate) and x.iteration == 3 for x in out)


def test_a_device_kept_running_after_the_final_model_follows_its_station_into_a_new_run(digits):
    trainer = build_trainer("softmax", input_shape=(8, 8), num_classes=10, lr=0.1, seed=0)
    dev = Device(DeviceConfig(device_id="d0", station="s", fleet="t"), trainer,
                 num_classes=10, sample_shape=(8, 8), rng=np.random.default_rng(0))
    dev.buffer.push(digits.x_train[:100], digits.y_train[:100])

    def model(it, final=False):
        return m.StationModel(fleet="t", sender="s", round=0, iteration=it,
                              weights=trainer.get_flat(), final=final)
    dev.handle(model(9, final=True), 0.0)
    assert dev.finished
    dev.handle(model(10), 0.0)  # nothing moves a finished device on its own
    assert dev.finished and dev.counters["rejected.bad_transition"] == 1
    dev.handle(m.Presence(fleet="t", sender="s", round=0, iteration=0, role="station",
                          online=True), 1.0)  # the station came back: a new federation
    dev.handle(model(0), 1.0)
    out = dev.handle(m.Selection(fleet="t", sender="s", round=0, iteration=0, members=("d0",),
                                 deadline=10.0), 1.0)
    assert not dev.finished and any(isinstance(x, m.DeviceUpdate) for x in out)


def test_two_processes_writing_one_file_each_leave_it_whole(tmp_path):
    """Two writers of one path (two devices given one state folder) used to share a
    temporary name: one renamed it away and the other died of FileNotFoundError."""
    import subprocess
    import sys

    script = ("import sys\nfrom edge_client.files import write_atomic\n"
              "for _ in range(300):\n"
              "    write_atomic(sys.argv[1], sys.argv[2].encode() * 4096)\n")
    target = tmp_path / "deployable.frame"
    procs = [subprocess.Popen([sys.executable, "-c", script, str(target), tag],
                              stderr=subprocess.PIPE) for tag in "ab"]
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err.decode()[-1000:]
    assert target.read_bytes() in (b"a" * 4096, b"b" * 4096)
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_thousand_device_roster_checkpoints_as_stacks_and_older_checkpoints_still_load(
        tmp_path):
    """A roster's histograms go as one stack a kind (3,000 arrays at 1,000 devices made a
    checkpoint take 0.1 s); the station restored from it knows each device as before, and
    so does one restored from the one-array-a-device layout of earlier checkpoints."""
    ids = tuple(f"d{k:04d}" for k in range(1000))
    st = Station(StationConfig(fleet="t", station_id="s", devices=ids, super_node_size=4),
                 num_params=4, num_classes=3, rng=np.random.default_rng(0))
    for k, d in enumerate(ids):
        st.handle(m.DeviceStats(fleet="t", sender=d, round=0, iteration=0, station="s",
                                seen_counts=np.array([k, 2 * k, 3]),
                                next_batch_counts=np.array([1, k % 2, 0])), 0.0)
    arrays, meta = st.snapshot()
    assert len(arrays) < 20, sorted(arrays)
    save_checkpoint(tmp_path / "s.ckpt.npz", arrays, meta)
    arrays, doc = load_checkpoint(tmp_path / "s.ckpt.npz")
    # The layout before stacks: one array a device and kind, under "<kind>_<device>".
    older = {k: v for k, v in arrays.items() if "__" not in k}
    for kind in {k.split("__")[0] for k in arrays if k.endswith("__keys")}:
        older.update({f"{kind}_{d}": row for d, row in zip(arrays[f"{kind}__keys"],
                                                          arrays[f"{kind}__stack"],
                                                          strict=True)})
    for saved in (arrays, older):
        back = Station(st.config, num_params=4, num_classes=3, rng=np.random.default_rng(0))
        back.restore(saved, StationCheckpoint.from_doc(doc))
        assert set(back.stats) == set(ids)
        for d in ids:
            assert back.stats[d].seen_counts.tolist() == st.stats[d].seen_counts.tolist()
            assert back.stats[d].next_batch_counts.tolist() == \
                st.stats[d].next_batch_counts.tolist()
        assert back.roster.ready() == st.roster.ready()
