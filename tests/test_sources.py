"""Sample sources: recorded video through the camera code path, sidecars, folders, pumps."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from edge_client.config import DeviceConfig, InferenceConfig, SourceConfig, load_config
from edge_client.device import Device
from edge_client.errors import ConfigError, SourceError
from edge_client.serving import StreamFeed
from edge_client.sources import (
    FixedLabel,
    ImageFolderSource,
    Preprocess,
    ReplaySource,
    SidecarLabels,
    SourcePump,
    SyntheticSource,
    TeacherLabels,
    VideoSource,
    build_source,
)
from edge_client.trainers import build_trainer

cv2 = pytest.importorskip("cv2")

FPS = 10


def _write_video(path, n_frames=30, size=(64, 48)):
    """Frame i is a flat grey of level 8*i: its content says which frame it is."""
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), FPS, size)
    assert writer.isOpened()
    for i in range(n_frames):
        frame = np.full((size[1], size[0], 3), 8 * i, np.uint8)
        frame[:, :, 2] = 255 - 8 * i  # colour, so grayscale conversion is exercised
        writer.write(frame)
    writer.release()
    return path


GRAY_28 = Preprocess(sample_shape=(1, 28, 28), resize=(28, 28), grayscale=True)


def _collect(source, limit=1000):
    out = []
    for sample, label, *_ in source.samples():
        out.append((sample, label))
        if len(out) >= limit:
            break
    return out


def test_recorded_video_goes_through_the_camera_code_path(tmp_path):
    video = _write_video(tmp_path / "line.avi")
    sidecar = tmp_path / "labels.jsonl"
    # Frames 0-19 are labelled i % 3; frames 20-29 are a gap.
    sidecar.write_text("".join(json.dumps({"frame": i, "label": i % 3}) + "\n"
                               for i in range(20)))
    source = VideoSource(str(video), GRAY_28, SidecarLabels(sidecar, num_classes=3))
    assert not source.live
    got = _collect(source)
    assert [label for _, label in got] == [i % 3 for i in range(20)]
    assert source.counters["unlabelled"] == 10
    sample = got[5][0]
    assert sample.shape == (1, 28, 28) and sample.dtype == np.float32
    assert 0.0 <= sample.min() and sample.max() <= 1.0
    # Grey level 0.299 R + 0.587 G + 0.114 B grows with the frame number, so the samples
    # must come out in frame order (MJPG is lossy: compare means only).
    assert np.all(np.diff([s.mean() for s, _ in got]) > 0)


def test_sampling_rate_and_time_keyed_sidecar(tmp_path):
    video = _write_video(tmp_path / "line.avi", n_frames=30)  # 3 s at 10 fps
    sidecar = tmp_path / "labels.csv"
    sidecar.write_text("t,label\n0.0,1\n1.0,\n2.0,2\n")  # a gap from 1.0 s to 2.0 s
    source = VideoSource(str(video), GRAY_28, SidecarLabels(sidecar, num_classes=3),
                         sample_fps=2.0)
    labels = [label for _, label in _collect(source)]
    assert labels == [1, 1, 2, 2]  # 2 frames/s kept; the second second is unlabelled
    assert source.counters["unlabelled"] == 2


def test_bad_sidecars_are_refused_with_line_numbers(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"frame": 0, "label": 1}\n{"frame": 1, "label": 7}\n'
                   '{"frame": 2, "label": "cat"}\n')
    with pytest.raises(SourceError, match=r"line 2: label 7; line 3: label 'cat'"):
        SidecarLabels(bad, num_classes=3)
    for text, message in (('{"frame": 0}\n', "needs"), ("not json\n", "line 1: not JSON"),
                          ('{"frame": 0, "label": 1}\n{"t": 1.0, "label": 1}\n', "same way"),
                          ('{"frame": 0, "label": 1}\n{"frame": 0, "label": 2}\n', "twice"),
                          ("", "empty")):
        bad.write_text(text)
        with pytest.raises(SourceError, match=message):
            SidecarLabels(bad, num_classes=3)


def test_unreachable_camera_retries_with_backoff_then_fails_clearly():
    sleeps = []
    source = VideoSource("rtsp://127.0.0.1:9/stream", GRAY_28, FixedLabel(0, 2), retries=3,
                         backoff=0.5, sleep=sleeps.append, rng=np.random.default_rng(0))
    with pytest.raises(SourceError, match=r"cannot open url 'rtsp://127.0.0.1:9/stream' after 4"):
        next(source.samples())
    assert source.counters["open_failures"] == 4
    assert len(sleeps) == 3
    for attempt, delay in enumerate(sleeps):  # jittered exponential: base*2^k*[0.5, 1]
        assert 0.25 * 2**attempt <= delay <= 0.5 * 2**attempt
    with pytest.raises(SourceError, match="does not exist"):
        VideoSource("/nonexistent/clip.mp4", GRAY_28, FixedLabel(0, 2))
    index = VideoSource("63", GRAY_28, FixedLabel(0, 2), retries=0, sleep=sleeps.append)
    with pytest.raises(SourceError, match="device '63'"):
        next(index.samples())


def test_wrong_frame_shape_is_counted_not_fatal(tmp_path, caplog):
    video = _write_video(tmp_path / "v.avi", n_frames=5)
    no_resize = Preprocess(sample_shape=(1, 28, 28), grayscale=True)
    source = VideoSource(str(video), no_resize, FixedLabel(1, 2))
    with caplog.at_level("WARNING", logger="edge_client.sources.video"):
        assert _collect(source) == []
    assert source.counters["wrong_shape"] == 5
    assert len([r for r in caplog.records if "wrong_shape" in r.getMessage()]) == 1


def test_a_video_loops_or_ends_once(tmp_path, caplog):
    import itertools
    video = _write_video(tmp_path / "v.avi", n_frames=5)
    looping = VideoSource(str(video), GRAY_28, FixedLabel(1, 2), loop=True)
    got = list(itertools.islice(looping.samples(), 12))
    assert len(got) == 12 and looping.counters["loops"] == 2
    once = VideoSource(str(video), GRAY_28, FixedLabel(1, 2))
    with caplog.at_level("INFO", logger="edge_client.sources.video"):
        assert len(_collect(once)) == 5
    assert once.counters["recording_ended"] == 1
    assert [r.getMessage() for r in caplog.records if "ended" in r.getMessage()] == [
        f"{video} ended after 5 frames"]


def test_image_folder_with_bad_files(tmp_path):
    rng = np.random.default_rng(0)
    for label in ("0", "1"):
        (tmp_path / label).mkdir()
        for i in range(3):
            cv2.imwrite(str(tmp_path / label / f"{i}.png"),
                        rng.integers(0, 255, (28, 28), dtype=np.uint8))
    cv2.imwrite(str(tmp_path / "1" / "big.png"), np.zeros((40, 40), np.uint8))
    (tmp_path / "0" / "broken.png").write_bytes(b"not a png")
    source = ImageFolderSource(tmp_path, Preprocess(sample_shape=(1, 28, 28)), num_classes=2,
                               rng=rng)
    got = _collect(source)
    assert sorted(label for _, label in got) == [0, 0, 0, 1, 1, 1]
    assert source.counters["wrong_shape"] == 1 and source.counters["unreadable"] == 1
    named = ImageFolderSource(tmp_path, Preprocess(sample_shape=(1, 28, 28), resize=(28, 28)),
                              num_classes=2, rng=rng, classes=("1", "0"))
    assert sorted(label for _, label in _collect(named)) == [0, 0, 0, 0, 1, 1, 1]
    (tmp_path / "cat").mkdir()
    with pytest.raises(SourceError, match="not label numbers"):
        ImageFolderSource(tmp_path, GRAY_28, num_classes=2, rng=rng)


def test_replay_arrays_from_config(tmp_path):
    x = np.random.default_rng(0).random((50, 8, 8), dtype=np.float32)
    y = np.arange(50) % 10
    np.savez(tmp_path / "data.npz", x=x, y=y)
    cfg = SourceConfig(kind="replay", path=str(tmp_path / "data.npz"))
    source, drops = build_source(cfg, sample_shape=(8, 8), num_classes=10,
                                 rng=np.random.default_rng(0))
    assert not drops and len(_collect(source)) == 50
    np.save(tmp_path / "x.npy", x)
    with pytest.raises(SourceError, match="labels_path"):
        build_source(SourceConfig(kind="replay", path=str(tmp_path / "x.npy")),
                     sample_shape=(8, 8), num_classes=10, rng=np.random.default_rng(0))
    with pytest.raises(SourceError, match="outside"):
        build_source(cfg, sample_shape=(8, 8), num_classes=5, rng=np.random.default_rng(0))
    with pytest.raises(SourceError, match="model needs"):
        build_source(cfg, sample_shape=(28, 28), num_classes=10, rng=np.random.default_rng(0))


def test_source_config_from_toml(tmp_path):
    path = tmp_path / "device.toml"
    path.write_text('[source]\nkind = "camera"\nuri = "0"\nsidecar = "l.jsonl"\n'
                    "resize = [64, 64]\nsample_fps = 2.0\n")
    cfg = load_config(SourceConfig, "source", path)
    assert cfg.resize == (64, 64) and cfg.is_video
    with pytest.raises(ConfigError, match="sidecar"):
        SourceConfig(kind="camera", uri="0")
    with pytest.raises(ConfigError, match="uri"):
        SourceConfig(kind="camera", label=1)
    with pytest.raises(ConfigError, match="kind"):
        SourceConfig(kind="microphone")


def test_pump_blocks_for_recordings_and_drops_for_live_cameras():
    rng = np.random.default_rng(0)
    replay = ReplaySource(np.zeros((100, 2), np.float32), np.arange(100) % 2, rng, loop=False)
    pump = SourcePump(replay, capacity=8).start()
    got = 0
    deadline = time.monotonic() + 10
    while not pump.exhausted and time.monotonic() < deadline:
        batch = pump.drain(5)
        got += 0 if batch is None else len(batch[1])
        time.sleep(0.001)
    assert got == 100 and pump.metrics()["samples"] == 100
    assert pump.metrics().get("frames_dropped", 0) == 0
    live = SourcePump(SyntheticSource((2,), 2, rng, limit=500), capacity=4,
                      drop_when_full=True).start()
    live.finished.wait(10)
    assert live.counters["frames_dropped"] == 496
    assert len(live.drain(100)[1]) == 4
    live.stop()


def test_a_failing_source_surfaces_in_the_training_loop(tmp_path):
    source = VideoSource("rtsp://127.0.0.1:9/x", GRAY_28, FixedLabel(0, 2), retries=0)
    pump = SourcePump(source).start()
    pump.finished.wait(10)
    assert pump.drain(10) is None
    with pytest.raises(SourceError, match="cannot open"):
        pump.check()
    assert pump.metrics()["source_errors"] == 1


def test_teacher_pseudo_labels_above_threshold(exported):
    folder = exported("small_cnn")
    sample = np.random.default_rng(0).random((1, 28, 28), dtype=np.float32)
    sure = TeacherLabels(folder / "inference.onnx", threshold=0.01, num_classes=10)
    assert 0 <= sure(0, 0.0, sample) < 10
    unsure = TeacherLabels(folder / "inference.onnx", threshold=1.0, num_classes=10)
    assert unsure(0, 0.0, sample) is None and unsure.counters["low_confidence"] == 1
    with pytest.raises(SourceError, match="cannot load teacher"):
        TeacherLabels(folder / "missing.onnx", threshold=0.5, num_classes=10)


def test_a_device_is_fed_from_a_video_pump(tmp_path):
    video = _write_video(tmp_path / "v.avi", n_frames=12)
    cfg = SourceConfig(kind="replay", path=str(video), label=1, resize=(28, 28), grayscale=True)
    source, drops = build_source(cfg, sample_shape=(1, 28, 28), num_classes=2,
                                 rng=np.random.default_rng(0))
    assert not drops  # a recording waits for the trainer instead of dropping frames
    dev = Device(DeviceConfig(device_id="d", station="s", holdout_every=0),
                 build_trainer("softmax", input_shape=(1, 28, 28), num_classes=2, lr=0.1),
                 num_classes=2, sample_shape=(1, 28, 28), rng=np.random.default_rng(0))
    pump = SourcePump(source).start()
    pump.finished.wait(10)
    feed = StreamFeed(dev, pump, inference=InferenceConfig())
    out = feed(now=0.0)
    assert dev.buffer.samples_seen == 12 and dev.buffer.seen_counts.tolist() == [0, 12]
    assert out and out[0].next_batch_counts.tolist() == [0, 12]
    assert feed(now=1.0) == []
    broken = SourcePump(VideoSource("rtsp://127.0.0.1:9/x", GRAY_28, FixedLabel(0, 2),
                                    retries=0)).start()
    broken.finished.wait(10)
    with pytest.raises(SourceError):
        StreamFeed(dev, broken, inference=InferenceConfig())(now=2.0)


def test_device_metrics_expose_buffer_overwrites():
    cfg = DeviceConfig(device_id="d", station="s", buffer_capacity=10, holdout_every=0)
    dev = Device(cfg, build_trainer("softmax", input_shape=(2,), num_classes=2, lr=0.1),
                 num_classes=2, sample_shape=(2,), rng=np.random.default_rng(0))
    dev.ingest(np.zeros((25, 2), np.float32), np.arange(25) % 2, 0.0)
    m = dev.metrics()
    assert m["buffer.overwritten_unread"] == 15 and m["buffer.unread"] == 10


def test_a_network_camera_that_sends_nothing_is_given_up_on_after_its_timeout():
    import socket
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    held = []  # connections accepted and never answered: a camera that hangs
    threading.Thread(target=lambda: [held.append(server.accept()) for _ in range(4)],
                     daemon=True).start()
    uri = f"http://127.0.0.1:{server.getsockname()[1]}/cam.mjpg"
    source = VideoSource(uri, GRAY_28, FixedLabel(0, 2), retries=0, timeout=1.0)
    started = time.monotonic()
    with pytest.raises(SourceError, match="cannot open"):
        next(source.samples())
    assert time.monotonic() - started < 10  # FFmpeg's own default waits 30 s
    server.close()


@pytest.mark.skipif(__import__("shutil").which("mosquitto") is None,
                    reason="Mosquitto is installed by .ci/run")
def test_a_camera_past_its_retries_stops_the_device_naming_it(tmp_path):
    """As docs/sources.md says: the device exits (code 5, so its unit restarts it) with the
    URI in its error, rather than serving on with a dead source."""
    import subprocess
    import sys

    from brokers import Mosquitto, acl_lines

    broker = Mosquitto(tmp_path, ["st0", "cam1"], acl_lines("f", {"st0": ["cam1"]}))
    try:
        uri = "http://127.0.0.1:9/cam.mjpg"  # nothing listens on the discard port
        config = tmp_path / "device.toml"
        config.write_text(
            '[device]\nfleet = "f"\ndevice_id = "cam1"\nstation = "st0"\n'
            '[model]\nname = "softmax"\ninput_shape = [8, 8]\nnum_classes = 4\n'
            f'[source]\nkind = "camera"\nuri = "{uri}"\nlabel = 0\ngrayscale = true\n'
            'resize = [8, 8]\nretries = 1\nbackoff = 0.1\ntimeout = 1.0\n'
            f'[broker]\nurl = "{broker.url}"\nusername = "cam1"\n'
            f'password = "{Mosquitto.PASSWORD}"\n')
        started = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "edge_client", "--config", str(config)],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 5, out.stderr[-2000:]
        assert uri in out.stderr and "after 2 attempts" in out.stderr
        assert time.monotonic() - started < 30
    finally:
        broker.stop()


def test_a_synthetic_source_keeps_its_pace():
    from edge_client.sources import SyntheticSource

    paced = SyntheticSource((4,), 2, np.random.default_rng(0), limit=6, fps=50.0)
    started = time.monotonic()
    assert len(list(paced.samples())) == 6
    assert time.monotonic() - started >= 6 / 50.0 * 0.9


def test_a_recording_of_pixels_is_held_as_pixels_and_read_as_a_camera_scales_them(tmp_path):
    """A replayed recording of camera frames (uint8) is scaled into [0, 1] as it is read,
    as a camera's frames are; held as float32 it took a board four times the memory."""
    from edge_client.sources import build_source

    x = np.random.default_rng(0).integers(0, 256, (40, 3, 8, 8), dtype=np.uint8)
    np.savez(tmp_path / "rec.npz", x=x, y=np.arange(40) % 4)
    source, live = build_source(SourceConfig(kind="replay", path=str(tmp_path / "rec.npz"),
                                             loop=False),
                                sample_shape=(3, 8, 8), num_classes=4,
                                rng=np.random.default_rng(1))
    assert not live and source.x.dtype == np.uint8 and source.x.nbytes == x.nbytes
    got, y = source.read(40)
    assert got.dtype == np.float32 and got.shape == (40, 3, 8, 8)
    order = source._order
    np.testing.assert_allclose(got, x[order].astype(np.float32) / 255, rtol=1e-6)
    np.testing.assert_array_equal(y, (np.arange(40) % 4)[order])


@pytest.mark.skipif(__import__("shutil").which("ffmpeg") is None,
                    reason="ffmpeg is installed by .ci/run")
def test_a_live_camera_lost_for_longer_than_its_retries_is_waited_for_and_resumes(tmp_path):
    """A camera that delivered frames and went away is an outage, not a wrong address: the
    source retries for as long as it takes (here 6 s against the 2 attempts of 0.1-0.2 s
    that a camera never opened gets), times the outage, says so at error level, and reads
    on when the camera is back on the same address."""
    import threading

    from brokers import free_port
    from stream_servers import StreamServer

    from lab.ports import wait_for_port

    server = StreamServer("mjpeg", free_port(), tmp_path / "cam.log")
    stop = threading.Event()
    frame = np.full((64, 64, 3), 128, np.uint8).tobytes()

    def feed() -> None:
        while not stop.is_set():
            server.write(frame)
            stop.wait(0.1)
    threading.Thread(target=feed, daemon=True).start()
    wait_for_port(server.port, server.proc, 20)
    source = VideoSource(server.uri, GRAY_28, FixedLabel(0, 2), retries=1, backoff=0.1,
                         max_backoff=0.5, timeout=1.0)
    pump = SourcePump(source, drop_when_full=True).start()
    try:
        deadline = time.monotonic() + 20
        while pump.drain(256) is None:
            assert time.monotonic() < deadline and pump.error is None, pump.error
            time.sleep(0.1)
        server.kill()
        deadline = time.monotonic() + 20
        while source.outage_s < 6.0:  # far past its retries
            assert time.monotonic() < deadline and pump.error is None, pump.error
            time.sleep(0.2)
        assert source.counters["camera_outages"] == 1 and source.counters["open_failures"] > 2
        server.start()
        deadline = time.monotonic() + 30
        while source.outage_s > 0:
            assert time.monotonic() < deadline and pump.error is None, pump.error
            time.sleep(0.2)
        pump.drain(256)
        time.sleep(1.0)
        assert pump.drain(256) is not None  # frames again
        assert source.counters["camera_outages"] == 1 and pump.error is None
    finally:
        stop.set()
        pump.stop()
        server.stop()
