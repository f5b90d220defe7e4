"""A camera that drifts: its station's ADWIN over the hits it reports (aggregator/drift.py),
judged on several shapes of stream and report sizes, its counts checked as claims, the flag
through a restart, and where operators read it (safl status, the page, the documents)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("river", reason="the station extra (river) is installed by make venv")

from aggregator.config import StationConfig  # noqa: E402
from aggregator.drift import JUDGED, MAX_FED, DriftWatch, spread  # noqa: E402
from aggregator.station import Station  # noqa: E402
from edge_client import messages as m  # noqa: E402
from edge_client.documents import (  # noqa: E402
    DeviceSummary,
    MessageError,
    StationSummary,
    decode_document,
    encode_document,
)
from edge_client.inference import Prequential  # noqa: E402
from edge_client.states import DeviceState, StationState  # noqa: E402

WIDE = ((0, 1), 10**6)  # a window that allows any report in these tests


def _watch() -> tuple[DriftWatch, Counter[str]]:
    counters: Counter[str] = Counter()
    return DriftWatch(counters, lambda kind: counters.update([f"clipped.{kind}"])), counters


def _flags(levels: np.ndarray, batch: int, seed: int) -> list[tuple[int, bool]]:
    """Whether the device is flagged after each report of ``batch`` scores, each right
    with its level's probability."""
    rng = np.random.default_rng(seed)
    watch, _ = _watch()
    scored = hits = 0
    out = []
    for i in range(0, len(levels), batch):
        right = rng.random(len(levels[i:i + batch])) < levels[i:i + batch]
        scored, hits = scored + len(right), hits + int(right.sum())
        watch.take("cam", scored, hits, *WIDE)
        out.append((scored, "cam" in watch.drifting))
    return out


def _lamp() -> np.ndarray:
    """0.85, a lamp change to 0.68 at score 3,000, the line relearning to 0.80, then back
    to 0.85 (the old lamps refitted) from score 6,000."""
    return np.r_[np.full(3000, .85), np.full(500, .68), np.linspace(.68, .80, 500),
                 np.full(2000, .80), np.full(3000, .85)]


@pytest.mark.parametrize("batch", [1, 10, 60])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_fall_is_flagged_once_and_cleared_once_it_is_back(batch, seed):
    flags = _flags(_lamp(), batch, seed)
    raised = next(s for s, f in flags if f)
    cleared = next(s for s, f in flags if s > raised and not f)
    assert 3000 < raised <= 3600, "flagged within 600 scores of the change, not before"
    assert 6000 < cleared <= 8600, "cleared once back at its level, not while below it"
    assert sum(a[1] != b[1] for a, b in zip(flags, flags[1:], strict=False)) == 2, \
        "raised and cleared once: no flapping on a window's noise"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_steady_rising_and_slightly_lower_streams_are_never_flagged(seed):
    for level in (0.5, 0.8, 0.95):
        assert not any(f for _, f in _flags(np.full(40_000, level), 10, seed)), level
    learning = np.r_[np.linspace(0.3, 0.85, 3000), np.full(20_000, 0.85)]
    assert not any(f for _, f in _flags(learning, 10, seed)), "a camera learning is no drift"
    # A fall of two points is within what a lamp change may cost: not an operator's alarm.
    assert not any(f for _, f in _flags(np.r_[np.full(3000, .85), np.full(20_000, .83)],
                                        10, seed))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_slow_decline_is_flagged_before_it_costs_fifteen_points(seed):
    decline = np.r_[np.full(3000, .85), np.linspace(.85, .65, 3000), np.full(3000, .65)]
    raised = next(s for s, f in _flags(decline, 10, seed) if f)
    assert 3000 < raised < 3000 + 0.75 * 3000


def test_a_reports_hits_are_spread_over_its_scores():
    assert spread(4, 2) == [False, True, False, True]
    assert spread(3, 0) == [False] * 3 and spread(3, 3) == [True] * 3
    assert sum(spread(1000, 617)) == 617


def _width(watch: DriftWatch, device: str = "cam") -> int:
    return int(watch._cameras[device].adwin.width)


def test_counts_are_claims_clipped_rebased_and_bounded():
    watch, counters = _watch()
    watch.take("cam", 10, 12, *WIDE)  # more hits than scores
    assert counters["clipped.prequential_counts"] == 1
    assert watch._cameras["cam"].adwin.estimation == 1.0  # the ten scores, all right at most
    # A claim of a billion scores feeds the detector MAX_FED at most, in milliseconds.
    began = time.process_time()
    watch.take("cam", 10**9, 10**9, *WIDE)
    assert time.process_time() - began < 1.0
    assert counters["clipped.prequential_counts"] == 2
    assert _width(watch) <= 10 + MAX_FED
    # Counts that went down: the device restarted; nothing is fed for that report.
    width = _width(watch)
    watch.take("cam", 5, 5, *WIDE)
    assert counters["drift.rebased"] == 1 and _width(watch) == width + 5
    # Reports in one window share its allowance: a hundred reports grow by one allowance.
    watch, counters = _watch()
    for k in range(1, 101):
        watch.take("cam", 50 * k, 40 * k, (0, 1), 100)
    assert _width(watch) == 100
    watch.take("cam", 5050, 4040, (100, 1), 100)  # the next window grows anew
    assert _width(watch) == 150


def test_each_count_bound_passes_a_claim_on_it_and_clips_one_past_it():
    """Hits: between none and every score; scores: the window's allowance, and MAX_FED a
    report.  A device sitting exactly on each is fed whole and not counted; one more is
    clipped onto it and counted."""
    watch, counters = _watch()
    watch.take("cam", 100, 100, (0, 1), 100)  # every score right, the whole allowance
    assert _width(watch) == 100 and not counters
    watch.take("cam", 201, 201, (100, 1), 100)  # one score past the next window's allowance
    assert _width(watch) == 200 and counters["clipped.prequential_counts"] == 1
    watch.take("cam", 251, 252, (200, 1), 100)  # one hit more than its scores
    assert _width(watch) == 250 and counters["clipped.prequential_counts"] == 2
    watch, counters = _watch()
    watch.take("cam", 50, -1, (0, 1), 100)  # fewer hits than none: fed as 50 misses
    assert counters["clipped.prequential_counts"] == 1 and _width(watch) == 50
    assert watch._cameras["cam"].adwin.estimation == 0.0
    watch, counters = _watch()
    watch.take("cam", MAX_FED, 0, *WIDE)  # a report of MAX_FED scores, whole
    assert _width(watch) == MAX_FED and not counters
    watch.take("cam", 2 * MAX_FED + 1, 0, (1, 1), 10**6)  # one score past MAX_FED
    assert _width(watch) == 2 * MAX_FED and counters["clipped.prequential_counts"] == 1


def test_prequential_counts_what_it_scored_and_got_right():
    pre = Prequential(window=4, num_classes=3)
    pre.score(np.array([0, 1, 2, 1, 0, 2]), np.array([0, 1, 1, 1, -1, 2]))
    assert (pre.scored, pre.hits) == (5, 4)  # the unpredicted slot is left out
    pre.score(np.array([1]), np.array([0]))
    assert (pre.scored, pre.hits, pre.samples) == (6, 4, 4)


def _station() -> Station:
    cfg = StationConfig(fleet="t", station_id="s", devices=("d0", "d1"), super_node_size=2,
                        rand_per_group=0, batch_size=8, max_seen_rate=100_000)
    return Station(cfg, num_params=4, num_classes=2, rng=np.random.default_rng(0))


def _report(st: Station, did: str, scored: int, hits: int) -> None:
    st.handle(m.DeviceStats(fleet="t", sender=did, round=0, iteration=0, station="s",
                            seen_counts=np.array([scored, scored]),
                            next_batch_counts=np.array([4, 4]), prequential_scored=scored,
                            prequential_hits=hits), 0.0)


def _stream(st: Station, did: str, levels: np.ndarray, start=(0, 0), seed=0) -> tuple[int, int]:
    rng = np.random.default_rng(seed)
    scored, hits = start
    for i in range(0, len(levels), 20):
        right = rng.random(len(levels[i:i + 20])) < levels[i:i + 20]
        scored, hits = scored + len(right), hits + int(right.sum())
        _report(st, did, scored, hits)
    return scored, hits


def test_a_station_names_a_drifting_device_and_keeps_the_flag_through_a_restart():
    st = _station()
    _stream(st, "d1", np.full(4000, 0.9), seed=1)
    counts = _stream(st, "d0", np.r_[np.full(3000, .85), np.full(1000, .6)])
    shown = st.roster.drift.shown()
    assert list(shown) == ["d0"] and st.roster.drift.off == ""
    assert 0.82 < shown["d0"] < 0.9
    assert st.counters["drift.detected"] == 1
    arrays, meta = st.snapshot()
    resumed = _station()
    resumed.restore(arrays, meta)
    assert resumed.roster.drift.drifting.keys() == {"d0"}, "a restart does not clear a flag"
    # The restarted station's fresh window judges it: still low, still flagged; back, clear.
    counts = _stream(resumed, "d0", np.full(JUDGED * 2, 0.6), counts, seed=2)
    assert resumed.roster.drift.drifting.keys() == {"d0"}
    _stream(resumed, "d0", np.full(3000, 0.86), counts, seed=3)
    assert resumed.roster.drift.drifting == {}


def test_a_station_without_river_says_it_watches_nothing(monkeypatch):
    monkeypatch.setitem(sys.modules, "river.drift", None)
    watch, _ = _watch()
    watch.take("cam", 10, 5, *WIDE)
    assert "river is not installed" in watch.off
    assert watch.drifting == {}


def test_operators_read_the_flag_in_safl_status_on_the_page_and_in_the_documents():
    from aggregator.monitor import FleetHistory
    from aggregator.monitor_page import trouble
    from aggregator.status import format_status

    station = StationSummary(station="s", state=StationState.COLLECTING, round=3,
                             iteration=9, devices=3, online=3, quorum=1,
                             drifting={"d0": 0.85}, devices_drifting=1)
    assert decode_document(encode_document(station)) == station
    bad = encode_document(station).replace(b'"d0": 0.85', b'"d0": "high"')
    with pytest.raises(MessageError, match="drifting"):
        decode_document(bad)
    history = FleetHistory("f")
    history.status.take(station)
    for did, acc in (("d0", 0.70), ("d1", 0.86)):
        history.status.presence[(m.Participant.DEVICE, did)] = True
        doc = DeviceSummary(device=did, station="s", state=DeviceState.READY, round=3,
                            iteration=9, prequential_accuracy=acc)
        history.status.take(doc)
        history.take(doc)
    text = format_status(history.status, "f")
    assert "drifting, prequential accuracy fell: d0 (from 0.850 to 0.700)" in text
    rows = {r["id"]: r for r in history.snapshot(Counter())["devices"]}
    assert rows["d0"]["drift_from"] == 0.85 and rows["d1"]["drift_from"] is None
    assert trouble(rows["d0"]) < trouble(rows["d1"])
    # A station's count below the devices it names is a claim, not a negative "more".
    history.status.take(StationSummary(station="s", state=StationState.COLLECTING, round=3,
                                       iteration=9, devices=3, online=3, quorum=1,
                                       drifting={"d0": 0.85}, devices_drifting=-4))
    assert "more their stations did not name" not in format_status(history.status, "f")
    off = StationSummary(station="s2", state=StationState.COLLECTING, round=3, iteration=9,
                         devices=1, online=1, quorum=1, drift_off="river is not installed")
    history.status.take(off)
    assert "s2 watches no camera for drift: river is not installed" in \
        format_status(history.status, "f")


def test_a_station_imports_river_only_once_a_device_scores():
    # river brings scipy and scikit-learn (0.8 s): a station whose devices score nothing,
    # as most simulated ones, never pays for it; the first scores import it.
    code = ("import sys\nfrom collections import Counter\nfrom aggregator.drift import DriftWatch\n"
            "watch = DriftWatch(Counter(), lambda key: None)\n"
            "watch.take('cam', 0, 0, (0, 1), 64)\n"
            "assert 'river' not in sys.modules, 'imported at start-up'\n"
            "watch.take('cam', 10, 5, (0, 1), 64)\n"
            "assert 'river' in sys.modules and watch.off == ''\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parent.parent)
