"""Write ``docs/states.md``: each role's transition table as a state diagram (as h11 draws
its own), so the pictures cannot drift from the code: ``tests/test_states.py`` fails when
the file is stale.

Run: ``python docs/make_state_diagrams.py`` from the repository root.
"""

from __future__ import annotations

from pathlib import Path

from aggregator.cloud import Cloud
from aggregator.fedbuff import BufferedStation
from aggregator.station import Station
from edge_client.device import Device
from edge_client.role import state_diagram

OUT = Path(__file__).with_name("states.md")

ROLES = (
    (Device, "A device waits for its station's first model, then holds the latest one and "
             "trains on it when selected; a selection that overtakes its model waits for it "
             "(MQTT orders messages per topic only)."),
    (Station, "A base station joins when its roster reported, then runs iterations: a super "
              "node if a quorum of devices is ready, else it waits for its devices' data "
              "(gathering); every T "
              "iterations it uploads and waits for the global model.  `resuming` is passed "
              "through when a station restarts from a checkpoint taken mid-round."),
    (BufferedStation, "A station in buffered mode (`[station] mode = \"buffered\"`, FedBuff) "
                      "moves through the same table with another meaning: `collecting` is "
                      "devices training (up to the super node size at once, each asked as a "
                      "place frees) and the buffer filling; each fold of `buffer_size` "
                      "updates is an iteration and re-enters `collecting`; `gathering` is "
                      "nobody to ask and nothing to fold; every T folds it uploads and "
                      "waits (answers that come meanwhile wait in the buffer for the global "
                      "model)."),
    (Cloud, "The cloud starts round 0 when every station sent its label counts, and closes "
            "a round when its stations reported (or at the deadline, with a quorum)."),
)


def render() -> str:
    parts = ["# The roles' states\n",
             "Generated from each role's `TRANSITIONS` table by `docs/make_state_diagrams.py`; "
             "do not edit by hand.  An event the table has no arrow for, in the role's state, "
             "is refused (`rejected.bad_transition`) and changes nothing.\n"]
    for role, text in ROLES:
        parts += [f"## {role.__name__} (`{role.__module__}`)\n", text + "\n",
                  "```mermaid", state_diagram(role), "```\n"]
    return "\n".join(parts)


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
