"""The update pipeline: what a device's update becomes before it leaves, and back.

A device's update is its step ``z - w^m`` from the model its station gave it.  With no stages
it travels as the model ``z`` itself, as always.  With stages (``update_stages``, the same on
every device and station of a fleet, in the manifest) the step passes through them in their
order and travels encoded; the station reverses the encoding onto its own ``w^m`` before any
check or fusion, and refuses an update encoded for other stages.

Stages, a registry like the fusion rules (``STAGES``); each is ``name`` or ``name:parameter``:

- ``clip:C``: the step scaled onto L2 norm ``C`` where longer (Sun et al. 2019's norm bound,
  and the clipping differential privacy needs);
- ``noise:z``: Gaussian noise of standard deviation ``z x C`` added to the clipped step (local
  differential privacy, accounted in ``edge_client/privacy.py``; it needs ``clip``);
- ``topk:f``: only the fraction ``f`` of coordinates largest in magnitude (Aji & Heafield
  2017), their positions as uint32;
- ``float16``: the values as float16 (half the bytes);
- ``int8:B``: the values as int8 with one float32 scale per block of ``B``, rounded
  stochastically so the rounding is unbiased (QSGD's idea, Alistarh et al. 2017).

What ``topk`` and a quantiser lose is kept on the device and added to its next step (error
feedback, Seide et al. 2014; Karimireddy et al. 2019), so a coordinate too small to be sent
now is sent once it has accumulated.  The order is clip, noise, topk, then a quantiser: what
follows the noise only post-processes a private release.
Pure numpy: the device encodes, the station decodes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import numpy as np

from .errors import ConfigError, MessageError
from .messages import MODEL_ENCODING, is_id

__all__ = ["STAGES", "Stage", "Encoded", "UpdatePipeline", "FLOAT16_MAX"]

FLOAT16_MAX = float(np.finfo(np.float16).max)


@dataclasses.dataclass(frozen=True)
class Encoded:
    """A step as it travels: positions (empty: every coordinate) and values in one of three
    carriers, ``values`` (float32), ``half`` (float16) or ``codes`` with ``scales`` (int8)."""

    indices: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.uint32))
    values: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.float32))
    half: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.float16))
    codes: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int8))
    scales: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.float32))


class Stage:
    """One step of the pipeline.  ``order`` fixes where it may stand (clip, sparsify,
    quantise); ``lossy`` stages feed their error back on the device."""

    name: ClassVar[str]
    order: ClassVar[int]
    lossy: ClassVar[bool] = True

    @property
    def spec(self) -> str:
        return self.name


class Clip(Stage):
    name, order, lossy = "clip", 0, False

    def __init__(self, parameter: float | None) -> None:
        if parameter is None or not parameter > 0:
            raise ConfigError("update_stages", "clip needs a bound > 0, as 'clip:1.5'")
        self.bound = float(parameter)

    @property
    def spec(self) -> str:
        return f"clip:{self.bound:g}"

    def apply(self, step: np.ndarray) -> np.ndarray:
        norm = float(np.linalg.norm(step))
        return step * np.float32(self.bound / norm) if norm > self.bound else step


class Noise(Stage):
    """Gaussian noise of standard deviation ``multiplier x C`` on the clipped step: local
    differential privacy for the device's data, accounted by ``edge_client/privacy.py``."""

    name, order, lossy = "noise", 1, False

    def __init__(self, parameter: float | None) -> None:
        if parameter is None or not parameter > 0:
            raise ConfigError("update_stages", "noise needs a multiplier > 0, as 'noise:1.1'")
        self.multiplier = float(parameter)

    @property
    def spec(self) -> str:
        return f"noise:{self.multiplier:g}"

    def apply(self, step: np.ndarray, bound: float, rng: np.random.Generator) -> np.ndarray:
        std = np.float32(self.multiplier * bound)
        return step + std * rng.standard_normal(step.size, dtype=np.float32)


class TopK(Stage):
    name, order = "topk", 2

    def __init__(self, parameter: float | None) -> None:
        if parameter is None or not 0 < parameter < 1:
            raise ConfigError("update_stages", "topk needs a fraction in (0, 1), as 'topk:0.1'")
        self.fraction = float(parameter)

    @property
    def spec(self) -> str:
        return f"topk:{self.fraction:g}"

    def select(self, step: np.ndarray) -> np.ndarray:
        """The positions kept, ascending."""
        k = max(1, math.ceil(self.fraction * step.size))
        if k >= step.size:
            return np.arange(step.size, dtype=np.uint32)
        kept = np.argpartition(np.abs(step), step.size - k)[step.size - k:]
        return np.sort(kept).astype(np.uint32)


class Float16(Stage):
    name, order = "float16", 3

    def __init__(self, parameter: float | None) -> None:
        if parameter is not None:
            raise ConfigError("update_stages", "float16 takes no parameter")

    def encode(self, values: np.ndarray, rng: np.random.Generator) -> Encoded:
        # A step past float16's range is absurd, but must not become an infinity on the wire.
        return Encoded(half=np.clip(values, -FLOAT16_MAX, FLOAT16_MAX).astype(np.float16))

    @staticmethod
    def decode(enc: Encoded, size: int) -> np.ndarray:
        return enc.half.astype(np.float32)


class Int8(Stage):
    name, order = "int8", 3

    def __init__(self, parameter: float | None) -> None:
        block = 256 if parameter is None else parameter
        if block != int(block) or not 1 <= block <= 65536:
            raise ConfigError("update_stages", "int8's block is a whole number in 1..65536, "
                              "as 'int8:256'")
        self.block = int(block)

    @property
    def spec(self) -> str:
        return f"int8:{self.block}"

    def encode(self, values: np.ndarray, rng: np.random.Generator) -> Encoded:
        n, b = values.size, self.block
        padded = np.zeros(-(-n // b) * b, np.float32)
        padded[:n] = values
        blocks = padded.reshape(-1, b)
        scales = (np.abs(blocks).max(axis=1) / 127).astype(np.float32)
        safe = np.where(scales > 0, scales, 1).astype(np.float32)[:, None]
        # Stochastic rounding: E[code] * scale is the value itself, so no bias accumulates.
        codes = np.floor(blocks / safe + rng.random(blocks.shape, dtype=np.float32))
        return Encoded(codes=np.clip(codes, -127, 127).astype(np.int8).ravel()[:n],
                       scales=scales)

    def decode(self, enc: Encoded, size: int) -> np.ndarray:
        if enc.scales.size != -(-size // self.block):
            raise MessageError("bad_encoding", f"{enc.scales.size} int8 scales for {size} "
                               f"values in blocks of {self.block}")
        if not (enc.scales >= 0).all():
            raise MessageError("bad_encoding", "int8 scales must be >= 0")
        return enc.codes.astype(np.float32) * np.repeat(enc.scales, self.block)[:size]


STAGES: dict[str, type[Stage]] = {s.name: s for s in (Clip, Noise, TopK, Float16, Int8)}


def _stage(spec: str) -> Stage:
    name, _, raw = spec.partition(":")
    if name not in STAGES:
        raise ConfigError("update_stages", f"unknown stage {spec!r}; known: {sorted(STAGES)}")
    try:
        parameter = float(raw) if raw else None
    except ValueError:
        raise ConfigError("update_stages", f"{spec!r}: {raw!r} is not a number") from None
    return STAGES[name](parameter)  # type: ignore[call-arg]


class UpdatePipeline:
    """A fleet's stages, parsed and checked once; ``id`` names them on the wire."""

    def __init__(self, specs: tuple[str, ...] | list[str] = ()) -> None:
        self.stages = [_stage(s) for s in specs]
        orders = [s.order for s in self.stages]
        if orders != sorted(set(orders)):
            raise ConfigError("update_stages", "stages go clip, noise, topk, then one of "
                              f"float16 or int8, each at most once; got {list(specs)}")
        self.id = "-".join(s.spec for s in self.stages) or MODEL_ENCODING
        if not is_id(self.id):
            raise ConfigError("update_stages", f"{self.id!r} is too long to name on the wire "
                              "(64 characters)")
        self.clip = next((s for s in self.stages if isinstance(s, Clip)), None)
        self.noise = next((s for s in self.stages if isinstance(s, Noise)), None)
        if self.noise and not self.clip:
            raise ConfigError("update_stages", "noise needs a clip stage before it: the noise "
                              "is scaled to the clipped step's bound")
        self.topk = next((s for s in self.stages if isinstance(s, TopK)), None)
        self.quantiser = next((s for s in self.stages if isinstance(s, (Float16, Int8))), None)
        self.lossy = any(s.lossy for s in self.stages)

    @property
    def active(self) -> bool:
        return bool(self.stages)

    @property
    def noise_multiplier(self) -> float:
        """Local DP's noise multiplier (0: no noise stage)."""
        return self.noise.multiplier if self.noise else 0.0

    def noised_step_bound(self, num_params: int) -> float:
        """The longest step an honest device sends through a noise stage: the clip bound
        plus the noise's norm, which passes ``sqrt(d) + 4`` standard deviations with
        probability under ``exp(-8)`` (Gaussian concentration); 0 without noise.  A
        station's distance guard starts from it, not from an unnoised step's length."""
        if self.noise is None or self.clip is None:
            return 0.0
        return self.clip.bound * (1 + self.noise.multiplier * (np.sqrt(num_params) + 4))

    def encode(self, step: np.ndarray, residual: np.ndarray | None, rng: np.random.Generator,
               noise_rng: np.random.Generator | None = None
               ) -> tuple[Encoded, np.ndarray | None]:
        """``step`` encoded, and the error to feed into the next one (None: nothing lossy).
        ``rng`` rounds; ``noise_rng`` (``rng`` where not given) draws the privacy noise."""
        step = np.asarray(step, np.float32)
        if self.clip is not None:
            step = self.clip.apply(step)
            if self.noise is not None:
                step = self.noise.apply(step, self.clip.bound, noise_rng or rng)
        if residual is not None:
            step = step + residual
        indices = self.topk.select(step) if self.topk else np.zeros(0, np.uint32)
        values = step[indices] if self.topk else step
        enc = self.quantiser.encode(values, rng) if self.quantiser else Encoded(
            values=values.astype(np.float32))
        enc = dataclasses.replace(enc, indices=indices)
        if not self.lossy:
            return enc, None
        return enc, step - self.decode(enc, step.size)

    def decode(self, enc: Encoded, size: int) -> np.ndarray:
        """The step ``enc`` carries, as ``size`` float32s; :class:`MessageError` where it cannot
        be one of ours (wrong carrier, lengths, positions)."""
        carriers = {"values": enc.values.size, "half": enc.half.size, "codes": enc.codes.size}
        wanted = ("codes" if isinstance(self.quantiser, Int8) else
                  "half" if isinstance(self.quantiser, Float16) else "values")
        if any(n for name, n in carriers.items() if name != wanted) or (
                wanted != "codes" and enc.scales.size):
            raise MessageError("bad_encoding", f"stages {self.id!r} send their values as "
                               f"{wanted} only")
        count = enc.indices.size if self.topk else size
        if carriers[wanted] != count:
            raise MessageError("bad_encoding", f"{carriers[wanted]} values, expected {count}")
        if not self.topk and enc.indices.size:
            raise MessageError("bad_encoding", "positions sent without a topk stage")
        if self.topk and enc.indices.size and (
                int(enc.indices[-1]) >= size or (np.diff(enc.indices.astype(np.int64)) <= 0).any()):
            raise MessageError("bad_encoding", "positions must ascend, each below the "
                               f"{size} parameters")
        values = (self.quantiser.decode(enc, count) if self.quantiser
                  else enc.values.astype(np.float32))
        if not self.topk:
            return values
        step = np.zeros(size, np.float32)
        step[enc.indices] = values
        return step
