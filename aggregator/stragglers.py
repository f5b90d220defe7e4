"""How long a station waits for its super node, learned from how long its devices take.

A fleet of mixed boards has stragglers: a device many times slower than the rest would
pace every internal synchronisation it is seated in up to ``iteration_timeout``.  The
station measures each device's reply time (from the iteration's start to its answer,
late answers included), and closes an iteration at ``straggler_factor`` times the fleet's
median reply time (never under ``straggler_min_wait``, never over ``iteration_timeout``),
or, in the iterations that began before three devices were timed, at that factor of the
median of the answers the super node has given, once half of it answered.
A member that missed that deadline sits out ``straggler_sit_out`` super nodes, twice as
many after each further miss in a row (at most 16 times), so a device that cannot keep up
costs the fleet one short wait now and then rather than a long one every time; an answer
in time clears its record.  A benched device is not seated while a quorum of others is
ready; an answer to an iteration that closed without it is still timed.
"""

from __future__ import annotations

import statistics
from collections import deque

from .config import StationConfig

__all__ = ["StragglerWatch"]

MAX_BACKOFF = 16  # the longest sit-out, in multiples of straggler_sit_out
MIN_ESTIMATES = 3  # reply times needed before the median is trusted over the timeout
MISSED_KEPT = 8  # missed iterations remembered per device, to time their late answers


class StragglerWatch:
    """Reply times per device, the deadline they give, and the sit-outs of those who miss."""

    def __init__(self, *, factor: float, min_wait: float, sit_out: int, timeout: float) -> None:
        self.factor, self.min_wait, self.sit_out, self.timeout = factor, min_wait, sit_out, timeout
        self.reply_s: dict[str, float] = {}
        self.misses: dict[str, int] = {}
        self.began = 0.0  # when the current super node was asked
        self._answer_s: list[float] = []  # seconds each of its in-time answers took
        self._blind = True  # it began before the fleet's reply times were known
        # Members that missed an iteration: when each such iteration asked them.
        self._missed: dict[str, dict[int, float]] = {}
        # Stragglers benched up to this iteration.  Unlike a refusal's sit-out, a bench never
        # fills a seat while a quorum of others is ready: seating a 30x slower board to fill
        # a super node would stall the iteration it was benched to spare.  Not checkpointed:
        # a restarted station learns reply times again within a few iterations.
        self.benched: dict[str, int] = {}
        # Seconds from each of the last super nodes' selection to its last in-time answer:
        # what an operator sizing a station reads (the summary's reply_median_s, reply_max_s).
        self.last_answers: deque[float] = deque(maxlen=64)

    @classmethod
    def for_station(cls, config: StationConfig) -> StragglerWatch:
        return cls(factor=config.straggler_factor, min_wait=config.straggler_min_wait,
                   sit_out=config.straggler_sit_out, timeout=config.iteration_timeout)

    @property
    def informed(self) -> bool:
        """Enough reply times for the fleet's median to set the deadline."""
        return bool(self.factor) and len(self.reply_s) >= MIN_ESTIMATES

    def budget(self) -> float:
        """Seconds the next super node has to answer."""
        if not self.informed:
            return self.timeout
        typical = statistics.median(self.reply_s.values())
        return min(self.timeout, max(self.min_wait, self.factor * typical))

    def peer_budget(self, times: list[float], members: int) -> float | None:
        """Seconds this super node has, from the answers it gave so far (``times``, seconds
        from its start): once half of its ``members`` answered (rounded up: one of a super
        node of two), the rest get ``factor`` times their median, whatever the history
        says; None before.  A fleet's first iterations, with no history, would otherwise
        wait out a straggler in full (a super node of two did, paced by a 30x slower
        member to 0.36x the round rate over its first 5 rounds: bench/rehearsal.py)."""
        if not self.factor or len(times) < -(-members // 2):
            return None
        return max(self.min_wait, self.factor * statistics.median(times))

    def reply_figures(self) -> dict[str, float | None]:
        """The median and the most of ``last_answers`` (None before any)."""
        done = list(self.last_answers)
        return {"reply_median_s": round(statistics.median(done), 4) if done else None,
                "reply_max_s": round(max(done), 4) if done else None}

    def answered(self, device: str, seconds: float, in_time: bool) -> None:
        self.reply_s[device] = max(0.0, seconds)
        if in_time:
            self.misses.pop(device, None)

    def missed(self, device: str) -> int:
        """A member missed the deadline: how many super nodes it sits out (0: the watch is
        off)."""
        if not self.factor or not self.sit_out:
            return 0
        streak = self.misses.get(device, 0) + 1
        self.misses[device] = streak
        return self.sit_out * min(MAX_BACKOFF, 2 ** (streak - 1))

    def begin(self, now: float) -> float:
        """A super node was asked at ``now``: its deadline."""
        if self._answer_s:
            self.last_answers.append(max(self._answer_s))
        self.began, self._blind, self._answer_s = now, not self.informed, []
        return now + self.budget()

    def reply(self, device: str, now: float, deadline: float, members: int) -> float | None:
        """An answer at ``now`` from the current super node of ``members``: None past
        ``deadline``, else the deadline, shortened by the answers so far where the fleet's
        times were unknown when it began (afterwards the fleet's median sets it: one fast,
        or hostile, member moves a super node's median but not the fleet's)."""
        if now > deadline:
            self.answered(device, now - self.began, False)
            return None
        self.answered(device, now - self.began, True)
        self._answer_s.append(now - self.began)
        peers = self.peer_budget(self._answer_s, members) if self._blind else None
        return deadline if peers is None else min(deadline, self.began + peers)

    def late(self, device: str, iteration: int, now: float) -> bool:
        """Whether this is an answer to an ``iteration`` that closed without it: then it is
        timed (how slow the device is), and nothing more."""
        asked = self._missed.get(device, {}).pop(iteration, None)
        if asked is None:
            return False
        self.answered(device, now - asked, False)
        return True

    def closed_without(self, device: str, iteration: int) -> bool:
        """``device`` left ``iteration`` unanswered: whether it is benched now."""
        missed = self._missed.setdefault(device, {})
        missed[iteration] = self.began
        if len(missed) > MISSED_KEPT:  # a device that died never answers: keep a few
            del missed[min(missed)]
        sit_out = self.missed(device)
        if sit_out:
            self.benched[device] = iteration + sit_out
        return bool(sit_out)

    def closed(self, unanswered: list[str], iteration: int) -> int:
        """``iteration`` closed at its deadline with ``unanswered`` members still awaited:
        how many of them are benched now."""
        return sum(self.closed_without(d, iteration) for d in unanswered)
