"""Products added and retired on a running fleet (issue 70 item 1): the catalogue the cloud
reads from its file and tells every role, the frames a device holds for a product to come,
and a provisioning re-run that may only add products at the end."""

from __future__ import annotations

import json
import time
from collections import Counter

import numpy as np
import pytest

from edge_client import messages as m
from edge_client.catalogue import MAX_AWAITED, Catalogue, HeldLabels
from edge_client.codec import decode, encode
from edge_client.errors import ConfigError, MessageError
from edge_client.head_stats import HeadSpec
from edge_client.sources.live_labels import LiveLabels

NAMES = ("bolt", "nut", "washer", "bracket", "gear", "pin", "cap", "ring", "sprocket",
         "hex nut")


def test_a_catalogue_follows_one_that_extends_it_and_refuses_one_that_renames_a_class():
    cat = Catalogue(10, NAMES[:8])
    assert cat.allowed.tolist() == [True] * 8 + [False] * 2  # free classes are never named
    assert cat.follow((), ()) == []  # a model without a catalogue is no news
    assert cat.follow(NAMES[:6], ()) == [] and cat.names == NAMES[:8]  # an older cloud's
    assert cat.follow(NAMES[:9], ()) == ["sprocket"] and cat.index["sprocket"] == 8
    assert cat.follow(NAMES[:9], ("nut",)) == [] and cat.retired == {"nut"}
    assert cat.allowed.tolist() == [True, False] + [True] * 7 + [False]
    assert cat.follow(NAMES[:9], ()) == [] and cat.retired == frozenset()  # back in production
    for products, retired, reason in (((*NAMES[:3], "axle"), (), "renamed"),
                                      ((*NAMES, "axle"), (), "too_many"),
                                      (NAMES[:9], ("axle",), "retired_unknown")):
        with pytest.raises(MessageError) as err:
            cat.follow(products, retired)
        assert err.value.reason == reason
    assert cat.names == NAMES[:9]  # a refused catalogue changes nothing
    assert Catalogue(10).allowed is None  # an unnamed fleet predicts every class
    assert Catalogue(3, ("a", "b"), ("a", "b")).allowed is None  # all retired: not a blank


def test_the_fleet_file_retires_products_by_name_and_never_all_of_them():
    from edge_client.config import ModelConfig

    assert ModelConfig(num_classes=10, class_names=NAMES[:4], retired=("nut",)).retired == \
        ("nut",)
    for retired, why in ((("axle",), "'axle' is not in class_names"),
                         (NAMES[:4], "every product retired")):
        with pytest.raises(ConfigError, match=f"'retired'.*{why}"):
            ModelConfig(num_classes=10, class_names=NAMES[:4], retired=retired)


def test_the_catalogue_travels_with_the_models_and_a_bad_name_is_refused_on_decode():
    g = m.GlobalModel(fleet="f", sender="cloud", round=1, iteration=2, weights=np.zeros(3),
                      p_real=np.full(2, 0.5), products=NAMES[:9], retired=("nut",))
    back = decode(encode(g), max_size=1 << 20).message
    assert back.products == NAMES[:9] and back.retired == ("nut",)
    bare = m.StationModel(fleet="f", sender="s", round=1, iteration=2, weights=np.zeros(3))
    assert b"products" not in encode(bare)  # optional: absent where there is none
    for bad in (("bolt", "bolt"), ("7",), (" bolt",), ("x" * 65,), ("a\nb",)):
        with pytest.raises(MessageError):
            m.StationModel(fleet="f", sender="s", round=1, iteration=2, weights=np.zeros(3),
                           products=bad)


def _labels(cat, held):
    return LiveLabels(10, window=0.5, delay_max=30.0, lag=0.0, catalogue=cat, held=held)


def _frames(labels, n, t0=1000.0):
    x = np.arange(n * 4, dtype=np.float32).reshape(n, 4)
    labels.add_frames(x, t0 + np.arange(n) * 0.1, np.zeros(n, np.int64))
    return x


def _label(t, label):
    return json.dumps({"t": t, "label": label}).encode()


def test_a_label_of_a_product_to_come_is_joined_to_its_frame_and_held(tmp_path):
    clock = [1000.0]
    cat = Catalogue(10, NAMES[:8], counters=Counter())
    held = HeldLabels(cat, hold_for=60.0, hold_max=3, folder=tmp_path, clock=lambda: clock[0])
    labels = _labels(cat, held)
    labels.clock = lambda: clock[0]
    x = _frames(labels, 6)
    joined = labels.add_label(_label(1000.0, "sprocket")) + labels.add_label(
        _label(1000.1, "nut"))
    assert [j[1] for j in joined] == [held.code("sprocket"), 1] and held.code("sprocket") < 0
    ready, classes = held.hold([joined[0][0]], [joined[0][1]])
    assert ready == [] and len(held) == 1 and cat.counters["label_held"] == 1
    np.testing.assert_array_equal(held._samples[0], x[0])
    # The oldest go first past hold_max; each held frame is kept for hold_for seconds.
    more = [labels.add_label(_label(1000.0 + 0.1 * k, "hex nut"))[0] for k in (2, 3, 4)]
    held.hold([j[0] for j in more], [j[1] for j in more])
    assert len(held) == 3 and cat.counters["label_held_dropped"] == 1
    held.keep(clock[0], force=True)
    again = HeldLabels(Catalogue(10, NAMES[:8], counters=Counter()), hold_for=60.0, hold_max=3,
                       folder=tmp_path, clock=lambda: clock[0])  # a restarted device's
    assert len(again) == 3 and again._names == ["hex nut"] * 3
    clock[0] += 61.0
    again.keep(clock[0])
    assert len(again) == 0 and again.counters["label_held_expired"] == 3
    # Added: what is held comes out as its class; a frame joined after is trained at once.
    assert cat.follow(NAMES, ()) == ["sprocket", "hex nut"]
    xs, ys = held.release(["sprocket", "hex nut"])
    assert ys.tolist() == [9, 9, 9] and len(held) == 0
    ready, classes = held.hold([x[5]], [held.code("hex nut")])
    assert classes == [9] and np.array_equal(ready[0], x[5])


def test_names_of_products_to_come_are_bounded_and_an_unnamed_fleet_refuses_names():
    cat = Catalogue(10, NAMES[:8])
    held = HeldLabels(cat, hold_for=60.0, hold_max=10)
    labels = _labels(cat, held)
    _frames(labels, 2)
    for k in range(MAX_AWAITED):
        assert held.code(f"part {k}") is not None
    assert labels.add_label(_label(1000.0, "one too many")) == []
    assert labels.counters["label_refused.unknown_product"] == 1
    assert labels.add_label(_label(1000.0, "part 3"))  # one awaited already: still held
    assert labels.add_label(_label(1000.0, 8)) == []  # a free class is no product by number
    assert labels.counters["label_refused.no_product"] == 1
    cat.follow(NAMES[:9], ())
    assert labels.add_label(_label(1000.1, 8))  # until it is one
    plain = LiveLabels(10, window=0.5, delay_max=30.0, lag=0.0)  # no names, nothing held
    _frames(plain, 2)
    assert plain.add_label(_label(1000.0, "bolt")) == []
    assert plain.counters["label_refused.unknown_product"] == 1


def test_a_corrupt_held_file_is_said_and_counted_and_the_device_starts_without_it(tmp_path,
                                                                                   caplog):
    (tmp_path / "held_labels.npz").write_bytes(b"not a zip")
    held = HeldLabels(Catalogue(10, NAMES[:8]), hold_for=60.0, hold_max=10, folder=tmp_path)
    assert len(held) == 0 and held.counters["label_held_unreadable"] == 1
    assert "unreadable" in caplog.text


def test_a_product_added_at_the_cloud_reaches_the_devices_whose_held_frames_teach_it(digits):
    """A head fleet on the in-process bus, its products the first eight classes: frames of
    two products to come are held by two devices; once the cloud's catalogue adds them,
    the next models carry it through the station, the devices train on what they held, and
    the global head predicts the new products, from those frames alone.  Retiring one
    masks it out of the devices' predictions."""
    from tests.test_head_stats import _head_fleet

    spec = HeadSpec("lda", 64, 10, np.full(64, 4.0, np.float32), 200.0)
    bus, runners, cloud, station, devices, x, y, _ = _head_fleet(digits, spec, n_devices=4)
    cloud.catalogue = Catalogue(10, NAMES[:8])
    helds = []
    for dev in devices:
        cat = Catalogue(10, NAMES[:8], counters=dev.counters)
        helds.append(HeldLabels(cat, hold_for=1e9, hold_max=500))
        dev.products.use(cat, helds[-1])
    new = {8: np.flatnonzero(y == 8)[:60], 9: np.flatnonzero(y == 9)[:60]}
    for k, cls in ((0, 8), (1, 9)):
        code = helds[k].code(NAMES[cls])
        helds[k].hold(list(x[new[cls]]), [code] * len(new[cls]))
    globals_: list[m.GlobalModel] = []
    from edge_client.topics import global_model_topic
    bus.subscribe(global_model_topic("t"), lambda topic, msg: globals_.append(msg))
    for r in runners:
        r.start()
    bus.run_until(lambda: globals_)
    assert globals_[-1].products == NAMES[:8]
    known = np.flatnonzero(y < 8)
    rng = np.random.default_rng(0)

    def next_rounds(n):  # the devices sense more of the known products: rounds go on
        for _ in range(n):
            for k, dev in enumerate(devices):
                runners[2 + k].publish(dev.ingest(x[pick := rng.choice(known, 40)], y[pick],
                                                  1.0))
            bus.run_until(lambda r=globals_[-1].round: globals_[-1].round > r)
    test = np.flatnonzero(np.isin(y, (8, 9)))
    test = test[~np.isin(test, np.concatenate(list(new.values())))]

    def predicted(weights):
        return (x @ weights[:640].reshape(10, 64).T + weights[640:]).argmax(1)
    assert not np.isin(predicted(globals_[-1].weights), (8, 9)).any()  # never named yet
    assert len(helds[0]) == 60 and devices[0].buffer.seen_counts[8] == 0

    cloud.catalogue = Catalogue(10, NAMES)  # the cloud's file, rewritten (follow_file)
    next_rounds(3)
    assert all(dev.products.catalogue.names == NAMES for dev in devices)
    assert [len(h) for h in helds] == [0] * 4
    assert devices[0].counters["label_held_joined"] == 60
    assert devices[0].buffer.seen_counts[8] == 60 and devices[1].buffer.seen_counts[9] == 60
    right = predicted(globals_[-1].weights)[test] == y[test]
    assert right.mean() >= 0.75, right.mean()  # learnt from 60 frames each, fleet-wide
    old = np.flatnonzero(y < 8)
    assert (predicted(globals_[-1].weights)[old] == y[old]).mean() > 0.85

    cloud.catalogue = Catalogue(10, NAMES, ("nut",))
    next_rounds(2)
    assert all(d.products.catalogue.retired == {"nut"} for d in devices)
    from edge_client.inference import predict
    allowed = devices[2].line.allowed  # what its line predicts among
    assert allowed.tolist() == [True, False] + [True] * 8
    nut = x[y == 1]
    assert (predict(devices[2].trainer, nut, globals_[-1].weights)[0] == 1).mean() > 0.8
    labels, _ = predict(devices[2].trainer, nut, globals_[-1].weights, allowed)
    assert 1 not in labels.tolist()


def test_the_cloud_follows_its_file_where_it_adds_products_and_refuses_the_rest(tmp_path,
                                                                             caplog):
    import os

    from aggregator.cloud import Cloud
    from aggregator.config import CloudConfig
    from aggregator.services import follow_file
    from edge_client.config import ModelConfig, load_config

    path = tmp_path / "cloud.toml"

    def write(names, retired=(), hidden=128):
        text = (f"[model]\nname = 'mlp'\ninput_shape = [4]\nnum_classes = 10\n"
                f"hidden = {hidden}\nclass_names = {json.dumps(list(names))}\n"
                f"retired = {json.dumps(list(retired))}\n")
        path.write_text(text)
        os.utime(path, ns=(time.time_ns(), time.time_ns() + len(text)))  # a new mtime

    write(NAMES[:8])
    model = load_config(ModelConfig, "model", path)
    cloud = Cloud(CloudConfig(fleet="t", stations=("s",), rounds=0), initial_weights=np.zeros(3),
                  num_classes=10)
    hook = follow_file(cloud, str(path), model)
    assert cloud.catalogue.names == NAMES[:8]
    now = 0.0
    for names, retired, hidden, followed in ((NAMES[:9], (), 128, NAMES[:9]),
                                             (NAMES[:9], ("pin",), 128, NAMES[:9]),
                                             (NAMES[1:9], (), 128, NAMES[:9]),  # moved
                                             (NAMES, (), 64, NAMES[:9])):  # another model
        write(names, retired, hidden)
        now += 10.0
        hook(now)
        assert cloud.catalogue.names == followed
    assert cloud.catalogue.retired == {"pin"}
    assert cloud.counters["catalogue.reloaded"] == 2
    assert cloud.counters["catalogue.reload_refused"] == 2
    assert "catalogue.reload_refused" in caplog.text
    path.write_text("[model\n")  # a broken file: refused, said, nothing changes
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 7))
    hook(now + 10.0)
    assert cloud.counters["catalogue.reload_refused"] == 3 and cloud.catalogue.names == NAMES[:9]
    assert cloud._global_model().products == NAMES[:9]


def test_status_names_the_products_the_held_labels_and_who_refused_the_catalogue():
    from aggregator.status import FleetStatus, format_status
    from edge_client.documents import CloudSummary, DeviceSummary

    found = FleetStatus()
    found.cloud = CloudSummary(state="collecting", round=3, iteration=9, stations=("s",),
                               classes=12, products=NAMES, retired=("nut",),
                               counters={"catalogue.reload_refused": 1})
    found.devices["cam-01"] = DeviceSummary(device="cam-01", station="s", state="ready",
                                            round=3, iteration=9, labels_held=12)
    found.devices["cam-02"] = DeviceSummary(device="cam-02", station="s", state="ready",
                                            round=3, iteration=9,
                                            counters={"catalogue.refused": 2})
    text = format_status(found, "plant")
    assert f"products: {', '.join(NAMES)}; 2 of 12 classes free; retired: nut" in text
    assert "labels held for products to come: cam-01 12" in text
    assert "ERROR cloud: its rewritten file was not followed" in text
    assert "ERROR cam-02: refused the cloud's products" in text


def test_provisioning_again_may_add_a_product_at_the_end_and_nothing_else(tmp_path):
    from aggregator.provision import provision
    from edge_client.config import ModelConfig, load_config

    def fleet(names, retired=()):
        path = tmp_path / "fleet.toml"
        path.write_text(f"""[fleet]
name = "plant"
cloud_host = "127.0.0.1"
cloud_port = 8883

[[stations]]
id = "hall-1"
host = "127.0.0.1"
port = 8884
devices = ["cam-01"]

[model]
name = "mlp"
input_shape = [4]
num_classes = 10
class_names = {json.dumps(list(names))}
retired = {json.dumps(list(retired))}
""")
        return path

    out = tmp_path / "out"
    provision(fleet(NAMES[:8]), out)
    ca = (out / "ca" / "ca.pem").read_bytes()
    provision(fleet(NAMES[:9], ("nut",)), out)
    for role in ("cloud/cloud.toml", "stations/hall-1/station.toml"):
        model = load_config(ModelConfig, "model", out / role)
        assert model.class_names == NAMES[:9] and model.retired == ("nut",), role
    assert (out / "ca" / "ca.pem").read_bytes() == ca  # the same fleet, not a new one
    for names in ((NAMES[1], NAMES[0], *NAMES[2:9]), NAMES[:8]):
        with pytest.raises(ConfigError, match="class_names.*at the end"):
            provision(fleet(names), out)
