"""Configuration: frozen dataclasses built from TOML, environment and CLI flags.

Precedence, lowest first: dataclass defaults, the role's TOML table, environment
variables ``SAFL_<ROLE>_<KEY>``, then explicit overrides (CLI flags).  Unknown
keys and wrong types are refused with a :class:`ConfigError` naming the key;
range checks live in each config's ``__post_init__``.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 (JetPack 6)
    import tomli as tomllib

from .errors import ConfigError
from .messages import ID_PATTERN, is_id

__all__ = ["load_config", "from_mapping", "check_range", "check_id", "DeviceConfig"]

C = TypeVar("C")


def check_range(key: str, value: float, low: float | None = None, high: float | None = None,
                *, low_open: bool = False) -> None:
    """Raise a ConfigError naming ``key`` unless ``low <= value <= high``."""
    if low is not None and (value <= low if low_open else value < low):
        raise ConfigError(key, f"must be {'>' if low_open else '>='} {low}, got {value!r}")
    if high is not None and value > high:
        raise ConfigError(key, f"must be <= {high}, got {value!r}")


def check_id(key: str, value: str) -> None:
    """Ids become MQTT topic levels: the one pattern messages check too (no '/', '+', '#')."""
    if not is_id(value):
        raise ConfigError(key, f"must be an id matching {ID_PATTERN.pattern} (letters, digits, "
                          f"'_', '.', ':', '-'; no '/', '+' or '#'), got {value!r}")


def _coerce(key: str, value: Any, hint: Any) -> Any:
    origin = typing.get_origin(hint)
    if hint is bool:
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "0", "false", "no"):
            return value.lower() in ("1", "true", "yes")
        if isinstance(value, bool):
            return value
    elif hint in (int, float):
        # TOML gives 1 for a float key; env and CLI give strings. An int key refuses 1.5.
        numeric = hint is float and isinstance(value, int) or isinstance(value, hint)
        if numeric and not isinstance(value, bool):
            return hint(value)
        if isinstance(value, str):
            try:
                return hint(value)
            except ValueError:
                pass
    elif hint is str:
        if isinstance(value, str):
            return value
    elif origin is tuple:
        items = value.split(",") if isinstance(value, str) else value
        if isinstance(items, (list, tuple)):
            inner = typing.get_args(hint)[0]
            return tuple(_coerce(key, v.strip() if isinstance(v, str) else v, inner)
                         for v in items if v != "")
    raise ConfigError(key, f"expected {getattr(hint, '__name__', hint)}, got {value!r}")


def from_mapping(cls: type[C], values: Mapping[str, Any]) -> C:
    """Build config ``cls`` from a flat mapping, refusing unknown keys."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in values:
        if key not in names:
            raise ConfigError(key, f"unknown key for {cls.__name__}; known: {sorted(names)}")
    for f in dataclasses.fields(cls):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if required and f.name not in values:
            raise ConfigError(f.name, f"is required by {cls.__name__} and missing")
    return cls(**{k: _coerce(k, v, hints[k]) for k, v in values.items()})


def load_config(cls: type[C], role: str, path: str | Path | None = None,
                overrides: Mapping[str, Any] | None = None,
                environ: Mapping[str, str] | None = None) -> C:
    """Load the ``[role]`` table of a TOML file, then environment, then overrides."""
    values: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as fh:
                doc = tomllib.load(fh)
        except OSError as exc:
            raise ConfigError("config", f"cannot read {path}: {exc.strerror}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError("config", f"{path} is not valid TOML: {exc}") from exc
        table = doc.get(role, {})
        if not isinstance(table, dict):
            raise ConfigError(role, f"must be a table in {path}")
        values.update(table)
    prefix = f"SAFL_{role.upper()}_"
    env = os.environ if environ is None else environ
    values.update({k[len(prefix):].lower(): v for k, v in env.items() if k.startswith(prefix)})
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return from_mapping(cls, values)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeviceConfig:
    """Settings of one device (SPEC §2-3)."""

    device_id: str
    station: str
    fleet: str = "default"
    batch_size: int = 32
    local_steps: int = 1
    lr: float = 0.05
    temperature: float = 50.0  # SAFL's maximum temperature L, in iterations
    mix: float = 0.5  # SAFL's eps: 1 recovers FedAvg/FedGS exactly
    granularity: str = "element"
    nu: float = 0.0  # upload-gate regulariser; 0 always uploads
    # The annealed merge uses the local model only while it is this many station
    # iterations old or younger; an older one starts from the aggregate (docs/algorithms.md).
    merge_max_age: int = 20
    gate_min_holdout: int = 100  # held-out samples before the upload gate may hold back
    # Device-local accuracy: the deployable (merged) model on the held-out slice, measured
    # when selected at most once per this many iterations and reported with the stats; 0: off.
    local_eval_interval: int = 50
    prox_mu: float = 0.0  # FedProx proximal weight; 0 disables
    buffer_capacity: int = 1024
    holdout_every: int = 10
    holdout_capacity: int = 256
    seed: int = 0  # of the merge masks and upload-gate draws
    hello_interval: float = 2.0  # seconds between stats repeats until a model arrives

    def __post_init__(self) -> None:
        from .safl import GRANULARITIES
        for key in ("device_id", "station", "fleet"):
            check_id(key, getattr(self, key))
        check_range("batch_size", self.batch_size, 1)
        check_range("local_steps", self.local_steps, 1)
        check_range("lr", self.lr, 0, low_open=True)
        check_range("temperature", self.temperature, 0, low_open=True)
        check_range("mix", self.mix, 0, 1)
        check_range("nu", self.nu, 0)
        check_range("merge_max_age", self.merge_max_age, 0)
        check_range("gate_min_holdout", self.gate_min_holdout, 0)
        check_range("local_eval_interval", self.local_eval_interval, 0)
        check_range("prox_mu", self.prox_mu, 0)
        check_range("buffer_capacity", self.buffer_capacity, 1)
        check_range("holdout_every", self.holdout_every, 0)
        check_range("holdout_capacity", self.holdout_capacity, 1)
        check_range("hello_interval", self.hello_interval, 0, low_open=True)
        if self.granularity not in GRANULARITIES:
            raise ConfigError("granularity", f"must be one of {GRANULARITIES}")


SOURCE_KINDS = ("replay", "camera", "synthetic")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PreprocessSettings:
    """How a frame becomes a sample: ``crop`` is ``x, y, w, h`` in source pixels,
    ``resize`` is ``w, h``; after ``scale``, ``mean``/``std`` (one value or one per
    channel) normalise."""

    crop: tuple[int, ...] = ()
    resize: tuple[int, ...] = ()
    grayscale: bool = False
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
    (JSONL/CSV keyed by frame or time), ``label`` (fixed) or ``teacher`` (ONNX model,
    kept above ``confidence``).  ``synthetic`` is for tests.
    """

    kind: str
    path: str = ""
    labels_path: str = ""
    uri: str = ""
    sidecar: str = ""
    label: int = -1
    teacher: str = ""
    confidence: float = 0.9
    classes: tuple[str, ...] = ()
    sample_fps: float = 0.0
    loop: bool = False
    seed: int = 0  # of the replay order
    # Replay at the federation's pace: ``per_iteration`` samples arrive with each station
    # model (0: stream through the pump as fast as training takes them), after ``initial``;
    # fractional rates carry over between iterations.
    per_iteration: float = 0.0
    initial: int = 0
    queue_size: int = 256
    retries: int = 5
    backoff: float = 0.5

    @property
    def is_video(self) -> bool:
        return self.kind == "camera" or (
            self.kind == "replay" and Path(self.path).suffix.lower() in VIDEO_SUFFIXES)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kind not in SOURCE_KINDS:
            raise ConfigError("kind", f"must be one of {SOURCE_KINDS}, got {self.kind!r}")
        if self.kind == "camera" and not self.uri:
            raise ConfigError("uri", "a camera source needs a device index, URL or pipeline")
        if self.kind == "replay" and not self.path:
            raise ConfigError("path", "a replay source needs an array file, image folder or video")
        labellers = [k for k in ("sidecar", "teacher") if getattr(self, k)] + (
            ["label"] if self.label >= 0 else [])
        if self.is_video and len(labellers) != 1:
            raise ConfigError("sidecar", "camera and video frames need exactly one of sidecar, "
                              f"label or teacher; got {labellers or 'none'}")
        check_range("confidence", self.confidence, 0, 1, low_open=True)
        check_range("sample_fps", self.sample_fps, 0)
        check_range("queue_size", self.queue_size, 1)
        check_range("per_iteration", self.per_iteration, 0)
        check_range("initial", self.initial, 0)
        check_range("retries", self.retries, 0)
        check_range("backoff", self.backoff, 0)


VIDEO_SUFFIXES = (".mp4", ".avi", ".mkv", ".mov", ".webm", ".mjpeg", ".h264")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BrokerConfig:
    """How a role reaches its MQTT broker (the ``[broker]`` table).

    ``url`` is ``mqtt://host:port`` (or ``mqtts://`` with TLS). ``protocol`` is
    ``auto`` (MQTT 5, falling back to 3.1.1), ``5`` or ``3.1.1``.
    """

    url: str = "mqtt://127.0.0.1:1883"
    username: str = ""
    password: str = ""
    ca: str = ""
    cert: str = ""
    key: str = ""
    protocol: str = "auto"
    keepalive: int = 30
    session_expiry: int = 3600  # seconds the broker keeps a disconnected session (MQTT 5)
    chunk_size: int = 256 * 1024
    max_message: int = 64 * 1024 * 1024  # largest reassembled frame accepted
    reassembly_memory: int = 256 * 1024 * 1024
    chunk_timeout: float = 60.0
    fp16: bool = False
    connect_timeout: float = 30.0
    backoff_min: float = 0.5
    backoff_max: float = 30.0

    @property
    def host_port(self) -> tuple[str, int]:
        rest = self.url.split("://", 1)[1]
        host, _, port = rest.rstrip("/").rpartition(":")
        return host.strip("[]"), int(port)

    @property
    def tls(self) -> bool:
        return self.url.startswith("mqtts://") or bool(self.ca)

    def __post_init__(self) -> None:
        scheme = self.url.split("://", 1)[0] if "://" in self.url else ""
        if scheme not in ("mqtt", "mqtts"):
            raise ConfigError("url", f"must look like mqtt://host:port, got {self.url!r}")
        try:
            host, port = self.host_port
        except ValueError as exc:
            raise ConfigError("url", f"needs a host and a numeric port: {self.url!r}") from exc
        if not host or not 0 < port < 65536:
            raise ConfigError("url", f"needs a host and a port in 1..65535: {self.url!r}")
        if self.protocol not in ("auto", "5", "3.1.1"):
            raise ConfigError("protocol", "must be 'auto', '5' or '3.1.1'")
        if bool(self.cert) != bool(self.key):
            raise ConfigError("cert", "a client certificate needs its key, and the reverse")
        for key in ("ca", "cert", "key"):
            if getattr(self, key) and not Path(getattr(self, key)).is_file():
                raise ConfigError(key, f"file {getattr(self, key)} does not exist")
        check_range("keepalive", self.keepalive, 5)
        check_range("chunk_size", self.chunk_size, 1024)
        check_range("max_message", self.max_message, self.chunk_size)
        check_range("reassembly_memory", self.reassembly_memory, self.chunk_size)
        check_range("chunk_timeout", self.chunk_timeout, 0, low_open=True)
        check_range("connect_timeout", self.connect_timeout, 0, low_open=True)
        check_range("backoff_min", self.backoff_min, 0, low_open=True)
        check_range("backoff_max", self.backoff_max, self.backoff_min)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The federation's model (the ``[model]`` table every role shares).

    ``backend`` is the trainer this role uses; ``artifacts`` the exported folder
    for ``ort``.  ``seed`` fixes the initial weights the cloud broadcasts.  ``module``
    names your own torch model instead of a zoo ``name``.
    """

    @property
    def spec(self) -> str:
        """What the trainers build: your module, else the zoo name."""
        return self.module or self.name

    name: str = "mlp"
    backend: str = "numpy"
    input_shape: tuple[int, ...] = (28, 28)
    num_classes: int = 10
    artifacts: str = ""
    seed: int = 0
    device: str = "auto"  # torch: "auto" (CUDA where available), "cpu", "cuda" or "cuda:N"
    # Your own torch model, "package.module:factory" (docs/own-model.md): used instead of name.
    module: str = ""

    def __post_init__(self) -> None:
        if self.backend not in ("numpy", "torch", "ort"):
            raise ConfigError("backend", f"must be numpy, torch or ort, got {self.backend!r}")
        if self.module and not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*", self.module):
            raise ConfigError("module", f"must be 'package.module:factory', got {self.module!r}")
        if self.module and self.backend == "numpy":
            raise ConfigError("module", "your own model needs backend = 'torch' (or 'ort' with "
                              "artifacts from safl models export --from-module)")
        if re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device) is None:
            raise ConfigError("device", f"must be 'auto', 'cpu', 'cuda' or 'cuda:N', got "
                              f"{self.device!r}")
        if self.device not in ("auto", "cpu") and self.backend != "torch":
            raise ConfigError("device", f"{self.device!r} needs backend = 'torch'")
        if self.backend == "ort" and not self.artifacts:
            raise ConfigError("artifacts", "the ort backend needs the exported artifacts folder")
        if not self.input_shape or min(self.input_shape) < 1:
            raise ConfigError("input_shape", f"must be positive sizes, got {self.input_shape}")
        check_range("num_classes", self.num_classes, 2)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServiceConfig:
    """How a service shows itself and keeps its state (the ``[service]`` table).

    ``metrics_port`` serves Prometheus metrics (0: off).  ``state_dir`` is where the
    cloud and stations checkpoint every round and resume from after a crash ("": no
    checkpoints, a restart starts over; systemd units point it at StateDirectory).
    """

    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"
    state_dir: str = ""

    def __post_init__(self) -> None:
        check_range("metrics_port", self.metrics_port, 0, 65535)
