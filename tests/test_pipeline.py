"""The update pipeline: stages encode a device's step, the station decodes it onto its own
model, error feedback sends what was left out later, and the wire carries the encodings."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from aggregator.config import StationConfig
from aggregator.station import Station
from edge_client import messages as m
from edge_client.codec import decode, encode
from edge_client.config import DeviceConfig
from edge_client.errors import ConfigError, MessageError
from edge_client.pipeline import Encoded, UpdatePipeline
from lab.simulation import run_federation
from lab.strategies import build_strategy


def _step(n=1000, seed=0):
    return np.random.default_rng(seed).normal(0, 0.01, n).astype(np.float32)


def test_each_quantiser_round_trips_within_its_resolution():
    step, rng = _step(), np.random.default_rng(1)
    plain = UpdatePipeline(())
    assert plain.id == m.MODEL_ENCODING and not plain.active
    half = UpdatePipeline(["float16"])
    enc, residual = half.encode(step, None, rng)
    assert enc.half.dtype == np.float16 and enc.values.size == 0
    np.testing.assert_allclose(half.decode(enc, step.size), step, atol=1e-5)
    np.testing.assert_allclose(residual, step - enc.half.astype(np.float32), atol=0)
    int8 = UpdatePipeline(["int8:100"])
    enc, _ = int8.encode(step, None, rng)
    assert enc.codes.dtype == np.int8 and enc.scales.size == 10
    scale = np.repeat(enc.scales, 100)
    assert (np.abs(int8.decode(enc, step.size) - step) <= scale + 1e-9).all()  # one level


def test_stochastic_rounding_is_unbiased():
    step, rng = _step(256), np.random.default_rng(2)
    int8 = UpdatePipeline(["int8:256"])
    mean = np.mean([int8.decode(int8.encode(step, None, rng)[0], 256) for _ in range(2000)],
                   axis=0)
    level = float(np.abs(step).max() / 127)
    # Rounding to nearest would leave errors up to half a level; unbiased rounding averages out.
    assert np.abs(mean - step).max() < 0.1 * level


def test_topk_sends_the_largest_and_error_feedback_sends_the_rest_later():
    pipe = UpdatePipeline(["topk:0.1"])
    step = _step(100)
    enc, residual = pipe.encode(step, None, np.random.default_rng(0))
    assert enc.indices.size == 10 and enc.indices.dtype == np.uint32
    assert (np.diff(enc.indices.astype(int)) > 0).all()
    assert set(enc.indices) == set(np.argsort(-np.abs(step))[:10])
    sent, residual, rng = np.zeros(100, np.float32), None, np.random.default_rng(0)
    steps = [_step(100, seed) for seed in range(30)]
    for s in steps:
        enc, residual = pipe.encode(s, residual, rng)
        sent += pipe.decode(enc, 100)
    # Nothing is lost, only delayed: what was sent plus what waits is every step's sum.
    np.testing.assert_allclose(sent + residual, np.sum(steps, axis=0), atol=1e-6)
    assert np.linalg.norm(residual) < 0.5 * np.linalg.norm(np.sum(steps, axis=0))


def test_clip_bounds_the_step_before_anything_else():
    pipe = UpdatePipeline(["clip:0.5", "float16"])
    step = np.full(100, 0.2, np.float32)  # norm 2
    enc, _ = pipe.encode(step, None, np.random.default_rng(0))
    assert np.linalg.norm(pipe.decode(enc, 100)) == pytest.approx(0.5, rel=1e-3)
    assert pipe.id == "clip:0.5-float16"


@pytest.mark.parametrize("stages, key", [
    (["int9"], "unknown stage"), (["topk:2"], "fraction"), (["int8", "topk:0.1"], "go clip"),
    (["float16", "int8"], "go clip"), (["clip"], "bound"), (["int8:x"], "not a number"),
    (["topk:0.1234567891", "clip:1.23456789"] * 3, "go clip")])
def test_bad_stages_are_named_at_start_up(stages, key):
    with pytest.raises(ConfigError, match="update_stages") as err:
        DeviceConfig(device_id="d", station="s", update_stages=tuple(stages))
    assert key in str(err.value)


def test_malformed_encodings_are_refused_by_name():
    pipe = UpdatePipeline(["topk:0.5", "int8:4"])
    good, _ = pipe.encode(_step(8), None, np.random.default_rng(0))
    assert pipe.decode(good, 8).shape == (8,)
    bad = {
        "positions out of order": dataclasses.replace(good, indices=good.indices[::-1].copy()),
        "a position past the model": dataclasses.replace(
            good, indices=np.array([0, 1, 2, 99], np.uint32)),
        "too few values": dataclasses.replace(good, codes=good.codes[:2]),
        "the wrong carrier": Encoded(indices=good.indices, values=np.ones(4, np.float32)),
        "scales of another block": dataclasses.replace(good, scales=np.ones(3, np.float32)),
        "a negative scale": dataclasses.replace(good, scales=-good.scales),
    }
    for name, enc in bad.items():
        with pytest.raises(MessageError) as err:
            pipe.decode(enc, 8)
        assert err.value.reason == "bad_encoding", name


# -- the station decodes onto its own model ----------------------------------------------


def _station(stages=(), **kw):
    """A started station of two devices and eight parameters, its model all ones (also
    tests/test_privacy.py's)."""
    cfg = StationConfig(fleet="t", station_id="s", devices=("d0", "d1"), **{
        "super_node_size": 2, "rand_per_group": 0, "sync_period": 5, "iteration_timeout": 10.0,
        "batch_size": 8, "update_stages": stages, **kw})
    st = Station(cfg, num_params=8, num_classes=2, rng=np.random.default_rng(0))
    for d in cfg.devices:
        st.handle(m.DeviceStats(fleet="t", sender=d, round=0, iteration=0, station="s",
                                seen_counts=np.array([9, 9]), next_batch_counts=np.array([4, 4])),
                  0.0)
    st.handle(m.GlobalModel(fleet="t", sender="cloud", round=0, iteration=0,
                            weights=np.ones(8), p_real=[0.5, 0.5]), 0.0)
    return st


def _encoded_update(sender, pipe, step, **over):
    enc, _ = pipe.encode(step, None, np.random.default_rng(0))
    fields = dict(fleet="t", sender=sender, round=0, iteration=0, station="s", num_samples=8,
                  encoding=pipe.id, weights=enc.values, indices=enc.indices, half=enc.half,
                  codes=enc.codes, scales=enc.scales)
    return m.DeviceUpdate(**{**fields, **over})


def test_a_station_fuses_encoded_steps_onto_its_model():
    pipe = UpdatePipeline(["float16"])
    st = _station(("float16",))
    st.handle(_encoded_update("d0", pipe, np.full(8, 0.25, np.float32)), 1.0)
    st.handle(_encoded_update("d1", pipe, np.full(8, -0.125, np.float32)), 1.0)
    assert st.iteration == 1 and st.counters["received_updates"] == 2
    np.testing.assert_allclose(st.weights, 1.0625)  # w^m + the mean step


def test_a_station_refuses_updates_encoded_for_other_stages():
    st = _station(("float16",))
    st.handle(_encoded_update("d0", UpdatePipeline(["int8:4"]), np.full(8, 0.25, np.float32)),
              1.0)
    plain = m.DeviceUpdate(fleet="t", sender="d1", round=0, iteration=0, station="s",
                           weights=np.full(8, 1.5, np.float32), num_samples=8)
    st.handle(plain, 1.0)
    assert st.counters["rejected.wrong_encoding"] == 2 and st.counters["refused_replies"] == 2
    np.testing.assert_allclose(st.weights, 1.0)  # nothing fused; the iteration closed at once
    forged = _encoded_update("d0", UpdatePipeline(["float16"]), np.zeros(8, np.float32),
                             half=np.zeros(3, np.float16), iteration=1)
    st.handle(forged, 2.0)
    assert st.counters["rejected.bad_encoding"] == 1


# -- the wire ---------------------------------------------------------------------------


def test_encoded_updates_cross_the_wire_and_plain_frames_are_unchanged():
    pipe = UpdatePipeline(["topk:0.1", "int8:256"])
    msg = _encoded_update("d0", pipe, _step(4096))
    frame = encode(msg)
    back = decode(frame, max_size=1 << 20).message
    for name in ("indices", "codes", "scales", "weights", "half"):
        assert np.array_equal(getattr(back, name), getattr(msg, name))
        assert getattr(back, name).dtype == getattr(msg, name).dtype
    assert back.encoding == pipe.id
    plain = m.DeviceUpdate(fleet="t", sender="d0", round=0, iteration=0, station="s",
                           weights=_step(4096), num_samples=8)
    plain_frame = encode(plain)
    assert b"encoding" not in plain_frame and b"indices" not in plain_frame
    assert len(frame) < len(plain_frame) / 6  # 410 positions, codes and 2 scales of 4,096
    assert m.payload_nbytes(msg) == 410 * 4 + 410 + 2 * 4


# -- a federation on compressed updates --------------------------------------------------


@pytest.mark.slow
def test_a_federation_on_int8_updates_learns_with_a_quarter_of_the_bytes(digits):
    from test_experiment import _spec

    from lab.experiment import ExperimentConfig

    settings = ExperimentConfig(name="t", factories=2, devices_per_factory=4, super_node=2,
                                sync_period=3, rounds=8).settings
    spec = dataclasses.replace(_spec(digits), rounds=8)
    runs = {}
    for stages in ((), ("int8:256",)):
        strategy = build_strategy("fedgs", settings)
        strategy = dataclasses.replace(strategy, device={**strategy.device,
                                                         "update_stages": stages})
        runs[stages] = run_federation(digits, strategy, spec)
    plain, int8 = runs[()], runs[("int8:256",)]
    up = {k: r.rows[-1]["bytes_device_up"] for k, r in runs.items()}
    assert up[()] / up[("int8:256",)] > 3.5
    assert int8.counters.get("rejected.wrong_encoding", 0) == 0
    # The steps were quantised (the model differs), and learning did not notice.
    assert int8.rows[-1]["loss"] != plain.rows[-1]["loss"]
    assert abs(int8.final_accuracy - plain.final_accuracy) <= 0.03
    assert int8.final_accuracy > 2 * plain.rows[0]["accuracy"]
