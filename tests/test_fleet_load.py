"""A provisioned fleet under load over TLS, and the faults a factory sees at size: each
device is the device service on its own certificate and connection (lab/fleet_load.py),
against Mosquitto brokers, ``safl station`` and ``safl cloud`` as provisioned.  CI runs 40
devices on two stations; ``bench/fleet_load.py`` runs a thousand (docs/scale.md)."""

from __future__ import annotations

import shutil

import pytest

from lab.fleet_load import run_load

pytest.importorskip("cryptography")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("mosquitto") is None,
                                 reason="Mosquitto is installed by .ci/run")]

DEVICES, STATIONS = 40, 2
REFUSED = ("rejected", "refused", "late_replies", "iterations_below_quorum", "replies_missed")


@pytest.mark.timeout(400)
def test_a_tls_fleet_under_load_loses_nothing_and_comes_back_from_each_fault(tmp_path):
    # The straggler deadline waits for every member (up to 30 s): beside the rest of the
    # suite the emulation's workers wait for a core, and the deadline would drop their
    # replies as late, as designed (the bench counts them, docs/scale.md).
    run = run_load(tmp_path, DEVICES, STATIONS, seconds=8, station={"straggler_factor": 0},
                   faults=("broker", "station", "drop"))
    first, last = run["window"]["first"], run["window"]["last"]
    for sid in ("st0", "st1"):
        summary = last["status"][sid]
        # Every device on the roster reported, is online, and said so in its summary.
        assert summary.online == DEVICES // STATIONS, summary
        assert last["status"][f"devices.{sid}"]["seen"] == DEVICES // STATIONS
        assert summary.iteration > first["status"][sid].iteration
        # Nothing an honest device sent was refused, late or missed before the faults.
        assert not {k: v for k, v in summary.counters.items() if k.startswith(REFUSED)}, \
            summary.counters
        # The operator reads how long a super node takes to answer.
        assert summary.reply_max_s is not None and 0 < summary.reply_median_s \
            <= summary.reply_max_s
    assert all(not k.startswith("rejected") for r in run["workers_report"]
               for k in r["transport"]), run["workers_report"]
    faults = {f["fault"]: f for f in run["faults"]}
    roster = DEVICES // STATIONS
    # Broker restarted: every device back; station killed: resumed from its checkpoint,
    # not from round 0; a tenth of the devices gone at once: the rest go on without them.
    assert faults["broker"]["online_after"] == roster
    assert faults["station"]["online_after"] == roster
    assert faults["station"]["round_after"] >= faults["station"]["round_before"] - 1 > 0
    assert faults["drop"]["online_after"] == roster - roster // 10
    for fault in faults.values():
        assert fault["iteration_after"] >= fault["iteration_before"] + 3, fault
        assert fault["recovered_s"] < 120, fault


@pytest.mark.timeout(300)
def test_a_camera_fleet_under_load_sums_its_head_statistics_without_a_refusal(tmp_path):
    """The configuration the docs recommend for cameras (a body, head_init = "auto": lda)
    under load (lab/load_body.py): every camera's statistics reach its station and are
    admitted, the station's sums reach the cloud, which solves the head, and the bytes are
    counted apart from the models'; nothing refused or clipped anywhere."""
    run = run_load(tmp_path, 20, 1, seconds=8, station={"straggler_factor": 0}, head="auto")
    first, last = run["window"]["first"], run["window"]["last"]
    before, after = first["status"]["st0"], last["status"]["st0"]
    assert after.counters["head_stats"] > before.counters.get("head_stats", 0)
    assert after.counters["head_stats_forwarded"] >= 1
    assert after.transport["head_stats_bytes_out"] > 0
    cloud = last["status"]["cloud"]
    assert cloud.counters["head_solves"] >= 1 and cloud.counters["head_stats"] >= 1
    devices = last["status"]["devices.st0"]
    assert devices["head_stats_bytes_out"] > first["status"]["devices.st0"].get(
        "head_stats_bytes_out", 0)
    assert 0 < devices["head_stats_bytes_out"] < devices["bytes_out"]
    for counters in (after.counters, cloud.counters):
        assert not {k: v for k, v in counters.items()
                    if k.startswith(("rejected", "clipped"))}, counters
