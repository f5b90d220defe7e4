"""What one compromised device sends: the attacks the trust checks are measured against.

Each attack rewrites a device's outgoing messages (``tamper``); ``replay`` sends the
device's first update again as every later reply.  ``nan`` cannot be a
message at all (messages refuse non-finite weights), so it becomes a forged frame,
checksum and all, that the receiver's :class:`~edge_client.admission.Admission`
must refuse.  The simulator and the hostile device process of the MQTT tests use
these same functions.  Used by ``safl experiment`` (``attack``, ``attackers``) and
``tests/hostile_device.py``; never by a production role.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from edge_client import messages as m
from edge_client.admission import Admission
from edge_client.codec import encode, reseal
from edge_client.runner import RoleRunner
from edge_client.topics import topic_for
from edge_client.transport import LocalBus

__all__ = ["ATTACKS", "tamper", "forge_nan", "install"]

ATTACKS = ("none", "scale", "inflate", "nan", "seen", "balanced", "replay")
SCALE = 1e6  # "an update scaled by 1e6"
INFLATED = 10**12  # "an update claiming 10^12 samples"
SEEN = 10**15  # "one report of 10^15 seen samples"


def forge_nan(frame: bytes, n_weights: int) -> bytes:
    """``frame`` with its first weight set to NaN and the checksum recomputed."""
    data = bytearray(frame)
    start = len(data) - n_weights * 4
    data[start:start + 4] = np.array([np.nan], np.float32).tobytes()
    return reseal(data)


def tamper(message: m.Message, attack: str,
           memory: dict[str, np.ndarray] | None = None) -> m.Message | bytes:
    """What the compromised device sends instead of ``message``; ``memory`` is what a
    replaying device keeps between its messages."""
    if isinstance(message, m.DeviceUpdate):
        if attack == "replay":
            if memory is None:  # without it the "attack" would silently be an honest device
                raise ValueError("the replay attack needs a memory to keep its first update")
            # Its first update again, as this iteration's reply: new id, valid fields.
            first = memory.setdefault("first", message.weights)
            return dataclasses.replace(message, weights=first)
        if attack == "scale":
            return dataclasses.replace(message, weights=message.weights * np.float32(SCALE))
        if attack == "inflate":
            return dataclasses.replace(message, num_samples=INFLATED)
        if attack == "nan":
            return forge_nan(encode(message), message.weights.size)
    if isinstance(message, m.DeviceStats):
        if attack == "seen":
            counts = np.zeros_like(message.seen_counts)
            counts[0] = SEEN
            return dataclasses.replace(message, seen_counts=counts)
        if attack == "balanced":
            # The histogram GBP-CS likes best: the batch spread evenly over the classes.
            total = max(1, int(message.next_batch_counts.sum()))
            width = message.next_batch_counts.size
            counts = np.full(width, total // width)
            counts[: total % width] += 1
            return dataclasses.replace(message, next_batch_counts=counts)
    return message




def install(runner: RoleRunner, attack: str, admission: Admission, bus: LocalBus) -> None:
    """Make a simulated device hostile: its runner sends ``tamper``'s output instead.

    A forged frame goes through ``admission`` (what the station's transport does) and
    whatever that yields, a refusal, is delivered in its place.
    """
    honest = runner.publish
    memory: dict[str, np.ndarray] = {}

    def publish(out: list[m.Message]) -> None:
        for message in out:
            sent = tamper(message, attack, memory)
            if isinstance(sent, bytes):
                got = admission.admit(topic_for(message), sent, 0.0)
                if got is not None:
                    bus.publish(topic_for(got), got)
            else:
                honest([sent])
    runner.publish = publish  # type: ignore[method-assign]  # the compromised device's voice
