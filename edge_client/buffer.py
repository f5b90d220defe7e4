"""The device's streaming buffer (SPEC §2).

A fixed-capacity FIFO of ``(x, y)``: new samples overwrite the oldest, training
batches are taken from the oldest unread samples and never reused, and every
``holdout_every``-th arrival goes to a bounded held-out slice used only to
evaluate ``h(.)`` for the upload gate.  It also keeps the label histograms the
base station needs for GBP-CS: of everything seen, and of the next batch.

A reported next batch is *pinned*: copied out of the ring, so that arrivals cannot
overwrite it before the device is picked for it.  GBP-CS chose the super node for that
histogram, so that is the batch the device trains on.
"""

from __future__ import annotations

import numpy as np

from .errors import ConfigError, ShapeError

__all__ = ["StreamBuffer"]


class _Ring:
    """Fixed-capacity ring of samples addressed by arrival number."""

    def __init__(self, capacity: int, sample_shape: tuple[int, ...]) -> None:
        self.capacity = capacity
        self.x = np.zeros((capacity, *sample_shape), dtype=np.float32)
        self.y = np.zeros(capacity, dtype=np.int64)
        self.written = 0

    @property
    def oldest(self) -> int:
        return max(0, self.written - self.capacity)

    def push(self, x: np.ndarray, y: np.ndarray) -> None:
        n = len(y)
        drop = max(0, n - self.capacity)  # more than it holds: only the last ones stay
        for at, part in self._runs(self.written + drop, self.written + n):
            self.x[at] = x[part.start - self.written:part.stop - self.written]
            self.y[at] = y[part.start - self.written:part.stop - self.written]
        self.written += n

    def take(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        runs = self._runs(start, stop)
        if len(runs) == 1:
            (at, _), = runs
            return self.x[at].copy(), self.y[at].copy()
        return (np.concatenate([self.x[at] for at, _ in runs]),
                np.concatenate([self.y[at] for at, _ in runs]))

    def _runs(self, start: int, stop: int) -> list[tuple[slice, range]]:
        """Arrivals ``start..stop`` (at most ``capacity`` of them) as at most two runs of
        the ring's rows: slices, not an index per sample (a device streams every iteration)."""
        runs = []
        while start < stop:
            at = start % self.capacity
            n = min(stop - start, self.capacity - at)
            runs.append((slice(at, at + n), range(start, start + n)))
            start += n
        return runs or [(slice(0, 0), range(start, start))]


class StreamBuffer:
    """Streaming FIFO with one-shot mini-batches and a held-out slice.

    Parameters
    ----------
    capacity : int
        Training samples kept; the oldest are overwritten first.
    num_classes : int
        Width ``F`` of the label histograms.
    sample_shape : tuple of int
        Shape of one input sample.
    holdout_every : int
        Every n-th arriving sample is held out (0 disables the held-out slice).
    holdout_capacity : int
        Bound on the held-out slice (oldest dropped first).
    """

    def __init__(
        self,
        capacity: int,
        num_classes: int,
        sample_shape: tuple[int, ...],
        *,
        holdout_every: int = 10,
        holdout_capacity: int = 256,
    ) -> None:
        for key, value, low in (("capacity", capacity, 1), ("num_classes", num_classes, 1),
                                ("holdout_every", holdout_every, 0),
                                ("holdout_capacity", holdout_capacity, 1)):
            if not isinstance(value, int) or value < low:
                raise ConfigError(key, f"must be an integer >= {low}, got {value!r}")
        self.num_classes = num_classes
        self.sample_shape = tuple(sample_shape)
        self.holdout_every = holdout_every
        self._train = _Ring(capacity, self.sample_shape)
        self._holdout = _Ring(holdout_capacity, self.sample_shape)
        self._read = 0
        self._arrivals = 0
        self.seen_counts = np.zeros(num_classes, dtype=np.int64)
        self.overwritten_unread = 0
        self._pinned: tuple[np.ndarray, np.ndarray] | None = None

    def push(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Append a batch of arriving samples (``x``: (n, *sample_shape), ``y``: (n,));
        returns which of them were held out."""
        x = np.asarray(x, dtype=np.float32)
        y = np.asarray(y)
        if x.shape[1:] != self.sample_shape or y.ndim != 1 or len(x) != len(y):
            raise ShapeError(f"expected x (n, {self.sample_shape}) and y (n,), "
                             f"got {x.shape} and {y.shape}")
        if len(y) and (y.min() < 0 or y.max() >= self.num_classes or
                       not np.issubdtype(y.dtype, np.integer)):
            raise ShapeError(f"labels must be integers in [0, {self.num_classes})")
        if not np.isfinite(x).all():
            raise ShapeError("samples contain NaN or Inf")
        arrival = self._arrivals + np.arange(len(y))
        held = (arrival % self.holdout_every == self.holdout_every - 1
                if self.holdout_every else np.zeros(len(y), dtype=bool))
        self._arrivals += len(y)
        self.seen_counts += np.bincount(y, minlength=self.num_classes)
        self._holdout.push(x[held], y[held])
        self._train.push(x[~held], y[~held])
        lost = self._train.oldest - self._read
        if lost > 0:
            self.overwritten_unread += lost
            self._read = self._train.oldest
        return held

    @property
    def unread(self) -> int:
        """Training samples not yet used (the pinned batch included)."""
        pinned = 0 if self._pinned is None else len(self._pinned[1])
        return self._train.written - self._read + pinned

    def pin(self, batch_size: int) -> bool:
        """Set aside the next full batch so that it is the one :meth:`next_batch` returns,
        whatever arrives meanwhile; a partial batch is not pinned (it may still fill)."""
        if self._pinned is None and self._train.written - self._read >= batch_size:
            self._pinned = self._take(batch_size)
        return self._pinned is not None

    @property
    def samples_seen(self) -> int:
        return self._arrivals

    def next_batch_counts(self, batch_size: int) -> np.ndarray:
        """Label histogram of the batch :meth:`next_batch` would return."""
        if self._pinned is not None:
            y = self._pinned[1]
        else:
            _, y = self._train.take(self._read, min(self._read + batch_size, self._train.written))
        return np.bincount(y, minlength=self.num_classes)

    def next_batch(self, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        """The pinned batch, else up to ``batch_size`` of the oldest unread samples; a batch
        is never returned again."""
        if batch_size < 1:
            raise ConfigError("batch_size", f"must be >= 1, got {batch_size!r}")
        if self._pinned is not None:
            batch, self._pinned = self._pinned, None
            return batch
        return self._take(batch_size)

    def _take(self, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        stop = min(self._read + batch_size, self._train.written)
        x, y = self._train.take(self._read, stop)
        self._read = stop
        return x, y

    def holdout(self) -> tuple[np.ndarray, np.ndarray]:
        """The held-out evaluation slice (never trained on)."""
        return self._holdout.take(self._holdout.oldest, self._holdout.written)

    @property
    def held_out(self) -> int:
        """Samples in the held-out slice, without copying them."""
        return self._holdout.written - self._holdout.oldest
