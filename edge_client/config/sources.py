"""``SourceConfig``: the ``[source]`` table, where a device's samples come from, and the
preprocessing settings it shares with the sources."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ..errors import ConfigError
from .loading import check_range

__all__ = ["SOURCE_KINDS", "PreprocessSettings", "SourceConfig", "VIDEO_SUFFIXES"]

SOURCE_KINDS = ("replay", "camera", "synthetic")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PreprocessSettings:
    """How a frame becomes a sample: ``crop`` is ``x, y, w, h`` in source pixels,
    ``resize`` is ``w, h``; after ``scale``, ``mean``/``std`` (one value or one per
    channel) normalise."""

    crop: tuple[int, ...] = ()
    resize: tuple[int, ...] = ()
    grayscale: bool = False  # convert frames to one grey channel
    rgb: bool = False  # colour frames in RGB order, as a pretrained body takes them (else BGR)
    scale: float = 1.0 / 255.0
    mean: tuple[float, ...] = ()
    std: tuple[float, ...] = ()

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
    path: str = ""
    labels_path: str = ""
    uri: str = ""
    sidecar: str = ""
    label: int = -1
    teacher: str = ""
    confidence: float = 0.9
    label_topic: str = ""
    label_window: float = 0.5
    label_delay_max: float = 30.0
    classes: tuple[str, ...] = ()  # class names, for an image folder's sub-folders
    sample_fps: float = 0.0  # frames a second taken from a camera or video, synthetic pace (0: all)
    loop: bool = False  # start a recording over at its end
    seed: int = 0  # of the replay order
    # Replay at the federation's pace: ``per_iteration`` samples arrive with each station
    # model (0: stream through the pump as fast as training takes them), after ``initial``;
    # fractional rates carry over between iterations.
    per_iteration: float = 0.0
    initial: int = 0
    queue_size: int = 256
    retries: int = 5
    backoff: float = 0.5
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
        check_range("confidence", self.confidence, 0, 1, low_open=True)
        check_range("sample_fps", self.sample_fps, 0)
        check_range("queue_size", self.queue_size, 1)
        check_range("per_iteration", self.per_iteration, 0)
        check_range("initial", self.initial, 0)
        check_range("retries", self.retries, 0)
        check_range("backoff", self.backoff, 0)
        check_range("timeout", self.timeout, 0, low_open=True)


VIDEO_SUFFIXES = (".mp4", ".avi", ".mkv", ".mov", ".webm", ".mjpeg", ".h264")
