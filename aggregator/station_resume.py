"""What of a station survives a restart: its snapshot at round boundaries, and the way back.

Each part writes and reads its own share (the roster's stats, admission's guards, the
seats, the samples and upload external synchronisation owes the cloud); this puts the
station's own (model, ``P_real``, state, round, iteration, generator, counters) beside
them.  :class:`~aggregator.station.Station` inherits it; its ``start`` then repeats the
upload or begins the iteration it was in.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from edge_client import messages as m
from edge_client.errors import ShapeError
from edge_client.states import StationState

from .admission import UpdateAdmission
from .central_dp import CentralDP
from .checkpoint import StationCheckpoint
from .external_sync import ExternalSync
from .heads import HeadLedger
from .roster import Roster
from .seating import Seating
from .trust import ClaimTally

__all__ = ["StationResume"]


class StationResume:
    """``snapshot`` and ``restore`` of a station."""

    # The station's own, set by its constructor.
    num_params: int
    state: StationState
    weights: np.ndarray | None
    p_real: np.ndarray | None
    round: int
    iteration: int
    rng: np.random.Generator
    counters: Counter[str]
    roster: Roster
    admission: UpdateAdmission
    seating: Seating
    external: ExternalSync
    dp: CentralDP
    tally: ClaimTally
    heads: HeadLedger | None

    @property
    def id(self) -> str:
        raise NotImplementedError  # the station's

    def snapshot(self) -> tuple[dict[str, np.ndarray], StationCheckpoint]:
        """Arrays and scalars that :meth:`restore` needs; taken at round boundaries."""
        models = {"weights": self.weights, "p_real": self.p_real}
        arrays = {k: v for k, v in models.items() if v is not None}
        arrays.update(self.roster.arrays())
        arrays.update(self.admission.arrays())
        if self.heads is not None:  # the sums so far, and what the cloud is owed
            arrays.update(self.heads.arrays())
        meta = StationCheckpoint(
            id=self.id, state=self.state, round=self.round, iteration=self.iteration,
            **self.external.state(), **self.seating.state(), **self.roster.state(),
            norms=self.admission.norms(), rng=dict(self.rng.bit_generator.state),
            counters=dict(self.counters), dp_bound=self.dp.adaptive_bound,
            tally=self.tally.state())
        return arrays, meta

    def restore(self, arrays: dict[str, np.ndarray], meta: StationCheckpoint) -> None:
        """Continue from a :meth:`snapshot`; call ``start`` next."""
        if meta.role != m.Participant.STATION or meta.id != self.id:
            raise ShapeError("the checkpoint is not this station's")
        if "weights" in arrays and arrays["weights"].size != self.num_params:
            raise ShapeError("the checkpoint's model has another size")
        self.weights = np.array(arrays["weights"]) if "weights" in arrays else None
        self.p_real = np.array(arrays["p_real"]) if "p_real" in arrays else None
        self.roster.restore(arrays, meta.seen_at, meta.windows, meta.trained_updates,
                            meta.drift_counts, meta.drift_levels, meta.seen_carried)
        self.state = StationState(meta.state)
        self.round, self.iteration = meta.round, meta.iteration
        self.external.restore(meta.consumed, meta.consumed_before)
        self.admission.restore(arrays, meta.norms)
        if self.heads is not None:
            self.heads.restore(arrays)
        self.seating.restore(meta.recent, meta.sitting_out)
        self.dp.resume(meta.dp_bound)
        self.seating.new_round()  # a checkpoint is a round's start
        self.dp.new_round()
        self.tally.restore(meta.tally)
        self.rng.bit_generator.state = meta.rng
        self.counters.update(meta.counters)
        if self.state == StationState.WAITING and meta.upload_samples is not None:
            if self.weights is None:
                raise ShapeError("the checkpoint owes the cloud an upload but has no model")
            self.external.restore_upload(self.weights, self.round, self.iteration,
                                         meta.upload_samples)

    def _model(self) -> np.ndarray:
        """``w^m``: every path that sends or checks against it runs after the first global
        model set it; before, this refuses (a bug, counted as such) instead of sending None."""
        return self._set(self.weights, "model")

    def _target(self) -> np.ndarray:
        """``P_real``, which comes with every global model."""
        return self._set(self.p_real, "P_real")

    def _set(self, value: np.ndarray | None, what: str) -> np.ndarray:
        if value is None:
            raise ShapeError(f"station {self.id} has no {what} yet")
        return value
