"""A station's side of external synchronisation: what it owes the cloud.

Every ``T`` iterations the station uploads ``w^m`` with the samples its internal syncs
fused since the last upload and the factory's label counts for ``P_real``; until the
cloud's global model answers, the upload is kept and repeated whenever the cloud
(re)appears.  Before the first global model the station repeats its label counts every
``hello_interval``.  The label counts never cover fewer samples than the station's
uploads have reported, which the cloud checks them against (``roster.py``).
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import numpy as np

from edge_client import messages as m

from .config import StationConfig
from .roster import Roster

__all__ = ["ExternalSync"]

log = logging.getLogger(__name__)


class ExternalSync:
    """The samples a station fused, its unanswered upload and the pace of its hellos."""

    def __init__(self, config: StationConfig, roster: Roster, counters: Counter[str]) -> None:
        self.config, self.roster, self.counters = config, roster, counters
        self.consumed = 0  # samples fused since the last upload
        self.consumed_before = 0  # of the rounds already uploaded
        self.pending: m.StationUpdate | None = None  # sent, not yet answered by a global model
        self.next_hello = 0.0
        # Whether this process has seen the cloud online: an offline presence before that is
        # the broker's retained history (a restarted station, a cloud not yet started), not
        # a Last Will firing now.
        self.cloud_seen_online = False
        # The fleet's products as the cloud last told them, relayed with every model to the
        # devices (edge_client/catalogue.py): nothing until a global model came.
        self.relayed: dict[str, Any] = {}

    def fused(self, samples: int) -> None:
        """An internal sync fused ``samples``."""
        self.consumed += samples

    def seen_counts(self) -> np.ndarray:
        """The factory's label counts for ``P_real`` (roster.py)."""
        return self.roster.seen_counts(self.consumed_before + self.consumed)

    def stats(self) -> m.StationStats:
        cfg = self.config
        return m.StationStats(fleet=cfg.fleet, sender=cfg.station_id, round=0, iteration=0,
                              seen_counts=self.seen_counts())

    def hello(self, now: float) -> list[m.Message]:
        """The label counts again, where ``hello_interval`` has passed since the last."""
        if now < self.next_hello:
            return []
        self.next_hello = now + self.config.hello_interval
        self.counters["hellos"] += 1
        return [self.stats()]

    def upload(self, weights: np.ndarray, round_: int, iteration: int) -> m.StationUpdate:
        """The upload that ends a synchronisation period, kept until it is answered."""
        cfg = self.config
        self.pending = m.StationUpdate(
            fleet=cfg.fleet, sender=cfg.station_id, round=round_, iteration=iteration,
            weights=weights, num_samples=self.consumed, seen_counts=self.seen_counts(),
            local_accuracies=np.array(self.roster.local_accuracies(), dtype=np.float32),
            prequential_accuracies=np.array(self.roster.prequential_accuracies(),
                                            dtype=np.float32))
        self.consumed_before += self.consumed
        self.consumed = 0
        return self.pending

    def answered(self, model: m.GlobalModel) -> None:
        """A global model came: nothing is owed, and its catalogue is the one relayed."""
        self.pending = None
        if model.products:
            self.relayed = {"products": model.products, "retired": model.retired}

    def cloud_presence(self, presence: m.Presence, station: str, joining: bool = False
                       ) -> list[m.Message]:
        """The cloud (re)appeared: our counts (unless the station is still joining), and
        the unanswered upload again.  It went away (its Last Will): said, and the upload
        waits for it."""
        if presence.online:
            self.cloud_seen_online = True
            return [] if joining else self.reannounce()
        if presence.final:
            self.counters["cloud_offline"] += 1
            log.info("station %s: the cloud finished", station)
        elif not self.cloud_seen_online:
            log.info("station %s: the cloud is not online (its retained presence says offline); "
                     "the station waits for it", station)
        else:
            self.counters["cloud_offline"] += 1
            log.warning("station %s: the cloud went offline (its Last Will); internal syncs "
                        "go on, the upload waits for it", station)
        return []

    def reannounce(self) -> list[m.Message]:
        """Our counts, and the unanswered upload again."""
        self.counters["reannouncements"] += 1
        return [self.stats(), *([self.pending] if self.pending is not None else [])]

    def state(self) -> dict[str, Any]:
        """The checkpoint's share."""
        return {"consumed": self.consumed, "consumed_before": self.consumed_before,
                "upload_samples": None if self.pending is None else self.pending.num_samples}

    def restore(self, consumed: int, consumed_before: int) -> None:
        self.consumed, self.consumed_before = int(consumed), int(consumed_before)

    def restore_upload(self, weights: np.ndarray, round_: int, iteration: int,
                       samples: int) -> None:
        """The upload a checkpoint says was unanswered, rebuilt to be repeated."""
        cfg = self.config
        self.pending = m.StationUpdate(fleet=cfg.fleet, sender=cfg.station_id, round=round_,
                                       iteration=iteration, weights=weights,
                                       num_samples=samples, seen_counts=self.seen_counts())
