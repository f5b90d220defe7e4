"""Frame admission: bytes from a topic in, a checked message (or a refusal) out.

Sans-IO like the roles: no MQTT here, so it is tested without a broker and used by
the paho transport and the simulator alike.  One :meth:`Admission.admit` call
reassembles chunks, decodes the frame (every header field is checked for type and
range before a message exists), checks fleet, layout, model size and that the
sender owns the topic, and drops duplicates.  It never raises: a bad frame becomes
a ``rejected.<reason>`` counter, a log line at most once per sender and reason a
minute, and, where the topic names the sender, a :class:`~edge_client.messages.Refusal`
for the role, so a station need not wait out a deadline for a member it refused.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable

from . import messages as m
from .codec import decode
from .errors import MessageError
from .reassembly import Reassembler, is_chunk
from .topics import is_document_topic, participant_of, topic_for

__all__ = ["Admission", "LogLimiter"]

log = logging.getLogger(__name__)


class LogLimiter:
    """Says whether a ``(sender, reason)`` may be logged: once per ``period`` seconds.

    A flood of bad frames must cost a counter increment, not a disk full of logs.
    """

    def __init__(self, period: float = 60.0, clock: Callable[[], float] = time.monotonic,
                 max_keys: int = 4096) -> None:
        self.period, self.clock, self.max_keys = period, clock, max_keys
        self._last: OrderedDict[tuple[str, str], float] = OrderedDict()

    def allow(self, sender: str, reason: str) -> bool:
        now, key = self.clock(), (sender, reason)
        last = self._last.get(key)
        if last is not None and now - last < self.period:
            return False
        self._last[key] = now
        self._last.move_to_end(key)
        while len(self._last) > self.max_keys:
            self._last.popitem(last=False)
        return True


class Admission:
    """Admits frames for one participant.

    Parameters
    ----------
    fleet : str
        Frames of another fleet are refused.
    layout_hash : str
        Frames stamped with another model layout are refused ("" accepts any).
    num_params : int
        Length every weights vector must have (0: not checked here).
    max_message, reassembly_memory : int
        Largest frame, and the memory partial chunked frames may hold.
    chunk_timeout : float
        Seconds a chunked frame may take to complete.
    counters : Counter, optional
        Where to count (a transport shares its own); a new one by default.
    seen_ids : int
        Message ids remembered for exactly-once delivery (``[broker] dedupe_window``).
    """

    def __init__(self, *, fleet: str, layout_hash: str = "", num_params: int = 0,
                 max_message: int, reassembly_memory: int, chunk_timeout: float,
                 owner: str = "", counters: Counter[str] | None = None,
                 seen_ids: int = 8192) -> None:
        self.fleet, self.layout_hash, self.num_params = fleet, layout_hash, num_params
        self.max_message, self.owner, self.seen_ids = max_message, owner, seen_ids
        self.counters: Counter[str] = Counter() if counters is None else counters
        self.limiter = LogLimiter()
        self._seen: OrderedDict[bytes, None] = OrderedDict()
        self._reassembler = Reassembler(max_size=max_message, memory_cap=reassembly_memory,
                                        timeout=chunk_timeout)

    def expire(self, now: float) -> None:
        """Drop chunked frames that did not complete in time."""
        self._reassembler.expire(now)
        self._sync()

    def _sync(self) -> None:
        for key, value in self._reassembler.counters.items():
            self.counters[key] = value

    def admit(self, topic: str, payload: bytes, now: float) -> m.Message | None:
        """The message to deliver, a :class:`~edge_client.messages.Refusal`, or None."""
        self.counters["bytes_in"] += len(payload)
        try:
            return self._admit(topic, payload, now)
        except MessageError as exc:
            return self._refuse(topic, exc.reason, str(exc))
        except Exception as exc:  # the last line: no frame may stop the service
            if self.limiter.allow(topic, "internal"):
                log.exception("%s: internal error admitting a frame on %s", self.owner, topic)
            return self._refuse(topic, "internal", repr(exc), logged=True)
        finally:
            self._sync()

    def _refuse(self, topic: str, reason: str, detail: str,
                logged: bool = False) -> m.Message | None:
        self.counters[f"rejected.{reason}"] += 1
        who = participant_of(topic, self.fleet)
        if not logged and self.limiter.allow(who[1] if who else topic, reason):
            log.warning("%s rejected a frame on %s: %s (further %s refusals from this sender "
                        "are counted, and logged at most once a minute)", self.owner, topic,
                        detail, reason)
        if who is None:
            return None
        return m.Refusal(fleet=self.fleet, sender=who[1], round=0, iteration=0,
                         reason=reason, role=who[0], leaf=who[2])

    def _admit(self, topic: str, payload: bytes, now: float) -> m.Message | None:
        if is_document_topic(topic):
            return None  # JSON documents for operators (documents.py), not frames
        digest = None
        if is_chunk(payload):
            whole = self._reassembler.add(topic, payload, now)
            if whole is None:
                return None
            payload, digest = whole, self._reassembler.last_digest
        frame = decode(payload, max_size=self.max_message, digest=digest)
        msg = frame.message
        if msg.fleet != self.fleet:
            raise MessageError("wrong_fleet", f"fleet {msg.fleet!r}")
        if self.layout_hash and frame.layout_hash and frame.layout_hash != self.layout_hash:
            raise MessageError("wrong_layout", f"layout {frame.layout_hash}, expected "
                               f"{self.layout_hash}")
        weights = getattr(msg, "weights", None)
        if self.num_params and weights is not None and weights.size != self.num_params:
            raise MessageError("wrong_length", f"{weights.size} weights, the model has "
                               f"{self.num_params}")
        if topic_for(msg) != topic:
            # The ACL confines each client to its own topics; a sender field that disagrees
            # with the topic is an impersonation attempt.
            raise MessageError("topic_mismatch", f"{type(msg).__name__} from {msg.sender!r} "
                               f"on {topic}")
        if frame.message_id in self._seen:
            self.counters["duplicates"] += 1
            return None
        self._seen[frame.message_id] = None
        while len(self._seen) > self.seen_ids:
            self._seen.popitem(last=False)
        self.counters["messages_in"] += 1
        return msg
