"""The ``safl`` command: one subcommand per role and task, imported lazily.

Each handler imports its module only when chosen, so a device command never
loads the aggregator or torch.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from .errors import SaflError

__all__ = ["main"]


def _demo(args: argparse.Namespace) -> int:
    from aggregator.demo import run_demo

    run_demo(rounds=args.rounds, out=args.out, seed=args.seed)
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="safl", description="safl-edge: SAFL and FedGS "
                                     "federated learning for edge fleets")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="SAFL+FedGS vs FedAvg on an in-process fleet")
    demo.add_argument("--rounds", type=int, default=100, help="external syncs (default 100)")
    demo.add_argument("--out", type=Path, default=None, help="output folder "
                      "(default runs/<timestamp>)")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(run=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.run(args)
    except SaflError as exc:
        print(f"safl: error: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
