"""Who sits in a station's super nodes.

Before the selector sees anyone, the seats are guarded: a device seated
``max_participations`` times this round is out (a hard cap, for central DP's
accounting), benched stragglers are out while a quorum of others is ready, and the
seat-share cap and a refused device's sit-out leave devices out where others can fill
their seats (:func:`~aggregator.trust.seat_candidates`).  Of those left, ``rand_per_group``
are drawn at random and the rest chosen by the configured selector (GBP-CS by default,
``selection.py``) for the next batches' histograms against ``P_real``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from edge_client import messages as m

from .config import StationConfig
from .selection import SelectorSettings, build_selector
from .trust import ShareCap, seat_candidates

__all__ = ["Seating"]


class Seating:
    """A station's seat guards and its selector."""

    def __init__(self, config: StationConfig, num_classes: int, rng: np.random.Generator,
                 counters: Counter[str]) -> None:
        self.config, self.num_classes, self.counters = config, num_classes, counters
        self.rng = rng  # the station's own: random seats draw between its other draws
        self._select = build_selector(config.selector,
                                      SelectorSettings(rng=rng, max_iter=config.gbp_max_iter))
        self.share = ShareCap(config.share_window, config.max_selection_share)
        self.seats: Counter[str] = Counter()  # each device's seats in this round's super nodes
        self.sitting_out: dict[str, int] = {}  # refused members: left out up to this iteration

    def pick(self, ready: list[str], want: int, *, stats: Mapping[str, m.DeviceStats],
             target: Callable[[], np.ndarray], benched: Mapping[str, int],
             iteration: int) -> tuple[str, ...]:
        """Up to ``want`` of the ``ready`` devices for a super node: benched stragglers
        and refused or over-seated devices left out where others can fill it,
        ``rand_per_group`` at random, the rest by the selector against ``target()``
        (asked only where someone is left to choose)."""
        cfg = self.config
        ready = self._under_cap(ready)
        on_time = [d for d in ready if benched.get(d, -1) < iteration]
        if len(on_time) >= cfg.min_quorum:
            ready = on_time
        ready, capped = seat_candidates(ready, self.share, self.sitting_out, iteration,
                                        min(want, len(ready)))
        if capped:
            self.counters["selection_share_capped"] += capped
        size = min(want, len(ready))
        hists = np.array([stats[d].next_batch_counts for d in ready], dtype=np.float64)
        n_random = min(cfg.rand_per_group, size)
        fixed = list(self.rng.choice(len(ready), size=n_random, replace=False)) if n_random else []
        picked = self._select(hists.reshape(len(ready), self.num_classes), target(),
                              size - n_random, fixed=fixed).tolist() if ready else []
        return tuple(sorted(ready[i] for i in [*fixed, *picked]))

    def seated(self, members: tuple[str, ...]) -> None:
        """``members`` sit in this iteration's super node."""
        self.share.record(members)
        self.seats.update(members)

    def refused(self, device: str, iteration: int) -> None:
        """A reply of ``device`` was refused at ``iteration``: counted, and it costs the
        device the seats of the next ``refused_sit_out`` super nodes."""
        self.counters["refused_replies"] += 1
        if self.config.refused_sit_out:
            self.sitting_out[device] = iteration + self.config.refused_sit_out

    def new_round(self) -> None:
        self.seats.clear()

    def state(self) -> dict[str, Any]:
        """The checkpoint's share: recent super nodes (the share cap) and sit-outs."""
        return {"recent": self.share.state(), "sitting_out": dict(self.sitting_out)}

    def restore(self, recent: list[list[str]], sitting_out: Mapping[str, int]) -> None:
        self.share.restore(recent)
        self.sitting_out = {d: int(i) for d, i in sitting_out.items()
                            if d in self.config.devices}

    def _under_cap(self, ready: list[str]) -> list[str]:
        """``ready`` less the devices seated ``max_participations`` times this round: a
        hard cap (unlike the share cap, nobody fills a seat past it), so a round's later
        super nodes shrink where the cap and the roster cannot fill them."""
        cap = self.config.max_participations
        if not cap:
            return ready
        under = [d for d in ready if self.seats[d] < cap]
        self.counters["participation_capped"] += len(ready) - len(under)
        return under
