"""The roles' states: what a device, a station and the cloud are doing, which the
summaries report, the services compare and ``safl status`` shows.

They live here, beside the protocol every role shares, so the JSON documents
(``documents.py``) and an operator's tools type them; the transitions between them are
each role's own table (``device.py``, ``aggregator/station.py``, ``aggregator/cloud.py``).
"""

from __future__ import annotations

from .role import RoleState

__all__ = ["DeviceState", "StationState", "CloudState"]


class DeviceState(RoleState):
    WAITING = "waiting"  # for its station's first model (it repeats its stats)
    READY = "ready"  # holds the station's model; trains when selected
    DONE = "done"  # the final model came


class StationState(RoleState):
    JOINING = "joining"  # waiting for its devices' first stats
    WAITING = "waiting"  # for the global model
    COLLECTING = "collecting"  # the replies of a super node
    # Fewer devices ready than the quorum: it waits for their data, up to
    # ``iteration_timeout`` an iteration, instead of closing iterations without training
    # (a live-camera fleet gathers between most iterations: labels trickle in).
    GATHERING = "gathering"
    RESUMING = "resuming"  # restarted from a checkpoint taken mid-round
    DONE = "done"


class CloudState(RoleState):
    JOINING = "joining"  # waiting for every station's label counts
    COLLECTING = "collecting"  # the stations' updates of the current round
    DONE = "done"  # the final global model went out
