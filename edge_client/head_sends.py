"""Each send of head statistics counted once, whoever restarts: the sender's side (an epoch
and a running count stamped on each send, and the sends its receiver's checkpoint may not
hold yet) and the receiver's (what it has counted of each sender).

Statistics are increments, so a lost one is lost from every solve after it, and one counted
twice weighs its frames double.  A receiver resumes from the checkpoint of its round's start
(``aggregator/services.py``): what it admitted after that died with it, though the broker
acknowledged it to the sender.  So a sender keeps its sends of the last rounds and sends
them again when its receiver's model goes back (it resumed); the receiver drops a send
whose running count it has already counted in that epoch, as a stream of sequence numbers
is deduplicated (an idempotent receiver).  A sender restarted without its state begins a
new epoch, counted from zero.  Numpy and the standard library only: a device imports it.
"""

from __future__ import annotations

import dataclasses
import secrets

from . import messages as m
from .fields import MAX_INT

__all__ = ["SendLog", "Counted", "draw"]


def draw() -> int:
    """A random epoch or process mark, within what a frame's integer field carries."""
    return 1 + secrets.randbelow(MAX_INT - 1)


class SendLog:
    """A sender's statistics: stamped with its epoch and running sample count, and kept for
    :data:`KEEP_ROUNDS` rounds of its receiver after the one they were sent in (by then the
    receiver's checkpoint holds them: it writes one as each round begins)."""

    KEEP_ROUNDS = 2

    def __init__(self, epoch: int = 0, upto: int = 0) -> None:
        self.epoch = epoch or draw()
        self.upto = upto  # samples sent in this epoch
        self.kept: list[m.HeadStats] = []
        self._heard: tuple[int, int] | None = None  # the receiver's latest (round, iteration)
        self._started = 0  # its process's draw (StationModel.started)

    def stamp(self, msg: m.HeadStats) -> m.HeadStats:
        """``msg`` with its place in the count, kept until its receiver surely holds it."""
        self.upto += int(msg.counts.sum())
        out = dataclasses.replace(msg, upto=self.upto, epoch=self.epoch)
        self.kept.append(out)
        return out

    def heard(self, round_: int, iteration: int, started: int = 0) -> list[m.HeadStats]:
        """The receiver's model of ``round_`` and ``iteration`` came, from its process that
        drew ``started`` (0: not told): the sends to repeat, every one kept where it went
        back or its process changed (it resumed from its checkpoint, which may lack them;
        killed in a round's first iteration, it comes back at the same one), else none;
        sends older than :data:`KEEP_ROUNDS` rounds are let go."""
        now = (round_, iteration)
        again = self._heard is not None and now < self._heard \
            or bool(started and self._started and started != self._started)
        self._heard, self._started = now, started or self._started
        self.kept = [k for k in self.kept if k.round + self.KEEP_ROUNDS >= round_]
        return list(self.kept) if again else []


class Counted:
    """A receiver's record of each sender's statistics: the epoch and running count of the
    last it counted (``through``, in its checkpoint)."""

    def __init__(self) -> None:
        self.through: dict[str, tuple[int, int]] = {}

    def already(self, msg: m.HeadStats) -> bool:
        """Whether ``msg`` was counted before (a sender too old to stamp: never)."""
        epoch, upto = self.through.get(msg.sender, (0, 0))
        return bool(msg.epoch) and msg.epoch == epoch and msg.upto <= upto

    def note(self, msg: m.HeadStats) -> None:
        if msg.epoch:
            self.through[msg.sender] = (msg.epoch, msg.upto)
