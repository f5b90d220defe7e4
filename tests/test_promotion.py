"""Safe promotion: a candidate model goes into use on the line only if it is not worse than
the deployed one on the recent labelled samples; a bad model is kept out, and an operator
can roll back."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from edge_client import messages as m
from edge_client.config import DeviceConfig, InferenceConfig
from edge_client.device import Device
from edge_client.errors import ConfigError
from edge_client.inference import NOT_PREDICTED
from edge_client.promotion import MIN_EVIDENCE, ShadowWindow
from edge_client.trainers import build_trainer


def _trained(digits, labels=None, steps=80):
    """Softmax weights trained on digits (``labels``: shuffled ones, a bad model that is
    plausible on the wire: the right shape, finite, of the usual norm)."""
    t = build_trainer("softmax", input_shape=(8, 8), num_classes=10, lr=0.5, seed=1)
    y = digits.y_train[:600] if labels is None else labels
    for k in range(steps):
        sl = slice(32 * (k % 18), 32 * (k % 18) + 32)
        t.train_step(digits.x_train[sl], y[sl])
    return t.get_flat()


def _device(promote: str, **inference):
    inference.setdefault("promote_every", 1)  # every candidate scored, but where tested
    return Device(DeviceConfig(device_id="d0", station="s0", batch_size=16, holdout_every=0),
                  build_trainer("softmax", input_shape=(8, 8), num_classes=10, lr=0.1, seed=0),
                  num_classes=10, sample_shape=(8, 8), rng=np.random.default_rng(0),
                  inference=InferenceConfig(promote=promote, **inference))


def _model(weights, iteration):
    return m.StationModel(fleet="default", sender="s0", round=iteration, iteration=iteration,
                          weights=weights)


def _stream(dev, digits, lo, hi, chunk=20):
    """Accuracy of the line's predictions over samples lo..hi of the training split past
    what the models were trained on (600 on), each predicted before the device takes it."""
    hits = 0
    for at in range(lo, hi, chunk):
        x, y = digits.x_train[600 + at:600 + at + chunk], digits.y_train[600 + at:600 + at + chunk]
        predicted = dev.line.infer(x)[0]
        hits += int((predicted == y).sum())
        dev.ingest(x, y, 0.0, predicted=predicted)
    return hits / (hi - lo)


@pytest.mark.parametrize("promote", ["not_worse", "always"])
def test_a_bad_model_from_the_station_is_kept_off_the_line(digits, promote):
    good = _trained(digits)
    shuffled = _trained(digits, labels=np.random.default_rng(5).permutation(
        digits.y_train[:600]))
    dev = _device(promote)
    dev.handle(_model(good, 0), 0.0)
    before = _stream(dev, digits, 0, 200)
    dev.handle(_model(shuffled, 1), 0.0)  # plausible on the wire, bad on the line
    after = _stream(dev, digits, 200, 400)
    assert before > 0.8
    if promote == "not_worse":
        assert after > before - 0.05 and dev.line.deployable_round == 0
        assert dev.counters["promotions_refused"] == 1 and dev.counters["promotions"] == 1
        verdict = dev.line.last_verdict
        assert verdict.shadow_accuracy < 0.3 < 0.8 < verdict.deployed_accuracy
        gauges = dev.metrics()
        assert gauges["deployed_round"] == 0 and gauges["shadow_accuracy"] < 0.3
        assert dev.summary().deployed_round == 0
    else:
        assert after < before - 0.5 and dev.line.deployable_round == 1
        assert dev.counters["promotions"] == 2 and not dev.counters["promotions_refused"]
    dev.handle(_model(_trained(digits, steps=120), 2), 0.0)  # a good one still goes in
    _stream(dev, digits, 400, 420)  # judged when the next labelled samples arrive
    assert dev.line.deployable_round == 2


def test_a_candidate_within_the_margin_is_promoted_and_one_beyond_it_is_not(digits):
    good = _trained(digits)
    dev = _device("not_worse", promote_margin=0.05)
    dev.handle(_model(good, 0), 0.0)
    _stream(dev, digits, 0, 200)
    noisy = good + np.random.default_rng(0).normal(0, 0.05, good.size).astype(np.float32)
    dev.handle(_model(noisy, 1), 0.0)  # a little worse or better: within 5 points
    _stream(dev, digits, 200, 220)
    assert dev.line.deployable_round == 1
    worse = good * np.float32(-1.0)
    dev.handle(_model(worse, 2), 0.0)
    _stream(dev, digits, 220, 240)
    assert dev.line.deployable_round == 1 and dev.counters["promotions_refused"] == 1


def test_one_candidate_is_scored_in_promote_every_iterations(digits):
    dev = _device("not_worse", promote_every=5)
    dev.handle(_model(_trained(digits), 0), 0.0)  # nothing deployed: in, unscored
    _stream(dev, digits, 0, 100)
    good = _trained(digits, steps=120)
    for it in range(1, 12):
        dev.handle(_model(good, it), 0.0)  # each judges the one before it where due
    _stream(dev, digits, 100, 120)
    # Scored at 1, 6 and 11: the line followed at each check and kept its model between.
    assert dev.counters["promotions"] == 4 and dev.counters["promotions.waiting"] == 8
    assert dev.line.deployable_iteration == 11
    final = dataclasses.replace(_model(-good, 12), final=True)
    dev.handle(final, 0.0)  # a final model is judged at once
    assert dev.counters["promotions_refused"] == 1 and dev.line.deployable_iteration == 11


def test_a_selected_device_scores_its_merged_model_beside_the_broadcast_only(digits):
    dev = _device("not_worse")
    dev.handle(_model(_trained(digits), 0), 0.0)  # nothing deployed: in, unscored
    _stream(dev, digits, 0, 100)
    good = _trained(digits, steps=120)
    for it in range(1, 6):
        dev.handle(_model(good, it), 0.0)
        dev.handle(m.Selection(fleet="default", sender="s0", round=it, iteration=it,
                               members=("d0",), deadline=1e9), 0.0)
        _stream(dev, digits, 100 + 20 * it, 120 + 20 * it)
    scored = dev.counters["promotions"] + dev.counters["promotions_refused"] - 1
    # One verdict an iteration, on the merged model and the broadcast it came from: none
    # was passed over.
    assert scored == 5 and dev.counters["promotions.waiting"] == 0
    assert dev.counters["uploads"] + dev.counters["skipped.gate"] == 5


@pytest.mark.parametrize("merge_is", ["bad", "good"])
def test_the_better_of_a_merge_and_its_broadcast_goes_into_use(digits, merge_is):
    """A camera line's devices step a solved head on bursts of one class: their merges
    predicted one class, and judged alone they kept the broadcast's solve off the line."""
    dev = _device("not_worse", promote_every=10)
    first = _trained(digits, steps=3)  # a poor model in use: the merges would beat it
    dev.handle(_model(first, 0), 0.0)
    _stream(dev, digits, 0, 100)
    good = _trained(digits, steps=120)
    one_class = _trained(digits, labels=np.zeros(600, np.int64), steps=20)
    broadcast, merge = (good, one_class) if merge_is == "bad" else (one_class, good)
    promoter = dev.line.promoter
    assert not promoter.offer(_model(broadcast, 10), broadcast, deployed=True)
    assert not promoter.offer(_model(broadcast, 10), merge, deployed=True, merged=True)
    _stream(dev, digits, 100, 120)  # the next labels: judged
    assert dev.line.deployable_iteration == 10
    assert np.array_equal(dev.line.deployable, good)
    assert dev.line.last_verdict.shadow_accuracy > 0.8
    assert dev.counters["promotions.broadcast_over_merge"] == (merge_is == "bad")
    assert dev.counters["promotions.waiting"] == 0
    later = _trained(digits, steps=130)
    promoter.offer(_model(later, 20), later, deployed=True)  # a broadcast after the merge:
    promoter.offer(_model(one_class, 21), one_class, deployed=True, merged=True)  # passed over
    assert dev.counters["promotions.waiting"] == 1


def test_the_held_out_slice_judges_while_no_labels_have_arrived(digits):
    dev = Device(DeviceConfig(device_id="d0", station="s0", batch_size=16, holdout_every=2),
                 build_trainer("softmax", input_shape=(8, 8), num_classes=10, lr=0.1, seed=0),
                 num_classes=10, sample_shape=(8, 8), rng=np.random.default_rng(0),
                 inference=InferenceConfig(promote_window=500, promote_every=1))
    dev.handle(_model(_trained(digits), 0), 0.0)
    # Samples loaded before the stream (a source's ``initial``) fill the buffer only.
    dev.buffer.push(digits.x_train[600:700], digits.y_train[600:700])  # 50 held out
    dev.handle(_model(-_trained(digits), 1), 0.0)
    assert dev.line.deployable_round == 0 and dev.line.last_verdict.samples == 0  # not yet judged
    dev.handle(_model(_trained(digits), 2), 0.0)  # no labels came between: judged now
    assert dev.line.deployable_round == 0 and dev.line.last_verdict.samples == 50


def test_the_window_keeps_the_deployed_models_hits_from_its_predictions_on_arrival():
    w = ShadowWindow(4, (2,))
    x = np.zeros((6, 2), np.float32)
    w.add(x, np.array([0, 1, 2, 3, 4, 5]), np.array([0, 9, 2, -1, 4, 9]))
    # Only the last four samples (2, 3, 4, 5) are kept; 3 was not predicted.
    assert len(w) == 4 and w._hits.tolist() == [1, -1, 1, 0]
    w.add(x[:1], np.array([7]), None)  # overwrites the oldest, 2, as unknown
    assert w._hits.tolist() == [-1, -1, 1, 0] and w._y.tolist() == [7, 3, 4, 5]
    with pytest.raises(ConfigError, match="promote"):
        InferenceConfig(promote="sometimes")


def _toml(tmp_path):
    toml = tmp_path / "dev.toml"
    toml.write_text('[device]\ndevice_id = "d0"\nstation = "s0"\n[model]\nname = "softmax"\n'
                    'input_shape = [8, 8]\nnum_classes = 10\n[source]\nkind = "synthetic"\n'
                    f'[service]\nstate_dir = "{tmp_path / "state"}"\n')
    return toml


def test_a_restarted_device_judges_candidates_against_the_model_it_kept(digits, tmp_path):
    from edge_client.serving import resume_deployable, save_deployable
    from edge_client.trainers import layout_hash

    dev = _device("not_worse")
    dev.handle(_model(_trained(digits), 4), 0.0)
    lay = layout_hash(dev.trainer.layout)
    save_deployable(tmp_path, dev, lay)
    again = _device("not_worse")  # restarted: its window is empty, its model on disk
    resume_deployable(tmp_path, again, lay)
    assert again.line.deployable_round == 4
    _stream(again, digits, 0, 100)
    again.handle(_model(-_trained(digits), 5), 0.0)
    _stream(again, digits, 100, 120)
    assert again.line.deployable_round == 4 and again.counters["promotions_refused"] == 1
    (tmp_path / "deployable.frame").write_bytes(b"torn")
    torn = _device("not_worse")
    resume_deployable(tmp_path, torn, lay)  # said and counted, and it starts without
    assert torn.line.deployable is None and torn.counters["errors.deployable"] == 1


def test_an_operator_rolls_back_to_the_model_in_use_before(digits, tmp_path, capsys):
    from edge_client.cli import main as device_main
    from edge_client.serving import load_deployable, save_deployable
    from edge_client.trainers import layout_hash

    toml, state = _toml(tmp_path), tmp_path / "state"
    dev = _device("always")
    lay = layout_hash(dev.trainer.layout)
    dev.handle(_model(_trained(digits), 1), 0.0)
    save_deployable(state, dev, lay)
    assert device_main(["rollback", "--config", str(toml)]) == 2  # one model only: said
    assert "no earlier model" in capsys.readouterr().err
    dev.handle(_model(_trained(digits, steps=10), 2), 0.0)
    save_deployable(state, dev, lay)  # the model of round 1 is kept beside it
    assert device_main(["rollback", "--config", str(toml)]) == 0
    assert "round 1" in capsys.readouterr().out
    assert load_deployable(state, layout_hash=lay).round == 1
    assert device_main(["rollback", "--config", str(toml)]) == 0  # and back again
    assert load_deployable(state, layout_hash=lay).round == 2


def test_a_candidate_exactly_at_the_margin_is_promoted_and_one_sample_below_is_not():
    trainer = build_trainer("softmax", input_shape=(2,), num_classes=2, lr=0.1, seed=0)
    w = ShadowWindow(50, (2,))
    x = np.zeros((50, 2), np.float32)
    deployed, candidate = trainer.get_flat(), trainer.get_flat()
    label = int(trainer.logits(x[:1], candidate).argmax())  # what both predict on zeros
    y = np.full(50, label)
    w.add(x, y, np.full(50, label))  # the deployed model: 50 of 50
    y2 = y.copy()
    y2[:1] = 1 - label  # the candidate predicts `label` everywhere: 49 of 50 now
    w._y[:] = y2
    assert w.judge(trainer, [candidate], deployed, margin=0.02).promoted  # 0.98 = 1.0 - 0.02
    w.add(x, y, np.full(50, label))
    y2[:2] = 1 - label
    w._y[:] = y2
    assert not w.judge(trainer, [candidate], deployed, margin=0.02).promoted  # 0.96


def test_a_shadow_score_fills_in_only_the_deployed_hits_its_budget_pays_for(digits):
    """On a slow board most samples arrive unpredicted: the candidate is scored on the
    samples whose deployed hits are known, after filling in the newest unknown ones the
    budget pays for (all where nothing limits the line), and never on fewer than
    MIN_EVIDENCE (a slow board's shadow score then costs two passes over that many)."""
    trainer = build_trainer("softmax", input_shape=(8, 8), num_classes=10, lr=0.5, seed=1)
    flat, asked = _trained(digits), []
    x, y = digits.x_train[:200], digits.y_train[:200]
    predicted = np.full(200, NOT_PREDICTED)
    predicted[-40:] = trainer.logits(x[-40:], flat).argmax(1)  # the newest 40 were predicted

    def affordable(n: int) -> int:
        asked.append(n)
        return 10

    w = ShadowWindow(200, (8, 8))
    w.add(x, y, predicted)
    verdict = w.judge(trainer, [flat], flat, 0.02, affordable)
    assert asked == [160] and verdict.samples == 50
    assert (w._hits[-50:] != -1).all() and (w._hits[:150] == -1).all()  # the newest filled
    assert w.judge(trainer, [flat], flat, 0.02).samples == 200  # unlimited: all of them
    few = ShadowWindow(200, (8, 8))
    few.add(x, y, np.where(np.arange(200) < 190, NOT_PREDICTED, predicted))
    asked.clear()
    assert few.judge(trainer, [flat], flat, 0.02, affordable).samples == MIN_EVIDENCE


def test_the_deployed_round_and_shadow_accuracy_travel_in_stats_and_are_checked(digits):
    from aggregator.config import StationConfig
    from aggregator.station import Station
    from edge_client import codec

    dev = _device("not_worse")
    dev.handle(_model(_trained(digits), 3), 0.0)
    _stream(dev, digits, 0, 100)
    dev.handle(_model(-_trained(digits), 4), 0.0)  # refused at the next labels
    _stream(dev, digits, 100, 120)
    stats = codec.decode(codec.encode(dev.start(0.0)[0]), max_size=1 << 20).message
    assert stats.deployed_round == 3 and stats.shadow_samples == 120  # all that came
    assert stats.shadow_accuracy == dev.line.last_verdict.shadow_accuracy < 0.3
    st = Station(StationConfig(station_id="s0", devices=("d0",), min_devices=1,
                               super_node_size=1), num_params=4, num_classes=10,
                 rng=np.random.default_rng(0))
    st.handle(dataclasses.replace(stats, shadow_accuracy=1.0), 0.0)  # on the bound: kept
    assert not st.counters["clipped.shadow_accuracy"] and st.stats["d0"].shadow_accuracy == 1.0
    st.handle(dataclasses.replace(stats, shadow_accuracy=1.0000001), 0.0)  # a claim, checked
    assert st.counters["clipped.shadow_accuracy"] == 1
    st.handle(dataclasses.replace(stats, shadow_accuracy=0.0), 0.0)  # the other bound: kept
    st.handle(dataclasses.replace(stats, shadow_accuracy=-1e-9), 0.0)
    assert st.counters["clipped.shadow_accuracy"] == 2
    assert st.stats["d0"].shadow_samples == 0 and st.stats["d0"].deployed_round == 3
