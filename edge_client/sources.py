"""Sample sources that feed a device's :class:`~edge_client.buffer.StreamBuffer`."""

from __future__ import annotations

import numpy as np

from .errors import ShapeError

__all__ = ["ReplaySource"]


class ReplaySource:
    """Replays labelled arrays as an endless stream, reshuffled on every pass.

    Stands in for a sensor in simulations: ``read(n)`` returns the next ``n``
    samples in arrival order.
    """

    def __init__(self, x: np.ndarray, y: np.ndarray, rng: np.random.Generator) -> None:
        if len(x) != len(y) or not len(y):
            raise ShapeError(f"replay needs equal, non-empty x and y, got {len(x)} and {len(y)}")
        self.x, self.y, self.rng = x, y, rng
        self._order = rng.permutation(len(y))
        self._pos = 0

    def read(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        idx = []
        while n > 0:
            if self._pos == len(self._order):
                self._order, self._pos = self.rng.permutation(len(self.y)), 0
            take = self._order[self._pos:self._pos + n]
            idx.append(take)
            self._pos += len(take)
            n -= len(take)
        sel = np.concatenate(idx) if idx else np.empty(0, dtype=np.int64)
        return self.x[sel], self.y[sel]
