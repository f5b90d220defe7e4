"""Internal synchronisation at a station: one iteration's super node, how each member
answered, and the running fold of their updates, ``w^m = sum_k (n_k / n) z_k``.

Every kind of reply is its member's answer, so none is waited for past it.  The station
makes the fold for each super node (the fusion rule's, or central DP's noised mean of
clipped steps) and releases it through central DP when the iteration closes; updates are
folded as they arrive and not kept, so a station holds one running sum, not every reply.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection

import numpy as np

from edge_client.messages import NamedEnum

from .config import StationConfig
from .fusion import Fold, fold_for

__all__ = ["InternalSync", "Reply"]


class Reply(NamedEnum):
    """How a super-node member answered this iteration."""

    UPDATE = "update"  # a model, folded into w^m
    SKIP = "skip"  # the upload gate held it back, or nothing to train on
    REFUSED = "refused"  # its update could not be honest, or its frame was refused


class InternalSync:
    """The current super node, its answers and its fold."""

    def __init__(self, config: StationConfig, counters: Counter[str]) -> None:
        self.config, self.counters = config, counters
        self.members: tuple[str, ...] = ()
        self.replies: dict[str, Reply] = {}
        self.fold: Fold = fold_for(config.fusion)

    def begin(self, members: tuple[str, ...], fold: Fold) -> None:
        """A new super node (or none): no answer, and nothing folded, from an earlier one."""
        self.members, self.replies, self.fold = members, {}, fold
        self.counters["asked"] += len(members)  # seats, against which replies are accounted

    def answered(self, device: str) -> bool:
        return device in self.replies

    def unanswered(self, offline: Collection[str]) -> list[str]:
        """Members still awaited: no answer yet, and online."""
        return [d for d in self.members if d not in self.replies and d not in offline]

    def missing(self) -> int:
        """Members without an answer, online or not."""
        return len(self.members) - len(self.replies)

    def update(self, device: str, weights: np.ndarray, samples: int) -> None:
        self.fold.add(weights, samples, key=device)
        self.replies[device] = Reply.UPDATE
        self.counters["received_updates"] += 1

    def skip(self, device: str) -> None:
        self.replies[device] = Reply.SKIP
        self.counters["received_skips"] += 1

    def refused(self, device: str) -> None:
        self.replies[device] = Reply.REFUSED
        self.counters["refused_updates"] += 1  # its reasons are the admission's rejected.*

    def take(self) -> Fold:
        """The iteration's fold, to release; a plain one stays in its place."""
        fold, self.fold = self.fold, fold_for(self.config.fusion)
        return fold
