"""The fleet's products: which class each product's name is, which are retired, and, on a
device, the labelled frames of products the fleet has not added yet, held until it does.

A line introduces a product before the fleet learns of it.  The classes are the model's
(``[model] num_classes``, in its layout); the products are names given to them in order
(``[model] class_names``), and the classes past the last name are free.  Adding a product
names the next free class: every sum, head and checkpoint stays valid, and the closed-form
head learns the class from its first statistics (the LDA solve leaves a class with none
unpredicted, ``head_solves.UNSEEN_BIAS``).  Retiring one masks its class out of every
prediction and keeps its statistics.

The cloud's file is the authority: its catalogue rides on every global model, a station
relays it on its own, and a device follows it where the two agree on every class both name
(one list extends the other).  One that names a class differently is refused
(``catalogue.refused``, at error level): the cloud and this device disagree on what a class
is, and a label of one would train the other.

A label naming a product not in the catalogue is joined to its frame as usual, then held
(:class:`HeldLabels`) for ``[source] hold_labels_for`` seconds, at most ``hold_labels_max``
frames (the oldest go first), on disk with the device's state; once the product is added
the held frames are trained on as its class.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from io import BytesIO
from pathlib import Path
from typing import Any

import numpy as np

from . import messages as m
from .admission import LogLimiter
from .errors import MessageError
from .files import write_atomic
from .inference import NOT_PREDICTED
from .messages import MAX_NAME

__all__ = ["Catalogue", "DeviceProducts", "HeldLabels", "HELD_FILE", "MAX_AWAITED"]

log = logging.getLogger(__name__)

HELD_FILE = "held_labels.npz"  # in the device's state directory
MAX_AWAITED = 64  # names of products to come a device holds frames of (more: refused)
SAVE_EVERY = 5.0  # seconds between writes of the held frames (an SD card wears)


class Catalogue:
    """The products of ``num_classes`` classes: ``names`` (class 0 first, possibly fewer
    than the classes) and ``retired``; :meth:`follow` adopts the cloud's."""

    def __init__(self, num_classes: int, names: tuple[str, ...] = (),
                 retired: tuple[str, ...] = (), *, counters: Counter[str] | None = None) -> None:
        self.num_classes = num_classes
        self.counters: Counter[str] = Counter() if counters is None else counters
        self.names: tuple[str, ...] = ()
        self.retired: frozenset[str] = frozenset()
        self.index: dict[str, int] = {}
        self._set(names, retired)

    def _set(self, names: tuple[str, ...], retired: tuple[str, ...] | frozenset[str]) -> None:
        self.names, self.retired = tuple(names), frozenset(retired)
        self.index = {name: k for k, name in enumerate(self.names)}

    @property
    def allowed(self) -> np.ndarray | None:
        """The classes a prediction may name (None: all): a named fleet's products less the
        retired; free classes and retired products never."""
        if not self.names:
            return None
        mask = np.zeros(self.num_classes, dtype=bool)
        mask[[k for k, n in enumerate(self.names) if n not in self.retired]] = True
        # Every product retired: predicting none would leave the line blind, so all are.
        return mask if mask.any() else None

    @property
    def retired_names(self) -> tuple[str, ...]:
        """The retired products, in class order."""
        return tuple(n for n in self.names if n in self.retired)

    def name(self, label: int) -> str | None:
        return self.names[label] if 0 <= label < len(self.names) else None

    def follow(self, products: tuple[str, ...], retired: tuple[str, ...]) -> list[str]:
        """Adopt the cloud's catalogue where it agrees with this one; returns the products
        it added (``()``: no news).  A disagreement is a :class:`MessageError`."""
        if not products:
            return []
        shared = min(len(products), len(self.names))
        if products[:shared] != self.names[:shared]:
            k = next(i for i in range(shared) if products[i] != self.names[i])
            raise MessageError("renamed", f"class {k} is {products[k]!r} to the cloud and "
                               f"{self.names[k]!r} here: provision both from one fleet file")
        if len(products) > self.num_classes:
            raise MessageError("too_many", f"{len(products)} products for {self.num_classes} "
                               "classes")
        if not set(retired) <= set(products):
            raise MessageError("retired_unknown", "a retired product the cloud does not name")
        added = list(products[len(self.names):])
        if added or frozenset(retired) != self.retired:
            for name in added:
                log.info("product %r added: class %d", name, products.index(name))
            for name in frozenset(retired) ^ self.retired:
                log.info("product %r %s", name, "retired" if name in retired else "back")
            self._set(tuple(products) if added else self.names, retired)
        return added

    def check_extends(self, names: tuple[str, ...]) -> None:
        """A new catalogue for the same classes (the cloud's file, rewritten): every class
        named so far keeps its name (a :class:`MessageError` otherwise)."""
        if tuple(names[:len(self.names)]) != self.names:
            raise MessageError("renamed", f"class_names {list(names)} do not begin with "
                               f"{list(self.names)}: a product is added at the end and "
                               "retired by name, never moved or removed")


class HeldLabels:
    """Labelled frames of products to come, by name, until the catalogue adds them."""

    def __init__(self, catalogue: Catalogue, *, hold_for: float, hold_max: int,
                 folder: str | Path | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        self.catalogue, self.hold_for, self.hold_max = catalogue, hold_for, hold_max
        self.counters = catalogue.counters
        self.clock = clock or time.time
        self.codes: dict[str, int] = {}  # name -> the negative label LiveLabels joins it by
        self._names: list[str] = []
        self._samples: list[np.ndarray] = []
        self._arrived: list[float] = []
        self.path = Path(folder) / HELD_FILE if folder else None
        self._dirty, self._saved, self._next_look = False, -math.inf, -math.inf
        if self.path is not None and self.path.exists():
            self._load()

    def __len__(self) -> int:
        return len(self._names)

    def code(self, name: str) -> int | None:
        """The label a frame of ``name`` (not in the catalogue) is joined by, or None where
        this device already awaits ``MAX_AWAITED`` products."""
        if name not in self.codes:
            awaited = sum(1 for n in self.codes if n not in self.catalogue.index)
            if awaited >= MAX_AWAITED:
                return None
            self.codes[name] = -1 - len(self.codes)
        return self.codes[name]

    def hold(self, samples: list[np.ndarray], codes: list[int]) -> tuple[list[np.ndarray],
                                                                          list[int]]:
        """Keep the frames of products to come; returns those whose product was added
        meanwhile, with their classes."""
        by_code = {c: n for n, c in self.codes.items()}
        now, ready, classes = self.clock(), [], []
        for sample, code in zip(samples, codes, strict=True):
            name = by_code[code]
            if name in self.catalogue.index:
                ready.append(sample)
                classes.append(self.catalogue.index[name])
                continue
            self._names.append(name)
            self._samples.append(np.asarray(sample, dtype=np.float32))
            self._arrived.append(now)
            self.counters["label_held"] += 1
            self._dirty = True
        self._bound(now)
        return ready, classes

    def _bound(self, now: float) -> None:
        keep = [i for i, t in enumerate(self._arrived) if now - t <= self.hold_for]
        if len(keep) < len(self._arrived):
            self.counters["label_held_expired"] += len(self._arrived) - len(keep)
        if len(keep) > self.hold_max:
            self.counters["label_held_dropped"] += len(keep) - self.hold_max
            keep = keep[-self.hold_max:]
        if len(keep) != len(self._arrived):
            self._names = [self._names[i] for i in keep]
            self._samples = [self._samples[i] for i in keep]
            self._arrived = [self._arrived[i] for i in keep]
            self._dirty = True

    def release(self, added: list[str]) -> tuple[np.ndarray, np.ndarray] | None:
        """The held frames of the products just ``added``, with their classes (None: none)."""
        take = [i for i, n in enumerate(self._names) if n in added]
        if not take:
            return None
        x = np.stack([self._samples[i] for i in take])
        y = np.array([self.catalogue.index[self._names[i]] for i in take], dtype=np.int64)
        rest = [i for i in range(len(self._names)) if i not in set(take)]
        self._names = [self._names[i] for i in rest]
        self._samples = [self._samples[i] for i in rest]
        self._arrived = [self._arrived[i] for i in rest]
        self.counters["label_held_joined"] += len(take)
        self._dirty = True
        log.info("%d held frames joined as %s", len(take), ", ".join(added))
        return x, y

    def keep(self, now: float, *, force: bool = False) -> None:
        """Expire (once a second), and write the held frames where they changed (every
        ``SAVE_EVERY`` s): a serve hook, called each loop turn."""
        if not force and now < self._next_look:
            return
        self._next_look = now + 1.0
        self._bound(self.clock())
        if self.path is None or not self._dirty or (now - self._saved < SAVE_EVERY
                                                     and not force):
            return
        names = np.array(self._names, dtype=f"<U{MAX_NAME}")
        samples = np.stack(self._samples) if self._samples else np.zeros((0, 0), np.float32)
        buf = BytesIO()
        np.savez(buf, names=names, samples=samples, arrived=np.array(self._arrived))
        write_atomic(self.path, buf.getvalue())
        self._dirty, self._saved = False, now

    def _load(self) -> None:
        assert self.path is not None
        try:
            with np.load(self.path, allow_pickle=False) as doc:
                names, samples, arrived = doc["names"], doc["samples"], doc["arrived"]
        except (OSError, ValueError, KeyError) as exc:
            self.counters["label_held_unreadable"] += 1
            log.error("held labels in %s unreadable (%s): starting without them", self.path,
                      exc)
            return
        if not (len(names) == len(samples) == len(arrived)):
            self.counters["label_held_unreadable"] += 1
            log.error("held labels in %s inconsistent: starting without them", self.path)
            return
        for name, sample, t in zip(names, samples, arrived, strict=True):
            self.code(str(name))
            self._names.append(str(name))
            self._samples.append(np.asarray(sample, dtype=np.float32))
            self._arrived.append(float(t))
        self._bound(self.clock())
        log.info("%d held labels of products to come read from %s", len(self), self.path)


class DeviceProducts:
    """A device's side of the catalogue: the one it follows, the classes its line may name
    (``line.allowed``), and the frames it holds for products to come (``held``)."""

    def __init__(self, catalogue: Catalogue, *, line: Any,
                 ingest: Callable[..., list[m.Message]], counters: Counter[str]) -> None:
        self.line, self.ingest, self.counters = line, ingest, counters
        self.catalogue = catalogue
        self.held: HeldLabels | None = None
        self._limiter = LogLimiter()

    def use(self, catalogue: Catalogue, held: HeldLabels | None = None) -> None:
        """The catalogue of this device's file, and where it holds frames (the service's)."""
        self.catalogue, self.held = catalogue, held
        self.line.allowed = catalogue.allowed

    def follow(self, message: m.StationModel, now: float) -> list[m.Message]:
        """The cloud's catalogue, relayed with a model: a product added trains on the frames
        held for it (unscored: they were predicted before their class existed)."""
        try:
            added = self.catalogue.follow(message.products, message.retired)
        except MessageError as exc:
            self.counters["catalogue.refused"] += 1
            if self._limiter.allow("catalogue", exc.reason):
                log.error("the fleet's products as the cloud sends them are refused "
                          "(catalogue.refused: %s): %s", exc.reason, exc)
            return []
        self.line.allowed = self.catalogue.allowed
        released = self.held.release(added) if self.held is not None and added else None
        if released is None:
            return []
        x, y = released
        return self.ingest(x, y, now, predicted=np.full(len(y), NOT_PREDICTED, np.int64))
