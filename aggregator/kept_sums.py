"""The head statistics an aggregator keeps (``heads.py``'s ledger), held in the forms they
arrive in, so that admitting a device's send costs about what reading it does.

A full float64 Gram made from each send, then added to a total and to what is owed upstream,
cost a station 5.2 ms a triangle at 1,280 features: 1,000 cameras would have needed more
than its thread (issue 71).  Here:

- ``folded``: everything folded so far, float64, the Gram as its packed upper triangle (the
  wire's layout: a triangle adds to it element for element, and it is half a matrix);
- ``fresh``: admitted since the last fold, float32 and in place: a triangle added as it
  arrives; a factor's rows (``G = F^T F``) gathered, and their product added a batch at a
  time (one BLAS product and one packing for many sends).

A station's fresh sums are what it owes the cloud: they go upstream as one float32 triangle
(what the wire carries anyway) and fold as they go, so float32 sums one round's sends only;
the cloud folds at once.
"""

from __future__ import annotations

import numpy as np

from edge_client.head_sums import Claim, HeadSums, pack_triangle, triangle_size, unpack_triangle

__all__ = ["KeptSums"]

# Factor rows gathered before one product adds them (512 x 1,281 float32: 2.6 MB): a send
# of 19 rows waits for two dozen others, and the product of many rows runs BLAS near its
# peak (one x86 core: 0.157 ms a row for 19 rows alone, 0.025 in 256, 0.020 in 512).
BATCH_ROWS = 512


class KeptSums:
    """Sums on ``d`` features and ``classes`` classes, with a Gram where ``gram``."""

    def __init__(self, d: int, classes: int, *, gram: bool) -> None:
        n, size = d + 1, triangle_size(d + 1) if gram else 0
        self.side = n
        self.tri = np.zeros(size)  # folded
        self.cross = np.zeros((n, classes))
        self.counts = np.zeros(classes)
        self.fresh_tri = np.zeros(size, np.float32)
        self.fresh_cross = np.zeros((n, classes))
        self.fresh_counts = np.zeros(classes)
        self._rows = np.zeros((BATCH_ROWS if gram else 0, n), np.float32)
        self._held = 0  # rows of ``_rows`` not yet multiplied in

    @property
    def n(self) -> int:
        """Samples in all, folded and fresh."""
        return int(round(float(self.counts.sum() + self.fresh_counts.sum())))

    @property
    def fresh_n(self) -> int:
        return int(round(float(self.fresh_counts.sum())))

    def add(self, claim: Claim, weight: float = 1.0) -> None:
        """Add a checked claim, ``weight`` < 1 where its share is capped."""
        if claim.tri is not None:
            self.fresh_tri += claim.tri if weight == 1.0 else np.float32(weight) * claim.tri
        elif claim.factor is not None:
            self._gather(claim.factor if weight == 1.0 else
                         np.float32(np.sqrt(weight)) * claim.factor)
        self.fresh_cross += weight * claim.cross
        self.fresh_counts += weight * claim.counts

    def _gather(self, rows: np.ndarray) -> None:
        if self._held + len(rows) > len(self._rows):
            self._multiply()
        self._rows[self._held:self._held + len(rows)] = rows
        self._held += len(rows)

    def _multiply(self) -> None:
        """The gathered rows' product into the fresh triangle."""
        if self._held:
            rows = self._rows[:self._held]
            self.fresh_tri += pack_triangle(rows.T @ rows)
            self._held = 0

    def take_fresh(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """What was admitted since the last fold, for the wire (the Gram's float32 triangle,
        the cross term flat, the counts), folded in as it goes."""
        self._multiply()
        out = (self.fresh_tri, self.fresh_cross.astype(np.float32).ravel(),
               np.rint(self.fresh_counts).astype(np.int64))
        self.fold()
        return out

    def fold(self) -> None:
        """Fold what is fresh into the float64 sums."""
        self._multiply()
        self.tri += self.fresh_tri
        self.cross += self.fresh_cross
        self.counts += self.fresh_counts
        self.fresh_tri = np.zeros(self.fresh_tri.size, np.float32)  # zero pages, unwritten
        self.fresh_cross = np.zeros_like(self.fresh_cross)
        self.fresh_counts = np.zeros_like(self.fresh_counts)

    def whole(self) -> HeadSums:
        """Everything admitted, float64, the Gram whole: what a solve takes."""
        self._multiply()
        gram = unpack_triangle(self.tri + self.fresh_tri, self.side) if self.tri.size \
            else np.zeros((0, 0))
        return HeadSums(gram, self.cross + self.fresh_cross, self.counts + self.fresh_counts)

    def arrays(self) -> dict[str, np.ndarray]:
        """For a checkpoint: the folded sums and the fresh ones, each packed."""
        self._multiply()
        return {"tri": self.tri, "cross": self.cross, "counts": self.counts,
                "fresh_tri": self.fresh_tri, "fresh_cross": self.fresh_cross,
                "fresh_counts": self.fresh_counts}

    def restore(self, arrays: dict[str, np.ndarray]) -> None:
        """From :meth:`arrays`, or from a checkpoint of the whole matrices that a version
        before these forms wrote (:meth:`restore_whole`)."""
        if "tri" not in arrays:
            return self.restore_whole(arrays)
        self.tri, self.cross, self.counts = (np.array(arrays[k], np.float64)
                                             for k in ("tri", "cross", "counts"))
        self.fresh_tri = np.array(arrays["fresh_tri"], np.float32)
        self.fresh_cross = np.array(arrays["fresh_cross"], np.float64)
        self.fresh_counts = np.array(arrays["fresh_counts"], np.float64)
        self._held = 0

    def restore_whole(self, arrays: dict[str, np.ndarray]) -> None:
        """``total_*`` and (a station's) ``pending_*``, each whole and float64: the pending
        part is what is fresh."""
        def packed(part: str) -> dict[str, np.ndarray]:
            gram = np.asarray(arrays[f"{part}_gram"], np.float64)
            return {"tri": pack_triangle(gram) if gram.size else np.zeros(0),
                    "cross": np.asarray(arrays[f"{part}_cross"], np.float64),
                    "counts": np.asarray(arrays[f"{part}_counts"], np.float64)}

        total = packed("total")
        pending = packed("pending") if "pending_counts" in arrays \
            else {k: np.zeros_like(v) for k, v in total.items()}  # the cloud's: none
        self.restore({**{k: total[k] - pending[k] for k in total},
                      **{f"fresh_{k}": v for k, v in pending.items()}})
