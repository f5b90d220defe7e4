"""Personal heads (edge_client/personal_head.py): Ditto's objective for a ridge head in closed
form, from the device's own sums and the global head; on the line through safe promotion;
the held-out slice that judges it kept out of the sums."""

from __future__ import annotations

import numpy as np
import pytest

from edge_client import messages as m
from edge_client.config import DeviceConfig, InferenceConfig
from edge_client.device import Device
from edge_client.errors import ConfigError
from edge_client.head_stats import HeadSpec, HeadStatsPath, augment
from edge_client.personal_head import PersonalHead, attach_personal
from edge_client.trainers import build_trainer

SPEC = HeadSpec("ridge", 64, 10, np.full(64, 4.0, np.float32), 200.0)
MINE = (3, 5, 8, 9)  # the device's classes: ones a global head confuses with others


def _flat(digits):
    return digits.x_train.reshape(len(digits.x_train), -1), digits.y_train


def _global_head(x, y):
    s = SPEC.zeros()
    s.add_rows(augment(x[:300], SPEC.centre, SPEC.clip), y[:300])
    return SPEC.solve(s)


def _accuracy(weights, x, y):
    return float(((x @ weights[:640].reshape(10, 64).T + weights[640:]).argmax(1) == y).mean())


def test_a_personal_head_is_dittos_closed_form_and_fits_its_device(digits):
    x, y = _flat(digits)
    glob = _global_head(x, y)
    head = PersonalHead(SPEC)
    assert head.solve(glob) is glob  # no frames of its own: the global head
    own = np.flatnonzero(np.isin(y, MINE))[-150:]
    a = augment(x[own], SPEC.centre, SPEC.clip).astype(np.float64)
    head.own.add_rows(a, y[own])
    mine = head.solve(glob)
    # (G + lambda I)^-1 (B + lambda P), P the global head on the augmented rows
    w = glob[:640].reshape(10, 64).astype(np.float64)
    prior = np.vstack([w.T, (glob[640:] + w @ SPEC.centre)[None, :]])
    onehot = np.eye(10)[y[own]]
    lam = head.last_lambda
    v = np.linalg.solve(a.T @ a + lam * np.eye(65), a.T @ onehot + lam * prior)
    want = np.concatenate([v[:64].T.ravel(), v[64] - v[:64].T @ SPEC.centre])
    np.testing.assert_allclose(mine, want, rtol=1e-4, atol=1e-4)
    xt, yt = digits.x_test.reshape(len(digits.x_test), -1), digits.y_test
    keep = np.isin(yt, MINE)
    on_mine = _accuracy(mine, xt[keep], yt[keep]), _accuracy(glob, xt[keep], yt[keep])
    assert on_mine[0] >= on_mine[1] + 0.04, on_mine  # measured 0.931 against 0.878
    # and it is the device's own: on every class it is worse (safe promotion's job); the
    # penalty's floor (head_solves.GCV_FLOOR) keeps it nearer the global head (measured
    # 0.856 against 0.925; without the floor 0.361, and 0.985 on its own classes)
    assert _accuracy(mine, xt, yt) < _accuracy(glob, xt, yt) - 0.04


def _device(personal: bool, promote: str = "always", holdout_every: int = 0,
            promote_window: int = 200) -> Device:
    dev = Device(DeviceConfig(device_id="d0", station="s0", batch_size=16,
                              holdout_every=holdout_every),
                 build_trainer("softmax", input_shape=(64,), num_classes=10, lr=0.1, seed=0),
                 num_classes=10, sample_shape=(64,), rng=np.random.default_rng(0),
                 inference=InferenceConfig(promote=promote, personal=personal,
                                           promote_every=1, promote_window=promote_window))
    HeadStatsPath.attach(dev, SPEC, 10)
    attach_personal(dev)
    return dev


@pytest.mark.parametrize("personal", [True, False])
def test_the_line_predicts_with_the_personal_head_and_training_keeps_the_global_one(
        digits, personal):
    x, y = _flat(digits)
    glob = _global_head(x, y)
    dev = _device(personal)
    own = np.flatnonzero(np.isin(y, MINE))[-150:]
    dev.ingest(x[own], y[own], 0.0)
    dev.handle(m.StationModel(fleet="default", sender="s0", round=1, iteration=1,
                              weights=glob), 0.0)
    deployed = dev.line.deployable
    if personal:
        again = PersonalHead(SPEC)
        again.own.add_rows(augment(x[own], SPEC.centre, SPEC.clip), y[own])
        np.testing.assert_allclose(deployed, again.solve(glob), rtol=1e-5, atol=1e-5)
        assert not np.allclose(deployed, glob)
    else:
        np.testing.assert_array_equal(deployed, glob)
    np.testing.assert_array_equal(dev._model.weights, glob)  # what it trains from


def test_a_personal_candidate_worse_on_the_line_is_kept_off_it(digits):
    """Safe promotion judges the personal head, not the broadcast: where the line turns
    to other products than the four the device trained on, its personal head is refused
    and the deployed model stays."""
    x, y = _flat(digits)
    glob = _global_head(x, y)
    dev = _device(True, promote="not_worse", promote_window=60)
    own = np.flatnonzero(np.isin(y, MINE))
    dev.ingest(x[own], y[own], 0.0)
    dev.line.restore(0, 0, glob)  # the global head is in use
    others = np.flatnonzero(~np.isin(y, MINE))[-60:]
    dev.ingest(x[others], y[others], 0.0)  # the line now shows the other six
    dev.handle(m.StationModel(fleet="default", sender="s0", round=1, iteration=1,
                              weights=glob), 0.0)
    dev.line.promote()
    assert dev.counters["promotions_refused"] == 1
    np.testing.assert_array_equal(dev.line.deployable, glob)


def test_personal_heads_need_a_ridge_head():
    dev = Device(DeviceConfig(device_id="d0", station="s0"),
                 build_trainer("softmax", input_shape=(64,), num_classes=10, lr=0.1, seed=0),
                 num_classes=10, sample_shape=(64,), rng=np.random.default_rng(0),
                 inference=InferenceConfig(personal=True))
    with pytest.raises(ConfigError, match="'personal'.*head_init = 'ridge'"):
        attach_personal(dev)


def test_held_out_samples_stay_out_of_the_statistics(digits):
    """The held-out slice judges the heads (the gate, safe promotion, device-local
    accuracy): a sample in it is not summed."""
    x, y = _flat(digits)
    dev = _device(True, holdout_every=4)
    dev.ingest(x[:40], y[:40], 0.0)
    assert dev.buffer.held_out == 10
    assert dev.head._held() == 30 and dev.head.first(False)[0].counts.sum() == 30
    assert dev.head.personal.own.n + dev.head.sums.n == 30  # sent, and not yet sent


def test_a_restarted_device_keeps_its_own_sums(digits, tmp_path):
    """What a device sent stays in its own sums across a restart (its state directory),
    so its personal head after the restart is the one it had; a file of another body's
    sums, or not sums at all, is refused naming ``state_dir``."""
    from edge_client.personal_head import PERSONAL_FILE

    x, y = _flat(digits)
    glob = _global_head(x, y)
    dev = _device(True)
    attach_personal(dev, str(tmp_path))
    own = np.flatnonzero(np.isin(y, MINE))[-150:]
    dev.ingest(x[own], y[own], 0.0)
    dev.head.first(True)  # sent: into its own sums, and kept
    before = dev.head.personal_head(glob)
    again = _device(True)
    assert again.head.personal.own.n == 0  # without the state directory, gone
    attach_personal(again, str(tmp_path))
    assert again.head.personal.own.n == 150
    for name in ("gram", "cross", "counts"):
        np.testing.assert_array_equal(getattr(again.head.personal.own, name),
                                      getattr(dev.head.personal.own, name))
    np.testing.assert_allclose(again.head.personal_head(glob), before, rtol=1e-6)
    other = _device(True)
    other.head.spec = other.head.personal.spec = HeadSpec("ridge", 64, 10,
                                                          np.zeros(64, np.float32), 200.0)
    with pytest.raises(ConfigError, match="'state_dir'.*another body"):
        other.head.personal.keep_in(tmp_path / PERSONAL_FILE)
    (tmp_path / PERSONAL_FILE).write_bytes(b"not sums")
    with pytest.raises(ConfigError, match="'state_dir'.*not this device's"):
        attach_personal(_device(True), str(tmp_path))


def test_a_services_personal_head_is_decomposed_off_the_prediction_path(digits):
    """A device service's personal head (background) never makes the line wait for its
    eigendecomposition: the candidate judged while the first is being made is the global
    head as it came, and once it is made the same closed form as in the foreground; a
    solve with frames the last decomposition lacked uses it and asks for the next."""
    x, y = _flat(digits)
    glob = _global_head(x, y)
    own = np.flatnonzero(np.isin(y, MINE))
    rows = augment(x[own], SPEC.centre, SPEC.clip)
    head, here = PersonalHead(SPEC, background=True), PersonalHead(SPEC)
    for h in (head, here):
        h.own.add_rows(rows[:150], y[own][:150])
    assert head.solve(glob) is glob and head.waited == 1
    head.settle()
    np.testing.assert_allclose(head.solve(glob), here.solve(glob), rtol=1e-6, atol=1e-6)
    for h in (head, here):
        h.own.add_rows(rows[150:], y[own][150:])
    stale = head.solve(glob)  # of the first 150 frames, while the next is made
    head.settle()
    np.testing.assert_allclose(head.solve(glob), here.solve(glob), rtol=1e-6, atol=1e-6)
    assert not np.allclose(stale, head.solve(glob)) and head.waited == 1

