"""A compromised station process for the safe-promotion test: the real station service,
whose models from ``--after`` seconds on carry the weights in ``--weights`` (a ``.npy``
file of a model that is plausible on the wire: the right size, finite, of the usual norm,
and trained on shuffled labels).

    python tests/hostile_station.py --config station.toml --weights bad.npy --after 30
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time

import numpy as np

import aggregator.services as services
from aggregator.config import StationConfig
from edge_client import messages as m
from edge_client.service import SHARED_TABLES, load_role_file


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--weights", required=True)
    parser.add_argument("--after", type=float, required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    bad = np.load(args.weights, allow_pickle=False).astype(np.float32)
    began, honest_transport = time.monotonic(), services.role_transport

    def hostile_transport(*a, **kw):
        transport = honest_transport(*a, **kw)
        honest = transport.publish

        def publish(topic: str, message: m.Message) -> None:
            if isinstance(message, m.StationModel) and time.monotonic() - began >= args.after:
                message = dataclasses.replace(message, weights=bad)
            honest(topic, message)
        transport.publish = publish  # type: ignore[method-assign]
        return transport
    services.role_transport = hostile_transport
    cfg = load_role_file(args.config, {"station": StationConfig, **SHARED_TABLES}, {})
    services.StationService(**cfg).run()


if __name__ == "__main__":
    main()
