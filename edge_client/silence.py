"""When a device's hellos have gone unanswered long enough to say so.

A wrong broker, or an ACL that drops a device's stats or its station's model, looks from
the device exactly like a station that has not started yet: the hellos simply go
unanswered.  :class:`Silence` says when that has lasted ``after`` seconds, then at each
doubling of it, so a misconfigured device is loud without flooding its log.  Where the
station's presence came through, the path works, and :func:`explain` names the wait instead.
"""

from __future__ import annotations

__all__ = ["Silence", "explain"]


def explain(device: str, station: str, silent: float, station_online: bool) -> str:
    """What a device says after ``silent`` seconds of unanswered hellos."""
    if station_online:
        return (f"device {device}: station {station} is online but has sent no model for "
                f"{silent:.0f} s: it waits for its roster, its quorum or the cloud's first "
                "model (`safl status` and the station's log say which)")
    return (f"device {device}: no answer from station {station} for {silent:.0f} s: is it "
            "running, and does this broker (and its ACL) carry this device's stats to it and "
            "its model back?")


class Silence:
    """The current stretch of unanswered hellos (none while answered)."""

    def __init__(self, after: float) -> None:
        self.after = after  # seconds before the first warning; 0: never
        self.since: float | None = None
        self.warned = 0.0  # the silence the last warning named

    def heard(self) -> None:
        """An answer came: the next silence counts from its own start."""
        self.since, self.warned = None, 0.0

    def hello(self, now: float) -> float | None:
        """A hello went out at ``now``: the seconds of silence to warn about, or None."""
        if self.since is None:
            self.since = now
        silent = now - self.since
        if not self.after or silent < max(self.after, 2 * self.warned):
            return None
        self.warned = silent
        return silent
