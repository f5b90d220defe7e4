"""``SourceConfig``: the ``[source]`` table, where a device's samples come from, and the
preprocessing settings it shares with the sources."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ..errors import ConfigError
from .loading import check_range

MAX_LABEL_LAG = 5.0  # s: the longest lag, either way, the device measures (label_lag.py MAX_LAG)

__all__ = ["SOURCE_KINDS", "PreprocessSettings", "SourceConfig", "VIDEO_SUFFIXES"]

SOURCE_KINDS = ("replay", "camera", "synthetic")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PreprocessSettings:
    """How a frame becomes a sample: ``crop`` is ``x, y, w, h`` in source pixels,
    ``resize`` is ``w, h``; after ``scale``, ``mean``/``std`` (one value or one per
    channel) normalise."""

    # x, y, w, h of the region kept, in source pixels (none: the whole frame)
    crop: tuple[int, ...] = ()
    resize: tuple[int, ...] = ()  # w, h the frame is resized to, after the crop
    grayscale: bool = False  # convert frames to one grey channel
    rgb: bool = False  # colour frames in RGB order, as a pretrained body takes them (else BGR)
    scale: float = 1.0 / 255.0  # what pixel values are multiplied by (1/255: into [0, 1])
    mean: tuple[float, ...] = ()  # subtracted after scale, one value or one per channel
    std: tuple[float, ...] = ()  # divided by after mean, one value or one per channel

    def __post_init__(self) -> None:
        if self.crop and (len(self.crop) != 4 or min(self.crop[2:]) <= 0 or min(self.crop) < 0):
            raise ConfigError("crop", f"must be x,y,w,h with positive w,h, got {self.crop}")
        if self.resize and (len(self.resize) != 2 or min(self.resize) <= 0):
            raise ConfigError("resize", f"must be w,h > 0, got {self.resize}")
        if len(self.mean) != len(self.std) or any(v <= 0 for v in self.std):
            raise ConfigError("std", "mean and std need the same length and std > 0")
        check_range("scale", self.scale, 0, low_open=True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SourceConfig(PreprocessSettings):
    """Where a device's samples come from (the ``[source]`` table of its TOML file).

    ``replay``: ``path`` is an ``.npz``/``.npy`` file (with ``labels_path``), an image
    folder with one sub-folder per label, or a video file (labelled like a camera).
    ``camera``: ``uri`` is a device index, an RTSP/HTTP URL or a GStreamer pipeline.
    Camera and video frames take their label from exactly one of ``sidecar``
    (JSONL/CSV keyed by frame or time), ``label`` (fixed), ``teacher`` (ONNX model,
    kept above ``confidence``) or ``label_topic`` (labels the line publishes live on the
    device's broker, joined to the frame captured nearest before their time within
    ``label_window`` seconds; frames wait ``label_delay_max`` seconds for theirs).
    ``synthetic`` is for tests.
    """

    kind: str  # replay, camera or synthetic
    path: str = ""  # replay: an .npz/.npy file, an image folder (a sub-folder per label) or a video
    labels_path: str = ""  # replay: the labels .npy beside an .npy of samples
    uri: str = ""  # camera: a device index, an RTSP/HTTP URL or a GStreamer pipeline
    sidecar: str = ""  # labels from a JSONL/CSV file keyed by frame number or time
    label: int = -1  # one fixed label for every frame (-1: none)
    teacher: str = ""  # labels from this ONNX model's predictions
    confidence: float = 0.9  # the teacher's probability a label needs to be kept
    label_topic: str = ""  # labels the line publishes live on the device's broker (docs/sources.md)
    # seconds before a label's t within which its frame must have been captured
    label_window: float = 0.5
    # seconds a frame waits for its label before it is dropped unlabelled
    label_delay_max: float = 30.0
    # s a camera's frames reach the device after the time the line's labels name (negative
    # where the line stamps a verdict after the item passed the camera): "auto" measures it
    # from the labels and joins by it (docs/sources.md), a number fixes it
    label_lag: float | str = "auto"
    # s the frames of labels naming a product the fleet has not added yet are held, to be
    # trained on once the cloud adds it (a week; edge_client/catalogue.py, kept in state_dir)
    hold_labels_for: float = 604800.0
    hold_labels_max: int = 2000  # such frames held at most (the oldest go first)
    classes: tuple[str, ...] = ()  # class names, for an image folder's sub-folders
    sample_fps: float = 0.0  # frames a second taken from a camera or video, synthetic pace (0: all)
    loop: bool = False  # start a recording over at its end
    seed: int = 0  # of the replay order
    # Replay at the federation's pace: ``per_iteration`` samples arrive with each station
    # model (0: stream through the pump as fast as training takes them), after ``initial``;
    # fractional rates carry over between iterations.
    per_iteration: float = 0.0
    initial: int = 0  # samples pushed into the buffer before the first iteration (replay)
    queue_size: int = 256  # frames the source's queue holds between the reader thread and training
    # Attempts after the first at opening a camera at start, before the device ends (exit 5:
    # a camera that never answered is a wrong address); a camera lost after it delivered
    # frames is retried for as long as it takes, every 10 s at most (camera_outage_seconds).
    retries: int = 5
    backoff: float = 0.5  # seconds before the first reconnect to a lost camera (doubling per try)
    timeout: float = 10.0  # s a network camera may stay silent before it is reconnected

    @property
    def is_video(self) -> bool:
        return self.kind == "camera" or (
            self.kind == "replay" and Path(self.path).suffix.lower() in VIDEO_SUFFIXES)

    @property
    def decoded(self) -> bool:
        """Frames OpenCV decodes (BGR, through ``Preprocess``): a camera, a video, images."""
        return self.is_video or (self.kind == "replay" and Path(self.path).is_dir())

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kind not in SOURCE_KINDS:
            raise ConfigError("kind", f"must be one of {SOURCE_KINDS}, got {self.kind!r}")
        if self.kind == "camera" and not self.uri:
            raise ConfigError("uri", "a camera source needs a device index, URL or pipeline")
        if self.kind == "replay" and not self.path:
            raise ConfigError("path", "a replay source needs an array file, image folder or video")
        labellers = [k for k in ("sidecar", "teacher", "label_topic") if getattr(self, k)] + (
            ["label"] if self.label >= 0 else [])
        if self.is_video and len(labellers) != 1:
            raise ConfigError("sidecar", "camera and video frames need exactly one of sidecar, "
                              f"label, teacher or label_topic; got {labellers or 'none'}")
        if self.label_topic and (not self.is_video or any(c in self.label_topic for c in "+#")):
            raise ConfigError("label_topic", "one topic (no wildcards), for camera and video "
                              "sources")
        check_range("label_window", self.label_window, 0, low_open=True)
        check_range("label_delay_max", self.label_delay_max, 0, low_open=True)
        if isinstance(self.label_lag, str):
            if self.label_lag != "auto":
                raise ConfigError("label_lag", f'must be "auto" or seconds, got '
                                  f'{self.label_lag!r}')
        else:
            check_range("label_lag", self.label_lag, -MAX_LABEL_LAG, MAX_LABEL_LAG)
        check_range("confidence", self.confidence, 0, 1, low_open=True)
        check_range("hold_labels_for", self.hold_labels_for, 0)
        check_range("hold_labels_max", self.hold_labels_max, 0)
        check_range("sample_fps", self.sample_fps, 0)
        check_range("queue_size", self.queue_size, 1)
        check_range("per_iteration", self.per_iteration, 0)
        check_range("initial", self.initial, 0)
        check_range("retries", self.retries, 0)
        check_range("backoff", self.backoff, 0)
        check_range("timeout", self.timeout, 0, low_open=True)


VIDEO_SUFFIXES = (".mp4", ".avi", ".mkv", ".mov", ".webm", ".mjpeg", ".h264")
