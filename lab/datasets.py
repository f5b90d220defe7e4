"""Offline datasets and non-i.i.d. partitions for simulations.

Fashion-MNIST is read from the Debian package ``dataset-fashion-mnist``
(idx files under ``/usr/share/datasets/fashion-mnist``); scikit-learn's bundled
8x8 digits are the fallback.  Nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import gzip
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge_client.errors import ConfigError, SaflError

__all__ = ["Dataset", "FASHION_MNIST_DIR", "load_dataset", "load_default",
           "dirichlet_label_skew", "assign_groups", "safl_split", "camera_frames",
           "sample_photos", "as_camera", "embedded", "through_body", "body_folder"]

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")


@dataclass(frozen=True)
class Dataset:
    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int

    @property
    def sample_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])


def _read_idx(path: Path, magic: int) -> np.ndarray:
    try:
        with gzip.open(path, "rb") as fh:
            raw = fh.read()
    except OSError as exc:
        raise SaflError(f"cannot read {path}: {exc}") from exc
    header = np.frombuffer(raw[:4], dtype=">u4")[0] if len(raw) >= 4 else 0
    if header != magic:
        raise SaflError(f"{path} is not an idx file (magic {header}, expected {magic})")
    ndim = magic & 0xFF
    dims = np.frombuffer(raw[4:4 + 4 * ndim], dtype=">u4").astype(int)
    data = np.frombuffer(raw[4 + 4 * ndim:], dtype=np.uint8)
    if data.size != np.prod(dims):
        raise SaflError(f"{path} is truncated: {data.size} bytes for shape {tuple(dims)}")
    return data.reshape(dims)


def _fashion_mnist(root: Path) -> Dataset:
    def part(prefix: str) -> tuple[np.ndarray, np.ndarray]:
        x = _read_idx(root / f"{prefix}-images-idx3-ubyte.gz", 2051)
        y = _read_idx(root / f"{prefix}-labels-idx1-ubyte.gz", 2049)
        return (x.astype(np.float32) / 255.0), y.astype(np.int64)

    x_tr, y_tr = part("train")
    x_te, y_te = part("t10k")
    return Dataset("fashion-mnist", x_tr, y_tr, x_te, y_te, 10)


def _digits(seed: int = 0) -> Dataset:
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise SaflError("scikit-learn is needed for the digits dataset: "
                        "pip install 'safl-edge[data]'") from exc
    bunch = load_digits()
    x = (bunch.images / 16.0).astype(np.float32)
    y = bunch.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(y))
    cut = int(0.8 * len(y))
    tr, te = order[:cut], order[cut:]
    return Dataset("digits", x[tr], y[tr], x[te], y[te], 10)


def load_dataset(name: str, *, root: Path = FASHION_MNIST_DIR) -> Dataset:
    """Load ``fashion-mnist`` or ``digits`` by name."""
    if name == "fashion-mnist":
        return _fashion_mnist(root)
    if name == "digits":
        return _digits()
    raise ConfigError("dataset", f"must be 'fashion-mnist' or 'digits', got {name!r}")


def load_default(root: Path = FASHION_MNIST_DIR) -> tuple[Dataset, str]:
    """Fashion-MNIST when its Debian package is installed, else digits; with a note why."""
    if (root / "train-images-idx3-ubyte.gz").exists():
        return _fashion_mnist(root), f"Fashion-MNIST from {root}"
    return _digits(), ("scikit-learn digits (Fashion-MNIST not found: "
                       "`sudo apt-get install dataset-fashion-mnist` to use it)")


def camera_frames(images: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Grey images ``(n, H, W)`` in [0, 1] as a camera's source delivers them at ``shape``
    ``(C, H', W')``: resized as ``[source] resize`` does (OpenCV, area), grey replicated to
    every channel, float32 in [0, 1]."""
    import cv2

    c, h, w = shape
    out = np.empty((len(images), c, h, w), np.float32)
    for i, image in enumerate(images):
        out[i] = cv2.resize(np.asarray(image, np.float32), (w, h), interpolation=cv2.INTER_AREA)
    return out


def _square(image: np.ndarray, top: int, left: int, side: int,
            shape: tuple[int, ...]) -> np.ndarray:
    """A square of an RGB photo resized to ``shape`` (C, H, W), float32 in [0, 1]."""
    import cv2

    c, h, w = shape
    crop = cv2.resize(image[top:top + side, left:left + side], (w, h),
                      interpolation=cv2.INTER_AREA)
    return crop.transpose(2, 0, 1)[:c].astype(np.float32) / 255.0


def sample_photos(shape: tuple[int, ...]) -> np.ndarray:
    """scikit-learn's two bundled photos (a temple, a flower), centre-cropped square and
    resized to ``shape``, float32 RGB in [0, 1]: real images a body is checked on."""
    from sklearn.datasets import load_sample_images

    out = []
    for image in load_sample_images().images:
        side = min(image.shape[:2])
        out.append(_square(image, (image.shape[0] - side) // 2, (image.shape[1] - side) // 2,
                           side, shape))
    return np.stack(out)


def photo_crops(shape: tuple[int, ...], n: int = 256, seed: int = 0) -> np.ndarray:
    """``n`` random square crops (a tenth of the short side to all of it) of scikit-learn's
    two photos, resized to ``shape``, half of them grey: public frames a body's head
    statistics are centred on at export, so the constant carries no fleet's data."""
    from sklearn.datasets import load_sample_images

    rng = np.random.default_rng(seed)
    images = load_sample_images().images
    out = np.empty((n, *shape), np.float32)
    for i in range(n):
        image = images[i % len(images)]
        side = int(rng.uniform(0.1, 1.0) * min(image.shape[:2]))
        top = int(rng.integers(0, image.shape[0] - side + 1))
        left = int(rng.integers(0, image.shape[1] - side + 1))
        out[i] = _square(image, top, left, side, shape)
        if rng.random() < 0.5:
            out[i] = out[i].mean(axis=0, keepdims=True)
    return out


def as_camera(data: Dataset, shape: tuple[int, ...]) -> Dataset:
    """``data`` as camera frames of ``shape`` (:func:`camera_frames`)."""
    return dataclasses.replace(data, name=f"{data.name}@{'x'.join(map(str, shape))}",
                               x_train=camera_frames(data.x_train, shape),
                               x_test=camera_frames(data.x_test, shape))


def embed_images(body, images: np.ndarray, shape: tuple[int, ...], *steps) -> np.ndarray:
    """Grey images as the body's embeddings of their camera frames at ``shape``, a thousand
    at a time, each frame through ``steps`` (a lamp, a stretch) first."""
    out = []
    for i in range(0, len(images), 1000):
        frames = camera_frames(images[i:i + 1000], shape)
        for step in steps:
            frames = step(frames)
        out.append(body.embed(frames))
    return np.concatenate(out)


def embedded(data: Dataset, shape: tuple[int, ...], body, cache: Path) -> Dataset:
    """``data`` as the body's embeddings of its camera frames at ``shape``, computed once per
    dataset, shape and body hash and kept in ``cache`` (numpy's .npz, no pickle): a long run
    with a body then costs the head's training only.  Frames are made and embedded a chunk at
    a time, so 60,000 of them never sit in memory at 64x64."""
    path = cache / f"{data.name}-{'x'.join(map(str, shape))}-{body.key}.npz"
    if path.exists():
        with np.load(path, allow_pickle=False) as z:
            x_train, x_test = z["x_train"], z["x_test"]
    else:
        x_train, x_test = embed_images(body, data.x_train, shape), embed_images(
            body, data.x_test, shape)
        cache.mkdir(parents=True, exist_ok=True)
        part = path.with_suffix(f".{os.getpid()}.part")
        with open(part, "wb") as fh:  # a file object: np.savez adds no suffix to it
            np.savez(fh, x_train=x_train, x_test=x_test)
        os.replace(part, path)
    return dataclasses.replace(data, name=f"{data.name}@{body.manifest.name}",
                               x_train=x_train, x_test=x_test)


def through_body(data: Dataset, shape: tuple[int, ...], body: str, body_dir: str = "",
                 blocks: int = 0) -> Dataset:
    """``data`` as body ``body``'s cached embeddings of its camera frames at ``shape`` (or,
    where its last ``blocks`` blocks train, the activations before them); the body comes
    from ``body_dir``, else from the cache ``safl experiment`` and ``safl demo`` export it
    to."""
    from edge_client.body import cache_home, open_exported

    folder = body_folder(body, shape, body_dir)
    return embedded(data, shape, open_exported(folder, blocks=blocks),
                    cache_home() / "embeddings")


def body_folder(body: str, shape: tuple[int, ...], body_dir: str = "") -> Path:
    """Where the lab finds body ``body`` exported at ``shape``: ``body_dir``, else the cache;
    a :class:`ConfigError` naming the command that exports it where it is not."""
    from edge_client.body import BODY_MANIFEST, default_body_dir

    folder = Path(body_dir) if body_dir else default_body_dir(body, shape)
    if not (folder / BODY_MANIFEST).exists():
        raise ConfigError("body_dir", f"no exported body in {folder}: safl experiment exports "
                          f"it, or run safl models export-body {body} --out {folder}")
    return folder


def dirichlet_label_skew(y: np.ndarray, num_clients: int, alpha: float,
                         rng: np.random.Generator, *, min_size: int = 20) -> list[np.ndarray]:
    """Split sample indices so each class is spread over clients by Dirichlet(alpha).

    Small ``alpha`` gives strong label skew.  Redraws until every client holds
    at least ``min_size`` samples (Hsu et al., 2019, the usual FL benchmark split).
    """
    if alpha <= 0:
        raise ConfigError("alpha", f"must be > 0, got {alpha!r}")
    if num_clients * min_size > len(y):
        raise ConfigError("num_clients", f"{num_clients} clients of >= {min_size} samples "
                          f"need more than {len(y)} samples")
    classes = np.unique(y)
    for _ in range(100):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for c in classes:
            idx = rng.permutation(np.flatnonzero(y == c))
            cuts = (np.cumsum(rng.dirichlet(np.full(num_clients, alpha)))[:-1] * len(idx))
            for client, chunk in enumerate(np.split(idx, cuts.astype(int))):
                parts[client].append(chunk)
        out = [np.sort(np.concatenate(p)) for p in parts]
        if min(len(p) for p in out) >= min_size:
            return out
    raise SaflError(f"no Dirichlet({alpha}) split gave every client {min_size} samples")


def assign_groups(num_clients: int, num_groups: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Assign clients to factories at random in near-equal groups (FedGS reference)."""
    if not 1 <= num_groups <= num_clients:
        raise ConfigError("stations", f"need 1..{num_clients} groups, got {num_groups}")
    return [np.sort(g) for g in np.array_split(rng.permutation(num_clients), num_groups)]


def safl_split(y: np.ndarray, num_clients: int, rng: np.random.Generator, *,
               multi_fraction: float = 0.5, classes_per_multi: int = 5) -> list[np.ndarray]:
    """The SAFL paper's split: some devices hold several classes, the others a single one.

    A ``multi_fraction`` of the devices each hold ``classes_per_multi`` random classes (the
    paper's example: {1, 2, 5, 7, 9}); every other device holds one class, taken in turn so
    that every class has a holder.  Each class's samples are shared evenly among its holders.
    """
    classes = np.unique(y)
    if not 0 <= multi_fraction <= 1 or not 1 <= classes_per_multi <= len(classes):
        raise ConfigError("classes_per_multi", f"need 0 <= multi_fraction <= 1 and 1 <= "
                          f"classes_per_multi <= {len(classes)}")
    n_multi = int(round(multi_fraction * num_clients))
    held = [set(rng.choice(classes, classes_per_multi, replace=False).tolist())
            for _ in range(n_multi)]
    held += [{int(classes[i % len(classes)])} for i in range(num_clients - n_multi)]
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c in classes:
        holders = [k for k, h in enumerate(held) if int(c) in h]
        if not holders:
            continue
        for k, chunk in zip(holders, np.array_split(rng.permutation(np.flatnonzero(y == c)),
                                                    len(holders)), strict=True):
            parts[k].append(chunk)
    return [np.sort(np.concatenate(p)) for p in parts]
