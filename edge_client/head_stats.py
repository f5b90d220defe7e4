"""Closed-form heads from what the fleet has seen: the head a federation solves, and the
statistics a device accumulates on its body's embeddings and when it sends them; the sums,
their wire forms and checks are ``head_sums.py``, the solves ``head_solves.py``.

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
from .head_sends import SendLog
from .head_solves import NCM_SCALE, head_vector, solve_lda, solve_ncm, solve_ridge
from .head_sums import (
    GRAM_KINDS,
    Claim,
    HeadSums,
    augment,
    check_claim,
    claim_of,
    factor_rows,
    one_hot,
    triangle_size,
)
from .novelty import DeviceNovelty

__all__ = ["HEAD_KINDS", "GRAM_KINDS", "HeadSpec", "HeadStatsPath", "head_spec", "HeadSums",
           "augment", "check_claim", "factor_rows", "triangle_size"]

log = logging.getLogger(__name__)

HEAD_KINDS = ("lda", "ridge", "ncm")
Embed = Callable[[np.ndarray], np.ndarray]  # buffered samples to the body's embeddings


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
        """A message's sums, checked against its counts, the Gram whole (:meth:`claim`)."""
        return self.claim(msg).sums()

    def claim(self, msg: m.HeadStats) -> Claim:
        """A message's statistics in the form they came, checked against their counts
        (:func:`claim_of`)."""
        if msg.factor.size and (msg.gram.size or msg.cross.size):
            raise MessageError("wrong_kind", "head statistics with a Gram both whole and as "
                               "a factor")
        gram = msg.gram.size > 0 or msg.factor.size > 0
        if gram != (self.kind in GRAM_KINDS):
            has = "with" if gram else "without"
            raise MessageError("wrong_kind", f"head statistics {has} a Gram, the federation's "
                               f"head is {self.kind}")
        return claim_of(self.features, self.classes, self.clip, tri=msg.gram, cross=msg.cross,
                        counts=msg.counts, factor=msg.factor, labels=msg.factor_labels)


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
    # The fewest labelled samples a send holds after the first: one send never stands for a
    # handful of frames (they wait for more), and a send's bytes pay for themselves.
    MIN_SEND = 16

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
        self.sends = SendLog()  # each send stamped, and kept until its station surely has it
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
            device.local.head_solved = spec.resolve == "every"

    def take(self, x: np.ndarray, y: np.ndarray) -> None:
        if len(y):
            rows = self.rows(x)
            if self.novelty is not None:
                self.novelty.calibrate(rows)
            self._rows.append(rows)
            self._labels.append(np.asarray(y))
            if sum(len(r) for r in self._rows) >= self._stage():
                self._flush()

    def _may_factor(self) -> bool:
        """Whether the increment may still go as a factor (:meth:`_factored`): a Gram is
        sent, no personal head keeps the device's own sums, nothing is in the sums yet."""
        return self.spec.kind in GRAM_KINDS and self.personal is None and not self.sums.n

    def _stage(self) -> int:
        """The staged rows at which they are added to the sums: one past what a factor
        takes while they may go as one (``factor_rows``: 64, 328 KB at 1,281 float32
        columns), else :data:`STAGE`."""
        return factor_rows(self.spec.features, sending=True) + 1 if self._may_factor() \
            else self.STAGE

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
        last send, or the increment is at least everything sent before it or as many rows
        as a factor carries; after the first, never fewer than :data:`MIN_SEND` samples.
        First, where the station's model went back (it resumed from its checkpoint), the
        sends it may have lost, again (``head_sends.py``)."""
        self.models += 1
        if self.novelty is not None:
            self.novelty.receive(model)
        again: list[m.Message] = [*self.sends.heard(model.round, model.iteration,
                                                    model.started)]  # its station restarted
        held = self._held()
        full = self._may_factor() and held >= factor_rows(self.spec.features, sending=True)
        if held == 0 or (self.models < self.every and held < self.sent and not full) or (
                self.sent and held < self.MIN_SEND):
            return again
        return again + self._send(model.round, model.iteration)

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
        empty = np.zeros(0, np.float32)
        factor = self._factored()
        if factor is not None:
            gram, cross, counts, whole = empty, empty, factor[2], factor[:2]
        else:
            self._flush()
            if self.personal is not None:  # what goes up stays in the device's own sums
                self.personal.add(self.sums)
            gram, cross, counts = self.sums.taken().packed()
            whole = (empty, empty)
        self.models, self.sent = 0, self.sent + int(counts.sum())
        scored, scored_by = self.novelty.taken() if self.novelty is not None \
            else (np.zeros(0, np.int64), 0)
        return [self.sends.stamp(m.HeadStats(
            fleet=self.fleet, sender=self.device, round=round_, iteration=iteration,
            station=self.station, gram=gram, cross=cross, counts=counts, novelty=scored,
            novelty_of=scored_by, factor=whole[0], factor_labels=whole[1]))]

    def _factored(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """The staged rows ``A`` as a factor of their Gram, where they are all the increment
        holds and at most half the Gram's side (fewer bytes than its triangle): ``R`` and
        ``Q^T Y`` of ``A = QR`` (``Y`` the labels one-hot), so that ``R^T R = A^T A`` and
        ``R^T Q^T Y = A^T Y``.  ``R`` is a rotation of the rows, not the rows: the Gram's own
        triangular factor, up to signs, so it tells what the Gram tells.  None where the
        increment goes whole."""
        k = sum(len(r) for r in self._rows)
        if not k or not self._may_factor() or k > factor_rows(self.spec.features, sending=True):
            return None
        a, y = np.concatenate(self._rows).astype(np.float64), np.concatenate(self._labels)
        self._rows, self._labels = [], []
        q, r = np.linalg.qr(a)  # reduced: q (k x k), r (k x d+1)
        return (r.astype(np.float32).ravel(),
                (q.T @ one_hot(y, self.spec.classes)).astype(np.float32).ravel(),
                np.bincount(y, minlength=self.spec.classes).astype(np.int64))
