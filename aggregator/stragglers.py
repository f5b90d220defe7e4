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
in time clears its record.
"""

from __future__ import annotations

import statistics

__all__ = ["StragglerWatch"]

MAX_BACKOFF = 16  # the longest sit-out, in multiples of straggler_sit_out
MIN_ESTIMATES = 3  # reply times needed before the median is trusted over the timeout


class StragglerWatch:
    """Reply times per device, the deadline they give, and the sit-outs of those who miss."""

    def __init__(self, *, factor: float, min_wait: float, sit_out: int, timeout: float) -> None:
        self.factor, self.min_wait, self.sit_out, self.timeout = factor, min_wait, sit_out, timeout
        self.reply_s: dict[str, float] = {}
        self.misses: dict[str, int] = {}

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
