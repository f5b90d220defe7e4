"""Inference on the stream: prequential accuracy, live labels, the stream loop, export."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections import Counter

import numpy as np
import pytest

from edge_client import messages as m
from edge_client.cli import main as device_main
from edge_client.config import DeviceConfig, InferenceConfig
from edge_client.device import Device
from edge_client.documents import Prediction, decode_document, encode_document
from edge_client.errors import ConfigError
from edge_client.inference import NOT_PREDICTED, Prequential
from edge_client.serving import StreamFeed, load_deployable, save_deployable
from edge_client.sources import LiveLabels
from edge_client.sources.pump import SourcePump
from edge_client.trainers import build_trainer, layout_hash


def test_prequential_scores_the_last_window_overall_and_per_class():
    pre = Prequential(window=4, num_classes=3)
    assert math.isnan(pre.accuracy) and pre.samples == 0
    assert pre.score(np.array([0, 1, 2]), np.array([0, 0, NOT_PREDICTED])) == 2
    assert pre.accuracy == 0.5 and pre.samples == 2
    pre.score(np.array([2, 2, 2, 1]), np.array([2, 2, 2, 1]))  # pushes the first two out
    assert pre.accuracy == 1.0 and pre.samples == 4 and pre.scored == 6
    per = pre.per_class()
    assert math.isnan(per[0]) and per[1] == 1.0 and per[2] == 1.0


DEFAULT = InferenceConfig()


def _device(digits, inference=DEFAULT, **cfg):
    return Device(DeviceConfig(device_id="d0", station="s0", batch_size=16, **cfg),
                  build_trainer("softmax", input_shape=(8, 8), num_classes=10, lr=0.1, seed=0),
                  num_classes=10, sample_shape=(8, 8), rng=np.random.default_rng(0),
                  inference=inference)


def _model(weights, iteration=0, round_=0):
    return m.StationModel(fleet="default", sender="s0", round=round_, iteration=iteration,
                          weights=weights)


def test_each_labelled_sample_is_predicted_before_it_is_trained_on(digits):
    dev = _device(digits)
    x, y = digits.x_train[:200], digits.y_train[:200]
    dev.ingest(x[:50], y[:50], 0.0)  # no model yet: nothing to predict with
    assert dev.line.prequential.samples == 0 and dev.counters["inference.no_model"] == 50
    trained = build_trainer("softmax", input_shape=(8, 8), num_classes=10, lr=0.5, seed=1)
    for _ in range(60):
        trained.train_step(digits.x_train[:600], digits.y_train[:600])
    dev.handle(_model(trained.get_flat()), 0.0)
    dev.ingest(x[50:], y[50:], 1.0)
    expected = (trained.logits(x[50:]).argmax(1) == y[50:]).mean()
    assert dev.line.prequential.samples == 150
    assert dev.line.prequential.accuracy == pytest.approx(expected)
    gauges = dev.metrics()
    assert gauges["prequential_accuracy"] == pytest.approx(expected)
    hits = trained.logits(x[50:]).argmax(1) == y[50:]
    for k in np.unique(y[50:]):
        assert gauges[f"prequential_accuracy.class_{k}"] == pytest.approx(hits[y[50:] == k].mean())
    stats = dev._stats(0, 0)
    assert stats.prequential_samples == 150 and stats.prequential_accuracy == pytest.approx(
        expected)
    # Its counts since it started, for its station's drift watch (aggregator/drift.py).
    assert (stats.prequential_scored, stats.prequential_hits) == (150, int(hits.sum()))


def test_every_model_and_the_merged_start_are_candidates_for_the_line(digits):
    dev = _device(digits, InferenceConfig(promote_every=1), mix=0.5, temperature=5.0)
    dev.ingest(digits.x_train[:64], digits.y_train[:64], 0.0)
    w0 = np.zeros(dev.trainer.num_params, np.float32)
    dev.handle(_model(w0, 0), 0.0)
    # Nothing to compare with: in at once.
    assert dev.line.deployable is not None and not dev.line.deployable.any()
    dev.handle(m.Selection(fleet="default", sender="s0", round=0, iteration=0,
                           members=("d0",), deadline=60.0), 0.0)
    # An unselected device keeps up with its station: the broadcast is a candidate (as good
    # as the zeros on these samples: both predict one class), promoted.  It judges the
    # merge of iteration 0 as it arrives, and is judged itself at the next labels.
    dev.handle(_model(np.full_like(w0, 1e-3), 1), 0.0)
    dev.ingest(digits.x_train[64:96], digits.y_train[64:96], 0.0)
    assert dev.line.deployable_iteration == 1 and dev.counters["promotions"] == 3
    dev.handle(m.Selection(fleet="default", sender="s0", round=0, iteration=1,
                           members=("d0",), deadline=60.0), 0.0)
    dev.ingest(digits.x_train[96:128], digits.y_train[96:128], 0.0)
    # Selected, with a fresh local model: the merge it made is the next candidate.
    assert dev.line.deployable_iteration == 1 and not np.array_equal(dev.line.deployable,
                                                                np.full_like(w0, 1e-3))
    assert not Device(dev.config, dev.trainer, num_classes=10, sample_shape=(8, 8),
                      rng=np.random.default_rng(0)).line.prequential  # the simulator's default


class _Frames:
    """A source of camera-like frames: (sample, label or None, frame number, capture time)."""

    def __init__(self, items):
        self.items, self.counters = items, Counter()

    def samples(self):
        yield from self.items

    def close(self):
        pass


def _drained_pump(items):
    pump = SourcePump(_Frames(items), capacity=len(items) + 1).start()
    pump.finished.wait(5)
    return pump


def _ready_device(digits, inference):
    dev = _device(digits, inference=inference)
    dev.handle(_model(np.zeros(650, np.float32)), 0.0)
    return dev


def test_the_stream_loop_publishes_predictions_and_skips_a_backlog(digits, tmp_path):
    now = time.time()
    items = [(digits.x_train[i], int(digits.y_train[i]), i, now - 1 + i * 0.01)
             for i in range(100)]
    published = []
    jsonl = tmp_path / "pred.jsonl"
    dev = _ready_device(digits, InferenceConfig(max_batch=30, jsonl=str(jsonl)))
    feed = StreamFeed(dev, _drained_pump(items), inference=dev.inference,
                      publish=published.append)
    feed(0.0)
    feed.close()
    # The 30 newest were predicted; 70 skipped, all 100 buffered for training all the same.
    assert len(published) == 30 and dev.counters["inference_skipped"] == 70
    assert [p.frame for p in published] == list(range(70, 100))
    assert dev.buffer.samples_seen == 100 and dev.line.prequential.samples == 30
    doc = published[0]
    assert doc.model_round == 0 and 0 < doc.confidence <= 1 and doc.latency_ms >= 0
    assert decode_document(encode_document(doc)) == doc
    lines = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert len(lines) == 30 and set(lines[0]) == {"t", "frame", "label", "confidence",
                                                  "model_round", "latency_ms", "item_t",
                                                  "product", "novelty", "unknown"}
    assert all(p.item_t == p.t for p in published)  # no live labels: no lag
    # One document, one serialiser: a line is the published document's fields, byte for byte.
    assert jsonl.read_bytes().splitlines() == [encode_document(p, bare=True) for p in published]
    # fps caps predictions by capture time: 100 frames over 1 s at 20 fps -> 20.
    dev2 = _ready_device(digits, InferenceConfig(fps=20))
    published.clear()
    StreamFeed(dev2, _drained_pump(items), inference=dev2.inference,
               publish=published.append)(0.0)
    assert len(published) == 20 and dev2.counters.get("inference_skipped", 0) == 0


def test_live_labels_join_the_frame_captured_nearest_before_them():
    clock = [1000.0]
    labels = LiveLabels(3, window=0.5, delay_max=30.0, clock=lambda: clock[0])
    xs = np.arange(4, dtype=np.float32)[:, None]
    labels.add_frames(xs, np.array([10.0, 10.2, 10.4, 20.0]), np.array([1, 2, 0, 1]))
    [joined] = labels.add_label(b'{"t": 10.3, "label": 2}')
    assert joined[0][0] == 1.0 and joined[1:] == (2, 2)  # 10.2, not 10.4
    assert labels.add_label(b'{"t": 15.0, "label": 1}') == []  # 4.6 s after 10.4: no frame
    assert labels.counters["label_unmatched"] == 1 and labels.pending == 3
    # A label naming a time no frame has reached yet waits for the frames read after it:
    # the frame read nearest before it may still be on its way.
    assert labels.add_label(b'{"t": 20.5, "label": 0}') == []
    assert labels.counters["label_unmatched"] == 1
    [late] = labels.add_frames(np.array([[7.0], [8.0]], dtype=np.float32),
                               np.array([20.4, 20.6]), np.array([0, 0]))
    assert late[0][0] == 7.0 and labels.pending == 4
    for bad, reason in ((b"not json", "malformed"), (b'{"t": 10.0}', "malformed"),
                        (b'{"t": 10.0, "label": 3}', "out_of_range"),
                        (b'{"t": 10.0, "label": true}', "out_of_range"),
                        (b'{"t": NaN, "label": 1}', "bad_time"),
                        (b'{"t": 1e999, "label": 1}', "bad_time"),
                        (b'{"t": 1e10, "label": 1}', "bad_time"),  # from the future
                        (b'{"t": 10, "label": 1, "pad": "' + b"x" * 2000 + b'"}', "oversized")):
        assert labels.add_label(bad) == []
        assert labels.counters[f"label_refused.{reason}"] >= 1, bad[:30]
    assert labels.pending == 4  # no refusal touched the frames waiting
    # A label exactly delay_max ahead of the device's clock waits; a hair past it is refused.
    assert labels.add_label(json.dumps({"t": clock[0] + 30.0, "label": 1}).encode()) == []
    before = labels.counters["label_refused.bad_time"]
    labels.add_label(json.dumps({"t": clock[0] + 30.001, "label": 1}).encode())
    assert labels.counters["label_refused.bad_time"] == before + 1
    clock[0] = 10.4 + 30.0 + 0.01
    assert labels.expire() == 2 and labels.counters["label_expired"] == 2  # 10.0 and 10.4
    assert labels.pending == 2
    # A label whose frames never come (the camera stopped) is unmatched after delay_max.
    labels.add_label(b'{"t": 40.0, "label": 1}')
    clock[0] += 30.01
    labels.expire()
    assert labels.counters["label_unmatched"] == 2


def test_labels_waiting_for_their_frames_are_bounded():
    """A line that floods labels no frame has reached: the waiting labels stay at capacity,
    the ones pushed out counted unmatched; at capacity exactly, none is."""
    labels = LiveLabels(3, window=0.5, delay_max=30.0, capacity=4, clock=lambda: 100.0)
    for k in range(4):
        labels.add_label(json.dumps({"t": 101.0 + k, "label": 1}).encode())
    assert labels.counters["label_unmatched"] == 0 and len(labels._waiting) == 4
    labels.add_label(b'{"t": 110.0, "label": 1}')
    assert labels.counters["label_unmatched"] == 1 and len(labels._waiting) == 4


def test_frames_wait_for_their_label_and_are_trained_on_only_then(digits):
    now = time.time()
    items = [(digits.x_train[i], None, i, now + i * 0.1) for i in range(20)]
    dev = _ready_device(digits, InferenceConfig())
    labels = LiveLabels(10, window=0.05, delay_max=30.0)
    feed = StreamFeed(dev, _drained_pump(items), inference=dev.inference, labels=labels,
                      publish=lambda doc: None)
    feed(0.0)
    assert dev.counters["predictions"] == 20 and dev.buffer.samples_seen == 0
    assert labels.pending == 20
    for i in range(0, 20, 2):
        feed.on_label(json.dumps({"t": now + i * 0.1 + 0.01,
                                  "label": int(digits.y_train[i])}).encode(), 1.0)
    assert dev.buffer.samples_seen == 10 and labels.counters["label_joined"] == 10
    assert dev.buffer.seen_counts.sum() == 10 and dev.line.prequential.samples == 10
    assert feed.on_label(b'{"t": 1, "label": 99}', 2.0) == []  # refused, counted, no crash


def test_prequential_scoring_changes_no_training_in_the_simulator(digits):
    from lab.experiment import _fleet, _strategy, load_experiment
    from lab.simulation import run_federation

    cfg = load_experiment("experiments/quick.toml")
    runs = {}
    for every in (0, 2):
        c = dataclasses.replace(cfg, prequential_every=every)
        runs[every] = run_federation(digits, _strategy(c, "safl_fedgs"),
                                     _fleet(c, digits, 0, "none"))
    assert [r["accuracy"] for r in runs[0].rows] == [r["accuracy"] for r in runs[2].rows]
    assert all(math.isnan(r["prequential_mean"]) for r in runs[0].rows)
    last = runs[2].rows[-1]
    assert 0.2 < last["prequential_mean"] <= 1 and last["prequential_worst10"] <= \
        last["prequential_mean"]
    assert runs[2].counters["prequential.scored"] > 1000


@pytest.mark.parametrize("backend", ["numpy", "torch", "ort"])
def test_the_exported_model_predicts_as_the_device_does(backend, digits, tmp_path, exported):
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    if backend == "numpy":
        model, shape, artifacts = "mlp", (64,), ""
    else:
        model, shape = "small_cnn", (1, 8, 8)
        artifacts = str(exported("small_cnn", input_shape=shape, num_classes=10)) \
            if backend == "ort" else ""
    if backend == "torch":
        pytest.importorskip("torch")
    trainer = build_trainer(model, backend=backend, input_shape=shape, num_classes=10,
                            lr=0.1, seed=3, artifacts=artifacts or None)
    x = digits.x_test[:300].reshape(300, *shape).astype(np.float32)
    for _ in range(20):
        trainer.train_step(digits.x_train[:256].reshape(256, *shape), digits.y_train[:256])
    dev = Device(DeviceConfig(device_id="cam1", station="s0"), trainer, num_classes=10,
                 sample_shape=shape, rng=np.random.default_rng(0), inference=InferenceConfig())
    dev.handle(_model(trainer.get_flat(), iteration=7, round_=3), 0.0)
    state = tmp_path / "state"
    save_deployable(state, dev, layout_hash(trainer.layout))
    toml = tmp_path / "dev.toml"
    toml.write_text(
        f'[device]\ndevice_id = "cam1"\nstation = "s0"\n'
        f'[model]\nname = "{model}"\nbackend = "{backend}"\n'
        f'input_shape = {list(shape)}\nnum_classes = 10\nseed = 3\n'
        + (f'artifacts = "{artifacts}"\n' if artifacts else "")
        + f'[source]\nkind = "synthetic"\n[service]\nstate_dir = "{state}"\n')
    out = tmp_path / "model.onnx"
    assert device_main(["export", "--config", str(toml), "--out", str(out)]) == 0
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    meta = session.get_modelmeta().custom_metadata_map
    assert meta["safl.model_round"] == "3" and meta["safl.num_classes"] == "10"
    assert meta["safl.input_shape"] == ",".join(map(str, shape))
    logits = session.run(None, {session.get_inputs()[0].name: x})[0]
    labels, _ = dev.line.infer(x)
    assert (logits.argmax(1) == labels).all()
    np.testing.assert_allclose(logits, trainer.logits(x, dev.line.deployable), rtol=1e-4, atol=1e-4)


def test_export_refuses_a_missing_or_foreign_model_with_a_message(tmp_path, digits, capsys):
    toml = tmp_path / "dev.toml"
    toml.write_text('[device]\ndevice_id = "cam1"\nstation = "s0"\n[model]\nname = "mlp"\n'
                    'input_shape = [64]\nnum_classes = 10\n[source]\nkind = "synthetic"\n'
                    f'[service]\nstate_dir = "{tmp_path / "state"}"\n')
    assert device_main(["export", "--config", str(toml), "--out", str(tmp_path / "m.onnx")]) == 2
    assert "no deployable model" in capsys.readouterr().err
    dev = _ready_device(digits, InferenceConfig())  # softmax: another layout than mlp
    save_deployable(tmp_path / "state", dev, layout_hash(dev.trainer.layout))
    with pytest.raises(Exception, match="layout"):
        load_deployable(tmp_path / "state", layout_hash=layout_hash(
            build_trainer("mlp", input_shape=(64,), num_classes=10, lr=0.1).layout))
    assert not (tmp_path / "m.onnx").exists()


def test_stations_and_the_cloud_summarise_prequential_accuracy_and_clip_claims():
    from aggregator.cloud import Cloud
    from aggregator.config import CloudConfig, StationConfig
    from aggregator.station import Station

    st = Station(StationConfig(station_id="s0", devices=("d0", "d1", "d2"), min_devices=3,
                               super_node_size=2),
                 num_params=4, num_classes=2, rng=np.random.default_rng(0))
    for did, acc in (("d0", 0.9), ("d1", 0.5), ("d2", 7.0)):  # d2 claims 700%
        st.handle(m.DeviceStats(fleet="default", sender=did, round=0, iteration=0,
                                station="s0", seen_counts=np.array([5, 5]),
                                next_batch_counts=np.array([1, 1]),
                                prequential_accuracy=acc, prequential_samples=100), 0.0)
    assert st.counters["clipped.prequential_accuracy"] == 1
    assert st.roster.accuracy_summary() == {"prequential_mean": 0.7, "prequential_worst10": 0.5}
    cloud = Cloud(CloudConfig(stations=("s0",), rounds=5), initial_weights=np.zeros(4, np.float32),
                  num_classes=2)
    cloud.handle(m.StationStats(fleet="default", sender="s0", round=0, iteration=0,
                                seen_counts=np.array([10, 10])), 0.0)
    cloud.handle(m.StationUpdate(fleet="default", sender="s0", round=0, iteration=1,
                                 weights=np.zeros(4, np.float32), num_samples=4,
                                 seen_counts=np.array([10, 10]),
                                 prequential_accuracies=np.array([0.9, 0.5, 3.0], np.float32)),
                 0.0)
    assert cloud.counters["clipped.prequential_accuracies"] == 1
    assert cloud.accuracy_summary()["prequential_mean"] == pytest.approx(0.7)


def test_a_prediction_carries_the_item_time_its_label_lag_implies(digits):
    """A line application matching items by time gets, beside the frame's read time, the
    time its label would name to join that frame: ``t`` less the lag the join applies."""
    now = time.time()
    items = [(digits.x_train[i], None, i, now - 1 + i * 0.1) for i in range(10)]
    published = []
    dev = _ready_device(digits, InferenceConfig())
    labels = LiveLabels(10, window=0.5, delay_max=30.0, lag=1.25)
    StreamFeed(dev, _drained_pump(items), inference=dev.inference, labels=labels,
               publish=published.append)(0.0)
    assert len(published) == 10
    assert [p.item_t for p in published] == [p.t - 1.25 for p in published]
    # the label naming a prediction's item time joins that very frame
    joined = labels.add_label(json.dumps({"t": published[3].item_t,
                                          "label": int(digits.y_train[3])}).encode())
    assert len(joined) == 1 and np.array_equal(joined[0][0], digits.x_train[3])
    # A label on a frame's read time to the microsecond is the line's verdict on that frame;
    # two microseconds off, it is an item's time like any other, joined by the lag.
    exact = labels.counters["label_joined_exact"]
    labels.add_label(json.dumps({"t": published[5].t + 0.9e-6, "label": 1}).encode())
    assert labels.counters["label_joined_exact"] == exact + 1
    labels.add_label(json.dumps({"t": published[6].t + 2e-6, "label": 1}).encode())
    assert labels.counters["label_joined_exact"] == exact + 1


def test_products_by_name_in_labels_and_predictions(digits):
    """Where the fleet names its classes ([model] class_names, in every role's file), a label
    may name its product instead of its number and each prediction carries the name; a
    product the fleet does not have is refused and counted, and so is a name where the
    classes have none."""
    from edge_client.catalogue import Catalogue
    from edge_client.config import ModelConfig
    from edge_client.errors import ConfigError

    names = ("bolt", "nut", "washer", "bracket", "gear", "pin", "cap", "ring", "clip", "hub")
    assert ModelConfig(num_classes=10, class_names=names).class_names == names
    longest = ("x" * 64, *names[1:])  # a name exactly at the bound, and one past it
    assert ModelConfig(num_classes=10, class_names=longest).class_names == longest
    with pytest.raises(ConfigError, match="'class_names'.*1-64 printable"):
        ModelConfig(num_classes=10, class_names=("x" * 65, *names[1:]))
    assert ModelConfig(num_classes=10, class_names=names[:9]).class_names == names[:9]
    for bad, why in (((*names, "axle"), "11 names for num_classes = 10"),
                     (("bolt",) * 10, "bolt named twice"), (("7", *names[1:]), "not a number"),
                     ((" bolt", *names[1:]), "no spaces")):
        with pytest.raises(ConfigError, match=f"'class_names'.*{why}"):
            ModelConfig(num_classes=10, class_names=bad)
    now = time.time()
    items = [(digits.x_train[i], None, i, now - 1 + i * 0.1) for i in range(4)]
    published = []
    dev = _ready_device(digits, InferenceConfig())
    dev.products.use(Catalogue(10, names))
    labels = LiveLabels(10, window=0.5, delay_max=30.0, lag=0.0, class_names=names)
    StreamFeed(dev, _drained_pump(items), inference=dev.inference, labels=labels,
               publish=published.append)(0.0)
    assert [p.product for p in published] == [names[p.label] for p in published]
    joined = labels.add_label(json.dumps({"t": published[1].t, "label": "washer"}).encode())
    assert [label for _, label, _ in joined] == [2]
    assert labels.add_label(json.dumps({"t": published[2].t, "label": "sprocket"}).encode()) == []
    assert labels.counters["label_refused.unknown_product"] == 1
    unnamed = LiveLabels(10, window=0.5, delay_max=30.0, lag=0.0)
    assert unnamed.add_label(json.dumps({"t": now, "label": "nut"}).encode()) == []
    assert unnamed.counters["label_refused.unknown_product"] == 1


def test_predictions_are_a_document_the_line_can_read():
    doc = Prediction(t=1.5, frame=3, label=2, confidence=0.75, model_round=4, latency_ms=12.0)
    raw = json.loads(encode_document(doc))
    assert raw["kind"] == "Prediction" and raw["label"] == 2 and raw["model_round"] == 4


def test_safl_status_shows_held_out_and_prequential_accuracy():
    from aggregator.status import FleetStatus, format_status
    from edge_client.documents import StationSummary

    doc = StationSummary(station="st0", state="collecting", round=3, iteration=9, devices=2,
                         online=2, quorum=1, local_mean=0.91, local_worst10=0.8,
                         prequential_mean=0.88, prequential_worst10=0.75)
    text = format_status(FleetStatus(stations={"st0": doc}), "plant")
    assert "held-out 0.910 (0.800), prequential 0.880 (0.750)" in text


def test_the_prediction_budget_pays_for_a_share_of_wall_time():
    """Credit accrues at ``share`` of the wall time, at most BURST seconds of it; a
    prediction costs the last one's time a sample, a shadow score what it took."""
    from edge_client.inference import PredictionBudget

    now = [0.0]
    budget = PredictionBudget(0.5, clock=lambda: now[0])
    assert budget.affordable(100) == 100  # no cost known yet: the first batch measures it
    budget.charge(1.0, 100)  # 10 ms a sample: 1 s of the 2 s of credit left
    assert budget.affordable(1000) == 100
    budget.charge(3.0)  # a shadow score that took longer than what was left
    assert budget.credit == pytest.approx(-2.0) and budget.affordable(10) == 0
    now[0] = 4.0  # 4 s of wall time repay 2 s
    assert budget.affordable(10) == 0
    now[0] = 4.2  # and 0.1 s more buys 10 predictions
    assert budget.affordable(1000) == 10
    now[0] = 100.0  # a quiet spell saves at most BURST seconds
    assert budget.affordable(10_000) == int(PredictionBudget.BURST / 0.01)
    unlimited = PredictionBudget(1.0, clock=lambda: now[0])
    unlimited.charge(50.0, 10)
    assert unlimited.affordable(10_000) == 10_000
    with pytest.raises(ConfigError, match="budget"):
        InferenceConfig(budget=0.0)


def test_a_slow_board_predicts_within_its_budget_and_keeps_the_newest(digits):
    """A device whose forward pass is the most of its work (a CNN on a board) predicts at
    most its ``budget`` share of the time, the newest samples of each batch, and counts the
    rest; with the budget at 1 every sample is predicted.  Under emulation such a device
    spent 73% of its time predicting and answered no selection in time."""
    def run(budget: float, seconds: float = 1.5) -> tuple[Device, float, float]:
        trainer = build_trainer("small_cnn", input_shape=(1, 8, 8), num_classes=10, lr=0.1,
                                seed=0)
        dev = Device(DeviceConfig(device_id="d0", station="s0"), trainer, num_classes=10,
                     sample_shape=(1, 8, 8), rng=np.random.default_rng(0),
                     inference=InferenceConfig(budget=budget, promote="always"))
        dev.line.budget.BURST = 0.05  # so that a short test measures the share, not a burst
        dev.handle(_model(trainer.get_flat()), 0.0)
        x, y = digits.x_train[:64].reshape(64, 1, 8, 8), digits.y_train[:64]
        calls, began = [], time.perf_counter()
        while time.perf_counter() - began < seconds:
            before = dev.counters["predictions"]
            dev.ingest(x, y, 0.0)
            calls.append((dev.counters["predictions"] - before) * dev.line.last_inference_s)
        return dev, calls, time.perf_counter() - began

    dev, calls, wall = run(0.2)
    assert dev.counters["inference.over_budget"] > 0
    # The share, the burst, and the overrun of one batch: its cost is known only once it ran
    # (on a loaded machine one batch of a few samples took 0.1 s while the process waited)
    assert sum(calls) <= 0.2 * wall + 0.05 + max(calls)
    assert dev.line.prequential.scored == dev.counters["predictions"]  # unpredicted: unscored
    # What the credit pays for is the newest of a batch: what is in front of the camera.
    budget = dev.line.budget
    # A set cost and credit, under the burst, and a clock that stands still: on a loaded
    # machine the measured cost of a sample reached 12 ms, and 10.5 of them exceeded the burst
    budget._per_sample, budget.credit = 1e-3, 10.5e-3
    budget.clock = lambda: budget._at
    x = digits.x_train[:64].reshape(64, 1, 8, 8)
    got = np.flatnonzero(dev.line.predict_every(x, 0) != NOT_PREDICTED)
    assert got.tolist() == list(range(54, 64))
    dev, _, _ = run(1.0, seconds=0.3)
    assert dev.counters["inference.over_budget"] == 0
    assert dev.counters["predictions"] == dev.counters["prequential.scored"] > 0


def test_a_camera_whose_predictions_fall_behind_says_so_and_when_it_keeps_up_again(caplog):
    """Over each minute, the share of the frames chosen for a prediction that the budget
    left unpredicted: past half, a warning (once, not every minute), back under, an info;
    the share is what /metrics, the page and safl status show (predictions_behind)."""
    import logging

    from aggregator.status import FleetStatus, _device_lines
    from edge_client.documents import DeviceSummary
    from edge_client.inference import FallingBehind
    from edge_client.states import DeviceState

    now = [0.0]
    watch = FallingBehind("cam-1", clock=lambda: now[0])
    caplog.set_level(logging.INFO, logger="edge_client.inference")
    for minute, skipped in enumerate((0, 7, 8, 2)):
        for second in range(60):
            now[0] = minute * 60 + second
            watch.note(10, skipped)
        now[0] = (minute + 1) * 60
        watch.note(0, 0)
        assert watch.share == pytest.approx(skipped / 10, abs=0.02), minute
    said = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert [level for level, _ in said] == ["WARNING", "INFO"], said
    assert "fall behind the camera" in said[0][1] and "cam-1" in said[0][1]
    found = FleetStatus()
    found.devices["cam-1"] = DeviceSummary(device="cam-1", station="s", round=1, iteration=1,
                                           state=DeviceState.READY, predictions_behind=0.7)
    assert "predictions falling behind: cam-1 (70% of frames unpredicted)" in \
        _device_lines(found)


def test_a_camera_predicting_exactly_half_its_frames_is_not_behind_and_one_frame_less_is():
    from edge_client.inference import FallingBehind

    now = [0.0]
    watch = FallingBehind("cam-1", clock=lambda: now[0])
    for skipped, behind in ((50, False), (51, True)):
        watch.note(100, skipped)
        now[0] += FallingBehind.WINDOW
        watch.note(0, 0)
        assert (watch.share > FallingBehind.BEHIND) is behind, (skipped, watch.share)
