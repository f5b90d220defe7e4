"""Frozen bodies on the device: a pretrained feature extractor that turns each frame into an
embedding once, at ingest, for a small federated head to predict from and train on.

An exported body is a folder (``safl models export-body``): ``body.onnx``, an inference graph
taking frames ``(n, C, H, W)`` in [0, 1] with its normalisation inside, and ``body.json``, the
manifest naming it, its input shape, its embedding size, the file's SHA-256 and a probe (the
embedding of a fixed frame).  The body's hash covers all of them and enters the federation's
layout hash: a device whose body differs from the federation's refuses its models as the
wrong layout, and they refuse its updates.

A body runs on ONNX Runtime (any distribution with ``InferenceSession``: plain
``onnxruntime`` on a Raspberry Pi, the training build on x86) or, with the torch backend and a
registered or importable factory, on torch (CUDA on a Jetson).  Either way the probe is
checked at start-up, so a body that computes something else is refused.  Nothing here imports
torch unless the torch runtime is chosen.

Where the body's last blocks train (``[model] train_body_blocks``), the device's body is the
frozen prefix before them (on ONNX Runtime on a CPU, in torch on CUDA): a frame is still
embedded once, into the activation the trained blocks take, and that is the buffered sample.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .errors import ArtifactError, ConfigError, ShapeError
from .trainers.base import BodyTail

__all__ = ["BODY_FILE", "BODY_MANIFEST", "BodyManifest", "Body", "probe_frames",
           "load_body_manifest", "body_manifest", "head_input_shape", "open_body", "body_id",
           "PROBE_TOLERANCE", "cache_home", "default_body_dir", "open_exported", "ort_forward",
           "embed_in_chunks", "body_tail"]

BODY_FILE = "body.onnx"
BODY_MANIFEST = "body.json"
BODY_VERSION = 1
PROBE_TOLERANCE = 1e-4  # relative, on the probe's embedding: ORT against torch, or a rebuild
CHUNK = 64  # frames per forward pass: bounds the body's activations on a 1 GB board


def cache_home() -> Path:
    """Where safl keeps what it derives on this machine (exported bodies, embedded datasets):
    ``$SAFL_CACHE``, else ``~/.cache/safl``."""
    return Path(os.environ.get("SAFL_CACHE") or "~/.cache/safl").expanduser()


def default_body_dir(name: str, input_shape: tuple[int, ...]) -> Path:
    """The folder the lab and ``safl demo`` export body ``name`` at ``input_shape`` to."""
    return cache_home() / "bodies" / (re.sub(r"[^\w.-]", "_", name) + "-"
                                      + "x".join(map(str, input_shape)))


def probe_frames(input_shape: tuple[int, ...], n: int = 2) -> np.ndarray:
    """Fixed frames in [0, 1] (smooth gradients and stripes) whose embeddings identify a body."""
    c, h, w = input_shape
    yy, xx = np.meshgrid(np.linspace(0, 1, h), np.linspace(0, 1, w), indexing="ij")
    out = np.empty((n, c, h, w), np.float32)
    for i in range(n):
        for ch in range(c):
            out[i, ch] = 0.5 + 0.5 * np.sin((i + 1) * 6 * xx + (ch + 1) * 4 * yy)
    return out


@dataclass(frozen=True)
class BodyManifest:
    """What ``body.json`` says of an exported body (see the module)."""

    name: str
    input_shape: tuple[int, int, int]
    embedding: int
    onnx_sha256: str
    probe: tuple[tuple[float, ...], ...]  # the embeddings of probe_frames(input_shape)
    factory: str = ""  # the torch definition, where there is one (registry name or spec)
    normalisation: str = "(x - 0.5) / 0.5, inside the graph"
    folder: Path = Path()
    # What a closed-form head's statistics centre embeddings by and clip their rows to
    # (edge_client/head_stats.py), from public photos at export: no fleet's data.  Empty
    # and 0 in a manifest exported before heads were solved.
    centre: tuple[float, ...] = ()
    row_clip: float = 0.0

    @property
    def hash(self) -> str:
        """16 hex digits naming the body: its file, shape, embedding and probe (and its
        head statistics' centre and clip, where it has them)."""
        parts: list[Any] = [self.name, list(self.input_shape), self.embedding,
                            self.onnx_sha256, self.normalisation]
        if self.centre:
            parts += [[round(v, 6) for v in self.centre], round(self.row_clip, 6)]
        canon = json.dumps(parts, separators=(",", ":"))
        return hashlib.sha256(canon.encode()).hexdigest()[:16]

    @property
    def graph(self) -> Path:
        """The body's ONNX graph."""
        return self.folder / BODY_FILE

    def to_json(self, **extra: Any) -> dict[str, Any]:
        return {"body_version": BODY_VERSION, "name": self.name, "hash": self.hash,
                "input_shape": list(self.input_shape), "embedding": self.embedding,
                "input": "float32 frames (n, C, H, W) in [0, 1]",
                "normalisation": self.normalisation, "file": BODY_FILE,
                "onnx_sha256": self.onnx_sha256, "factory": self.factory,
                "probe": [list(p) for p in self.probe],
                **({"centre": [round(v, 6) for v in self.centre],
                    "row_clip": round(self.row_clip, 6)} if self.centre else {}), **extra}


def load_body_manifest(folder: str | Path) -> BodyManifest:
    """Read and check an exported body's manifest; :class:`ArtifactError` says what is wrong.
    Read once per version of the file: a role's start-up asks for it several times (its
    trainer's input, the layout hash, the body itself)."""
    folder = Path(folder)
    try:
        st = (folder / BODY_MANIFEST).stat()
        stamp = (st.st_mtime_ns, st.st_size)
    except OSError:
        stamp = (-1, -1)  # _read_manifest says why
    return _read_manifest(folder, stamp)


@functools.lru_cache(maxsize=8)
def _read_manifest(folder: Path, stamp: tuple[int, int]) -> BodyManifest:
    try:
        raw = json.loads((folder / BODY_MANIFEST).read_text())
        shape = tuple(int(d) for d in raw["input_shape"])
        manifest = BodyManifest(
            name=str(raw["name"]), input_shape=shape, embedding=int(raw["embedding"]),  # type: ignore[arg-type]
            onnx_sha256=str(raw["onnx_sha256"]), factory=str(raw.get("factory", "")),
            normalisation=str(raw["normalisation"]),
            probe=tuple(tuple(float(v) for v in p) for p in raw["probe"]), folder=folder,
            centre=tuple(float(v) for v in raw.get("centre", ())),
            row_clip=float(raw.get("row_clip", 0.0)))
    except FileNotFoundError as exc:
        raise ArtifactError(f"no exported body in {folder} (no {BODY_MANIFEST}): run safl "
                            "models export-body NAME --out DIR") from exc
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ArtifactError(f"{folder / BODY_MANIFEST} is not a body manifest: {exc!r}") from exc
    if len(shape) != 3 or min(shape) < 1 or manifest.embedding < 1 \
            or len(manifest.centre) not in (0, manifest.embedding):
        raise ArtifactError(f"{folder / BODY_MANIFEST}: input_shape must be (C, H, W), "
                            "embedding positive and centre of the embedding's size")
    if raw.get("hash") != manifest.hash:
        raise ArtifactError(f"{folder / BODY_MANIFEST} says hash {raw.get('hash')}, its "
                            f"contents hash to {manifest.hash}: edited by hand?")
    return manifest


def body_manifest(model: Any) -> BodyManifest | None:
    """The manifest of the body a ``[model]`` table names (None for ``body = "none"``)."""
    if model.body == "none":
        return None
    manifest = load_body_manifest(model.body_dir)
    if model.body not in (manifest.name, manifest.factory):
        raise ConfigError("body", f"{model.body_dir} holds body {manifest.name!r}, the "
                          f"configuration names {model.body!r}")
    if tuple(model.input_shape) != manifest.input_shape:
        raise ConfigError("input_shape", f"the body takes frames of {manifest.input_shape}, "
                          f"[model] input_shape is {tuple(model.input_shape)}")
    return manifest


def body_id(model: Any) -> str:
    """The body's hash and what its frames go through first, for the federation's layout
    hash ("" without a body): roles that embed frames differently refuse each other."""
    manifest = body_manifest(model)
    if manifest is None:
        return ""
    return manifest.hash + ("-autocontrast" if model.body_input == "autocontrast" else "")


def body_tail(model: Any) -> BodyTail | None:
    """The body's blocks that train with the head (None where the body stays frozen)."""
    blocks = getattr(model, "train_body_blocks", 0)
    manifest = body_manifest(model) if blocks else None
    if manifest is None:
        return None
    if not manifest.factory:
        raise ConfigError("train_body_blocks", f"body {manifest.name} was exported from an "
                          "ONNX file and has no torch definition to train")
    return BodyTail(manifest.factory, manifest.input_shape, blocks,
                    fixed_head=model.head_kind != "random" and bool(manifest.centre))


def head_input_shape(model: Any) -> tuple[int, ...]:
    """What the federated model takes: the body's embedding (or, where its last blocks
    train, the activation before them), else the frame itself."""
    tail = body_tail(model)
    if tail is not None:
        from .trainers.bodies import prefix_shape
        return prefix_shape(*tail.cut)
    manifest = body_manifest(model)
    return (manifest.embedding,) if manifest is not None else tuple(model.input_shape)


class Body:
    """A frozen body, ready to embed frames (see the module); build with :func:`open_body`."""

    def __init__(self, manifest: BodyManifest, runtime: str,
                 forward: Callable[[np.ndarray], np.ndarray], *,
                 out_shape: tuple[int, ...] = (), blocks: int = 0,
                 whole: Callable[[np.ndarray], np.ndarray] | None = None) -> None:
        self.manifest, self.runtime, self._forward = manifest, runtime, forward
        # A prefix (blocks > 0) makes activations of out_shape; ``whole`` is then the full
        # body with its pretrained tail, which the probe checks.
        self.out_shape = out_shape or (manifest.embedding,)
        self.blocks, self._whole = blocks, whole or forward
        # What the frames cost: the device's /metrics says the body's ms a frame from these.
        self.frames, self.seconds = 0, 0.0
        self.autocontrast = False  # [model] body_input: each frame stretched before it

    @property
    def ms_per_frame(self) -> float | None:
        """The body's mean wall time a frame so far (None before the first frame)."""
        return 1000 * self.seconds / self.frames if self.frames else None

    @property
    def key(self) -> str:
        """Names what :meth:`embed` computes: the body's hash, and where it is cut."""
        return self.manifest.hash + (f"-tail{self.blocks}" if self.blocks else "") + (
            "-autocontrast" if self.autocontrast else "")

    @property
    def bytes_per_sample(self) -> int:
        """What one buffered sample costs (float32)."""
        return 4 * int(np.prod(self.out_shape))

    def embed(self, frames: np.ndarray) -> np.ndarray:
        """``(n, *out_shape)`` float32 embeddings of ``frames`` ``(n, C, H, W)`` in [0, 1]."""
        began = time.perf_counter()
        if self.autocontrast:
            frames = autocontrast(frames)
        out = self._run(self._forward, frames, self.out_shape)
        self.frames += len(out)
        self.seconds += time.perf_counter() - began
        return out

    def _run(self, forward: Callable[[np.ndarray], np.ndarray], frames: np.ndarray,
             out_shape: tuple[int, ...]) -> np.ndarray:
        x = np.asarray(frames, dtype=np.float32)
        if x.shape[1:] != self.manifest.input_shape:
            raise ShapeError(f"the body takes frames of {self.manifest.input_shape}, got "
                             f"{x.shape[1:]}")
        if not len(x):
            return np.zeros((0, *out_shape), np.float32)
        return embed_in_chunks(forward, x)

    def check_probe(self) -> float:
        """The largest relative error on the probe against the manifest; raises past
        :data:`PROBE_TOLERANCE`."""
        want = np.asarray(self.manifest.probe, dtype=np.float64)
        got = self._run(self._whole, probe_frames(self.manifest.input_shape, len(want)),
                        (self.manifest.embedding,))
        err = float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-12))
        if not err <= PROBE_TOLERANCE:
            raise ArtifactError(f"body {self.manifest.name} on {self.runtime} computes other "
                                f"embeddings than its manifest records (relative error "
                                f"{err:.2e} > {PROBE_TOLERANCE:g}): a different body")
        return err


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def autocontrast(frames: np.ndarray) -> np.ndarray:
    """Each frame stretched so that its 1st and 99th percentiles (over all its channels, so
    its hues stay) go to 0 and 1: a lamp that dims, brightens or flattens the picture
    changes it no more than a gradient across it does.  In the lab (EfficientNet-Lite0 on
    Fashion-MNIST at 3x64x64, docs/results.md), frames at lower contrast, brighter and with
    a gradient across them cost the head solved on the old picture 17 points as they came
    and 0.4 stretched, which costs the unchanged picture 0.1."""
    x = np.asarray(frames, np.float32)
    axes = tuple(range(1, x.ndim))
    low, high = np.percentile(x, (1.0, 99.0), axis=axes, keepdims=True)
    return np.clip((x - low) / np.maximum(high - low, 1e-3), 0.0, 1.0).astype(np.float32)


def embed_in_chunks(forward: Callable[[np.ndarray], np.ndarray], x: np.ndarray) -> np.ndarray:
    """``forward`` over ``x`` :data:`CHUNK` frames at a time, float32 (the device's embedding,
    and the export's checks against torch)."""
    return np.concatenate([forward(np.ascontiguousarray(x[i:i + CHUNK]))
                           for i in range(0, len(x), CHUNK)]).astype(np.float32, copy=False)


def ort_forward(path: str | Path | bytes, threads: int = 0
                ) -> Callable[[np.ndarray], np.ndarray]:
    """An ONNX Runtime session on the graph at ``path`` (or the graph itself), as a function
    of a batch of frames."""
    from .trainers.ort_backend import import_onnxruntime

    ort = import_onnxruntime(training=False)  # never torch, even where it is installed
    options = ort.SessionOptions()
    # A board's memory is the bound, not the speed: without the arena and the memory
    # patterns the session keeps 10-18 MB less (one frame, then batches of 16), measured
    # on EfficientNet-Lite0 at 3x64x64, at the same ms a frame (docs/install-edge.md).
    options.enable_cpu_mem_arena = False
    options.enable_mem_pattern = False
    if threads:
        options.intra_op_num_threads = threads
    graph = path if isinstance(path, bytes) else str(path)
    session = ort.InferenceSession(graph, options, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return lambda x: session.run(None, {name: x})[0]


def _checked_ort_forward(manifest: BodyManifest, threads: int) -> Callable[[np.ndarray],
                                                                           np.ndarray]:
    path = manifest.graph
    try:
        actual = _file_sha256(path)
    except OSError as exc:
        raise ArtifactError(f"cannot read the body's graph {path}: {exc.strerror}") from exc
    if actual != manifest.onnx_sha256:
        raise ArtifactError(f"{path} has SHA-256 {actual[:16]}..., its manifest "
                            f"{manifest.onnx_sha256[:16]}...: not the exported body")
    return ort_forward(path, threads)


def _prefix(manifest: BodyManifest, tail: BodyTail, device: str, threads: int = 0) -> Body:
    """The frozen prefix before the blocks that train (``body_torch.frozen_prefix``)."""
    from .body_torch import frozen_prefix

    forward, runtime, out_shape, whole = frozen_prefix(tail, manifest.input_shape, device,
                                                       threads, ort_forward)
    return Body(manifest, runtime, forward, out_shape=out_shape, blocks=tail.blocks,
                whole=whole)


def open_body(model: Any, *, threads: int = 0) -> Body | None:
    """The body a ``[model]`` table names, probe-checked (None without one).  It runs on
    torch where the model trains on CUDA (a Jetson) and the body has a torch definition; on a
    CPU, ONNX Runtime is faster than torch's eager forward (1.05 against 2.8-4.3 ms a 64x64
    frame on one core, ``bench/body.py``), so every CPU board runs it there, with ``threads``
    (0: its default).  Where the body's last blocks train, it is the prefix before them
    (:func:`_prefix`)."""
    manifest = body_manifest(model)
    if manifest is None:
        return None
    from .body_torch import cuda_forward  # torch itself only where it runs

    tail = body_tail(model)
    on_gpu = cuda_forward(manifest.factory, manifest.input_shape, model.device) if (
        tail is None and manifest.factory and model.backend == "torch"
        and model.device != "cpu") else None
    if tail is not None:
        body = _prefix(manifest, tail, model.device, threads)
    elif on_gpu is None:
        body = open_exported(manifest.folder, threads=threads)
    else:
        body = Body(manifest, f"torch ({model.device})", on_gpu)
    if tail is not None or on_gpu is not None:
        body.check_probe()
    body.autocontrast = model.body_input == "autocontrast"
    return body


def open_exported(folder: str | Path, *, threads: int = 0, blocks: int = 0) -> Body:
    """An exported body on ONNX Runtime, probe-checked (the lab embeds datasets with it); with
    ``blocks``, its prefix before its last ``blocks`` blocks."""
    manifest = load_body_manifest(folder)
    if blocks:
        body = _prefix(manifest, BodyTail(manifest.factory, manifest.input_shape, blocks), "cpu",
                       threads)
    else:
        body = Body(manifest, "onnxruntime", _checked_ort_forward(manifest, threads))
    body.check_probe()
    return body

