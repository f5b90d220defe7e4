"""Sample sources feeding a device's stream buffer, built from its ``[source]`` config.

``replay`` (arrays, image folders, video files), ``camera`` (OpenCV capture) and
``synthetic`` (tests); camera and video labels may also arrive live (``live_labels.py``).
OpenCV is needed for images, video and cameras only: ``pip install 'safl-edge[camera]'``.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ..config import SourceConfig
from ..errors import SourceError
from .labels import FixedLabel, SidecarLabels, TeacherLabels
from .live_labels import LiveLabels, parse_label
from .preprocess import Preprocess
from .pump import Source, SourcePump
from .replay import ImageFolderSource, ReplaySource, load_arrays
from .video import Labeler, VideoSource

__all__ = [
    "Source",
    "SourcePump",
    "ReplaySource",
    "ImageFolderSource",
    "VideoSource",
    "SyntheticSource",
    "Preprocess",
    "FixedLabel",
    "SidecarLabels",
    "TeacherLabels",
    "build_source",
    "LiveLabels",
    "parse_label",
    "load_arrays",
]


class SyntheticSource:
    """Class-dependent Gaussian samples, for tests and smoke runs only: as fast as they are
    taken, or ``fps`` a second (a sensor's pace, for a dry run beside real cameras)."""

    def __init__(self, sample_shape: tuple[int, ...], num_classes: int,
                 rng: np.random.Generator, *, limit: int | None = None,
                 fps: float = 0.0) -> None:
        self.sample_shape, self.num_classes, self.rng, self.limit = (
            tuple(sample_shape), num_classes, rng, limit)
        self.period = 1.0 / fps if fps else 0.0
        self.centres = rng.normal(size=(num_classes, *self.sample_shape)).astype(np.float32)
        self.counters: Counter[str] = Counter()

    def samples(self) -> Iterator[tuple[np.ndarray, int]]:
        n = 0
        while self.limit is None or n < self.limit:
            y = int(self.rng.integers(self.num_classes))
            noise = self.rng.normal(scale=0.5, size=self.sample_shape).astype(np.float32)
            yield self.centres[y] + noise, y
            n += 1
            if self.period:
                time.sleep(self.period)

    def close(self) -> None:
        pass


def _require_cv2() -> None:
    try:
        import cv2  # noqa: F401
    except ImportError as exc:
        raise SourceError("images, video and cameras need OpenCV: "
                          "pip install 'safl-edge[camera]'") from exc


def build_source(cfg: SourceConfig, *, sample_shape: tuple[int, ...], num_classes: int,
                 rng: np.random.Generator) -> tuple[Source, bool]:
    """Build the configured source; returns it and whether its pump may drop when full."""
    if cfg.kind == "synthetic":
        return SyntheticSource(sample_shape, num_classes, rng, fps=cfg.sample_fps), False
    preprocess = Preprocess.from_settings(cfg, sample_shape)
    path = Path(cfg.path)
    if cfg.is_video:
        _require_cv2()
        labeler: Labeler | None
        if cfg.sidecar:
            labeler = SidecarLabels(cfg.sidecar, num_classes)
        elif cfg.label_topic:
            labeler = None  # the service joins the line's labels (live_labels.py)
        elif cfg.teacher:
            labeler = TeacherLabels(cfg.teacher, threshold=cfg.confidence,
                                    num_classes=num_classes)
        else:
            labeler = FixedLabel(cfg.label, num_classes)
        source = VideoSource(cfg.uri or cfg.path, preprocess, labeler,
                             sample_fps=cfg.sample_fps, retries=cfg.retries,
                             timeout=cfg.timeout,
                             backoff=cfg.backoff, loop=cfg.loop, rng=rng)
        return source, source.live
    if path.is_dir():
        _require_cv2()
        return ImageFolderSource(path, preprocess, num_classes=num_classes, rng=rng,
                                 classes=cfg.classes, loop=cfg.loop), False
    x, y = load_arrays(path, cfg.labels_path or None, num_classes, pixels=True)
    if x[0].size != int(np.prod(sample_shape)):
        raise SourceError(f"{path}: samples of shape {x.shape[1:]}, the model needs "
                          f"{tuple(sample_shape)}")
    return ReplaySource(x.reshape(len(x), *sample_shape), y, rng, loop=cfg.loop), False
