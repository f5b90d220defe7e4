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
