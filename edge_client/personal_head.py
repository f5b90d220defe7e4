"""Personal heads: the head a device predicts with on its own line, the federation's ridge
head pulled toward what the device's own frames say (``[inference] personal``).

Ditto (Li et al., ICML 2021, "Ditto: fair and robust federated learning through
personalization") gives each client ``v = argmin f_own(v) + lambda ||v - w*||^2`` beside the
global model ``w*``.  For a ridge head (squared loss on one-hot targets over the augmented
rows of ``head_stats.py``) that objective is closed form:

    V = (G_own + lambda I)^-1 (B_own + lambda W*) = W* + (G_own + lambda I)^-1 (B_own - G_own W*)

from the device's own sums (every labelled frame it trained on: its held-out slice is not
in them, so that slice still judges the head honestly) and the global head it was sent.
It is the solve of "the global statistics plus its own" with the fleet's Gram, which no
device holds (6.6 MB a round to every device), replaced by ``lambda I`` about the global
head.  lambda is chosen by generalised cross-validation on the device's own sums against
the global head's residual (:func:`~edge_client.head_solves.gcv_lambda`): a device that has
seen a few frames keeps close to the global head, one that has seen many of a few classes
fits them.  The head is for the device's predictions only (safe promotion decides whether
it goes into use, ``promotion.py``); training and uploads keep the federation's weights.
"""

from __future__ import annotations

import io
import logging
import threading
from pathlib import Path
from typing import Any

import numpy as np

from .errors import ConfigError, MessageError
from .files import write_atomic
from .head_solves import gcv_lambda, head_vector
from .head_stats import HeadSpec, HeadSums

__all__ = ["PersonalHead", "attach_personal", "PERSONAL_FILE"]

log = logging.getLogger(__name__)

# In the device's [service] state_dir: its own sums (float32, the Gram's triangle, 3.3 MB
# on 1,280 features), rewritten after each send, so that a restart keeps them.
PERSONAL_FILE = "personal_sums.npz"


class PersonalHead:
    """A device's own sums of every labelled frame it trained on, and its personal solve."""

    def __init__(self, spec: HeadSpec, *, background: bool = False) -> None:
        if spec.kind != "ridge":
            raise ValueError("a personal head pulls a ridge head toward the device's frames")
        self.spec = spec
        # What the device has sent of its statistics (added as each send goes, so that no
        # frame's rank-one update is paid twice); the unsent increment joins it at a solve.
        self.own = spec.zeros(np.float32)  # as the device's statistics: 6.6 MB at 1,280 features
        self.last_lambda = 0.0  # the last solve's penalty
        # The own sums' eigendecomposition, with the sums it is of (float64): by their sample
        # count, so that candidates scored with no new frame between them (promote =
        # "always" scores every broadcast) reuse it.  ``background``: made on a thread of
        # its own (a device service's), since it costs seconds on a board (1,281 features:
        # docs/bodies.md) and the line's predictions must not wait for it; a solve then uses
        # the last one made and asks for the next.  The thread touches no socket.
        self._eig: tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None
        self.background = background
        self._worker: threading.Thread | None = None
        self.waited = 0  # solves that found no decomposition yet: the global head as it was
        self.path: Path | None = None  # where they are kept (:meth:`keep_in`)

    def add(self, sent: HeadSums) -> None:
        """What the device just sent joins its own sums, written where they are kept."""
        self.own.add(sent)
        if self.path is not None:
            tri, cross, counts = self.own.packed()
            out = io.BytesIO()
            np.savez(out, gram=tri, cross=cross, counts=counts, centre=self.spec.centre)
            write_atomic(self.path, out.getbuffer())

    def keep_in(self, path: Path) -> None:
        """Keep the own sums in ``path`` from now on, starting from what it holds: a
        :class:`ConfigError` on ``state_dir`` where it holds something else (another body's
        sums, or not sums at all), as nothing should guess what a device saw."""
        self.path = path
        if not path.exists():
            return
        spec = self.spec
        try:
            with np.load(path, allow_pickle=False) as kept:
                if not np.array_equal(kept["centre"], spec.centre):
                    raise ValueError("the sums of another body (its centre differs)")
                # float32, as kept: no float64 Gram (13 MB) at a board's start
                self.own = HeadSums.unpacked(spec.features, spec.classes, kept["gram"],
                                             kept["cross"], kept["counts"], np.float32)
        except (OSError, ValueError, KeyError, MessageError) as exc:
            raise ConfigError("state_dir", f"{path} is not this device's personal-head sums "
                              f"({exc}): move it aside to start them again") from exc
        log.info("personal head: the sums of %d samples kept in %s", self.own.n, path)

    def solve(self, weights: np.ndarray, unsent: HeadSums | None = None) -> np.ndarray:
        """The personal head beside the global head ``weights`` (the linear head's flat
        vector) from the device's own sums and its ``unsent`` increment; ``weights`` as
        they are where the device has no frames of its own yet."""
        own, d, c = self.own, self.spec.features, self.spec.classes
        n = own.n + (unsent.n if unsent is not None else 0)
        if n == 0:
            return weights
        ready = self._eig  # in the background, the one made before this solve: never waited for
        if ready is None or ready[0] != n:
            self._decompose(n, unsent)
            ready = ready if self.background else self._eig
        if ready is None:  # the first is still being made
            self.waited += 1
            return weights
        n, eig, vecs, gram, cross = ready
        w = np.asarray(weights[:d * c], np.float64).reshape(c, d)
        # On the augmented rows (centred, a bias column) the global head is [W^T; b + W centre].
        prior = np.vstack([w.T, (np.asarray(weights[d * c:], np.float64)
                                 + w @ self.spec.centre)[None, :]])
        q = vecs.T @ (cross - gram @ prior)
        yy = n - 2.0 * float((prior * cross).sum()) + float((prior * (gram @ prior)).sum())
        lam = gcv_lambda(eig, (q ** 2).sum(axis=1), n, max(yy, 0.0))
        v = prior + vecs @ (q / (np.maximum(eig, 0.0) + lam)[:, None])
        self.last_lambda = lam
        return head_vector(v[:d].T, v[d], self.spec.centre)

    def _decompose(self, n: int, unsent: HeadSums | None) -> None:
        """The eigendecomposition of the own sums as they are (``n`` samples): here, or on
        the background thread where none is being made already."""
        if self._worker is not None and self._worker.is_alive():
            return
        gram, cross = self.own.gram.astype(np.float64), self.own.cross.astype(np.float64)
        if unsent is not None:
            gram += unsent.gram
            cross += unsent.cross

        def made() -> None:
            eig, vecs = np.linalg.eigh(gram)
            self._eig = (n, eig, vecs, gram, cross)  # one assignment: read whole or not at all

        if not self.background:
            made()
            return
        self._worker = threading.Thread(target=made, name="personal-head", daemon=True)
        self._worker.start()

    def settle(self, timeout: float | None = None) -> None:
        """Wait for the decomposition being made, if any (tests, and a service's end)."""
        if self._worker is not None:
            self._worker.join(timeout)


def attach_personal(device: Any, state_dir: str | None = None, *,
                    background: bool = False) -> None:
    """Give ``device`` its personal head where ``[inference] personal`` asks for one: its
    statistics keep its own sums too (in ``state_dir`` where there is one, so that a restart
    keeps them; ``""``, a service without one, is warned about), and each candidate its
    line judges is first made personal (one solve per candidate scored, not per broadcast);
    ``background``, a service's: its eigendecompositions off the prediction path."""
    inference = device.line.inference
    if inference is None or not inference.personal:
        return
    head = device.head
    if head is None or head.spec.kind != "ridge" or head.embed is not None:
        raise ConfigError("personal", "a personal head pulls the federation's ridge head "
                          "toward the device's frames: it needs [model] head_init = 'ridge' "
                          "and a frozen body (train_body_blocks = 0)")
    head.personal = PersonalHead(head.spec, background=background)
    device.line.promoter.personalise = head.personal_head
    if state_dir:
        head.personal.keep_in(Path(state_dir) / PERSONAL_FILE)
    elif state_dir is not None:
        log.warning("device %s: no [service] state_dir, so its personal head's sums start "
                    "again at each restart", device.id)
