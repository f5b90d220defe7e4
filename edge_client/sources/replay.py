"""Replay sources: labelled arrays (``.npz``/``.npy``) and image folders.

No pickle: arrays load with ``allow_pickle=False``.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from ..errors import ShapeError, SourceError
from .preprocess import Preprocess

__all__ = ["ReplaySource", "load_arrays", "ImageFolderSource", "IMAGE_SUFFIXES"]

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".pgm", ".ppm", ".tif", ".tiff")


class ReplaySource:
    """Replays labelled arrays as a stream, reshuffled on every pass.

    ``read(n)`` returns the next ``n`` samples (fewer at the end when
    ``loop`` is false); ``samples()`` yields them one by one for a pump.  A ``uint8`` ``x``
    (camera frames as pixels) is kept so and scaled into [0, 1] as it is read, as a camera's
    frames are: a recording held as float32 is four times the memory (14 MB against 3.5
    for 286 frames at 3x64x64 on a board).
    """

    def __init__(self, x: np.ndarray, y: np.ndarray, rng: np.random.Generator, *,
                 loop: bool = True) -> None:
        if len(x) != len(y) or not len(y):
            raise ShapeError(f"replay needs equal, non-empty x and y, got {len(x)} and {len(y)}")
        self.x, self.y, self.rng, self.loop = x, y, rng, loop
        self.counters: Counter[str] = Counter()
        self._order = rng.permutation(len(y))
        self._pos = 0
        self._carry = 0.0  # fraction of a sample owed by paced()

    def read(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        idx = []
        while n > 0:
            if self._pos == len(self._order):
                if not self.loop:
                    break
                self._order, self._pos = self.rng.permutation(len(self.y)), 0
            take = self._order[self._pos:self._pos + n]
            idx.append(take)
            self._pos += len(take)
            n -= len(take)
        sel = np.concatenate(idx) if idx else np.empty(0, dtype=np.int64)
        return _floats(self.x[sel]), self.y[sel]

    def samples(self) -> Iterator[tuple[np.ndarray, int]]:
        while True:
            x, y = self.read(1)
            if not len(y):
                return
            yield x[0], int(y[0])

    def paced(self, rate: float, local_steps: int) -> tuple[np.ndarray, np.ndarray]:
        """The samples that arrive in one station iteration at ``rate`` per local-step time:
        fractions carry over, so a device sensing 4.3 samples a step gets exactly that on
        average.  The simulator and a replaying device service both pace replay with it."""
        self._carry += rate * local_steps
        n = int(self._carry)
        self._carry -= n
        return self.read(n)

    def close(self) -> None:
        pass


def load_arrays(path: str | Path, labels: str | Path | None = None,
                num_classes: int | None = None, *, pixels: bool = False
                ) -> tuple[np.ndarray, np.ndarray]:
    """Load ``x, y`` from an ``.npz`` (keys ``x``/``y``) or an ``.npy`` plus a labels ``.npy``.
    A ``uint8`` ``x`` holds pixels (a recording of camera frames, a quarter of float32's
    bytes): it is scaled into [0, 1], as ``[source] scale`` scales a camera's frames, or
    with ``pixels`` kept as pixels for :class:`ReplaySource` to scale as it reads them."""
    path = Path(path)
    try:
        if path.suffix == ".npz":
            with np.load(path, allow_pickle=False) as archive:
                if not {"x", "y"} <= set(archive.files):
                    raise SourceError(f"{path} must hold arrays 'x' and 'y', has {archive.files}")
                x, y = archive["x"], archive["y"]
        elif path.suffix == ".npy":
            if labels is None:
                raise SourceError(f"{path} holds samples only: give labels_path (.npy) too")
            x, y = np.load(path, allow_pickle=False), np.load(labels, allow_pickle=False)
        else:
            raise SourceError(f"{path}: replay arrays must be .npz or .npy")
    except (OSError, ValueError) as exc:
        raise SourceError(f"cannot read arrays from {path}: {exc}") from exc
    if len(x) != len(y) or y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
        raise SourceError(f"{path}: need x (n, ...) and integer y (n,), got {x.shape}, "
                          f"{y.shape} {y.dtype}")
    if num_classes is not None and len(y) and (y.min() < 0 or y.max() >= num_classes):
        bad = np.flatnonzero((y < 0) | (y >= num_classes))[:5].tolist()
        raise SourceError(f"{path}: labels outside [0, {num_classes}) at rows {bad}")
    return (x if pixels and x.dtype == np.uint8 else _floats(x)), y.astype(np.int64)


def _floats(x: np.ndarray) -> np.ndarray:
    """Samples as float32; pixels (``uint8``) scaled into [0, 1] on the way."""
    return x * np.float32(1 / 255) if x.dtype == np.uint8 else x.astype(np.float32, copy=False)


class ImageFolderSource:
    """Images in one sub-folder per label (``root/<label>/*.png``), read with OpenCV.

    ``classes`` maps sub-folder names to label indices in order; without it the
    sub-folders must be named ``0``, ``1``, ...  Unreadable or mis-shaped images
    are counted and skipped.
    """

    def __init__(self, root: str | Path, preprocess: Preprocess, *, num_classes: int,
                 rng: np.random.Generator, classes: Sequence[str] = (), loop: bool = False):
        self.root, self.preprocess, self.rng, self.loop = Path(root), preprocess, rng, loop
        self.counters: Counter[str] = Counter()
        if not self.root.is_dir():
            raise SourceError(f"image folder {self.root} does not exist")
        names = list(classes) or sorted(p.name for p in self.root.iterdir() if p.is_dir())
        index = {name: i for i, name in enumerate(names)}
        if not classes:
            try:
                index = {name: int(name) for name in names}
            except ValueError as exc:
                raise SourceError(f"{self.root}: sub-folders {names} are not label numbers; "
                                  "list them in 'classes'") from exc
        self.files: list[tuple[Path, int]] = []
        for folder in sorted(p for p in self.root.iterdir() if p.is_dir()):
            if folder.name not in index:
                raise SourceError(f"{folder} is not one of the classes {names}")
            label = index[folder.name]
            if not 0 <= label < num_classes:
                raise SourceError(f"{folder}: label {label} outside [0, {num_classes})")
            self.files += [(f, label) for f in sorted(folder.iterdir())
                           if f.suffix.lower() in IMAGE_SUFFIXES]
        if not self.files:
            raise SourceError(f"no images ({', '.join(IMAGE_SUFFIXES)}) under {self.root}")

    def samples(self) -> Iterator[tuple[np.ndarray, int]]:
        import cv2

        while True:
            for i in self.rng.permutation(len(self.files)):
                path, label = self.files[i]
                image = cv2.imread(str(path), cv2.IMREAD_UNCHANGED)
                if image is None:
                    self.counters["unreadable"] += 1
                    log.warning("cannot decode image %s; skipped", path)
                    continue
                try:
                    yield self.preprocess(image), label
                except ShapeError as exc:
                    self.counters["wrong_shape"] += 1
                    log.warning("%s: %s; skipped", path, exc)
            if not self.loop:
                return

    def close(self) -> None:
        pass
