"""A compromised device process for the fault tests: the real device service, with every
message it sends rewritten by :func:`lab.attacks.tamper`.

    python tests/hostile_device.py ATTACK --config device.toml
"""

from __future__ import annotations

import argparse
import logging

from aggregator.config import StationConfig
from aggregator.roster import SHAPE_TOLERANCE
from edge_client.runner import StopFlag, serve
from edge_client.service import DEVICE_TABLES, DeviceService, load_role_file
from lab.attacks import tamper


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("attack")
    parser.add_argument("--config", required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    cfg = load_role_file(args.config, DEVICE_TABLES, {})
    runner, transport, hooks = DeviceService(**cfg).build()
    honest = transport.publish
    # What a replaying device keeps of its first update; the growth a station with the
    # default bounds accepts (the attacker has read the code) for one lying at the bound.
    memory = {"growth": StationConfig.max_seen_rate * cfg["device"].local_steps,
              "tolerance": SHAPE_TOLERANCE}

    def publish(topic, message):
        sent = tamper(message, args.attack, memory)
        if isinstance(sent, bytes):  # a forged frame: straight onto the wire
            transport.publish_raw(topic, sent)
        else:
            honest(topic, sent)
    transport.publish = publish
    serve(runner, transport, stop=StopFlag(), done=lambda: runner.role.finished, hooks=hooks)


if __name__ == "__main__":
    main()
