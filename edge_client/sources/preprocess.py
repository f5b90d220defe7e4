"""Frame preprocessing: crop, resize, grayscale, scale and normalise to a model's input."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from ..config import PreprocessSettings
from ..errors import ShapeError

__all__ = ["Preprocess"]


@dataclass(frozen=True, kw_only=True)
class Preprocess(PreprocessSettings):
    """Turn an OpenCV image (H, W) or (H, W, 3) BGR into a float32 sample of ``sample_shape``.

    A result of another shape raises :class:`ShapeError`.
    """

    sample_shape: tuple[int, ...]

    @classmethod
    def from_settings(cls, settings: PreprocessSettings,
                      sample_shape: tuple[int, ...]) -> Preprocess:
        fields = {f.name: getattr(settings, f.name) for f in dataclasses.fields(PreprocessSettings)}
        return cls(sample_shape=tuple(sample_shape), **fields)

    def __call__(self, image: np.ndarray) -> np.ndarray:
        import cv2

        if self.crop:
            x, y, w, h = self.crop
            if y + h > image.shape[0] or x + w > image.shape[1]:
                raise ShapeError(f"crop {self.crop} exceeds the {image.shape[1]}x"
                                 f"{image.shape[0]} frame")
            image = image[y:y + h, x:x + w]
        if self.resize:
            image = cv2.resize(image, tuple(self.resize), interpolation=cv2.INTER_AREA)
        if self.grayscale and image.ndim == 3:
            image = cv2.cvtColor(image, cv2.COLOR_BGR2GRAY)
        elif self.rgb and image.ndim == 3:
            image = cv2.cvtColor(image, cv2.COLOR_BGR2RGB)
        out = image.astype(np.float32) * np.float32(self.scale)
        out = out[None] if out.ndim == 2 else out.transpose(2, 0, 1)
        if self.mean:
            mean = np.asarray(self.mean, np.float32).reshape(-1, 1, 1)
            out = (out - mean) / np.asarray(self.std, np.float32).reshape(-1, 1, 1)
        if out.shape != tuple(self.sample_shape) and out.shape[1:] != tuple(self.sample_shape):
            raise ShapeError(f"frame gives a {out.shape} sample, the model needs "
                             f"{self.sample_shape}: set crop/resize/grayscale")
        return np.ascontiguousarray(out.reshape(self.sample_shape))
