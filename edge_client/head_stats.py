"""Closed-form heads from what the fleet has seen: the statistics a device accumulates on its
body's embeddings, how they travel and are checked; the solves are ``head_solves.py``.

A linear head on a frozen body is a ridge regression away from its data: with ``z`` an
embedding centred by the body's constant, clipped to norm ``clip`` and given a bias column,
``G = sum z z^T`` and ``B = sum z onehot(y)^T`` (and the per-class counts) are all a solve
needs, and they are sums.  A device adds each labelled frame once, at ingest; a station adds
its devices' increments, the cloud its stations'; the head solved from the sum is the one a
centralised solve on every frame would give, whatever the label skew and the arrival order
(Fani et al., ICML 2024, "Accelerating heterogeneous federated learning with closed-form
classifiers").  ``lda`` solves the same sums as a discriminant with equal class priors, so
that a product with a few frames among thousands is learnt from them; ``ncm`` sends only
``B`` and the counts: the class means (Legate et al., NeurIPS 2023), a cosine classifier.

The solves centre by the sums' own mean (an unpenalised bias, exactly), so the body's
constant only keeps the clip meaningful and float32 increments precise.  Everything here is
numpy; a device with a body imports it.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import messages as m
from .body import BODY_MANIFEST, body_manifest
from .errors import ConfigError, MessageError
from .head_solves import NCM_SCALE, head_vector, solve_lda, solve_ncm, solve_ridge
from .novelty import DeviceNovelty

__all__ = ["HEAD_KINDS", "GRAM_KINDS", "HeadSpec", "HeadStatsPath", "head_spec", "HeadSums",
           "augment", "check_claim", "triangle_size"]

log = logging.getLogger(__name__)

HEAD_KINDS = ("lda", "ridge", "ncm")
GRAM_KINDS = ("lda", "ridge")  # the solves whose statistics carry the Gram
Embed = Callable[[np.ndarray], np.ndarray]  # buffered samples to the body's embeddings


def triangle_size(n: int) -> int:
    """Entries of an ``n x n`` symmetric matrix's upper triangle, the diagonal included."""
    return n * (n + 1) // 2


def augment(x: np.ndarray, centre: np.ndarray, clip: float) -> np.ndarray:
    """Embeddings centred by the body's constant, rows clipped to norm ``clip``, and a bias
    column of ones: the rows the statistics are sums over."""
    z = np.asarray(x, np.float32).reshape(len(x), -1) - centre
    norms = np.sqrt(np.einsum("ij,ij->i", z, z))
    over = norms > clip
    if over.any():
        z[over] *= (clip / norms[over])[:, None]
    return np.hstack([z, np.ones((len(z), 1), np.float32)])


@dataclass
class HeadSums:
    """Summed statistics of a linear head on ``d`` features and ``classes`` classes:
    ``gram`` (``(d+1, d+1)``, empty for ``ncm``), ``cross`` (``(d+1, classes)``) and
    ``counts``; the last row and column of ``gram`` and the last row of ``cross`` are the
    bias column's."""

    gram: np.ndarray
    cross: np.ndarray
    counts: np.ndarray

    @classmethod
    def zeros(cls, d: int, classes: int, *, kind: str = "ridge",
              dtype: type = np.float64) -> HeadSums:
        gram: np.ndarray = np.zeros((d + 1, d + 1) if kind in GRAM_KINDS else (0, 0), dtype)
        return cls(gram, np.zeros((d + 1, classes), dtype), np.zeros(classes, dtype))

    @property
    def n(self) -> int:
        return int(round(float(self.counts.sum())))

    @property
    def has_gram(self) -> bool:
        return self.gram.size > 0

    def add_rows(self, a: np.ndarray, y: np.ndarray) -> None:
        """Add augmented rows ``a`` (:func:`augment`) with labels ``y``: one pass each."""
        y = np.asarray(y, np.int64)
        a = a.astype(self.cross.dtype, copy=False)  # products in the sums' precision
        if self.has_gram:
            self.gram += a.T @ a  # BLAS: one rank-k update for the batch
        onehot = np.zeros((len(y), self.counts.size), a.dtype)
        onehot[np.arange(len(y)), y] = 1
        self.cross += a.T @ onehot
        self.counts += np.bincount(y, minlength=self.counts.size).astype(self.counts.dtype)

    def add(self, other: HeadSums, weight: float = 1.0) -> None:
        """Add another participant's sums (``weight`` < 1: its share capped)."""
        if self.has_gram and other.has_gram:
            self.gram += weight * other.gram
        self.cross += weight * other.cross
        self.counts += weight * other.counts  # fractional where weighted: bias row and counts agree

    def taken(self) -> HeadSums:
        """These sums, and zero in their place: the increment since the last send.  The
        arrays themselves go (fresh zeros take their place, untouched pages until the next
        rows come): a copy would hold a second Gram (6.6 MB) at a board's peak."""
        out = HeadSums(self.gram, self.cross, self.counts)
        # np.zeros, not zeros_like: it maps zero pages, where zeros_like writes them all.
        self.gram, self.cross, self.counts = (np.zeros(a.shape, a.dtype) for a in (
            out.gram, out.cross, out.counts))
        return out

    def packed(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """float32 for the wire: the Gram's upper triangle row by row, the cross term
        flat, the counts."""
        g = self.gram
        tri = np.concatenate([g[i, i:] for i in range(len(g))]).astype(
            np.float32, copy=False) if self.has_gram else np.zeros(0, np.float32)
        return (tri, self.cross.astype(np.float32, copy=False).ravel(),
                np.rint(self.counts).astype(np.int64))

    @classmethod
    def unpacked(cls, d: int, classes: int, tri: np.ndarray, cross: np.ndarray,
                 counts: np.ndarray, dtype: type = np.float64) -> HeadSums:
        """From the wire's arrays (float64 from here on, or ``dtype``); :class:`MessageError`
        where their sizes do not fit a head on ``d`` features and ``classes`` classes."""
        n = d + 1
        if cross.size != n * classes or counts.size != classes \
                or tri.size not in (0, triangle_size(n)):
            raise MessageError("wrong_length", f"head statistics of {tri.size}, {cross.size} "
                               f"and {counts.size} values; a head on {d} features and "
                               f"{classes} classes has {triangle_size(n)}, {n * classes} and "
                               f"{classes}")
        gram: np.ndarray = np.zeros((n, n) if tri.size else (0, 0), dtype)
        start = 0
        for i in range(n if tri.size else 0):
            row = tri[start:start + n - i]
            gram[i, i:] = row
            gram[i:, i] = row
            start += n - i
        return cls(gram, cross.astype(dtype).reshape(n, classes),
                   np.asarray(counts, dtype).copy())


def check_claim(s: HeadSums, clip: float, *, tolerance: float = 1e-3) -> None:
    """A participant's statistics checked against what their counts imply: the bias
    entries equal the counts, every row's norm within ``clip`` (the trace, the bias row and
    each class's sum), nothing negative on the diagonal.  :class:`MessageError` otherwise."""
    n, d = s.n, s.cross.shape[0] - 1
    slack = tolerance * max(n, 1)
    if np.abs(s.cross[d] - s.counts).max(initial=0.0) > slack:
        raise MessageError("stats_inconsistent", "the bias row of the cross term is not the "
                           "class counts")
    per_class = np.sqrt((s.cross[:d] ** 2).sum(axis=0))
    if (per_class > s.counts * clip * (1 + tolerance) + slack).any():
        raise MessageError("stats_out_of_bounds", "a class's summed embeddings exceed its "
                           "count times the clip")
    if not s.has_gram:
        return
    g = s.gram
    diag = np.diagonal(g)
    if abs(g[d, d] - n) > slack or (diag < -slack).any():
        raise MessageError("stats_inconsistent", f"the Gram's corner is {g[d, d]:.0f}, the "
                           f"counts sum to {n}")
    if np.abs(g[d, :d] - s.cross[:d].sum(axis=1)).max(initial=0.0) > slack * clip + 1e-3:
        raise MessageError("stats_inconsistent", "the Gram's bias row is not the sum of the "
                           "classes' embeddings")
    if diag[:d].sum() > n * clip * clip * (1 + tolerance) + slack:
        raise MessageError("stats_out_of_bounds", f"the Gram's trace {diag[:d].sum():.1f} "
                           f"exceeds {n} rows of norm {clip}")


@dataclass(frozen=True)
class HeadSpec:
    """A federation's closed-form head: ``kind`` (``lda``, ``ridge`` or ``ncm``), on ``features``
    embedding features and ``classes`` classes, the body's ``centre`` and ``clip``, and
    ``resolve``: ``every`` (each round's solve replaces the head) or ``once``."""

    kind: str
    features: int
    classes: int
    centre: np.ndarray
    clip: float
    resolve: str = "every"
    # A ridge head that stays fixed while tuned blocks train is as sharp as the cosine head
    # (Fed3R+FT's temperature): its scores, about 1 for its class and 0 for the rest, make a
    # near-flat softmax, whose loss would push every sample's features however well placed.
    scale: float = 1.0
    unknown_share: float = 0.05  # [model] unknown_share: what the cloud's threshold flags

    def zeros(self, dtype: type = np.float64) -> HeadSums:
        return HeadSums.zeros(self.features, self.classes, kind=self.kind, dtype=dtype)

    def solve(self, s: HeadSums) -> np.ndarray:
        """The head these sums give, as the linear head's flat vector."""
        if self.kind == "ncm":
            w, b = solve_ncm(s)
        else:
            w, b, _ = (solve_lda if self.kind == "lda" else solve_ridge)(s)
        return head_vector(w, b, self.centre) * np.float32(self.scale)

    def unpack(self, msg: m.HeadStats) -> HeadSums:
        """A message's sums, checked against its counts (:func:`check_claim`)."""
        if (msg.gram.size > 0) != (self.kind in GRAM_KINDS):
            has = "with" if msg.gram.size else "without"
            raise MessageError("wrong_kind", f"head statistics {has} a Gram, the federation's "
                               f"head is {self.kind}")
        s = HeadSums.unpacked(self.features, self.classes, msg.gram, msg.cross, msg.counts)
        check_claim(s, self.clip)
        return s


def head_spec(model: Any) -> HeadSpec | None:
    """The closed-form head a ``[model]`` table asks for, with its body's centre and clip;
    None where ``head_init`` comes to random, or is ``auto`` and the body was exported
    without a centre (by a version before heads were solved)."""
    kind = model.head_kind
    manifest = body_manifest(model) if kind != "random" else None
    if manifest is None:
        return None
    if not manifest.centre:
        if model.head_init == "auto":
            log.info("body %s has no centre for a closed-form head (exported by an older "
                     "version): the head starts random", manifest.name)
            return None
        raise ConfigError("head_init", f"{manifest.folder / BODY_MANIFEST} has no centre for "
                          f"a {kind} head (exported by an older version): export the body "
                          "again (safl models export-body), or set head_init = 'random'")
    return HeadSpec(kind, manifest.embedding, model.num_classes,
                    np.asarray(manifest.centre, np.float32), manifest.row_clip,
                    model.head_resolution, scale=NCM_SCALE if model.train_body_blocks and
                    kind == "ridge" else 1.0, unknown_share=model.unknown_share)


class HeadStatsPath:
    """A device's statistics: each labelled sample's row made once at ingest and staged,
    the staged rows added in one rank-k update per ``STAGE`` of them (a frame at a time
    costs 7.4 ms on one x86 core, 0.28 ms in 32s), and the increment since the last send
    sent every ``every`` models of its station (float32: a 6.6 MB Gram on 1,280 features),
    and sooner while the device is new: whenever what it holds is at least what it has sent,
    so that its first frames reach a solve within an iteration or two (a ridge head from 500
    frames is at 0.80: docs/bodies.md) and the sends early on are a handful, doubling."""

    STAGE = 64  # rows staged before they are added: 330 KB at 1,281 float32 columns

    def __init__(self, spec: HeadSpec, every: int, *, fleet: str, device: str,
                 station: str, await_station: bool = False, embed: Embed | None = None,
                 counters: Counter[str] | None = None) -> None:
        self.spec, self.every = spec, every
        # The fleet's unknown-part detector, and the labelled frames' scores that set its
        # threshold (novelty.py); none on class means only (no Gram, no covariance).
        self.novelty = DeviceNovelty(spec.features, spec.classes,
                                     Counter() if counters is None else counters, device) \
            if spec.kind in GRAM_KINDS else None
        # Where the body's last blocks train, a buffered sample is the activation before them,
        # which ``embed`` finishes with the pretrained blocks: what the head is solved on.
        self.embed = embed
        self.fleet, self.device, self.station = fleet, device, station
        self.sums = spec.zeros(np.float32)
        self._rows: list[np.ndarray] = []
        self._labels: list[np.ndarray] = []
        self.models = 0
        self.sent = 0  # samples sent so far
        self.personal: Any = None  # the device's own sums too (personal_head.py), where asked
        # Over a broker the first send waits for the station's presence: MQTT drops a
        # publish no one has subscribed to, and a send is not repeated.
        self.await_station = await_station

    @classmethod
    def attach(cls, device: Any, spec: HeadSpec | None, every: int, *,
               await_station: bool = False, embed: Embed | None = None) -> None:
        """Give ``device`` its statistics, where the federation solves its head;
        ``await_station`` over a broker (:meth:`first`); ``embed`` where the body's last
        blocks train (:func:`~edge_client.trainers.pretrained_embedding`)."""
        if spec is not None:
            cfg = device.config
            device.head = cls(spec, every, fleet=cfg.fleet, device=cfg.device_id,
                              station=cfg.station, await_station=await_station, embed=embed,
                              counters=device.counters)

    def take(self, x: np.ndarray, y: np.ndarray) -> None:
        if len(y):
            rows = self.rows(x)
            if self.novelty is not None:
                self.novelty.calibrate(rows)
            self._rows.append(rows)
            self._labels.append(np.asarray(y))
            if sum(len(r) for r in self._rows) >= self.STAGE:
                self._flush()

    def rows(self, x: np.ndarray) -> np.ndarray:
        """Samples as the rows the statistics sum (through the pretrained blocks, where the
        body's last ones train)."""
        x = x if self.embed is None else self.embed(x)
        return augment(x, self.spec.centre, self.spec.clip)

    def _flush(self) -> None:
        if self._rows:
            self.sums.add_rows(np.concatenate(self._rows), np.concatenate(self._labels))
            self._rows, self._labels = [], []

    def personal_head(self, weights: np.ndarray) -> np.ndarray:
        """The device's personal head beside the global head ``weights`` (personal_head.py)."""
        self._flush()
        return self.personal.solve(weights, self.sums)

    def due(self, model: m.StationModel) -> list[m.Message]:
        """The increment, where there is one and this model is the ``every``-th since the
        last send, or the increment is at least everything sent before it."""
        self.models += 1
        if self.novelty is not None:
            self.novelty.receive(model)
        held = self._held()
        if held == 0 or (self.models < self.every and held < self.sent):
            return []
        return self._send(model.round, model.iteration)

    def first(self, station_online: bool) -> list[m.Message]:
        """What the device holds before it has sent anything, for its station's first solve:
        at its start, or, where it held nothing then or (``await_station``) its station was
        not yet heard online, when it hears its station online; so the fleet's first global
        model is a head solved from the frames its devices started with.  Once only: the
        station subscribes before its presence says online, so a send after it arrives."""
        if self.await_station and not station_online:
            return []
        return self._send(0, 0) if self.sent == 0 and self._held() else []

    def _held(self) -> int:
        return self.sums.n + sum(len(r) for r in self._rows)

    def _send(self, round_: int, iteration: int) -> list[m.Message]:
        self._flush()
        if self.personal is not None:  # what goes up stays in the device's own sums
            self.personal.add(self.sums)
        self.models, self.sent = 0, self.sent + self.sums.n
        gram, cross, counts = self.sums.taken().packed()
        scored, scored_by = self.novelty.taken() if self.novelty is not None \
            else (np.zeros(0, np.int64), 0)
        return [m.HeadStats(fleet=self.fleet, sender=self.device, round=round_,
                            iteration=iteration, station=self.station, gram=gram,
                            cross=cross, counts=counts, novelty=scored, novelty_of=scored_by)]
